"""The ASYNCRL_PUREPYTHON switch (ext/backend.py), for every hot path.

The compiled extensions are built (``make setup``/``make build``) wherever the suite runs, so
"unset" (prefer compiled) must end on them as "0" does; only under "1" are they deliberately
not used, and the tests that need them are skipped.
"""

import importlib
import importlib.machinery
import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

import ext
from ext import backend

HOT_PATHS = ["squeue", "replay", "codec"]
PURE = os.environ.get(backend.ENV_VAR, "").strip() == "1"
EXT_DIR = Path(ext.__file__).resolve().parent
ROOT = EXT_DIR.parent
needs_compiled = pytest.mark.skipif(
    PURE, reason="ASYNCRL_PUREPYTHON=1: the compiled modules are deliberately not used"
)


def assert_compiled(module, name: str) -> None:
    """``module`` is the compiled ext._<name>, loaded from the extension built in ext/."""
    assert module.__name__ == f"ext._{name}"
    assert isinstance(module.__loader__, importlib.machinery.ExtensionFileLoader), module.__loader__
    path = Path(module.__file__).resolve()
    assert path.parent == EXT_DIR, path
    assert any(path.name == f"_{name}{suffix}" for suffix in importlib.machinery.EXTENSION_SUFFIXES), path


def assert_reference(module, name: str) -> None:
    """``module`` is the pure-Python ext._<name>_ref from ext/."""
    assert module.__name__ == f"ext._{name}_ref"
    assert isinstance(module.__loader__, importlib.machinery.SourceFileLoader), module.__loader__
    assert Path(module.__file__).resolve() == EXT_DIR / f"_{name}_ref.py"


@pytest.mark.parametrize("name", HOT_PATHS)
def test_each_selector_serves_the_backend_asked_for(name):
    """This session's switch, whatever it is: "1" serves the references, "0" and unset the
    compiled extensions (unset falls back only when they are not built, which they are)."""
    selector = importlib.import_module(f"ext.{name}")
    if backend.requested() == "pure":
        assert selector.BACKEND == "ref"
        assert_reference(selector._impl, name)
        assert selector._impl is importlib.import_module(f"ext._{name}_ref")
    else:
        assert selector.BACKEND == "ext", f"ext.{name} fell back to the reference (build the extensions)"
        assert_compiled(selector._impl, name)
        assert selector._impl is importlib.import_module(f"ext._{name}")


_PROBE = (
    "import json, importlib\n"
    "out = {}\n"
    "for name in %r:\n"
    "    m = importlib.import_module('ext.' + name)\n"
    "    out[name] = [m.BACKEND, m._impl.__name__, m._impl.__file__]\n"
    "print(json.dumps(out))\n" % (HOT_PATHS,)
)


def _select_in_a_fresh_process(value: str | None) -> subprocess.CompletedProcess:
    """Import every selector in a new interpreter with the switch set to ``value`` (None:
    unset), so each setting is checked whatever this session's own is."""
    env = dict(os.environ)
    env.pop(backend.ENV_VAR, None)
    if value is not None:
        env[backend.ENV_VAR] = value
    return subprocess.run(
        [sys.executable, "-c", _PROBE], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
    )


@pytest.mark.parametrize(
    "value,want",
    [
        pytest.param(None, "ext", marks=needs_compiled, id="unset"),
        pytest.param("", "ext", marks=needs_compiled, id="empty"),
        pytest.param("0", "ext", marks=needs_compiled, id="0"),
        pytest.param("1", "ref", id="1"),
        pytest.param(" 1 ", "ref", id="1-padded"),
    ],
)
def test_each_setting_selects_its_backend_in_a_fresh_process(value, want):
    proc = _select_in_a_fresh_process(value)
    assert proc.returncode == 0, proc.stderr
    assert "pure-Python" not in proc.stderr  # no fallback warning
    got = json.loads(proc.stdout)
    assert sorted(got) == sorted(HOT_PATHS)
    for name, (name_backend, module_name, file) in got.items():
        assert name_backend == want
        path = Path(file).resolve()
        assert path.parent == EXT_DIR
        if want == "ext":
            assert module_name == f"ext._{name}"
            assert any(path.name == f"_{name}{s}" for s in importlib.machinery.EXTENSION_SUFFIXES), path
        else:
            assert module_name == f"ext._{name}_ref" and path.name == f"_{name}_ref.py"


@pytest.mark.parametrize("value", ["yes", "true", "2", "pure", "01"])
def test_a_garbage_setting_stops_the_import(value):
    """Documented in ext/backend.py: a value other than 1, 0 or unset is refused, not guessed."""
    proc = _select_in_a_fresh_process(value)
    assert proc.returncode != 0 and proc.stdout == ""
    assert "RuntimeError" in proc.stderr and f"{backend.ENV_VAR}={value!r} is not understood" in proc.stderr


@pytest.mark.parametrize("name", HOT_PATHS)
def test_pure_python_selects_the_reference(monkeypatch, name):
    monkeypatch.setenv(backend.ENV_VAR, "1")
    module = backend.load(name)
    assert module is importlib.import_module(f"ext._{name}_ref")
    assert_reference(module, name)
    assert backend.name_of(module) == "ref"


@needs_compiled
@pytest.mark.parametrize("value", ["0", None])
@pytest.mark.parametrize("name", HOT_PATHS)
def test_compiled_selects_the_extension(monkeypatch, name, value):
    if value is None:
        monkeypatch.delenv(backend.ENV_VAR, raising=False)  # unset: prefers the compiled module
    else:
        monkeypatch.setenv(backend.ENV_VAR, value)
    module = backend.load(name)
    assert module is importlib.import_module(f"ext._{name}")  # an ImportError fails the test
    assert_compiled(module, name)
    assert backend.name_of(module) == "ext"


@pytest.mark.parametrize("name", HOT_PATHS)
def test_compiled_but_unimportable_raises(monkeypatch, name):
    monkeypatch.setenv(backend.ENV_VAR, "0")
    monkeypatch.setitem(sys.modules, f"ext._{name}", None)  # makes the import fail
    with pytest.raises(RuntimeError, match=rf"ext\._{name}"):
        backend.load(name)


def test_compiled_but_missing_raises(monkeypatch):
    monkeypatch.setenv(backend.ENV_VAR, "0")
    with pytest.raises(RuntimeError, match=r"ext\._no_such_hot_path"):
        backend.load("no_such_hot_path")


def test_auto_falls_back_to_the_references_with_one_warning(monkeypatch, caplog):
    monkeypatch.delenv(backend.ENV_VAR, raising=False)
    for name in HOT_PATHS:
        monkeypatch.setitem(sys.modules, f"ext._{name}", None)
    monkeypatch.setattr(backend, "_warned", False)
    with caplog.at_level(logging.WARNING, logger=backend.__name__):
        for name in HOT_PATHS:
            assert backend.load(name) is importlib.import_module(f"ext._{name}_ref")
    warnings = [r for r in caplog.records if r.name == backend.__name__]
    assert len(warnings) == 1 and "pure-Python" in warnings[0].getMessage()


@pytest.mark.parametrize("value", ["yes", "true", "2", "pure"])
def test_garbage_switch_value_raises(monkeypatch, value):
    monkeypatch.setenv(backend.ENV_VAR, value)
    with pytest.raises(RuntimeError, match=backend.ENV_VAR):
        backend.load("squeue")
