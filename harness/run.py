"""``python -m harness.run SCENARIO.yaml [--out DIR] [--set dotted.key=value ...]``
``python -m harness.run --resume RUN_DIR``

Validates the scenario before anything runs, runs every mode it lists on the same
workload and seed, and writes ``DIR/<mode>/report.json``, ``DIR/<mode>/timeline.png``,
``DIR/<mode>/trace.json`` (every worker's spans, for Perfetto), ``DIR/<mode>/metrics.jsonl``
(and TensorBoard's event files, or W&B's or MLflow's, per ``report.loggers``) while each mode
runs, and ``DIR/summary.json`` (with rewards, ``DIR/reward_vs_time.png`` and
``DIR/reward_vs_samples.png`` too). With several ``seeds`` every mode runs once per seed, in
``DIR/seed-<s>/``, and ``DIR/summary.json`` holds each figure over the seeds. With
checkpoints on (``checkpoint.every``), the run directory is written in place and a run that
stopped resumes from its latest checkpoints with ``--resume``. Exit code 2 and one line on
stderr for bad input (scenario, --set, run directory, checkpoint), with nothing written. A file with a ``sweep:`` section runs its grid
instead (harness/sweep.py, docs/sweeps.md).
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import logging
import os
import sys
import warnings
from datetime import datetime
from pathlib import Path

from rich.console import Console
from rich.markup import escape
from rich.logging import RichHandler

from core.real.workers import apply_env
from core.runtimes.dispatch import run_mode
from core.api import RunStopped
from core.model.faults import RestartsExhausted
from core.pipeline.group_filter import FilterStarved
from core.model.user_code import UserCodeError
from core.runtimes.ray_start import cluster
from core.runtimes.ray_checkpoint import ROLLOUT_FILE, load_ray_run, load_rollout_side
from core.runtimes.run_checkpoint import load_run, scenario_digest, tool_journal_mark
from core.store import tool_journal
from core.store.checkpoint import STATE_FILE, CheckpointError
from core.model.config import ConfigError, with_changes
from core.model.env_config import EnvScenario
from core.model.owned import is_owned
from harness import band, command_line, report, started
from harness.console import (
    ModeProgress, agent_lines, comparison_table, correction_lines, faults_table, honesty_lines, implied_mfu_lines, published_table,
    seeds_table, target_table,
)
from harness.gpu_sampler import NvmlSampler
from harness.live_metrics import METRICS_FILE, LoggerFailed, MetricsFileError, MetricsStream, check_loggers, read_history
from harness.metrics import reward_curve
from harness.plots import reward_curves_png, reward_png, summary_png, timeline_png
from harness.profiler import ProfileError, Profiler, py_spy
from harness import run_directory
from harness.extras import check_installed
from harness.run_directory import RunDirectory, RunDirectoryError
from harness.arguments import ArgumentError, OneLineParser, whole_number
from harness.scenario import ScenarioError, Variant, load_resolved, load_variants
from harness.sweep import has_sweep
from harness.sweep import main as run_sweep
from harness.spans import calibration_spans
from harness.trace import llm_trace, write_trace

SCENARIO_FILE = "scenario.json"  # the resolved scenario of a run written in place (resumable)


# An example of each option that takes a value, for the fix of an argument error.
_EXAMPLES = {"--resume": "--resume runs/my-run", "--stop-at-step": "--stop-at-step 6", "--out": "--out runs/my-run",
             "--set": "--set trainer.steps=100"}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = OneLineParser(prog="python -m harness.run", description=__doc__.split("\n\n")[1], examples=_EXAMPLES,
                      shape="one scenario file, then options")
    p.add_argument("scenario", nargs="?", help="scenario YAML, e.g. scenarios/quickstart.yaml")
    p.add_argument("--resume", type=Path, metavar="RUN_DIR",
                   help="go on with a run that stopped, from its latest checkpoints (modes already done are kept)")
    p.add_argument("--stop-at-step", type=whole_number, metavar="N",
                   help="stop each mode after trainer step N, as a crash would, leaving its checkpoints for --resume")
    p.add_argument("--out", type=Path, help="run directory (default: runs/<name>-<timestamp>)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override any scenario key, e.g. --set trainer.steps=100 (repeatable)")
    p.add_argument("--band", action="store_true",
                   help="sim: each mode's speedup over sync as a 10th-90th percentile interval over band.points draws "
                        "of the uncertain inputs, and the input to measure first (costs band.points runs)")
    p.add_argument("--no-plots", action="store_true", help="skip timeline.png and summary.png")
    p.add_argument("--profile", action="store_true",
                   help="record the driver and every worker process with py-spy: <mode>/profile/*.svg")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    # Ctrl-C stays "interrupted while starting" (harness/__init__.py) until the run directory is
    # claimed: every check before it imports lazily (tensorboardX imports torch), and has
    # written nothing.
    try:
        args = parse_args(argv)
    except ArgumentError as exc:
        Console(stderr=True).print(f"[bold red]error:[/] {escape(str(exc))}", highlight=False, soft_wrap=True)
        return 2
    apply_env()
    console = Console()
    if not console.is_terminal:
        console = Console(width=160)
    err = Console(stderr=True)
    logging.basicConfig(level=logging.WARNING, handlers=[RichHandler(console=err, show_path=False)], format="%(message)s")
    if args.scenario is not None and has_sweep(args.scenario):
        try:
            return run_sweep(args, console, err)  # a grid of runs, ranked: harness/sweep.py
        except KeyboardInterrupt:
            return _interrupted(None, err)
    try:
        if args.resume is not None:
            variants, out, done = _resumable(args)
        else:
            if args.scenario is None:
                raise ScenarioError("no scenario given; fix: pass a scenario YAML such as scenarios/quickstart.yaml, or --resume RUN_DIR")
            variants, done = load_variants(args.scenario, args.overrides), {}
            out = args.out or Path("runs") / f"{variants[0].scenario.name}-{datetime.now():%Y%m%d-%H%M%S}"
            check_installed(variants[0].scenario)
            if isinstance(variants[0].scenario, EnvScenario):
                _env_harness().check_new(variants, args)
            else:
                _check_new_run(variants, args)
        for v in variants:
            check_loggers(v.scenario.report.loggers)
            if args.band:
                band.check(v.scenario)
        if args.profile:
            try:
                py_spy()  # before anything runs, not when the first mode starts
            except ProfileError as exc:
                raise ScenarioError(str(exc)) from None
        first = variants[0].scenario
        env_kind = isinstance(first, EnvScenario)
        if not env_kind:
            for line in dict.fromkeys(line for v in variants for line in correction_lines(v.scenario)):
                err.print(f"[yellow]{escape(line)}[/]", highlight=False, soft_wrap=True)
        # Written where it stays, to be resumed: a run with checkpoints.
        resumable = args.resume is not None or (bool(first.checkpoint.every) if env_kind else _resumable_run(first, args))
        if args.resume is None:
            out = run_directory.check(out, "run", "summary.json", in_place=resumable, resume_file=SCENARIO_FILE)
            where = RunDirectory.claim(out, "run")
        else:
            where = RunDirectory.reopen(out, "run")
    except (ScenarioError, CheckpointError, RunDirectoryError) as exc:
        err.print(f"[bold red]error:[/] {escape(str(exc))}", highlight=False, soft_wrap=True)
        return 2
    started()
    try:
        if resumable and args.resume is None:
            report.write_json(where.path / SCENARIO_FILE, first.model_dump(mode="json"))
        if env_kind:
            summary = _env_harness().main(first, where.path, console, plots=not args.no_plots, profile=args.profile,
                                   stop_at_version=args.stop_at_step)
        else:
            summaries, summary = _run_variants(variants, where.path, console, args, done)
        where.commit()
    except (ScenarioError, ConfigError) as exc:  # what only the cluster (or env.id) can tell, before any actor starts
        where.abandon(keep=False)
        err.print(f"[bold red]error:[/] {escape(str(exc))}", highlight=False, soft_wrap=True)
        return 2
    except RunStopped as exc:
        where.release()
        console.print(f"{exc}; its checkpoints are in {out}. Go on with: python -m harness.run --resume {out}", highlight=False)
        return 0
    except (RestartsExhausted, UserCodeError, FilterStarved, LoggerFailed) as exc:
        # Settings a run proved unworkable (calls that always time out), or the user's code that
        # failed while it ran (its reward function): one line, not a traceback.
        kept = where.abandon(keep=resumable)
        line = exc.plain() if isinstance(exc, UserCodeError) else exc
        err.print(f"[bold red]error:[/] {escape(str(line))}" + (f" (checkpoints kept in {where.out})" if kept else ""),
                  highlight=False, soft_wrap=True)
        return 1
    except KeyboardInterrupt as exc:  # Ctrl-C: one line on what is left, not the traceback of wherever the run was
        return _interrupted(where.out if where.abandon(keep=resumable) else None, err, getattr(exc, "unjournaled", ()))
    except BaseException:
        where.abandon(keep=resumable)
        raise
    if env_kind:
        console.print(_env_harness().table(first, summary))
    else:
        _print_tables(variants, summaries, summary, console)
    labels = tuple(v.label for v in variants if v.label)
    console.print(f"reports in {out}: {', '.join(run_directory.listing(out, first.modes, labels))}", highlight=False)
    return 0


def _interrupted(kept: Path | None, err: Console, unjournaled: tuple[str, ...] = ()) -> int:
    """Ctrl-C: one line on what the run left in ``kept`` (None: nothing), instead of the traceback
    of wherever it was, and exit code 130 (128 + SIGINT). A run written in place with checkpoints
    is resumable; any other was removed, and a finished run it would have replaced is as it was.
    ``unjournaled``: a second Ctrl-C cut short the wait for these tool calls, which the line names."""
    # The run's asyncio tasks die with it; collected, each would be logged with a traceback as
    # an exception never retrieved.
    logging.getLogger("asyncio").setLevel(logging.CRITICAL + 1)
    # A Ctrl-C that lands between making a coroutine and starting its task leaves it unawaited;
    # collected at exit, Python would add two lines of warning to the one line this prints.
    warnings.filterwarnings("ignore", message=r"coroutine .* was never awaited", category=RuntimeWarning)
    if kept is None:
        line = "interrupted; nothing was kept (the partial run directory was removed)"
    elif any(kept.glob("*/checkpoints/step-*")) or any(kept.glob("seed-*/*/checkpoints/step-*")):
        line = f"interrupted; its checkpoints are kept in {kept}. Go on with: python -m harness.run --resume {kept}"
    else:
        line = f"interrupted before its first checkpoint; {kept} keeps its scenario. Start it again with: python -m harness.run --resume {kept}"
    if unjournaled:
        ids = ", ".join(unjournaled[:20]) + (f" and {len(unjournaled) - 20} more" if len(unjournaled) > 20 else "")
        line += f" (stopped at once: tool calls {ids} were still running and may run again on resume)"
    err.print(line, highlight=False, soft_wrap=True)
    return 130  # the command ends without waiting for threads (harness/run.py's __main__)


def _run_variants(variants: list[Variant], path: Path, console: Console, args, done: dict) -> tuple[dict, dict]:
    """Every variant of an LLM scenario file into ``path``, then the run's summary: (each
    variant's summary, the run's)."""
    first = variants[0].scenario
    env = report.environment()
    summaries = {}
    for v in variants:
        where = path / v.label if v.label else path
        where.mkdir(exist_ok=True)
        summaries[v.label] = _run_variant(
            v.scenario, v.label, where, env, console, plots=not args.no_plots, profile=args.profile,
            done=done, stop_at_step=args.stop_at_step, root=path, band_on=args.band, published=v.published,
        )
    if variants[0].label is None:
        summary = summaries[None]
    else:
        summary = report.variants_summary(first, {v.label: (summaries[v.label], v.published) for v in variants})
    report.write_json(path / "summary.json", summary)  # last: it marks the run finished
    return summaries, summary


def _print_tables(variants: list[Variant], summaries: dict, summary: dict, console: Console) -> None:
    for v in variants:
        title = f"{v.scenario.name} {v.label}" if v.label else v.scenario.name
        console.print(comparison_table(title, summaries[v.label]))
        for line in honesty_lines(summaries[v.label]):
            console.print(f"[yellow]{line}[/]", highlight=False)
        for line in implied_mfu_lines(summaries[v.label]):
            console.print(f"[yellow]{line}[/]", highlight=False)
        for line in agent_lines(summaries[v.label]):
            console.print(line, highlight=False)
        for line in band.lines(summaries[v.label]):
            console.print(line, highlight=False)
        for table in (faults_table(title, summaries[v.label]), seeds_table(title, summaries[v.label]),
                      target_table(title, summaries[v.label])):
            if table is not None:
                console.print(table)
    if any(v.published for v in variants):
        console.print(published_table(variants[0].scenario.name, summary))


def _env_harness():
    """harness.env_run, imported on use: an env workload needs torch and gymnasium (the [real]
    extra), which the slim install that runs the sim quickstart leaves out."""
    from harness import env_run

    return env_run


def _resumable_run(sc, args) -> bool:
    """Written in place, for --resume: a run with checkpoints (on ray, whole ones: both the
    trainer's and the rollout side, core/runtimes/ray_checkpoint.py)."""
    return bool(sc.checkpoint.every) or args.stop_at_step is not None


def _check_new_run(variants: list[Variant], args) -> None:
    sc = variants[0].scenario
    if _resumable_run(sc, args):
        if len(variants) > 1 or variants[0].label is not None:
            raise ScenarioError(f"{args.scenario}: a file of variants is not checkpointed; fix: run one variant's settings as its own scenario")
        if not sc.checkpoint.every:
            raise ScenarioError(f"--stop-at-step {args.stop_at_step}: the run keeps no checkpoints to resume from; fix: --set checkpoint.every=1")
        several = next((v.scenario for v in variants if len(v.scenario.run_seeds) > 1), None)
        if several is not None:
            raise ScenarioError(
                f"seeds = {list(several.seeds)}: a run over several seeds is not checkpointed; "
                "fix: run one seed (--set seeds=[]), or set checkpoint.every: 0 and drop --stop-at-step"
            )
        if args.stop_at_step is not None and not 1 <= args.stop_at_step < sc.trainer.steps:
            raise ScenarioError(f"--stop-at-step {args.stop_at_step}: must be between 1 and trainer.steps - 1 = {sc.trainer.steps - 1}; fix: pick a step in that range")


def _resumable(args) -> tuple[list[Variant], Path, dict]:
    """The run to resume, checked whole before anything runs: its scenario, the scenario file
    (if given) against it, and every unfinished mode's latest checkpoint."""
    run_dir = args.resume
    if args.overrides:
        raise ScenarioError(f"--set {args.overrides[0]}: a resumed run keeps the scenario it started with; fix: drop --set, or start a new run")
    if args.out is not None and args.out != run_dir:
        raise ScenarioError(f"--out {args.out}: a resumed run is written where it started ({run_dir}); fix: drop --out")
    if not run_dir.is_dir():
        raise ScenarioError(f"--resume {run_dir}: no such directory; fix: pass the directory of a run that stopped")
    run_directory.check_markers(run_dir)
    if not is_owned(run_dir, "run"):  # a user's directory holding a scenario.json is not one to write a run into
        raise ScenarioError(f"--resume {run_dir}: carries no stamp of a run asyncrl wrote, so it is not resumed (nothing in it "
                            "is written); fix: pass the directory of a run that stopped")
    if (run_dir / SCENARIO_FILE).is_symlink():
        raise ScenarioError(f"{run_dir / SCENARIO_FILE}: is a symbolic link, which asyncrl never follows in a run directory; "
                            "fix: put back the scenario.json the run wrote, or start the run again")
    if not (run_dir / SCENARIO_FILE).is_file():
        raise ScenarioError(f"--resume {run_dir}: no {SCENARIO_FILE}, so not a run that kept checkpoints; fix: pass a run directory written with checkpoint.every >= 1")
    if (run_dir / "summary.json").is_file():
        raise ScenarioError(f"--resume {run_dir}: this run finished; fix: pass a run that stopped before its end")
    sc = load_resolved(run_dir / SCENARIO_FILE)
    check_installed(sc)
    if args.scenario is not None:
        given = load_variants(args.scenario)
        other = given[0].scenario
        if len(given) > 1 or scenario_digest(other) != scenario_digest(sc):
            raise ScenarioError(
                f"{args.scenario}: is not the scenario {run_dir} was run with ({sc.name!r}, in {run_dir / SCENARIO_FILE}); "
                "fix: resume without a scenario file, or with the one it ran"
            )
    # Every file the resume reads back is read and checked here, before anything runs: a
    # finished mode's report, an unfinished one's checkpoint and metrics.jsonl.
    if isinstance(sc, EnvScenario):
        env_run = _env_harness()
        for seed in sc.run_seeds():
            _check_directory(run_dir / f"seed-{seed}", f"the directory of seed {seed}")
            for mode in sc.modes:
                where = run_dir / f"seed-{seed}" / mode
                if _check_directory(where, f"the directory of mode {mode}") and _finished_mode(where):
                    _read_report(where, mode, env_run.SCHEMA, metrics=(*env_run.HEADLINE, "reached_target"),
                                 series=("eval_env_steps", "eval_time_s", "eval_return"))
                else:
                    env_run.check_resume(where)
                    _check_appended(where, ("store/queue.journal", "store/arrivals.journal", "store/replay.journal"))
        return [Variant(None, sc)], run_dir, {}
    done = {}
    for mode in sc.modes:
        where = run_dir / mode
        if _check_directory(where, f"the directory of mode {mode}") and _finished_mode(where):
            done[mode] = _read_report(where, mode, report.SCHEMA,
                                      numbers=("throughput/trained_samples_per_s", "throughput/trained_tokens_per_s"))
        else:
            if sc.runtime == "ray":
                point = load_ray_run(run_dir, sc, mode)
                at, state = (point.path / ROLLOUT_FILE, load_rollout_side(point.path).state) if point is not None else (where, None)
            else:
                got = load_run(run_dir, sc, mode)
                at, state = (got[0] / STATE_FILE, got[1].state) if got is not None else (where, None)
            _check_appended(where, ("queue.journal",))
            tool_journal.check(where / tool_journal.NAME, *tool_journal_mark(state, str(at)))
    return [Variant(None, sc)], run_dir, done


def _check_directory(path: Path, what: str) -> bool:
    """Whether ``path``, a directory of the run to resume, is there; ``ScenarioError`` if
    something else is in its place (a file, or a link, which the resume would write through)."""
    if path.is_symlink() or (path.exists() and not path.is_dir()):
        kind = "a symbolic link" if path.is_symlink() else "a file"
        raise ScenarioError(f"{path}: is {kind}, not {what}; fix: move it out of the run directory (that part of the run "
                            "then starts again), or start the run again")
    return path.exists()


def _finished_mode(where: Path) -> bool:
    """A mode has finished when its report is there (a link or any other thing by that name
    included, so that it is refused rather than the mode run again over it)."""
    return os.path.lexists(where / "report.json")


def _read_report(where: Path, mode: str, schema: str, **fields) -> dict:
    try:
        return report.read_report(where / "report.json", schema, mode, fix=f"delete {where} to run mode {mode} again", **fields)
    except report.ReportError as exc:
        raise ScenarioError(str(exc)) from None


def _check_appended(where: Path, journals: tuple[str, ...]) -> None:
    """The files a resumed mode goes on appending to: its metrics.jsonl holds only lines asyncrl
    wrote, and each of its ``journals`` is a regular file where present (opened to append, a
    link would be written through, a FIFO would block)."""
    try:
        read_history(where / METRICS_FILE)
    except MetricsFileError as exc:
        raise ScenarioError(str(exc)) from None
    for name in journals:
        path = where / name
        if path.is_symlink() or (path.exists() and not path.is_file()):
            raise ScenarioError(f"{path}: is {'a symbolic link' if path.is_symlink() else 'not a regular file'}, not the journal "
                                "asyncrl wrote; fix: put back the journal the run wrote, or start the run again")


def _run_variant(sc, label, where: Path, env: dict, console: Console, plots: bool, profile: bool = False, **kw) -> dict:
    if sc.runtime == "ray":
        with cluster(sc.ray.address, sc.ray.num_cpus, sc.reward.serve):  # one Ray instance for every mode and seed of the run
            return _run_seeds(sc, label, where, env, console, plots, profile, **kw)
    return _run_seeds(sc, label, where, env, console, plots, profile, **kw)


def _run_seeds(sc, label, where: Path, env: dict, console: Console, plots: bool, profile: bool, **kw) -> dict:
    """One seed: the modes in ``where``, as a run has always been laid out. Several: each seed's
    modes in ``where/seed-<s>`` with that seed's own summary, then the summary over seeds and
    the reward figures with their spread in ``where``."""
    seeds = sc.run_seeds
    if len(seeds) == 1:
        one = sc if seeds[0] == sc.seed else with_changes(sc, {"seed": seeds[0]})
        return _run_modes(one, label, where, env, console, plots, profile, **kw)[0]
    per_seed, curves = {}, {}
    for s in seeds:
        sub = where / f"seed-{s}"
        sub.mkdir(exist_ok=True)
        tag = f"{label}/seed-{s}" if label else f"seed-{s}"
        per_seed[s], reports = _run_modes(with_changes(sc, {"seed": s}), tag, sub, env, console, plots, profile, **kw)
        report.write_json(sub / "summary.json", per_seed[s])
        for mode in sc.modes:
            curve = reward_curve(reports[mode])
            if curve is not None:
                curves.setdefault(mode, []).append(curve)
    if plots and curves:
        reward_curves_png(curves, sc.target_reward, _reward_title(sc, label, seeds), where)
    return report.seeds_summary(sc, per_seed)


def _reward_title(sc, label, seeds: tuple[int, ...] | None = None) -> str:
    """Over several ``seeds``, they are named; a label (a variant, or one seed of several) is;
    else the run's one seed is."""
    name = f"{sc.name} {label}" if label else sc.name if seeds else f"{sc.name}, seed {sc.seed}"
    if seeds:
        name += f", seeds {', '.join(map(str, seeds))}"
    return f"{name}: batch reward, trailing mean over {sc.learn.reward_window} steps"


def _run_modes(
    sc, label, where: Path, env: dict, console: Console, plots: bool, profile: bool,
    done: dict | None = None, stop_at_step: int | None = None, root: Path | None = None,
    band_on: bool = False, published: dict | None = None,
) -> tuple[dict, dict]:
    """Every mode of ``sc`` in ``where`` (within the run directory ``root``, ``where`` if None):
    (the summary, each mode's report). Each mode's figures stream as it runs (harness/live_metrics.py).
    ``band_on``: the band of its speedups too (harness/band.py); ``published``: a published
    speedup to draw in summary.png."""
    reports = dict(done or {})
    with ModeProgress(console, sc.trainer.steps) as progress:
        for mode in sc.modes:
            if mode in reports:
                continue
            progress.start(f"{label}/{mode}" if label else mode)
            (where / mode).mkdir(exist_ok=True)
            resume = (where / mode / "checkpoints").is_dir()
            name = "/".join(p for p in (sc.name, label, mode) if p)
            with Profiler(where / mode / "profile") if profile else contextlib.nullcontext() as profiler:
                with NvmlSampler() as gpu, MetricsStream(
                    where / mode, sc.report.loggers, root=root or where, name=name, group=sc.name, mode=mode,
                    config=sc.model_dump(mode="json"), resume=resume,
                ) as stream:

                    def told(event) -> None:
                        progress.on_step(event)
                        stream.record(event)

                    result = run_mode(
                        sc, mode, on_step=told, on_processes=profiler.attach if profiler else None, run_dir=where,
                        resume=resume, stop_at_step=stop_at_step,
                    )
            (where / mode / "queue.journal").unlink(missing_ok=True)  # the run's, not the report's
            rep = report.build(sc, result, env, gpu.summary())
            reports[mode] = rep
            report.write_json(where / mode / "report.json", rep)
            write_trace(where / mode / "trace.json", llm_trace(result))
            spans = calibration_spans(result)
            if spans is not None:  # a real run: what harness.calibrate fits
                report.write_json(where / mode / "spans.json", spans)
            if sc.report.timeline and plots:
                timeline_png(result, where / mode / "timeline.png", sc.report.timeline_rows)
                if result.trainer.step_info and "reward_mean" in result.trainer.step_info[0]:
                    reward_png(result, where / mode / "reward.png")
    reports = {m: reports[m] for m in sc.modes}
    curves = {m: [c] for m in sc.modes if (c := reward_curve(reports[m])) is not None}
    if plots and curves:
        reward_curves_png(curves, sc.target_reward, _reward_title(sc, label), where)
    summary = report.summary(sc, reports)
    if band_on:
        with ModeProgress(console, sc.band.points) as progress:
            progress.start(f"{label}/band" if label else "band")
            drawn = band.compute(sc, on_done=lambda _: progress.advance())
        band.attach(drawn, summary, where)
    if plots:
        pub = {published["mode"]: published["speedup_vs_sync"]} if published and "speedup_vs_sync" in published else None
        summary_png(summary, " ".join(p for p in (sc.name, label) if p), where / "summary.png", pub)
    return summary, reports


if __name__ == "__main__":
    code = command_line(main)
    if code == 130:
        # Interrupted, and what the run leaves is settled and said: the process ends here,
        # without the interpreter's teardown, where Ray's threads, interrupted mid-call, crashed
        # it now and then (SIGSEGV after the line) and pool threads could still hold it.
        atexit._run_exitfuncs()  # what registered itself to run at exit still does (Ray's node cleanup)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)
