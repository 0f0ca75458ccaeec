"""What-if sweeps: a ``sweep:`` section turns a scenario file into a grid of runs.

``python -m harness.run FILE`` runs a sweep when the file has one (docs/sweeps.md). Every grid
point is the file's scenario with the axes' keys set; each runs every listed mode on the sim
runtime in a pool of worker processes, through the same ``run_mode`` and ``report.build`` as
harness.run, and writes ``points/<label>/<mode>/report.json``. Then the points are ranked by
one mode's objective under the constraints: ``sweep.json``, ``best.yaml``, ``heatmap.png`` and
a table.

What refuses the sweep (one line, exit 2, nothing run) and what refuses only a point:
- the sweep: a malformed ``sweep:`` section, an axis key the scenario does not have, a value its
  key does not accept (type, range, choice), a constraint or objective that does not parse or
  names no numeric metric, and a grid whose every point is refused;
- a point: a check across keys that the point's combination fails (``core.model.config``'s
  ``ConfigError`` from a scenario-wide check, e.g. the model plus KV cache not fitting a GPU, or
  ``admission_lead`` above ``max_staleness``). It shows as ``refused: reason``.
"""

from __future__ import annotations

import copy
import difflib
import math
import operator
import os
import re
import time
from dataclasses import dataclass, field, replace
from datetime import datetime
from pathlib import Path
from typing import Any, Optional

import yaml
from pydantic import ValidationError
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.markup import escape

from core.model.config import ConfigError, Placement, Scenario, clipped, set_dotted, shown, with_changes
from core.runtimes.dispatch import run_mode

from harness import report, started
from harness.console import sweep_table
from harness.metrics import collect
from harness.plots import grid_heatmap_png
from harness.process_pool import run_all
from harness import run_directory
from harness.run_directory import RunDirectory, RunDirectoryError
from harness.scenario import ScenarioError, error_line, _parse_sets, _read

SCHEMA = "asyncrl.sweep/1"
# A grid this large takes hours on a workstation (a point of longtail-128gpu is seconds of CPU); a
# grid of a million points was built, validated point by point and held in memory before any ran.
MAX_POINTS = 10_000
# Each worker is a process of its own (about 100 MB): a slip of zeros would fork the machine to death.
MAX_WORKERS = 256
DEFAULT_OBJECTIVE = "throughput/trained_tokens_per_s"  # honest: dropping long samples does not raise it
RESOURCE_KEYS = {"gpus": "total GPUs of the point's placement in the ranked mode"}
SECTION_KEYS = ("axes", "constraints", "objective", "goal", "mode", "workers", "heatmap")
# Shown for every point whatever the objective.
TABLE_KEYS = ("throughput/trained_samples_per_s", "throughput/trained_tokens_per_s", "staleness/max", "bound/efficiency")
_OPS = {"<=": operator.le, ">=": operator.ge, "<": operator.lt, ">": operator.gt, "==": operator.eq, "!=": operator.ne}
_CONSTRAINT = re.compile(r"^\s*([A-Za-z_][\w./-]*)\s*(<=|>=|==|!=|<|>)\s*([-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?)\s*$")
_UNSAFE = re.compile(r"[^A-Za-z0-9._=+-]")


@dataclass(frozen=True)
class Axis:
    """One dimension of the grid: a dotted key and its values, or labelled sets of linked keys."""

    name: str
    labels: tuple[str, ...]
    settings: tuple[dict, ...]  # per value: {dotted.key: value}
    short: str = ""  # the column title: a key's last part, unless two axes share it


@dataclass(frozen=True)
class Constraint:
    """``key op number``: a report metric of the ranked mode, or ``gpus``."""

    key: str
    op: str
    bound: float
    text: str

    def holds(self, value: float) -> bool:
        return _OPS[self.op](value, self.bound)


@dataclass(frozen=True)
class Point:
    """One grid point: its value on every axis, the keys it sets, and its scenario or why it is refused."""

    index: int
    values: dict  # axis name -> value label
    settings: dict  # dotted.key -> value
    label: str  # directory name under points/
    scenario: Optional[Scenario] = None
    refused: Optional[str] = None


@dataclass(frozen=True)
class Sweep:
    path: Path
    name: str
    data: dict  # the file without its sweep section, --set applied: best.yaml starts from it
    axes: tuple[Axis, ...]
    constraints: tuple[Constraint, ...]
    objective: str
    goal: str
    mode: str
    workers: int
    heatmap: tuple[str, ...]
    points: tuple[Point, ...] = field(default=())


