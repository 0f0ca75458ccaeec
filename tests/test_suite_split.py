"""How `make test` splits the suite between its two passes.

The first pass runs every test on the compiled extensions; the second runs the suite again on
the pure-Python references (``ASYNCRL_PUREPYTHON=1``) less the tests marked ``runtime``: those
whose subject is the Ray or vLLM runtime (actors, the session's test cluster, vLLM engines),
not the backend under it. What checks the backend (the hot paths, the pipeline, the invariants,
the sim, faults and resume in process) runs in both.

The checks here read the test modules with ``ast`` (none is imported, so this costs nothing):

* a module that imports ``ext`` (``import ext``, ``from ext import ...``, ``from ext.x import
  ...``, anywhere in it) carries no ``runtime`` mark, on the module or on any of its tests: it
  tests the backend, so the pure pass must run all of it;
* whatever is marked ``runtime`` (a module, a test, a parameter) exercises Ray or vLLM: its code
  (docstrings left out) names one of them, a module of theirs or the session's Ray fixtures;
* a test that asks for the session's Ray cluster is marked, where its module imports no ``ext``:
  the pure pass starts no cluster;
* the Makefile's pure pass deselects the marked tests and nothing else, the compiled pass runs
  everything, and the pure pass can never collect nothing (pytest's exit 5): this module, and
  every module that imports ``ext``, is always in it.
"""

from __future__ import annotations

import ast
import re
import shlex
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TESTS = ROOT / "tests"
MARKER = "runtime"
# A word that names Ray or vLLM: ray, ray_session, ray.get, raylet, core.runtimes.ray_env,
# "real-cpu-vllm.yaml", VllmEngine; not array or stray.
RAY_OR_VLLM = re.compile(r"(?<![a-z])ray|vllm")
RAY_FIXTURES = {"ray_session", "ray_cluster", "spare_node"}  # tests/conftest.py


def _modules() -> list[Path]:
    return sorted(TESTS.glob("test_*.py"))


def _parse(path: Path) -> ast.Module:
    return ast.parse(path.read_text(), filename=str(path))


def ext_imports(tree: ast.Module) -> list[int]:
    """The lines that import ``ext`` or a module of it, anywhere in the module."""
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            names = [node.module or ""]
        else:
            continue
        if any(n == "ext" or n.startswith("ext.") for n in names):
            lines.append(node.lineno)
    return lines


def _is_runtime_mark(node: ast.AST) -> bool:
    """``pytest.mark.runtime`` or ``mark.runtime`` (called or not)."""
    if isinstance(node, ast.Call):
        node = node.func
    return (
        isinstance(node, ast.Attribute) and node.attr == MARKER
        and (
            (isinstance(node.value, ast.Attribute) and node.value.attr == "mark")
            or (isinstance(node.value, ast.Name) and node.value.id == "mark")
        )
    )


def _parents(tree: ast.Module) -> dict[ast.AST, ast.AST]:
    return {child: parent for parent in ast.walk(tree) for child in ast.iter_child_nodes(parent)}


