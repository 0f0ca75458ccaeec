"""``python -m harness.calibrate RUN_DIR [--mode sync] [-o SCENARIO.yaml] [--predict]``
``python -m harness.calibrate PHASES.yaml``

Fits the sim's cost model to one mode of a real run (its ``<mode>/spans.json``) by least
squares, and writes a runnable sim scenario with the run's workload shape, the fitted costs
(``calibrated:``) and the trained response lengths (``workload.lengths``, a file next to it):

  engine step  = overhead + per_seq * running + kv * context held (+ per prompt token, vLLM)
  prefill      = per_token * tokens (torch engine: prefill is its own step)
  trainer step = overhead + a * tokens + b * sum of squared lengths
  transfer     = mean of rollout paused -> resumed at a sync

``--predict`` runs the written scenario on the sim and prints, for every mode the run
directory holds, the measured and predicted throughput and step time; modes other than
``--mode`` are held out: nothing is fitted to them. Given a YAML file of published phase
times instead of a run directory, ``core.sim.phase_fit.fit_phases`` turns it into cost
changes. Exit code 2 and one line on stderr for bad input, before anything is written.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import stat
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import numpy as np
import yaml
from pydantic import ValidationError
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from core.model.bounded_parse import TooNested, loads_yaml
from core.model.config import MODES, Placement, Scenario
from core.model.phase_table import PhaseTable
from core.model.regular_file import UnreadableFile, read_regular
from core.model.run_plan import RunPlan
from core.runtimes.sim import run_sim
from core.sim.phase_fit import fit_phases
from harness import command_line, report, started
from harness.arguments import ArgumentError, OneLineParser
from harness.scenario import error_line
from harness.spans import SpansError, read_spans
from harness.probes import engine_contention, train_speedup

# The sections of a real run's scenario that a sim run does not read.
_REAL_ONLY = ("engine", "tiny_model", "task", "learn", "eval", "ray", "reward")
PHASES_BYTES = 1 << 20  # a table of phase times is a few KB
_COMPARED = ("throughput/trained_samples_per_s", "throughput/trained_tokens_per_s", "latency/step_mean_s")


class CalibrationError(ValueError):
    """Bad input: the one line the CLI prints."""


@dataclass(frozen=True)
class Fit:
    """Least-squares coefficients (non-negative) of ``y ~ X``, with how well they fit."""

    names: tuple[str, ...]
    coef: tuple[float, ...]
    r2: float
    rmse: float  # root-mean-square residual, in y's unit
    n: int
    mean_y: float

    def __getitem__(self, name: str) -> float:
        return self.coef[self.names.index(name)]


def nnls(X: np.ndarray, y: np.ndarray, names: tuple[str, ...]) -> Fit:
    """Least squares with every coefficient >= 0 (a cost term cannot be negative): a column
    whose coefficient comes out negative is dropped (set to 0) and the rest refitted."""
    X, y = np.asarray(X, dtype=np.float64), np.asarray(y, dtype=np.float64)
    if X.ndim != 2 or X.shape[0] != y.shape[0] or X.shape[0] == 0:
        raise CalibrationError(f"cannot fit {', '.join(names)}: no rows")
    active = list(range(X.shape[1]))
    coef = np.zeros(X.shape[1])
    while active:
        # Columns scaled to unit norm so that tokens and tokens^2 are solved on equal footing.
        cols = X[:, active]
        scale = np.linalg.norm(cols, axis=0)
        scale[scale == 0] = 1.0
        try:
            c, *_ = np.linalg.lstsq(cols / scale, y, rcond=None)
        except np.linalg.LinAlgError:
            raise CalibrationError(f"cannot fit {', '.join(names)}: the rows determine no fit; fix: calibrate from a run of more steps") from None
        c = c / scale
        if np.all(c >= 0):
            coef[:] = 0.0
            coef[active] = c
            break
        active.pop(int(np.argmin(c)))
    resid = y - X @ coef
    ss_tot = float(((y - y.mean()) ** 2).sum())
    r2 = 1.0 - float((resid**2).sum()) / ss_tot if ss_tot > 0 else 1.0
    return Fit(names, tuple(float(c) for c in coef), r2, float(np.sqrt((resid**2).mean())), len(y), float(y.mean()))


@dataclass(frozen=True)
class Calibration:
    decode: Fit
    prefill: Optional[Fit]  # None when the engine's steps mix prefill in (vLLM)
    train: Fit
    transfer_s: float
    transfer_n: int
    train_devices: int
    response_lens: list
    prompt_tokens: int
    prompt_share: float
    prefill_spread: float = 0.0  # (max - min) / mean of the tokens per prefill
    transfer_spread: float = 0.0  # standard deviation over mean of the measured syncs

    def calibrated(self, source: str, speedup: dict[int, float]) -> dict:
        """The scenario's ``calibrated:`` section."""
        d, t = self.decode, self.train
        return {
            "source": source,
            "decode_overhead_s": d["1"],
            "decode_per_seq_s": d["running"],
            "decode_kv_s_per_token": d["context"],
            "prefill_s_per_token": self.prefill_per_token()[0],
            "train_overhead_s": t["1"],
            "train_s_per_token": t["tokens"],
            "train_s_per_token_sq": t["tokens_sq"],
            "train_devices": self.train_devices,
            "train_speedup": dict(speedup),
            "transfer_s": self.transfer_s,
            # How far a prediction from these may be off: the band draws within twice it (core/sim/band.py).
            "decode_error": relative_error(d),
            "train_error": relative_error(t),
            "transfer_error": self.transfer_spread,
        }

    def prefill_per_token(self) -> tuple[float, str]:
        """Seconds per prefilled token, and where it comes from. A prefill's fixed part (a
        separate engine iteration on the torch engine) has no term in the sim, whose engines
        charge prefill per request. When the fitted mode's prefills all hold about as many
        tokens (a sync run prefills only fresh prompts), their slope cannot be told from their
        fixed part; then the decode fit's cost of one more sequence in a batched forward stands
        for one more prefilled token."""
        if self.prefill is None:
            return self.decode["prompt_tokens"], "fitted with the engine step (vLLM)"
        if self.prefill_spread >= 1.0:
            return self.prefill["tokens"], "fitted slope"
        return self.decode["running"], f"prefills span too few token counts (spread {self.prefill_spread:.2f}): decode per_seq"