def has_sweep(path: str | Path) -> bool:
    """Whether a scenario file holds a ``sweep:`` section; an unreadable file is left to harness.run to report."""
    try:
        data = _read(Path(path))
    except ScenarioError:
        return False
    return "sweep" in data


def load_sweep(path: str | Path, overrides: list[str] = ()) -> Sweep:
    """Read and check a sweep file and every point of its grid; ``ScenarioError`` (one line) if
    the sweep cannot run. ``--set sweep.KEY=V`` changes the sweep section, other keys the base."""
    path = Path(path)
    data = _read(path)
    body = data.pop("sweep", None)
    at = f"{path}: sweep"
    if "variants" in data:
        raise ScenarioError(f"{path}: holds both variants and a sweep; fix: make each variant an axis value, or split the file")
    if not isinstance(body, dict):
        raise ScenarioError(f"{at} = {shown(body)}: must be a mapping with 'axes'; fix: see docs/sweeps.md")
    body = copy.deepcopy(body)
    base_sets = []
    for key, value, where in _parse_sets(list(overrides)):
        if key.startswith("sweep."):
            _set_or_fail(body, key.removeprefix("sweep."), value, where)
        else:
            base_sets.append((key, value, where))
    unknown = sorted(set(body) - set(SECTION_KEYS))
    if unknown:
        close = difflib.get_close_matches(unknown[0], SECTION_KEYS, n=1)
        hint = f"did you mean '{close[0]}'?" if close else f"known keys: {', '.join(SECTION_KEYS)}"
        raise ScenarioError(f"{at}.{clipped(unknown[0])}: unknown key; fix: remove it; {hint}")
    axes = _axes(body.get("axes"), at)
    n = math.prod(len(a.labels) for a in axes)
    if n > MAX_POINTS:
        raise ScenarioError(f"{at}.axes: a grid of {n:,} points, more than a sweep runs ({MAX_POINTS:,}); fix: sweep fewer values, "
                            "or split the grid into several sweeps")
    by_key = {k: a.name for a in axes for s in a.settings for k in s}
    for key, value, where in base_sets:
        if key in by_key:
            raise ScenarioError(f"{where}: {key} is set by sweep axis '{by_key[key]}'; fix: change that axis's values in {path}, or drop --set")
        _set_or_fail(data, key, value, where)

    modes = data.get("modes", Scenario.model_fields["modes"].default)
    if data.get("runtime", "sim") != "sim":
        raise ScenarioError(f"{path}: runtime = {shown(data['runtime'])}: a sweep runs on the sim runtime; fix: set runtime: sim")
    mode = body.get("mode")
    if mode is None:
        if not isinstance(modes, (list, tuple)) or len(modes) != 1:
            raise ScenarioError(f"{at}.mode: is required when modes lists several; fix: name the mode whose report is ranked, one of {list(modes)}")
        mode = modes[0]
    if not isinstance(modes, (list, tuple)) or mode not in modes:
        raise ScenarioError(f"{at}.mode = {shown(mode)}: is not one of the modes the file runs ({modes}); fix: use one of them, or add it to modes")
    goal = body.get("goal", "max")
    if goal not in ("max", "min"):
        raise ScenarioError(f"{at}.goal = {shown(goal)}: is not one of the choices; fix: use max or min")
    objective = body.get("objective", DEFAULT_OBJECTIVE)
    if not isinstance(objective, str) or "/" not in objective:
        raise ScenarioError(f"{at}.objective = {shown(objective)}: is not a report metric; fix: name one such as {DEFAULT_OBJECTIVE}")
    workers = body.get("workers", os.cpu_count() or 1)
    if isinstance(workers, bool) or not isinstance(workers, int) or not 1 <= workers <= MAX_WORKERS:
        raise ScenarioError(f"{at}.workers = {shown(workers)}: must be a whole number from 1 to {MAX_WORKERS}; "
                            f"fix: use e.g. {os.cpu_count()} (this machine's CPUs)")
    constraints = _constraints(body.get("constraints", []), at)
    heatmap = body.get("heatmap", [a.name for a in axes[:2]])
    names = [a.name for a in axes]
    if not isinstance(heatmap, list) or not 1 <= len(heatmap) <= 2 or any(h not in names for h in heatmap) or len(set(heatmap)) != len(heatmap):
        raise ScenarioError(f"{at}.heatmap = {shown(heatmap)}: must list one or two axis names; fix: use names from {names}")

    sweep = Sweep(path, str(data.get("name", "scenario")), data, axes, constraints, objective, goal, mode, workers, tuple(heatmap))
    points = _points(sweep)
    if all(p.refused for p in points):
        raise ScenarioError(f"{at}: every one of the {len(points)} points is refused, the first: {points[0].refused}; fix: change the axes or the base scenario")
    return replace(sweep, points=tuple(points))


