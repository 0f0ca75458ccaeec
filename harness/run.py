"""``python -m harness.run SCENARIO.yaml [--out DIR] [--set dotted.key=value ...]``

Validates the scenario before anything runs, runs every mode it lists on the same
workload and seed, and writes ``DIR/<mode>/report.json``, ``DIR/<mode>/timeline.png``
and ``DIR/summary.json``. Exit code 2 and one line on stderr for a bad scenario.
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import sys
import tempfile
from datetime import datetime
from pathlib import Path

from rich.console import Console
from rich.logging import RichHandler

from core.driver import run_mode
from core.workers import apply_env
from harness import report
from harness.console import ModeProgress, comparison_table, published_table
from harness.gpu_sampler import NvmlSampler
from harness.plots import reward_png, timeline_png
from harness.profiler import Profiler
from harness.scenario import ScenarioError, load_variants


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m harness.run", description=__doc__.split("\n\n")[1])
    p.add_argument("scenario", help="scenario YAML, e.g. scenarios/quickstart.yaml")
    p.add_argument("--out", type=Path, help="run directory (default: runs/<name>-<timestamp>)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override any scenario key, e.g. --set trainer.steps=100 (repeatable)")
    p.add_argument("--no-plots", action="store_true", help="skip timeline.png")
    p.add_argument("--profile", action="store_true",
                   help="record the driver and every worker process with py-spy: <mode>/profile/*.svg")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    apply_env()
    console = Console()
    if not console.is_terminal:
        console = Console(width=160)
    err = Console(stderr=True)
    logging.basicConfig(level=logging.WARNING, handlers=[RichHandler(console=err, show_path=False)], format="%(message)s")
    try:
        variants = load_variants(args.scenario, args.overrides)
    except ScenarioError as exc:
        err.print(f"[bold red]error:[/] {exc}", highlight=False, soft_wrap=True)
        return 2

    first = variants[0].scenario
    out = args.out or Path("runs") / f"{first.name}-{datetime.now():%Y%m%d-%H%M%S}"
    if out.exists() and not (out / "summary.json").is_file():
        # Only an earlier run directory is ever replaced; anything else is the user's.
        err.print(f"[bold red]error:[/] --out {out}: exists and is not a run directory; fix: pass a new directory", highlight=False)
        return 2
    out.parent.mkdir(parents=True, exist_ok=True)
    # Build the run directory aside and move it into place whole: no half-written runs.
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        env = report.environment()
        summaries = {}
        for v in variants:
            where = staging / v.label if v.label else staging
            where.mkdir(exist_ok=True)
            summaries[v.label] = _run_variant(
                v.scenario, v.label, where, env, console, plots=not args.no_plots, profile=args.profile
            )
        if variants[0].label is None:
            summary = summaries[None]
        else:
            summary = report.variants_summary(first, {v.label: (summaries[v.label], v.published) for v in variants})
        report.write_json(staging / "summary.json", summary)
        if out.exists():
            shutil.rmtree(out)
        staging.rename(out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    for v in variants:
        title = f"{v.scenario.name} {v.label}" if v.label else v.scenario.name
        console.print(comparison_table(title, summaries[v.label]))
    if any(v.published for v in variants):
        console.print(published_table(first.name, summary))
    files = ["summary.json", "<mode>/report.json", "<mode>/timeline.png"]
    if first.runtime != "sim":
        files.append("<mode>/reward.png")
    if args.profile:
        files.append("<mode>/profile/*.svg")
    console.print(f"reports in {out}: {', '.join(files)}", highlight=False)
    return 0


def _run_variant(sc, label, where: Path, env: dict, console: Console, plots: bool, profile: bool = False) -> dict:
    if sc.runtime == "ray":
        from core.ray_runtime import cluster

        with cluster(sc):  # one Ray instance for every mode of the run
            return _run_modes(sc, label, where, env, console, plots, profile)
    return _run_modes(sc, label, where, env, console, plots, profile)


def _run_modes(sc, label, where: Path, env: dict, console: Console, plots: bool, profile: bool) -> dict:
    reports = {}
    with ModeProgress(console, sc.trainer.steps) as progress:
        for mode in sc.modes:
            progress.start(f"{label}/{mode}" if label else mode)
            (where / mode).mkdir()
            profiler = Profiler(where / mode / "profile") if profile else None
            on_processes = _with_driver(profiler) if profiler else None
            try:
                with NvmlSampler() as gpu:
                    system = run_mode(sc, mode, on_step=progress.on_step, on_processes=on_processes)
            finally:
                if profiler:
                    profiler.stop()
            rep = report.build(sc, system, env, gpu.summary())
            reports[mode] = rep
            report.write_json(where / mode / "report.json", rep)
            if sc.report.timeline and plots:
                timeline_png(system, where / mode / "timeline.png", sc.report.timeline_rows)
                if system.trainer.step_info and "reward_mean" in system.trainer.step_info[0]:
                    reward_png(system, where / mode / "reward.png")
    return report.summary(sc, reports)


def _with_driver(profiler: "Profiler"):
    """The driver is recorded too, whichever processes the runtime reports."""

    def attach(processes: list[tuple[str, int]]) -> None:
        if not any(name == "driver" for name, _ in processes):
            processes = [("driver", os.getpid())] + processes
        profiler.attach(processes)

    return attach


if __name__ == "__main__":
    sys.exit(main())