def fit_spans(spans: dict) -> Calibration:
    """The cost model's coefficients from one mode's spans (``harness.spans``)."""
    decode, prefill, mixed = [], [], []
    for rows in spans["engines"].values():
        decode += rows.get("decode", [])
        prefill += rows.get("prefill", [])
        mixed += rows.get("steps", [])
    if mixed:
        m = np.asarray(mixed, dtype=np.float64)
        X = np.column_stack([np.ones(len(m)), m[:, 0], m[:, 1], m[:, 2]])
        dfit = nnls(X, m[:, 3], ("1", "running", "context", "prompt_tokens"))
        pfit = None
    else:
        if not decode:
            raise CalibrationError("no engine step was recorded; fix: calibrate from a real run's sync mode")
        d = np.asarray(decode, dtype=np.float64)
        dfit = nnls(np.column_stack([np.ones(len(d)), d[:, 0], d[:, 1]]), d[:, 2], ("1", "running", "context"))
        if not prefill:
            raise CalibrationError("no prefill was recorded; fix: calibrate from a run that generated")
        p = np.asarray(prefill, dtype=np.float64)
        pfit = nnls(np.column_stack([np.ones(len(p)), p[:, 0]]), p[:, 1], ("1", "tokens"))
    if not spans["train"]:
        raise CalibrationError("no trainer step was recorded; fix: calibrate from a run that trained")
    t = np.asarray(spans["train"], dtype=np.float64)
    tfit = nnls(np.column_stack([np.ones(len(t)), t[:, 0], t[:, 1]]), t[:, 2], ("1", "tokens", "tokens_sq"))
    transfer = [x for x in spans["transfer_s"] if x >= 0]
    lens = [int(n) for n in spans["response_lens"]]
    if not lens:
        raise CalibrationError("no trained response length was recorded; fix: calibrate from a run of this version")
    prompts = spans["prompt_lens"]
    group = spans["scenario"]["workload"]["group_size"]
    return Calibration(
        dfit, pfit, tfit, float(np.mean(transfer)) if transfer else 0.0, len(transfer),
        int(spans["placement"]["trainer_gpus"]), lens,
        max(1, round(float(np.mean(prompts)))) if prompts else spans["scenario"]["workload"]["prompt_tokens"],
        prompt_share(lens, group),
        float(np.ptp(p[:, 0]) / p[:, 0].mean()) if pfit is not None and p[:, 0].mean() > 0 else 0.0,
        float(np.std(transfer) / np.mean(transfer)) if len(transfer) > 1 and np.mean(transfer) > 0 else 0.0,
    )