def _set_or_fail(data: dict, key: str, value: Any, where: str) -> None:
    try:
        set_dotted(data, key, value)
    except ConfigError as exc:
        raise ScenarioError(f"{where}: {exc.problem}; fix: {exc.fix}") from None


def _axes(raw: Any, at: str) -> tuple[Axis, ...]:
    example = "e.g. axes: {staleness.max_staleness: [0, 1, 2]}"
    if not isinstance(raw, dict) or not raw:
        raise ScenarioError(f"{at}.axes = {shown(raw)}: must map one or more axis names to their values; fix: {example}")
    axes = []
    for name, values in raw.items():
        name = str(name)
        where = f"{at}.axes.{name}"
        if isinstance(values, dict):  # labelled linked keys: {label: {key: value}}
            entries = [(str(k), v) for k, v in values.items()]
        elif isinstance(values, list):
            entries = [(None, v) for v in values]
        else:
            raise ScenarioError(f"{where} = {shown(values)}: must be a list of values; fix: e.g. [0, 1, 2]")
        if not entries:
            raise ScenarioError(f"{where}: has no values; fix: list one or more")
        if len(entries) > MAX_POINTS:
            raise ScenarioError(f"{where}: has {len(entries):,} values, more than a sweep runs ({MAX_POINTS:,} points); fix: list fewer")
        linked = isinstance(values, dict) or any(isinstance(v, dict) for _, v in entries)
        labels, settings = [], []
        for label, v in entries:
            if linked:
                if not isinstance(v, dict) or not v:
                    raise ScenarioError(f"{where}: entry {shown(v)} is not a mapping of dotted keys; fix: write every entry as {{dotted.key: value, ...}}")
                settings.append({str(k): x for k, x in v.items()})
                labels.append(label if label is not None else ":".join(_text(x) for x in v.values()))
            else:
                settings.append({name: v})
                labels.append(_text(v))
        dup = next((x for x in labels if labels.count(x) > 1), None)
        if dup is not None:
            raise ScenarioError(f"{where}: the value {shown(dup)} is listed twice; fix: list each value once")
        safe = [_UNSAFE.sub("-", x) for x in labels]
        if len(set(safe)) != len(safe):
            raise ScenarioError(f"{where}: values {labels} give the same directory name; fix: label the entries ({{label: {{key: value}}}})")
        axes.append(Axis(name, tuple(labels), tuple(settings)))
    seen: dict[str, str] = {}
    for a in axes:
        for key in sorted({k for s in a.settings for k in s}):
            if key in seen and seen[key] != a.name:
                raise ScenarioError(f"{at}.axes.{a.name}: sets {key}, which axis '{seen[key]}' sets too; fix: set each key on one axis")
            seen[key] = a.name
    shorts = [a.name.rsplit(".", 1)[-1] for a in axes]
    return tuple(
        Axis(a.name, a.labels, a.settings, s if shorts.count(s) == 1 else a.name) for a, s in zip(axes, shorts)
    )


def _text(v: Any) -> str:
    return v if isinstance(v, str) else yaml.safe_dump(v, default_flow_style=True).strip().removesuffix("...").strip()


def parse_constraint(text: Any, at: str = "sweep.constraints") -> Constraint:
    """``KEY OP NUMBER`` with OP one of <= >= < > == !=; read with a pattern, never evaluated."""
    m = _CONSTRAINT.match(text) if isinstance(text, str) else None
    if m is None:
        raise ScenarioError(
            f"{at}: {text!r}: is not 'KEY OP NUMBER'; fix: write e.g. 'staleness/max <= 2' or 'gpus <= 128' "
            "(KEY a report metric or gpus, OP one of <= >= < > == !=)"
        )
    key, op, num = m.groups()
    if key not in RESOURCE_KEYS and "/" not in key:
        raise ScenarioError(f"{at}: {shown(text)}: {key} is neither a report metric (such as staleness/max) nor gpus; fix: use one of those")
    return Constraint(key, op, float(num), text.strip())


