"""An env scenario (``kind: env``) run by ``python -m harness.run``: every mode, every seed, then
one report per run, a summary over seeds, and the evaluation return of every mode in one figure.

Written into a run directory asyncrl creates and stamps (the same rules as an LLM run's):
``DIR/seed-<s>/<mode>/report.json``, ``DIR/summary.json``, ``DIR/return_vs_time.png`` and
``DIR/return_vs_env_steps.png``; while each run goes, its ``metrics.jsonl`` (and the loggers'
files, harness/live_metrics.py), and after it its spans as ``trace.json`` (harness/trace.py).
With checkpoints (``checkpoint.every``) the directory is written in place: each run keeps its
checkpoints in ``DIR/seed-<s>/<mode>/`` while it goes, a run that stopped goes on from them
(``--resume``), and runs already reported are kept.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Optional

import gymnasium as gym
import numpy as np
from rich.console import Console
from rich.table import Table

from core.env.chunk_intake import STALE
from core.env.curve import EnvCurve
from core.env.footprint import check_memory
from core.env.wiring import env_space
from core.model.config import ConfigError, clipped, shown
from core.model.env_config import EnvScenario
from core.model.progress import ProgressFn
from core.runtimes.dispatch import run_env_mode
from core.runtimes.ray_env import PlacementError, check_fits
from core.runtimes.ray_env_state import check_resume
from core.runtimes.ray_start import cluster
from harness import report
from harness.live_metrics import MetricsStream
from harness.profiler import Profiler
from harness.scenario import ScenarioError, Variant
from harness.plots import RETURN_FIGURES, env_timeline_png, env_window, reward_curves_png
from harness.trace import env_trace, write_trace

__all__ = ["check_new", "check_places", "check_resume", "main", "metrics", "run_one", "table"]  # check_resume: the store's, for harness.run

SCHEMA = "asyncrl.env-report/1"
# Figures reported per run and, over seeds, with their spread.
HEADLINE = (
    "time_to_target_s", "env_steps_to_target", "final_return", "env_steps_per_s", "updates_per_s",
    "samples_per_insert", "policy_lag_mean", "sampler_blocked_s", "learner_blocked_s", "chunks_dropped_stale", "chunks_lost",
)


def metrics(sc: EnvScenario, curve: EnvCurve) -> dict:
    """One run's figures. Time to target is training time until the first evaluated policy at or
    above ``env.target_return``; None if no evaluation got there."""
    hit = curve.first_reaching(sc.env.target_return)
    st = curve.replay
    steps = st["env_steps"]
    led = curve.chunks
    if sc.learner == "ppo":
        # Transitions drawn by gradient steps per transition that arrived: epochs, less what was dropped.
        spi = curve.updates * sc.ppo.minibatch / steps if steps else 0.0
    else:
        spi = st["samples_per_insert"]
    return {
        "reached_target": hit is not None,
        "time_to_target_s": curve.wall_s[hit] if hit is not None else None,
        "env_steps_to_target": curve.env_steps[hit] if hit is not None else None,
        "final_return": curve.eval_return[-1] if curve.eval_return else None,
        "best_return": max(curve.eval_return) if curve.eval_return else None,
        "env_steps": steps,
        "train_s": curve.train_s,
        "env_steps_per_s": steps / curve.train_s if curve.train_s else None,
        "updates": curve.updates,
        "updates_per_s": curve.updates / curve.train_s if curve.train_s else None,
        "versions": curve.versions,
        "samples_per_insert": spi,
        "policy_lag_mean": float(np.mean(curve.policy_lag)) if curve.policy_lag else None,
        # Which side the rate limit held back, and for how long.
        "sampler_blocked_s": st["insert_blocked_s"],
        "learner_blocked_s": st["sample_blocked_s"],
        "rows_inserted": st.get("rows_inserted"),
        "rows_evicted_unsampled": st.get("rows_evicted_unsampled"),
        "rows_refused": st["rows_refused"],
        "episodes": curve.episodes,
        # The ledger (core/env/chunk_intake.py): every chunk a sampler sent is trained, dropped (by
        # reason: too stale, or refused at the close) or in flight (in the store at the end).
        "chunks_produced": led.produced,
        "chunks_trained": led.trained if sc.learner == "ppo" else None,
        "chunks_dropped_stale": sum(led.dropped[r] for r in STALE),
        "chunks_lost": led.produced - led.trained - led.dropped_total - curve.chunks_in_flight,
        "learner": curve.learner,
        "evaluations_lost": curve.evaluations_lost,
        **{k: v for k, v in curve.faults.items() if k.startswith("faults/")},
        "fault_records": curve.faults.get("records", []),
        # The sim runtime's own figures (links, replay, weight fetches); a real run has none.
        **({"sim": st["sim"]} if "sim" in st else {}),
    }


def check_new(variants: list[Variant], args) -> None:
    """An env scenario: one scenario per file; ``--stop-at-step`` counts learner versions and
    needs checkpoints."""
    sc = variants[0].scenario
    if len(variants) > 1 or variants[0].label is not None:
        raise ScenarioError(f"{args.scenario}: an env scenario with variants is not supported yet; fix: one scenario per file")
    if args.stop_at_step is not None:
        if not sc.checkpoint.every:
            raise ScenarioError(f"--stop-at-step {args.stop_at_step}: the run keeps no checkpoints to resume from; "
                                "fix: --set checkpoint.every=10")
        if args.stop_at_step < 1:
            raise ScenarioError(f"--stop-at-step {args.stop_at_step}: counts learner versions, from 1; fix: pick 1 or more")
    if sc.runtime == "sim" and sc.sim.row_bytes is not None and sc.sim.param_bytes is not None:
        return  # env.id is then a label: the sim never makes the environment
    try:
        space = env_space(sc)  # the environment is made once here, so a bad id is refused before anything runs
    except ValueError as exc:  # one the wiring refused, with its fix
        raise ScenarioError(str(exc)) from None
    except (gym.error.Error, ImportError) as exc:
        reason = " ".join(str(exc).split())
        raise ScenarioError(f"env.id = {shown(sc.env.id)}: {clipped(reason)}; fix: a gymnasium id with a vector observation, e.g. "
                            "CartPole-v1 (MuJoCo ids such as HalfCheetah-v5 need: pip install -e '.[mujoco]')") from None
    except Exception as exc:  # noqa: BLE001 - a user's env that fails to build: one line, not its traceback
        reason = " ".join(f"{type(exc).__name__}: {exc}".split())
        raise ScenarioError(f"env.id = {shown(sc.env.id)}: making it failed ({clipped(reason)}); fix: make the env build with "
                            "gymnasium.make alone, or use another id") from None
    check_places(sc)
    try:
        check_memory(sc, space)
    except ConfigError as exc:
        raise ScenarioError(str(exc)) from None


def check_places(sc: EnvScenario) -> None:
    """A run on a local Ray instance whose actors could not all be placed, refused before
    ``ray.init`` starts it; a joined cluster is asked once connected (``check_fits`` in ``main``)."""
    if "async" not in sc.modes or sc.runtime != "ray" or sc.ray.address is not None:
        return
    try:
        check_fits(sc, local_cpus=float(sc.ray.num_cpus or os.cpu_count() or 1))  # what start_cluster gives it
    except PlacementError as exc:
        raise ScenarioError(str(exc)) from None


def run_one(sc: EnvScenario, mode: str, seed: int, workdir: Path, stop_at_version: Optional[int] = None,
            on_progress: Optional[ProgressFn] = None, profile: bool = False) -> EnvCurve:
    """One run; ``workdir`` is its own directory (its checkpoints, with ``checkpoint.every``;
    with ``profile``, py-spy's flame graphs of the driver and every actor in ``profile/``);
    ``on_progress`` is told each version published and each evaluation."""
    with Profiler(workdir / "profile") if profile else contextlib.nullcontext() as profiler:
        return run_env_mode(sc, mode, seed, workdir, stop_at_version, on_progress, profiler.attach if profiler else None)


def main(sc: EnvScenario, out: Path, console: Console, plots: bool, *, profile: bool = False,
         stop_at_version: Optional[int] = None) -> dict:
    """Run every mode over every seed into ``out``, a run directory the caller has claimed, each
    run's report as it finishes; runs already reported there are kept (a resume).
    ``stop_at_version``: every run stops there (``RunStopped`` from the first)."""
    env = report.environment()
    per_mode: dict[str, dict[int, dict]] = {m: {} for m in sc.modes}
    curves: dict[str, list[dict]] = {m: [] for m in sc.modes}
    needs_ray = "async" in sc.modes and sc.runtime == "ray"
    with cluster(sc.ray.address, sc.ray.num_cpus) if needs_ray else contextlib.nullcontext():
        if needs_ray:
            try:
                check_fits(sc)  # before any mode runs
            except PlacementError as exc:
                raise ScenarioError(str(exc)) from None
        for seed in sc.run_seeds():
            for mode in sc.modes:
                where = out / f"seed-{seed}" / mode
                if (where / "report.json").is_file():  # finished before a resume
                    done = report.read_json(where / "report.json")
                    per_mode[mode][seed] = done["metrics"]
                    ser = done["series"]
                    curves[mode].append({"time_s": ser["eval_time_s"], "env_steps": ser["eval_env_steps"],
                                         "reward": ser["eval_return"]})
                    continue
                resume = (where / "checkpoints").is_dir()
                where.mkdir(parents=True, exist_ok=True)
                with MetricsStream(where, sc.report.loggers, root=out, name=f"{sc.name}/seed-{seed}/{mode}", group=sc.name,
                                   mode=mode, config=sc.model_dump(mode="json"), resume=resume) as stream:
                    curve = run_one(sc, mode, seed, where, stop_at_version, stream.record, profile)
                m = metrics(sc, curve)
                got = (f"reached {sc.env.target_return:g} after {m['time_to_target_s']:.1f} s, {m['env_steps_to_target']:,} env steps"
                       if m["reached_target"] else f"did not reach {sc.env.target_return:g}")
                if "sim" in m:
                    got = (f"simulated, busiest link {m['sim']['link_busy_max']:.0%}, replay busy "
                           f"{m['sim']['replay_busy']:.0%}, {m['sim']['weight_fetches']:,} weight fetches")
                console.print(f"{sc.name} seed {seed}, {mode}: {got}; {m['env_steps']:,} env steps, {m['updates']:,} updates "
                              f"in {m['train_s']:.1f} s", highlight=False)
                per_mode[mode][seed] = m
                curves[mode].append({"time_s": curve.wall_s, "env_steps": curve.env_steps, "reward": curve.eval_return})
                lo, hi = env_window(curve.spans, curve.train_s)
                report.write_json(where / "report.json", {
                    "schema": SCHEMA, "scenario": sc.model_dump(mode="json"), "mode": mode, "seed": seed,
                    **env, "metrics": m,
                    "series": {"eval_env_steps": curve.env_steps, "eval_time_s": curve.wall_s, "eval_return": curve.eval_return},
                    # The spans of the window timeline.png shows (the whole run's would be the size of the run).
                    "timeline": {"window_s": [lo, hi], "spans": {
                        name: [sp for sp in spans if sp[2] > lo and sp[1] < hi] for name, spans in curve.spans.items()}},
                })
                if curve.spans:  # the sim's none
                    write_trace(where / "trace.json", env_trace(curve.spans, sc.name, mode, seed))
                if plots and curve.spans:
                    env_timeline_png(curve.spans, (lo, hi), f"{sc.name} / {mode}, seed {seed}", where / "timeline.png")
    summary = {
        "schema": SCHEMA, "scenario_name": sc.name, "seeds": list(sc.run_seeds()),
        "modes": {m: {k: report.spread({s: r[k] for s, r in runs.items()}) for k in HEADLINE} for m, runs in per_mode.items()},
        "reached": {m: sum(r["reached_target"] for r in runs.values()) for m, runs in per_mode.items()},
    }
    if plots and sc.runtime != "sim":  # a sim run evaluates nothing
        reward_curves_png(curves, sc.env.target_return, f"{sc.name}: greedy evaluation return ({sc.env.eval_episodes} episodes)",
                          out, figures=RETURN_FIGURES, ylabel="mean evaluation return", per_seed=True)
    report.write_json(out / "summary.json", summary)  # last: it marks the run finished
    return summary


def table(sc: EnvScenario, summary: dict) -> Table:
    n = len(summary["seeds"])
    what = "simulated throughput, nothing evaluated" if sc.runtime == "sim" else f"time to a mean evaluation return of {sc.env.target_return:g}"
    t = Table(title=f"{sc.name}: {what}" + (f", mean (min..max) over {n} seeds" if n > 1 else ""))
    for col in ("mode", "reached", "time to target, s", "env steps to target", "env steps/s", "updates/s",
                "samples/insert", "policy lag, versions", "sampler waited, s", "learner waited, s", "chunks dropped / lost",
                "final return"):
        t.add_column(col, justify="left" if col == "mode" else "right")
    for mode, figs in summary["modes"].items():
        t.add_row(
            mode, "-" if sc.runtime == "sim" else f"{summary['reached'][mode]}/{n}",
            _fmt(figs["time_to_target_s"], "{:.1f}"), _fmt(figs["env_steps_to_target"], "{:,.0f}"),
            _fmt(figs["env_steps_per_s"], "{:,.0f}"), _fmt(figs["updates_per_s"], "{:,.0f}"),
            _fmt(figs["samples_per_insert"], "{:.1f}"), _fmt(figs["policy_lag_mean"], "{:.1f}"),
            _fmt(figs["sampler_blocked_s"], "{:.1f}"), _fmt(figs["learner_blocked_s"], "{:.1f}"),
            f"{_fmt(figs['chunks_dropped_stale'], '{:.0f}')} / {_fmt(figs['chunks_lost'], '{:.0f}')}",
            _fmt(figs["final_return"], "{:.0f}"),
        )
    evals = ("async holds its samplers and learner while it evaluates, and leaves those seconds out" if sc.env.hold_for_eval
             else "async evaluates beside training, on the same cores")
    t.caption = ("time to target: training seconds until the first evaluation at or above the target (sync stops "
                 f"its clock while it evaluates; {evals}); waited: seconds the store held that side "
                 "back (DQN: the rate limit; PPO: the queue); policy lag: learner version minus the mean version of its "
                 "batch's rows; chunks dropped: too stale to train (PPO); lost: sent by a sampler and in no count, "
                 "which must be 0")
    return t


def _fmt(s: dict, form: str) -> str:
    if s["mean"] is None:
        return "-"
    if s["n"] > 1:
        return f"{form.format(s['mean'])}\n({form.format(s['min'])}..{form.format(s['max'])})"
    return form.format(s["mean"])