def relative_error(fit: Fit) -> float:
    """A fit's root-mean-square residual over its mean observation (0 for a fit of nothing), at most 10."""
    return min(10.0, fit.rmse / fit.mean_y) if fit.mean_y > 0 else 0.0


def prompt_share(lens: list, group_size: int) -> float:
    """Share of the log-length variance between groups (one-way ICC of log lengths, groups
    of ``group_size`` in training order): the workload's ``prompt_share``."""
    x = np.log(np.maximum(np.asarray(lens, dtype=np.float64), 1.0))
    k = len(x) // group_size
    if k < 2 or group_size < 2:
        return 0.0
    g = x[: k * group_size].reshape(k, group_size)
    msb = group_size * g.mean(axis=1).var(ddof=1)
    msw = g.var(axis=1, ddof=1).mean()
    denom = msb + (group_size - 1) * msw
    return float(min(1.0, max(0.0, (msb - msw) / denom))) if denom > 0 else 0.0


def sim_scenario(spans: dict, cal: Calibration, lengths_path: str, source: str, speedup: dict[int, float]) -> dict:
    """A runnable sim scenario: the run's workload shape, its modes, the fitted costs."""
    real = Scenario.model_validate(spans["scenario"])
    out = real.model_dump(mode="json", exclude_defaults=True)
    for key in _REAL_ONLY:
        out.pop(key, None)
    out["name"] = f"{real.name}-calibrated"
    out["runtime"] = "sim"
    out["modes"] = list(real.modes)
    wl = out.setdefault("workload", {})
    wl["lengths"] = lengths_path
    wl["prompt_tokens"] = cal.prompt_tokens
    wl["prompt_share"] = round(cal.prompt_share, 4)
    out["calibrated"] = cal.calibrated(source, speedup)
    out["calibrated"]["decode_placement"] = "colocated" if spans["placement"]["colocated"] else "separated"
    Scenario.model_validate(out)  # what is written runs
    return out


def load_spans(run_dir: Path, mode: str) -> dict:
    if not run_dir.is_dir():
        raise CalibrationError(f"{run_dir}: no such directory; fix: pass a run directory written by harness.run")
    path = run_dir / mode / "spans.json"
    if not path.is_file():
        have = sorted(p.parent.name for p in run_dir.glob("*/spans.json"))
        hint = f"modes with spans: {', '.join(have)}" if have else "only real runs (local, ray) write spans.json"
        raise CalibrationError(f"{path}: missing ({hint}); fix: run the scenario with harness.run on a real runtime")
    try:
        return read_spans(path, mode)
    except SpansError as exc:
        raise CalibrationError(str(exc)) from None


def parse_speedup(items: list[str]) -> dict[int, float]:
    out = {}
    for item in items:
        n, _, s = item.partition("=")
        try:
            out[int(n)] = float(s)
        except ValueError:
            raise CalibrationError(f"--train-speedup {item}: expected DEVICES=SPEED such as 1=0.55; fix: give it that way") from None
        if out[int(n)] <= 0 or int(n) < 1:
            raise CalibrationError(f"--train-speedup {item}: devices >= 1 and speed > 0; fix: give positive numbers")
    return out