def _constraints(raw: Any, at: str) -> tuple[Constraint, ...]:
    if isinstance(raw, str):
        raw = [raw]
    if not isinstance(raw, list):
        raise ScenarioError(f"{at}.constraints = {shown(raw)}: must be a list of 'KEY OP NUMBER'; fix: e.g. ['staleness/max <= 2', 'gpus <= 128']")
    return tuple(parse_constraint(c, f"{at}.constraints[{i}]") for i, c in enumerate(raw))


def grid(axes: tuple[Axis, ...]) -> list[tuple[dict, dict]]:
    """Every combination, the first axis outermost: (axis name -> value label, dotted key -> value)."""
    out: list[tuple[dict, dict]] = [({}, {})]
    for a in axes:
        out = [({**vals, a.name: label}, {**sets, **s}) for vals, sets in out for label, s in zip(a.labels, a.settings)]
    return out


def _points(sweep: Sweep) -> list[Point]:
    """Each point validated as a Scenario: a value its key refuses stops the sweep; a check
    across keys that this combination fails refuses the point."""
    origin_of = {k: f"{sweep.path}: sweep.axes.{a.name}" for a in sweep.axes for s in a.settings for k in s}
    points = []
    for i, (values, settings) in enumerate(grid(sweep.axes)):
        label = "__".join(f"{_UNSAFE.sub('-', a.short)}={_UNSAFE.sub('-', values[a.name])}" for a in sweep.axes)
        data = copy.deepcopy(sweep.data)
        for key, value in settings.items():
            _set_or_fail(data, key, value, origin_of[key])
        try:
            sc = Scenario.model_validate(data)
        except ValidationError as exc:
            cause = exc.errors()[0].get("ctx", {}).get("error")
            if isinstance(cause, ConfigError):
                points.append(Point(i, values, settings, label, refused=str(cause)))
                continue
            raise ScenarioError(error_line(exc, {"": str(sweep.path), **origin_of})) from None
        points.append(Point(i, values, settings, label, scenario=sc))
    return points


def probe_metrics(sweep: Sweep) -> dict:
    """The metrics a point's report holds, from a one-step run of the first runnable point: the
    objective and constraints are checked against them before the sweep runs."""
    sc = next(p.scenario for p in sweep.points if p.scenario is not None)
    tiny = with_changes(sc, {"trainer.steps": 1, "faults": [], "checkpoint.every": 0})
    return collect(run_mode(tiny, sweep.mode))


def check_keys(sweep: Sweep, metrics: dict) -> None:
    """Objective and constraint keys must be numeric metrics of a report; ``ScenarioError`` if not."""
    numeric = sorted(k for k, v in metrics.items() if isinstance(v, (int, float)) and not isinstance(v, bool))
    wanted = [(f"{sweep.path}: sweep.objective", sweep.objective)]
    wanted += [(f"{sweep.path}: sweep.constraints[{i}]", c.key) for i, c in enumerate(sweep.constraints) if c.key not in RESOURCE_KEYS]
    for where, key in wanted:
        if key in numeric:
            continue
        if key in metrics:
            raise ScenarioError(f"{where}: {key} is not a number ({metrics[key]!r}); fix: use a numeric metric such as {DEFAULT_OBJECTIVE}")
        close = difflib.get_close_matches(key, numeric, n=1)
        hint = f"did you mean '{close[0]}'?" if close else "see docs/report.md for the metrics"
        raise ScenarioError(f"{where}: {key} is not a report metric; fix: {hint}")


def run_point(sc: Scenario, where: str, env: dict) -> dict:
    """One grid point, in a worker process: every mode as harness.run runs it (no plots);
    writes ``<where>/<mode>/report.json`` and ``<where>/summary.json``; returns each mode's
    metrics and the CPU seconds the point took."""
    cpu = time.process_time()
    out = Path(where)
    reports = {}
    for mode in sc.modes:
        (out / mode).mkdir(parents=True, exist_ok=True)
        rep = report.build(sc, run_mode(sc, mode), env)
        report.write_json(out / mode / "report.json", rep)
        reports[mode] = rep
    report.write_json(out / "summary.json", report.summary(sc, reports))
    return {"modes": {mode: rep["metrics"] for mode, rep in reports.items()}, "cpu_s": time.process_time() - cpu}


