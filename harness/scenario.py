"""Scenario files in: YAML + ``--set`` overrides, validated into one frozen ``Scenario``.

Every problem becomes one ``ScenarioError`` line naming where it is (file or --set), the
dotted key, the value and the fix.
"""

from __future__ import annotations

import codecs
import copy
import difflib
import math
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import yaml
from pydantic import BaseModel, ValidationError

from core.model.config import MAX_INT, REFUSED, ConfigError, Scenario, clipped, name_problem, safe_name, set_dotted, shown
from core.model.env_config import EnvScenario
from core.model.bounded_parse import TooNested, check_yaml_events, loads_json
from core.model.regular_file import UnreadableFile, read_regular

# Far above any scenario (a few KB, a few hundred values, 5 levels deep), far below what hurts.
MAX_FILE_BYTES = 1 << 20
MAX_DEPTH = 32
MAX_VALUES = 100_000  # after YAML aliases are expanded: a 'billion laughs' file is refused here
MAX_NUMBER_CHARS = 40  # int('9' * 5000) raises; no count needs more than 16 digits
MAX_KEY_PARTS = 16
_FIX_FILE = "pass a scenario YAML such as scenarios/quickstart.yaml"
_BOMS = ((codecs.BOM_UTF32_LE, "UTF-32"), (codecs.BOM_UTF32_BE, "UTF-32"), (codecs.BOM_UTF16_LE, "UTF-16"), (codecs.BOM_UTF16_BE, "UTF-16"))


class ScenarioError(Exception):
    """A scenario that cannot run; the message is the whole story, one line."""


class _NotYaml(ScenarioError):
    """Text that does not parse as YAML (a ``--set`` value then stands for itself)."""


class _Refused(Exception):
    """Input the YAML loader refuses, at a mark (where in the text), with its fix."""

    def __init__(self, mark: Any, problem: str, fix: str) -> None:
        self.mark, self.problem, self.fix = mark, problem, fix
        super().__init__(problem)