def fit_table(cal: Calibration) -> Table:
    t = Table(title="calibration: least-squares fit (coefficients >= 0)")
    for col in ("cost", "coefficients", "R²", "rms residual", "mean", "rows"):
        t.add_column(col, justify="left" if col in ("cost", "coefficients") else "right")

    def row(name: str, f: Fit) -> None:
        coefs = ", ".join(f"{n}: {c:.4g}" for n, c in zip(f.names, f.coef))
        t.add_row(name, coefs, f"{f.r2:.3f}", f"{f.rmse * 1e3:.2f} ms", f"{f.mean_y * 1e3:.2f} ms", str(f.n))

    row("engine step (s)", cal.decode)
    if cal.prefill is not None:
        row("prefill (s)", cal.prefill)
    per_token, why = cal.prefill_per_token()
    t.add_row("prefill used (s/token)", f"{per_token:.4g}: {why}", "", "", "", "")
    row(f"trainer step (s, {cal.train_devices} dev)", cal.train)
    t.add_row("transfer (s)", f"mean {cal.transfer_s:.4g}", "", "", "", str(cal.transfer_n))
    lens = np.asarray(cal.response_lens)
    t.add_row("response lengths", f"mean {lens.mean():.1f}, median {np.median(lens):.0f}, p99 {np.percentile(lens, 99):.0f}; "
              f"prompt {cal.prompt_tokens} tokens, prompt_share {cal.prompt_share:.3f}", "", "", "", str(len(lens)))
    return t


def measured(run_dir: Path, modes: tuple[str, ...]) -> dict[str, dict]:
    """The figures --predict compares, of each mode the run finished (its report.json)."""
    out = {}
    for mode in modes:
        rep = run_dir / mode / "report.json"
        if not rep.is_file():
            continue
        try:
            out[mode] = report.read_report(rep, report.SCHEMA, mode, numbers=_COMPARED, fix="run the scenario again")["metrics"]
        except report.ReportError as exc:
            raise CalibrationError(str(exc)) from None
    return out


def predict(reports: dict[str, dict], scenario: Scenario, fitted_mode: str) -> list[dict]:
    """Every mode the run finished: measured (``measured``) against the calibrated sim."""
    rows = []
    for mode, got in reports.items():
        predicted = report.build(scenario, run_sim(RunPlan.of(scenario, mode)), {})["metrics"]
        row = {"mode": mode, "held_out": mode != fitted_mode}
        for k in _COMPARED:
            row[k] = (got[k], predicted[k], predicted[k] / got[k] - 1.0 if got[k] else math.nan)
        rows.append(row)
    return rows


def predict_table(rows: list[dict]) -> Table:
    t = Table(title="measured (real run) vs predicted (calibrated sim)")
    t.add_column("mode")
    for k in _COMPARED:
        t.add_column(k.split("/")[1], justify="right")
    for r in rows:
        cells = [f"{m:,.3g} / {p:,.3g} ({e:+.1%})" for m, p, e in (r[k] for k in _COMPARED)]
        t.add_row(r["mode"] + (" (held out)" if r["held_out"] else " (fitted)"), *cells)
    return t