def runtime_marks(tree: ast.Module) -> list[tuple[int, ast.AST | None]]:
    """Each ``runtime`` mark in the module: (its line, what it marks). What it marks: the module
    (``pytestmark = ...``), a decorated test, fixture or class, or one ``pytest.param(...)``;
    None where it is none of these (the checks below refuse that)."""
    parents = _parents(tree)
    found = []
    for node in ast.walk(tree):
        # The attribute inside a call is the same mark: count it once.
        if not _is_runtime_mark(node) or (isinstance(parents.get(node), ast.Call) and parents[node].func is node):
            continue
        marks, up = None, node
        while up in parents:
            up, child = parents[up], up
            if isinstance(up, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                marks = up if child in up.decorator_list else None
                break
            if isinstance(up, ast.Call) and isinstance(up.func, ast.Attribute) and up.func.attr == "param":
                marks = up
                break
            if isinstance(up, (ast.Assign, ast.AnnAssign)) and parents.get(up) is tree:
                targets = up.targets if isinstance(up, ast.Assign) else [up.target]
                marks = tree if any(isinstance(t, ast.Name) and t.id == "pytestmark" for t in targets) else None
                break
        found.append((node.lineno, marks))
    return found


def _docstrings(tree: ast.Module) -> set[int]:
    ids = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
                ids.add(id(first.value))
    return ids


def names_ray_or_vllm(region: ast.AST, docstrings: set[int]) -> bool:
    """Whether the code of ``region`` (not its docstrings, nor a test's own name) names Ray or
    vLLM: an import, a name, an attribute, an argument (the session's Ray fixtures), a string."""
    words = []
    for node in ast.walk(region):
        if isinstance(node, ast.Name):
            words.append(node.id)
        elif isinstance(node, ast.Attribute):
            words.append(node.attr)
        elif isinstance(node, ast.arg):
            words.append(node.arg)
        elif isinstance(node, ast.alias):
            words += [node.name, node.asname or ""]
        elif isinstance(node, ast.ImportFrom):
            words.append(node.module or "")
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
            words.append(node.value)
    return any(RAY_OR_VLLM.search(w.lower()) for w in words)


def problems(name: str, tree: ast.Module) -> list[str]:
    """What is wrong with the module ``name``'s place in the split (nothing: [])."""
    ext, marks = ext_imports(tree), runtime_marks(tree)
    if ext and marks:
        return [
            f"tests/{name} imports ext (line {ext[0]}) and marks {MARKER} (line {marks[0][0]}): the pure-Python pass "
            f"would not run {'it' if marks[0][1] is tree else 'those tests'}; fix: take the mark off (a module that imports "
            "ext tests the backend), or move the Ray/vLLM tests to a module that does not import ext"
        ]
    found, docstrings = [], _docstrings(tree)
    for line, region in marks:
        if region is None:
            found.append(f"tests/{name}:{line}: a {MARKER} mark on neither the module (pytestmark), a test, a fixture, a class nor a pytest.param")
        elif not names_ray_or_vllm(region, docstrings):
            where = "the module" if region is tree else f"line {region.lineno}"
            found.append(
                f"tests/{name}:{line}: what the {MARKER} mark marks ({where}) names neither Ray nor vLLM: the pure-Python pass "
                "skips only what exercises the Ray or vLLM runtime"
            )
    # And the other way: a test that asks for the session's Ray cluster is marked (the pure pass
    # starts no cluster), unless its module imports ext (then it runs in both passes, as above).
    marked = {id(region) for _, region in marks}
    if id(tree) not in marked and not ext:
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name.startswith("test") and id(node) not in marked:
                asks = RAY_FIXTURES & {a.arg for a in node.args.args + node.args.kwonlyargs}
                if asks:
                    found.append(f"tests/{name}:{node.lineno}: {node.name} asks for {min(asks)} and is not marked {MARKER}")
    return found


SPLIT = {path.name: (ext_imports(tree), runtime_marks(tree), tree) for path in _modules() for tree in [_parse(path)]}


@pytest.mark.parametrize("name", sorted(SPLIT))
def test_a_module_that_imports_ext_runs_in_the_pure_pass_and_a_runtime_mark_marks_ray_or_vllm(name):
    found = problems(name, SPLIT[name][2])
    assert not found, "\n".join(found)


@pytest.mark.parametrize("source, expected", [
    # An ext import anywhere, and a mark anywhere: the module, a test, a parameter.
    ("import pytest\nfrom ext import codec\npytestmark = pytest.mark.runtime\n", "imports ext (line 2) and marks runtime (line 3)"),
    ("import pytest\n@pytest.mark.runtime\ndef test_a(ray_session):\n    import ext.squeue\n", "imports ext (line 4)"),
    ("from ext.replay import Replay\nENGINES = [pytest.param('vllm', marks=[pytest.mark.runtime])]\n", "marks runtime (line 2)"),
    # A mark on what names neither Ray nor vLLM (a docstring or a test's own name does not count).
    ("import pytest\n@pytest.mark.runtime\ndef test_ray_a(tmp_path):\n    \"\"\"On ray.\"\"\"\n    assert 1\n", "names neither Ray nor vLLM"),
    ("import pytest\nimport numpy\npytestmark = [pytest.mark.runtime]\n", "names neither Ray nor vLLM"),
    ("import pytest\nMARKS = pytest.mark.runtime\n", "on neither the module"),
    ("import pytest\ndef test_a(tmp_path, ray_session):\n    assert 1\n", "asks for ray_session and is not marked runtime"),
    # What passes: Ray's fixtures, a scenario or engine of theirs, their modules; ext without the mark.
    ("import pytest\n@pytest.mark.runtime\ndef test_a(ray_session):\n    assert 1\n", None),
    ("import pytest\n@pytest.mark.runtime\n@pytest.mark.parametrize('e', ['torch', 'vllm'])\ndef test_a(e):\n    assert 1\n", None),
    ("import pytest\nfrom core.runtimes.ray_env import run_async\npytestmark = pytest.mark.runtime\n", None),
    ("import pytest\nfrom ext import codec\ndef test_a():\n    run('scenarios/real-cpu-vllm.yaml')\n", None),
])
def test_the_checks_catch_what_they_are_for(source, expected):
    found = problems("t.py", ast.parse(source))
    if expected is None:
        assert found == []
    else:
        assert len(found) == 1 and expected in found[0], found


def test_the_split_leaves_the_pure_pass_the_backend_and_the_makefile_asks_for_it():
    marked = {n for n, (_, marks, _) in SPLIT.items() if marks}
    ext = {n for n, (lines, _, _) in SPLIT.items() if lines}
    # Both sides are there: the split does something, and the pure pass never collects nothing.
    assert marked and ext and Path(__file__).name not in marked
    assert "test_backend.py" in ext  # the backend's own switch
    markers = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]["markers"]
    assert any(m.split(":")[0].strip() == MARKER for m in markers)
    # The two passes of `make test`: the compiled one deselects nothing, the pure one the marked tests.
    passes = {}
    for line in (ROOT / "Makefile").read_text().splitlines():
        words = shlex.split(line.strip()) if "-m pytest" in line and "ASYNCRL_PUREPYTHON=" in line else []
        if words:
            passes[next(w for w in words if w.startswith("ASYNCRL_PUREPYTHON="))] = words[words.index("pytest") + 1 :]
    assert set(passes) == {"ASYNCRL_PUREPYTHON=0", "ASYNCRL_PUREPYTHON=1"}, passes
    deselecting = {"-m", "-k", "--deselect", "--ignore", "--ignore-glob"}
    assert not deselecting & set(passes["ASYNCRL_PUREPYTHON=0"]), passes
    pure = passes["ASYNCRL_PUREPYTHON=1"]
    assert "-m" in pure and pure[pure.index("-m") + 1] == f"not {MARKER}", passes
    assert not (deselecting - {"-m"}) & set(pure) and pure.count("-m") == 1, passes


def test_no_collected_runtime_test_lives_in_a_module_that_imports_ext(request):
    """The same rule on what this run collected, however the mark got there (a conftest hook,
    a mark this file's reading does not see)."""
    for item in request.session.items:
        if item.get_closest_marker(MARKER) is not None:
            name = Path(str(item.fspath)).name
            assert not SPLIT.get(name, ([],))[0], f"{item.nodeid} is marked {MARKER} and its module imports ext"
