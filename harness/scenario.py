"""Scenario files in: YAML + ``--set`` overrides, validated into one frozen ``Scenario``.

Every problem becomes one ``ScenarioError`` line naming where it is (file or --set), the
dotted key, the value and the fix.
"""

from __future__ import annotations

import copy
import difflib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import yaml
from pydantic import BaseModel, ValidationError

from core.model.config import ConfigError, Scenario, set_dotted
from core.model.env_config import EnvScenario


class ScenarioError(Exception):
    """A scenario that cannot run; the message is the whole story, one line."""


def _root(data: dict) -> type[BaseModel]:
    """The scenario model a file describes: an env workload (``kind: env``) or an LLM one."""
    return EnvScenario if isinstance(data, dict) and data.get("kind") == "env" else Scenario


def _model_at(loc: tuple, root: type[BaseModel] = Scenario) -> type[BaseModel] | None:
    model: type[BaseModel] = root
    for part in loc:
        field = model.model_fields.get(str(part))
        if field is None or not (isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel)):
            return None
        model = field.annotation
    return model


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
    if kind.startswith(("int_", "float_", "bool_", "string_", "tuple_", "list_", "dict_", "model_")):
        return err["msg"].lower(), "write a value of that type"
    return err["msg"], "see the field's docstring in core/model/config.py"


def _error_line(exc: ValidationError, origin: dict[str, str], root: type[BaseModel] = Scenario) -> str:
    err = exc.errors()[0]
    cause = err.get("ctx", {}).get("error")
    if isinstance(cause, ConfigError):
        key, value, problem, fix = cause.key, cause.value, cause.problem, cause.fix
    else:
        key = ".".join(str(p) for p in err["loc"]) or "(scenario)"
        value = err.get("input")
        problem, fix = _fix_for(err, root)
        if isinstance(value, dict):
            value = "{...}"
    where = origin.get(key, origin.get("", ""))
    extra = len(exc.errors()) - 1
    more = f" ({extra} more problem{'s' if extra > 1 else ''} after this one)" if extra else ""
    return f"{where}: {key} = {value!r}: {problem}; fix: {fix}{more}"


def _set(data: dict, key: str, value: Any, where: str) -> None:
    try:
        set_dotted(data, key, value)
    except ConfigError as exc:
        raise ScenarioError(f"{where}: {exc.problem}; fix: {exc.fix}") from None


def _read(path: Path) -> dict:
    if not path.is_file():
        raise ScenarioError(f"{path}: no such file; fix: pass a scenario YAML such as scenarios/quickstart.yaml")
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        at = f"line {mark.line + 1}, column {mark.column + 1}: " if mark else ""
        raise ScenarioError(f"{path}: {at}not valid YAML ({getattr(exc, 'problem', exc)}); fix: correct the syntax there") from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ScenarioError(f"{path}: the top level is a {type(data).__name__}; fix: write a mapping of keys such as 'name:' and 'trainer:'")
    return data


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
        raise ScenarioError(_error_line(exc, origin, root)) from None


def _parse_sets(overrides: list[str]) -> list[tuple[str, Any, str]]:
    out = []
    for item in overrides:
        key, eq, raw = item.partition("=")
        key = key.strip()
        if not eq or not key or any(not p for p in key.split(".")):
            raise ScenarioError(f"--set {item!r}: expected dotted.key=value; fix: e.g. --set trainer.steps=100")
        try:
            value = yaml.safe_load(raw) if raw.strip() else raw
        except yaml.YAMLError:
            value = raw
        out.append((key, value, f"--set {item}"))
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
    import json

    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ScenarioError(f"{path}: unreadable ({exc}); fix: resume a run directory that asyncrl wrote") from None
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
    variants = data.pop("variants", None)
    origin = {"": str(path)}
    if variants is None:
        return [Variant(None, _build(data, sets, origin))]
    if not isinstance(variants, dict) or not variants:
        raise ScenarioError(f"{path}: variants = {variants!r}: must map labels to {{set: ..., published: ...}}; fix: see scenarios/verl-table.yaml")
    out = []
    for label, body in variants.items():
        where = f"{path}: variants.{label}"
        body = body or {}
        if not isinstance(body, dict) or set(body) - {"set", "published"}:
            raise ScenarioError(f"{where}: only 'set' and 'published' are allowed; fix: move other keys under 'set'")
        own = [(k, v, f"{where}.set") for k, v in (body.get("set") or {}).items()]
        sc = _build(data, own + sets, origin)
        out.append(Variant(str(label), sc, dict(body.get("published") or {})))
    return out