def run_points(sweep: Sweep, root: Path, env: dict, on_done=None) -> dict[int, dict]:
    """Run every runnable point, ``sweep.workers`` at a time in spawned processes (one worker:
    in this process). Returns index -> run_point's answer, or {"error": text} for a point whose run raised."""
    todo = {p.index: p for p in sweep.points if p.scenario is not None}
    jobs = [(i, (p.scenario, str(root / p.label), env)) for i, p in todo.items()]
    return run_all(run_point, jobs, sweep.workers, on_done=(lambda i: on_done(todo[i])) if on_done else None)


def rank(sweep: Sweep, results: dict[int, dict]) -> tuple[list[dict], Optional[dict]]:
    """One row per point (status ok, violates, refused or failed) and the best row under the
    constraints (None when no point meets them). Ties go to the first point in grid order."""
    rows = []
    for p in sweep.points:
        row = {"label": p.label, "values": p.values, "settings": p.settings, "status": "ok", "reason": None, "metrics": {}}
        rows.append(row)
        if p.refused:
            row.update(status="refused", reason=p.refused)
            continue
        got = results.get(p.index) or {"error": "not run"}
        if "error" in got:
            row.update(status="failed", reason=got["error"])
            continue
        m = got["modes"][sweep.mode]
        row["cpu_s"] = got.get("cpu_s")
        shown = {k: m.get(k) for k in (sweep.objective, *TABLE_KEYS)}
        shown["gpus"] = Placement.of(p.scenario, sweep.mode).total_gpus
        for c in sweep.constraints:
            shown[c.key] = shown["gpus"] if c.key in RESOURCE_KEYS else m.get(c.key)
        row["metrics"] = shown
        broken = [c.text for c in sweep.constraints if not isinstance(shown[c.key], (int, float)) or not c.holds(shown[c.key])]
        if broken:
            row.update(status="violates", reason="; ".join(broken))
    ok = [r for r in rows if r["status"] == "ok" and isinstance(r["metrics"].get(sweep.objective), (int, float))]
    sign = 1 if sweep.goal == "max" else -1
    best = max(ok, key=lambda r: sign * r["metrics"][sweep.objective], default=None)  # max keeps the first of equals
    return rows, best


def heatmap_cells(sweep: Sweep, rows: list[dict], best: Optional[dict]) -> tuple[list[list], tuple | None]:
    """The heatmap's grid over its one or two axes: (value or None, note) per cell. With more axes a
    cell shows the best point over the others (one meeting the constraints when there is one)."""
    axes = {a.name: a for a in sweep.axes}
    ya = axes[sweep.heatmap[0]]
    xa = axes[sweep.heatmap[1]] if len(sweep.heatmap) > 1 else None
    xs = xa.labels if xa else ("",)
    sign = 1 if sweep.goal == "max" else -1
    cells, best_at = [], None
    for yi, y in enumerate(ya.labels):
        line = []
        for xi, x in enumerate(xs):
            here = [r for r in rows if r["values"][ya.name] == y and (xa is None or r["values"][xa.name] == x)]
            ran = [r for r in here if isinstance(r["metrics"].get(sweep.objective), (int, float))]
            pick = [r for r in ran if r["status"] == "ok"] or ran
            if pick:
                r = max(pick, key=lambda r: sign * r["metrics"][sweep.objective])
                line.append((r["metrics"][sweep.objective], "" if r["status"] == "ok" else "violates"))
            else:
                line.append((None, here[0]["status"] if here else ""))
            if best is not None and best in here:
                best_at = (yi, xi)
        cells.append(line)
    return cells, best_at


def sweep_json(sweep: Sweep, rows: list[dict], best: Optional[dict], timing: dict) -> dict:
    return {
        "schema": SCHEMA,
        "scenario_name": sweep.name,
        "file": str(sweep.path),
        "mode": sweep.mode,
        "modes_run": list(next(p.scenario.modes for p in sweep.points if p.scenario is not None)),
        "objective": sweep.objective,
        "goal": sweep.goal,
        "constraints": [c.text for c in sweep.constraints],
        "axes": {a.name: {"labels": list(a.labels), "settings": list(a.settings)} for a in sweep.axes},
        "points": rows,
        "best": best,
        **timing,
    }


def best_scenario(sweep: Sweep, best: dict) -> dict:
    """The file's scenario with the best point's keys set: runnable with harness.run."""
    data = copy.deepcopy(sweep.data)
    for key, value in best["settings"].items():
        set_dotted(data, key, value)
    return data