def _probe(spans: dict, cal: Calibration, scenario: dict, speedup: dict[int, float], console: Console) -> None:
    """Measure the trainer's speed-up and the engines' contention; put them in ``scenario``."""
    real = Scenario.model_validate(spans["scenario"])
    devices = [Placement.of(real, m).trainer_gpus for m in real.modes]
    probed, secs = train_speedup(real, spans["prompt_lens"], cal.response_lens, cal.train_devices, devices)
    console.print("probe, trainer seconds per step by devices: " + ", ".join(f"{n}: {t:.3f}" for n, t in secs.items())
                  + f"; speed relative to {cal.train_devices}: " + ", ".join(f"{n}: {v:.3f}" for n, v in probed.items()),
                  highlight=False)
    c = scenario["calibrated"]
    c["train_speedup"] = {**probed, **speedup}
    engines = spans["placement"]["engines"]
    if real.runtime == "local" and engines > 1:
        lens = np.asarray(cal.response_lens)
        factor, alone_ms, many_ms = engine_contention(
            real, engines, spans["prompt_lens"], cal.response_lens, real.trainer.batch_size // engines, int(np.percentile(lens, 90)))
        console.print(f"probe, decode step of one engine next to a stepping trainer {alone_ms:.2f} ms, of {engines} engines "
                      f"side by side in one process {many_ms:.2f} ms: separated engines step {factor:.3f}x as fast",
                      highlight=False)
        c["separated_decode_speedup"] = factor


def _check_writable(path: Path, replace: bool) -> None:
    """A file calibrate writes lies outside any run directory, in the user's tree: it is created
    anew, replaces an existing one only with --force and only a regular file, and is never
    written through a link or into a device."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    except OSError as exc:
        raise CalibrationError(f"{path}: cannot be checked ({exc.strerror}); fix: name a file in a directory you can write") from None
    if stat.S_ISLNK(st.st_mode):
        raise CalibrationError(f"{path}: is a symbolic link, which calibrate never writes through; fix: name a new file")
    if stat.S_ISDIR(st.st_mode):
        raise CalibrationError(f"{path}: is a directory; fix: name a YAML file")
    if not stat.S_ISREG(st.st_mode):
        raise CalibrationError(f"{path}: is not a regular file (a device, FIFO or socket); fix: name a new file")
    if not replace:
        raise CalibrationError(f"{path}: exists, and calibrate does not replace a file unasked; fix: name a new file, or pass --force")


def _write(path: Path, text: str, replace: bool) -> None:
    """Write ``path`` as ``_check_writable`` allows; O_NOFOLLOW and O_EXCL hold it to that even if
    the path changed since it was checked."""
    _check_writable(path, replace)
    flags = os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | (os.O_TRUNC if replace else os.O_EXCL)
    try:
        fd = os.open(path, flags, 0o644)
    except OSError as exc:
        raise CalibrationError(f"{path}: cannot be written ({exc.strerror}); fix: name a new file in a directory you can write") from None
    with os.fdopen(fd, "w") as f:
        f.write(text)


# An example of each option that takes a value, for the fix of an argument error.
_EXAMPLES = {"--mode": "--mode sync", "--out": "-o runs/my-run/calibrated.yaml", "--train-speedup": "--train-speedup 1=0.55",
             "--separated-decode-speedup": "--separated-decode-speedup 1.3"}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = OneLineParser(prog="python -m harness.calibrate", description=__doc__.split("\n\n")[1], examples=_EXAMPLES,
                      shape="a run directory or a table of phase times, then options")
    p.add_argument("source", type=Path, help="a real run's directory, or a YAML file of published phase times")
    p.add_argument("--mode", default="sync", choices=MODES, help="the mode to fit (default sync); the others stay held out")
    p.add_argument("-o", "--out", type=Path, help="scenario to write (default RUN_DIR/calibrated.yaml)")
    p.add_argument("--force", action="store_true", help="replace the scenario and its .lengths.json if they exist (regular files only)")
    p.add_argument("--train-speedup", action="append", default=[], metavar="DEVICES=SPEED",
                   help="measured trainer speed on DEVICES devices relative to the fitted mode's (default: linear)")
    p.add_argument("--separated-decode-speedup", type=float, metavar="FACTOR",
                   help="how much faster an engine steps next to a trainer than beside the fitted mode's other engines "
                        "(what --probe measures), e.g. from an earlier --probe on this machine")
    p.add_argument("--probe", action="store_true",
                   help="measure on this machine what the cost model has no term for (harness/probes.py; run it on a "
                        "quiet machine): the trainer's speed-up at every device count the modes use, and in-process "
                        "contention between the fitted mode's engines on the local runtime")
    p.add_argument("--predict", action="store_true", help="run the written scenario and compare with every mode of the run")
    return p.parse_args(argv)


def _phases(path: Path, console: Console) -> int:
    fix = "pass a YAML file of phase times"
    try:
        # A table of phase times is a few levels and a few dozen values.
        table = loads_yaml(read_regular(path, PHASES_BYTES, fix).decode("utf-8"), max_depth=8, max_values=100_000)
    except UnreadableFile as exc:
        raise CalibrationError(str(exc)) from None
    except TooNested as exc:
        raise CalibrationError(f"{path}: {exc}; fix: {fix}") from None
    except (UnicodeDecodeError, yaml.YAMLError) as exc:
        raise CalibrationError(f"{path}: not readable YAML ({type(exc).__name__}); fix: {fix}") from None
    if not isinstance(table, dict):
        raise CalibrationError(f"{path}: not a table of phase times (a YAML mapping); fix: see scenarios/published/")
    try:
        changes, lines = fit_phases(table)
    except ValidationError as exc:
        raise CalibrationError(error_line(exc, {"": str(path)}, PhaseTable)) from None
    for line in lines:
        console.print(line, highlight=False)
    console.print(yaml.safe_dump(changes, sort_keys=False), highlight=False)
    return 0


def main(argv: list[str] | None = None) -> int:
    started()
    wrote: dict[str, list[Path]] = {"new": [], "done": []}
    try:
        return _main(argv, wrote)
    except KeyboardInterrupt:
        # The pair is written together or not at all: a lengths file this call created goes
        # with the scenario that would have named it.
        if not wrote["done"]:
            for path in wrote["new"]:
                path.unlink(missing_ok=True)
        said = f"{' and '.join(map(str, wrote['done']))} are written" if wrote["done"] else "nothing was written"
        sys.stderr.write(f"interrupted; {said}\n")
        return 130


def _main(argv: list[str] | None, wrote: dict[str, list[Path]]) -> int:
    """``main``; ``wrote`` is told each file created ("new") and the pair once both are ("done")."""
    console = Console()
    err = Console(stderr=True)
    try:
        args = parse_args(argv)
        if args.source.is_file():
            given = [flag for flag, on in (("--out", args.out), ("--force", args.force), ("--probe", args.probe), ("--predict", args.predict),
                                           ("--train-speedup", args.train_speedup)) if on]
            if given:
                raise CalibrationError(f"{given[0]}: fits from a run directory, and {args.source} is a table of phase times; "
                                       f"fix: drop {given[0]}, or pass a run directory")
            return _phases(args.source, console)
        speedup = parse_speedup(args.train_speedup)
        factor = args.separated_decode_speedup
        if factor is not None and not (math.isfinite(factor) and factor > 0):
            raise CalibrationError(f"--separated-decode-speedup {factor}: must be a finite number > 0; fix: give the factor --probe printed")
        out = args.out or args.source / "calibrated.yaml"
        if out.name in ("", ".", ".."):
            raise CalibrationError(f"-o {str(args.out)!r}: names no file; fix: name a new YAML file, e.g. {_EXAMPLES['--out']}")
        spans = load_spans(args.source, args.mode)
        reports = measured(args.source, tuple(spans["scenario"]["modes"])) if args.predict else {}
        cal = fit_spans(spans)
        lengths_file = out.with_name(out.stem + ".lengths.json")
        for path in (out, lengths_file):  # both, before either is written
            _check_writable(path, args.force)
        # Relative to the working directory, as every path of a scenario.
        lengths_ref = os.path.relpath(lengths_file) if not lengths_file.is_absolute() else str(lengths_file)
        source = f"{args.source} mode {args.mode}"
        lengths_file.parent.mkdir(parents=True, exist_ok=True)
        if not lengths_file.exists():
            wrote["new"].append(lengths_file)
        _write(lengths_file, json.dumps(cal.response_lens) + "\n", args.force)
        try:
            scenario = sim_scenario(spans, cal, lengths_ref, source, speedup)
        except ValidationError as exc:
            lengths_file.unlink(missing_ok=True)
            first = exc.errors()[0]
            raise CalibrationError(f"the fitted scenario does not validate ({'.'.join(map(str, first['loc']))}: {first['msg'].lower()}); "
                                   f"fix: check the rows of {args.source / args.mode / 'spans.json'}") from None
    except (ArgumentError, CalibrationError) as exc:
        err.print(f"[bold red]error:[/] {escape(str(exc))}", highlight=False, soft_wrap=True)
        return 2
    if args.probe:
        _probe(spans, cal, scenario, speedup, console)
    elif args.separated_decode_speedup is not None:
        scenario["calibrated"]["separated_decode_speedup"] = args.separated_decode_speedup
    try:
        _write(out, f"# Calibrated by: python -m harness.calibrate {' '.join(argv if argv is not None else sys.argv[1:])}\n"
               + yaml.safe_dump(scenario, sort_keys=False), args.force)
    except CalibrationError as exc:  # the path changed since it was checked
        if not args.force:
            lengths_file.unlink(missing_ok=True)  # created by this call
        err.print(f"[bold red]error:[/] {escape(str(exc))}", highlight=False, soft_wrap=True)
        return 2
    wrote["done"] = [out, lengths_file]
    console.print(fit_table(cal))
    console.print(f"wrote {out} and {lengths_file}", highlight=False)
    if args.predict:
        console.print(predict_table(predict(reports, Scenario.model_validate(scenario), args.mode)))
    return 0


if __name__ == "__main__":
    sys.exit(command_line(main))