class _Loader(yaml.SafeLoader):
    """PyYAML's safe loader, strict: a key given twice in one mapping is an error (PyYAML keeps
    the last silently), and an integer too long to be a count is refused before ``int()`` sees it."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        if isinstance(node, yaml.MappingNode):
            seen: dict[Any, Any] = {}
            for key_node, _ in node.value:
                if not isinstance(key_node, yaml.ScalarNode) or key_node.tag == "tag:yaml.org,2002:merge":
                    continue
                key = self.construct_object(key_node)
                first = seen.setdefault(key, key_node.start_mark)
                if first is not key_node.start_mark:
                    raise _Refused(key_node.start_mark, f"{shown(key)} is given twice in one mapping (first on line {first.line + 1})",
                                   "keep one of the two, or merge them")
        return super().construct_mapping(node, deep=deep)

    def construct_yaml_int(self, node: yaml.ScalarNode) -> int:
        text = self.construct_scalar(node)
        if len(text) > MAX_NUMBER_CHARS:
            raise _Refused(node.start_mark, f"a number of {len(text):,} characters", "use a number of at most 16 digits")
        return super().construct_yaml_int(node)


_Loader.add_constructor("tag:yaml.org,2002:int", _Loader.construct_yaml_int)


def _check_events(text: str) -> None:
    """Nesting depth and the number of values once aliases are expanded, counted on the event
    stream before the composer, which recurses per level, and before anything walks a structure
    whose aliases multiply it (core/model/bounded_parse.py)."""
    try:
        check_yaml_events(text, MAX_DEPTH, MAX_VALUES, _Loader)
    except TooNested as exc:
        fix = "flatten it: a scenario is a few levels deep" if exc.bound == "depth" else "write the values out; a scenario holds a few hundred"
        raise _Refused(exc.mark, exc.problem, fix) from None


def _at(text: str, index: int) -> str:
    """'line L, column C' of character ``index`` of ``text``."""
    start = text.rfind("\n", 0, index) + 1
    line = text.count("\n", 0, index) + 1
    return f"line {line}, column {index - start + 1}"


def parse_yaml(text: str, where: str) -> Any:
    """YAML text to Python values, within the limits above; ``ScenarioError`` names ``where``,
    the line and column, and the fix."""
    try:
        _check_events(text)
        return yaml.load(text, Loader=_Loader)
    except _Refused as exc:
        m = exc.mark
        raise ScenarioError(f"{where}: line {m.line + 1}, column {m.column + 1}: {exc.problem}; fix: {exc.fix}") from None
    except yaml.reader.ReaderError as exc:
        raise _NotYaml(f"{where}: {_at(text, exc.position)}: character U+{exc.character:04X} is not allowed in YAML "
                       "(a control character); fix: remove it") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        at = f"line {mark.line + 1}, column {mark.column + 1}: " if mark else ""
        problem = " ".join(str(getattr(exc, "problem", None) or "syntax error").split())
        raise _NotYaml(f"{where}: {at}not valid YAML ({problem}); fix: correct the syntax there") from None


def _decode(data: bytes, path: Path) -> str:
    """UTF-8 text (a UTF-8 byte order mark allowed); anything else is one line naming the byte."""
    for bom, name in _BOMS:
        if data.startswith(bom):
            raise ScenarioError(f"{path}: is {name} (it starts with a byte order mark); fix: save it as UTF-8")
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        start = exc.start
        line = data.count(b"\n", 0, start) + 1
        column = start - (data.rfind(b"\n", 0, start) + 1) + 1
        raise ScenarioError(f"{path}: line {line}, column {column} (byte {start}): byte {data[start]:#04x} is not UTF-8; "
                            "fix: save the file as UTF-8") from None


def _root(data: dict) -> type[BaseModel]:
    """The scenario model a file describes: an env workload (``kind: env``) or an LLM one."""
    return EnvScenario if isinstance(data, dict) and data.get("kind") == "env" else Scenario


def _model_at(loc: tuple, root: type[BaseModel] = Scenario) -> type[BaseModel] | None:
    model: type[BaseModel] = root
    for part in loc:
        field = model.model_fields.get(str(part))
        if field is None:
            return None
        # An optional section (``filter``, ``agent``, ``trainer.lora``): the model inside Optional.
        kinds = [a for a in typing.get_args(field.annotation) if a is not type(None)] or [field.annotation]
        if len(kinds) != 1 or not (isinstance(kinds[0], type) and issubclass(kinds[0], BaseModel)):
            return None
        model = kinds[0]
    return model


# What to write for a value of the wrong type, by pydantic's error kind.
_TYPE_FIXES = (
    ("bool_", "write true or false"),
    ("int_", "write a whole number"),
    ("float_", "write a number"),
    ("string_", "write text (in quotes if YAML would read it as something else)"),
    (("list_", "tuple_", "set_"), "write a list, e.g. [a, b]"),
    (("dict_", "model_"), "write a mapping of its keys (key: value, or {key: value} in --set)"),
)


def _fix_for(err: dict, root: type[BaseModel]) -> tuple[str, str]:
    """(problem, fix) for one pydantic error."""
    kind, ctx, loc = err["type"], err.get("ctx", {}), err["loc"]
    if kind == "extra_forbidden":
        parent = _model_at(tuple(loc[:-1]), root)
        names = list(parent.model_fields) if parent else []
        close = difflib.get_close_matches(str(loc[-1]), names, n=1)
        hint = f"did you mean '{close[0]}'?" if close else f"known keys here: {', '.join(names)}"
        return "unknown key", f"remove it; {hint}"
    if kind == "missing":
        return "is required", "add it"
    bounds = {
        "greater_than": "use a value > {gt}",
        "greater_than_equal": "use a value >= {ge}",
        "less_than": "use a value < {lt}",
        "less_than_equal": "use a value <= {le}",
    }
    if kind in bounds:
        return err["msg"].lower(), bounds[kind].format(**ctx)
    if kind == "literal_error":
        return "is not one of the choices", f"use one of {ctx.get('expected')}"
    if kind == REFUSED:
        return ctx["problem"], ctx["fix"]
    if kind == "finite_number":
        return "is not a finite number", "use a finite number (no .inf or .nan)"
    if kind == "too_long":
        return f"has more than {ctx.get('max_length')} entries", f"list at most {ctx.get('max_length')}"
    whole = _whole(err.get("input")) if kind in ("int_parsing", "int_from_float", "int_type") else None
    if whole is not None:  # YAML 1.1 reads 1e6 (no dot) as text, and 1.0e6 as a float: either means this count
        return "is not written as a whole number", f"write {whole}"
    for prefix, fix in _TYPE_FIXES:
        if kind.startswith(prefix):
            return err["msg"].lower(), fix
    return err["msg"], f"see the field's docstring in {root.__module__.replace('.', '/')}.py"


def _whole(value: object) -> Optional[int]:
    """The whole number a count written as ``1e6`` or ``1.0e6`` stands for, or None."""
    try:
        x = float(value) if isinstance(value, (str, float)) and not isinstance(value, bool) else None
    except ValueError:
        return None
    return int(x) if x is not None and math.isfinite(x) and x == int(x) and abs(x) <= MAX_INT else None


def error_line(exc: ValidationError, origin: dict[str, str], root: type[BaseModel] = Scenario) -> str:
    err = exc.errors()[0]
    cause = err.get("ctx", {}).get("error")
    if isinstance(cause, ConfigError):
        key, value, problem, fix = cause.key, cause.value, cause.problem, cause.fix
    else:
        key = ".".join(str(p) for p in err["loc"]) or "(scenario)"
        value = err.get("input")
        problem, fix = _fix_for(err, root)
    # A missing key's input is the mapping it is missing from: nothing to echo.
    shown_value = "" if err["type"] == "missing" else " = " + ("{...}" if isinstance(value, dict) else shown(value))
    parts = key.split(".")
    # The file, or the --set that gave the key or a section above it (--set filter={...}).
    where = next((origin[k] for k in (".".join(parts[:i]) for i in range(len(parts), 0, -1)) if k in origin), origin.get("", ""))
    extra = len(exc.errors()) - 1
    more = f" ({extra} more problem{'s' if extra > 1 else ''} after this one)" if extra else ""
    return f"{where}: {clipped(key)}{shown_value}: {problem}; fix: {fix}{more}"


def _set(data: dict, key: str, value: Any, where: str) -> None:
    try:
        set_dotted(data, key, value)
    except ConfigError as exc:
        raise ScenarioError(f"{where}: {exc.problem}; fix: {exc.fix}") from None


def _read(path: Path) -> dict:
    try:
        data = read_regular(path, MAX_FILE_BYTES, _FIX_FILE)
    except UnreadableFile as exc:
        raise ScenarioError(str(exc)) from None
    data = parse_yaml(_decode(data, path), str(path))
    if data is None:
        raise ScenarioError(f"{path}: holds no scenario (it is empty, or only comments); fix: {_FIX_FILE}, or write keys such as 'name:' and 'trainer:'")
    if not isinstance(data, dict):
        raise ScenarioError(f"{path}: the top level is a {type(data).__name__}; fix: write a mapping of keys such as 'name:' and 'trainer:'")
    return data


def _check_key(key: Any, where: str) -> str:
    """A dotted key: a string of at most ``MAX_KEY_PARTS`` non-empty parts."""
    if not isinstance(key, str) or not key or len(key.split(".")) > MAX_KEY_PARTS or any(not p for p in key.split(".")):
        raise ScenarioError(f"{where}: {shown(key)} is not a dotted key (such as trainer.steps); fix: e.g. trainer.steps: 100")
    return key


def _build(data: dict, changes: list[tuple[str, Any, str]], origin: dict[str, str]) -> Scenario | EnvScenario:
    data = copy.deepcopy(data)
    origin = dict(origin)
    for key, value, where in changes:
        _set(data, key, value, where)
        origin[key] = where
    root = _root(data)
    try:
        return root.model_validate(data)
    except ValidationError as exc:
        raise ScenarioError(error_line(exc, origin, root)) from None


def _parse_sets(overrides: list[str]) -> list[tuple[str, Any, str]]:
    out = []
    for item in overrides:
        key, eq, raw = item.partition("=")
        key = key.strip()
        parts = key.split(".")
        if not eq or not key or any(not p for p in parts) or len(parts) > MAX_KEY_PARTS:
            raise ScenarioError(f"--set {shown(item)}: expected dotted.key=value; fix: e.g. --set trainer.steps=100")
        where = f"--set {clipped(item)}"
        try:
            value = parse_yaml(raw, where) if raw.strip() else raw
        except _NotYaml:
            value = raw  # not YAML (e.g. a path with ': '): the text itself; a limit passed is still an error
        out.append((key, value, where))
    return out


@dataclass(frozen=True)
class Variant:
    """One scenario of a file; files with a ``variants:`` section hold several."""

    label: Optional[str]
    scenario: Scenario | EnvScenario
    published: dict = field(default_factory=dict)


def load_resolved(path: str | Path) -> Scenario:
    """A run directory's resolved scenario (JSON, every key written); ``ScenarioError`` if it
    is unreadable or no longer valid."""
    path = Path(path)
    fix = "resume a run directory that asyncrl wrote"
    try:
        data = loads_json(read_regular(path, MAX_FILE_BYTES, fix))
    except UnreadableFile as exc:
        raise ScenarioError(str(exc)) from None
    except (ValueError, RecursionError) as exc:
        raise ScenarioError(f"{path}: unreadable ({clipped(str(exc))}); fix: {fix}") from None
    if not isinstance(data, dict):
        raise ScenarioError(f"{path}: not a scenario (a JSON object); fix: resume a run directory that asyncrl wrote")
    return _build(data, [], {"": str(path)})


def load(path: str | Path, overrides: list[str] = ()) -> Scenario:
    """Read, override and validate a single-scenario file; raises ``ScenarioError`` with one line."""
    variants = load_variants(path, overrides)
    if len(variants) != 1 or variants[0].label is not None:
        raise ScenarioError(f"{path}: holds {len(variants)} variants; fix: load it with load_variants")
    return variants[0].scenario


def load_variants(path: str | Path, overrides: list[str] = ()) -> list[Variant]:
    """Every scenario a file describes: itself, or one per entry of its ``variants:`` section.

    A variant is ``label: {set: {dotted.key: value}, published: {metric: value, source: text}}``;
    ``published`` holds figures to print beside the prediction. ``--set`` applies last.
    """
    path = Path(path)
    data = _read(path)
    sets = _parse_sets(list(overrides))
    if "sweep" in data:
        raise ScenarioError(f"{path}: holds a sweep, a grid of scenarios; fix: run it with python -m harness.run, or load it with harness.sweep.load_sweep")
    if "variants" not in data:
        return [Variant(None, _build(data, sets, {"": str(path)}))]
    variants = data.pop("variants")
    origin = {"": str(path)}
    if not isinstance(variants, dict) or not variants:
        raise ScenarioError(f"{path}: variants = {shown(variants)}: must map labels to {{set: ..., published: ...}}; fix: see scenarios/verl-table.yaml")
    out = []
    for label, body in variants.items():
        label = str(label)
        problem = name_problem(label)
        if problem is not None:  # a label names the variant's directory and titles its plots
            raise ScenarioError(f"{path}: variants.{clipped(label)}: the label {problem}; fix: use e.g. {safe_name(label)!r}")
        where = f"{path}: variants.{label}"
        body = {} if body is None else body
        if not isinstance(body, dict) or set(body) - {"set", "published"}:
            raise ScenarioError(f"{where} = {shown(body)}: holds other than 'set' and 'published'; fix: move other keys under 'set'")
        for part, example in (("set", "{trainer.steps: 100}"), ("published", "{metric: value, source: text}")):
            if not isinstance(body.get(part) or {}, dict):
                raise ScenarioError(f"{where}.{part} = {shown(body[part])}: must be a mapping; fix: e.g. {part}: {example}")
        own = [(_check_key(k, f"{where}.set"), v, f"{where}.set") for k, v in (body.get("set") or {}).items()]
        sc = _build(data, own + sets, origin)
        out.append(Variant(label, sc, dict(body.get("published") or {})))
    return out