def main(args, console: Console, err: Console) -> int:
    """The sweep behind ``python -m harness.run FILE``; ``args`` are harness.run's."""
    t0 = time.perf_counter()
    try:
        for used, name in ((args.resume is not None, "--resume"), (args.stop_at_step is not None, "--stop-at-step"), (args.profile, "--profile")):
            if used:
                raise ScenarioError(f"{name}: {args.scenario} is a sweep, which is neither checkpointed nor profiled; fix: drop {name}, or run one point's settings as its own scenario")
        sweep = load_sweep(args.scenario, args.overrides)
        out = args.out or Path("runs") / f"{sweep.name}-{datetime.now():%Y%m%d-%H%M%S}"
        out = run_directory.check(out, "sweep", "sweep.json")
        check_keys(sweep, probe_metrics(sweep))
        claimed = RunDirectory.claim(out, "sweep")
    except (ScenarioError, RunDirectoryError) as exc:
        err.print(f"[bold red]error:[/] {escape(str(exc))}", highlight=False, soft_wrap=True)
        return 2
    started()  # Ctrl-C from here on is the sweep's to answer (harness.run)
    staging = claimed.path
    runnable = sum(p.scenario is not None for p in sweep.points)
    workers = max(1, min(sweep.workers, runnable))
    try:
        env = report.environment()
        t1 = time.perf_counter()
        with Progress(
            TextColumn("[bold]sweep"), BarColumn(), TextColumn("{task.completed}/{task.total} points"), TimeElapsedColumn(),
            console=console, disable=not console.is_terminal,
        ) as progress:
            task = progress.add_task("points", total=runnable)
            results = run_points(sweep, staging / "points", env, on_done=lambda p: progress.advance(task))
        t2 = time.perf_counter()
        rows, best = rank(sweep, results)
        cpu = [r["cpu_s"] for r in rows if r.get("cpu_s")]
        timing = {"workers": workers, "points_wall_s": t2 - t1, "points_cpu_s": sum(cpu), "wall_s": None}
        files = ["sweep.json", "points/<label>/<mode>/report.json"]
        if best is not None:
            (staging / "best.yaml").write_text(
                f"# the best point of {sweep.path} ({best['label']}): {sweep.objective} {sweep.goal} under "
                f"{', '.join(c.text for c in sweep.constraints) or 'no constraints'}\n"
                + yaml.safe_dump(best_scenario(sweep, best), sort_keys=False)
            )
            files += ["best.yaml"]
        if not args.no_plots:
            cells, best_at = heatmap_cells(sweep, rows, best)
            axes = {a.name: a for a in sweep.axes}
            ya, xa = axes[sweep.heatmap[0]], axes[sweep.heatmap[1]] if len(sweep.heatmap) > 1 else None
            more = len(sweep.axes) > len(sweep.heatmap)
            grid_heatmap_png(
                staging / "heatmap.png",
                title=f"{sweep.name}: {sweep.mode}, {sweep.objective}" + (" (best over the other axes)" if more else ""),
                rows=(ya.short, list(ya.labels)),
                columns=(xa.short, list(xa.labels)) if xa else ("", [""]),
                cells=cells,
                best=best_at,
                note=f"outlined: best ({sweep.goal}) under {', '.join(c.text for c in sweep.constraints) or 'no constraints'}",
            )
            files.append("heatmap.png")
        timing["wall_s"] = time.perf_counter() - t0
        report.write_json(staging / "sweep.json", sweep_json(sweep, rows, best, timing))  # last: it marks the sweep finished
        claimed.commit()
    except BaseException:
        claimed.abandon(keep=False)
        raise
    console.print(sweep_table(sweep.name, sweep.mode, [(a.name, a.short) for a in sweep.axes], rows, sweep.objective, best))
    where = " under " + ", ".join(c.text for c in sweep.constraints) if sweep.constraints else ""
    if best is None:
        console.print(f"no point meets{where or ' the constraints'}", highlight=False)
    else:
        vals = ", ".join(f"{a.short} {best['values'][a.name]}" for a in sweep.axes)
        console.print(f"best{where}: {vals}: {best['metrics'][sweep.objective]:,.2f} {sweep.objective} ({best['label']})", highlight=False)
    console.print(
        f"{len(sweep.points)} points ({runnable} run on {workers} worker{'s' * (workers > 1)} in {timing['points_wall_s']:.1f} s, "
        f"{timing['points_cpu_s'] / max(1, len(cpu)):.1f} CPU-s each); "
        f"in {out}: {', '.join(files)}",
        highlight=False,
    )
    return 1 if any(r["status"] == "failed" for r in rows) else 0
