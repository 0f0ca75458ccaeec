"""Throughput of the async env pipeline against ``env.send_every`` and ``env.samplers`` (issue 14),
every configuration in one process run, on one Ray instance.

    python bench/env_throughput.py [--env-steps N] [--learner-bound-env-steps M] [--repeats R] [--out DIR]

Two rate limits, each with its own baseline (send_every 10, one sampler) measured in the same run:

- **sampler-bound**: ``replay.samples_per_insert`` 0.1, so the learner takes one update per 640
  env steps and the limiter never holds a sampler back; what is left is the sampler side alone
  (environments, policy forward, the insert's round trip, weights between chunks).
- **learner-bound**: the scenario's default 32 samples per insert (rl-zoo's CartPole DQN); the
  samplers wait on the learner.

Sweeps: ``send_every`` 1, 10, 100 with one sampler; ``samplers`` 1, 2, 4 at send_every 10. In the
sampler-bound case also send_every 1, 10, 100 with a sampler that fetches the newest weights
before every chunk (seed 003's design, where every send pulled weights), against asyncrl's
fetch-only-a-new-version.

Every configuration runs ``run_async(sc, seed, stop_at_target=False)`` for a fixed number of env
steps, with one evaluation episode at the very end (outside the timed part). Each sampler reserves
``ray.sampler.num_cpus`` 0.25 in every configuration, so that 4 samplers, the learner (1 CPU) and
the replay (0) fit a 2-CPU instance (``check_fits``); the reservation is bookkeeping only, each
sampler and the learner run one torch thread whatever it is.

The sampler, learner and replay actors are the pipeline's own classes with timers around their
calls (``_timed_classes``): the seconds a sampler spent in ``collect`` (environments + policy),
in the insert (the chunk's encoding, the round trip to the replay actor and any wait on the rate
limit) and in fetching weights, and the process CPU seconds of each actor over its run. Before the
async runs, the same sampler's ``collect`` runs in this process with no Ray call, for the rate of
stepping alone.

Not part of ``make test`` or ``make bench``: minutes of wall time, and what it measures belongs in
docs/results.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from harness.report import commit_label, load_average  # noqa: E402

log = logging.getLogger("env_throughput")

SAMPLER_BOUND_SPI = 0.1
LEARNER_BOUND_SPI = 32.0
SAMPLER_CPUS = 0.25
SEND_EVERY = (1, 10, 100)
SAMPLERS = (1, 2, 4)
BASELINE = (10, 1)  # (send_every, samplers)
REGIMES = ("sampler-bound", "learner-bound")


@dataclass(frozen=True)
class Config:
    regime: str
    send_every: int
    samplers: int
    variant: str = ""
    """'': the sampler as it is; 'fetch': it fetches the newest weights before every chunk, new or
    not (seed 003's design); 'overlap': it collects the next chunk while the previous chunk's
    insert is in flight (a change proposed for ``SamplerHost.run``, measured here)."""

    @property
    def label(self) -> str:
        return f"send_every={self.send_every}, samplers={self.samplers}" + (f", {VARIANTS[self.variant]}" if self.variant else "")

    @property
    def key(self) -> tuple:
        return (self.regime, self.send_every, self.samplers, self.variant)

    def is_baseline(self) -> bool:
        return (self.send_every, self.samplers) == BASELINE and not self.variant


SHORT = {"": "", "fetch": " (003)", "overlap": " (ov)"}
VARIANTS = {"": "as is", "fetch": "fetch every chunk (seed 003)", "overlap": "insert overlapped with the next collect (proposed)"}


def configs(overlap_only: bool = False) -> list[Config]:
    """Every configuration of one repeat, in run order; the baselines first in each regime.
    ``overlap_only``: the sampler-bound send_every sweep, as is and overlapped."""
    if overlap_only:
        regime = "sampler-bound"
        return ([Config(regime, *BASELINE)] + [Config(regime, s, 1) for s in SEND_EVERY if (s, 1) != BASELINE]
                + [Config(regime, s, 1, "overlap") for s in SEND_EVERY])
    out: list[Config] = []
    for regime in REGIMES:
        seen: list[Config] = []
        for c in [Config(regime, *BASELINE)] + [Config(regime, s, 1) for s in SEND_EVERY] + [Config(regime, 10, n) for n in SAMPLERS]:
            if c not in seen:
                seen.append(c)
        if regime == "sampler-bound":
            seen += [Config(regime, s, 1, "fetch") for s in SEND_EVERY]
        out += seen
    return out


def row_key(r: dict) -> tuple:
    """A row's configuration, as ``Config.key``."""
    return (r["regime"], r["send_every"], r["samplers"], r["variant"])


def scenario_changes(c: Config, env_steps: int) -> dict[str, object]:
    """The dotted-key changes to the default ``EnvScenario`` for one configuration."""
    return {
        "env.send_every": c.send_every,
        "env.samplers": c.samplers,
        "env.env_steps": env_steps,
        "env.eval_every": 10 * env_steps,  # no evaluation during the run; one episode at its end
        "env.eval_episodes": 1,
        "replay.samples_per_insert": SAMPLER_BOUND_SPI if c.regime == "sampler-bound" else LEARNER_BOUND_SPI,
        "ray.sampler.num_cpus": SAMPLER_CPUS,
    }


def ratios(rows: list[dict], key: str = "env_steps_per_s") -> dict[tuple, dict]:
    """Per configuration (its ``Config`` fields as a tuple): the mean of ``key`` over repeats, and
    the mean, min and max over repeats of its ratio to the same repeat's baseline of its regime."""
    base = {(r["regime"], r["repeat"]): r[key] for r in rows if r["baseline"]}
    out: dict[tuple, dict] = {}
    for r in rows:
        k = row_key(r)
        d = out.setdefault(k, {"values": [], "ratios": []})
        d["values"].append(r[key])
        b = base.get((r["regime"], r["repeat"]))
        if b:
            d["ratios"].append(r[key] / b)
    for d in out.values():
        d["mean"] = float(np.mean(d["values"]))
        rs = d["ratios"] or [float("nan")]
        d["ratio"], d["ratio_min"], d["ratio_max"] = float(np.mean(rs)), float(min(rs)), float(max(rs))
    return out


def busy_cores_since(prev: Optional[tuple[float, float]]) -> tuple[tuple[float, float], float]:
    """(the /proc/stat reading now, cores the whole machine kept busy since ``prev``): everyone's
    load, this bench's and any other's."""
    fields = [float(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = fields[3] + fields[4]
    now = (sum(fields), idle)
    if prev is None:
        return now, float("nan")
    total, idl = now[0] - prev[0], now[1] - prev[1]
    ticks = os.sysconf("SC_CLK_TCK")
    return now, ((total - idl) / ticks) / max(1e-9, total / ticks / (os.cpu_count() or 1))


# ---- the in-process sampler ----------------------------------------------------------------------

def collect_alone(send_every: int, env_steps: int, seed: int = 0) -> dict:
    """The pipeline's sampler stepping in this process, no Ray call: env steps per second of
    ``collect`` alone, and the share of a chunk's pickling (its codec record) beside it."""
    import pickle

    import torch

    from core.env.wiring import make_policy, make_sampler
    from core.model.config import with_changes
    from core.model.env_config import EnvScenario

    torch.set_num_threads(1)
    sc = with_changes(EnvScenario(), {"env.send_every": send_every})
    policy = make_policy(sc, seed, 0)
    sampler = make_sampler(sc, seed, 0, policy)
    collect_s = encode_s = 0.0
    try:
        while sampler.env_steps < env_steps:
            t0 = time.perf_counter()
            chunk = sampler.collect()
            t1 = time.perf_counter()
            pickle.loads(pickle.dumps(chunk, protocol=5))
            encode_s += time.perf_counter() - t1
            collect_s += t1 - t0
    finally:
        sampler.close()
    return {"send_every": send_every, "env_steps": sampler.env_steps, "collect_s": collect_s,
            "env_steps_per_s": sampler.env_steps / collect_s, "codec_roundtrip_s": encode_s}


def fetch_cost(reps: int = 200) -> dict:
    """Seconds of one weights fetch as a sampler does it (``ray.get`` of the published ref, then
    ``set_weights``), here in the driver, and the size of the weights."""
    import ray

    from core.env.wiring import make_learner, make_policy
    from core.model.env_config import EnvScenario

    sc = EnvScenario()
    weights = make_learner(sc, 0).weights()
    policy = make_policy(sc, 0, 0)
    ref = ray.put(weights)
    t0 = time.perf_counter()
    for _ in range(reps):
        policy.set_weights(ray.get(ref), 1)
    return {"fetch_s": (time.perf_counter() - t0) / reps, "bytes": int(sum(v.nbytes for v in weights.values()))}


# ---- timed actors --------------------------------------------------------------------------------

def _timed_classes(collector, variant: str):
    """The pipeline's SamplerHost, LearnerHost and TransitionReplay with timers, built inside a
    function so that cloudpickle ships them by value to the actors' processes. What each measures
    goes to ``collector`` (an actor) at the end of its run; the replay's CPU seconds ride on its
    own ``stats``."""
    from core.env.transition_replay import TransitionReplay
    from core.runtimes.ray_env import LearnerHost, SamplerHost

    class _TimedCall:
        def __init__(self, method, timers: dict) -> None:
            self._method, self._timers = method, timers

        def remote(self, *args):
            t0 = time.perf_counter()
            ref = self._method.remote(*args)  # the chunk is encoded here

            async def wait():
                try:
                    return await ref
                finally:
                    self._timers["insert_s"] += time.perf_counter() - t0
                    self._timers["inserts"] += 1

            return wait()

    class _TimedReplayHandle:
        def __init__(self, handle, timers: dict) -> None:
            self.insert_chunk = _TimedCall(handle.insert_chunk, timers)

    class TimedSamplerHost(SamplerHost):
        def __init__(self, sc, seed, sampler_id) -> None:
            super().__init__(sc, seed, sampler_id)
            self.timers = {"collect_s": 0.0, "insert_s": 0.0, "weights_s": 0.0, "inserts": 0}
            collect = self.sampler.collect

            def timed_collect():
                t0 = time.perf_counter()
                try:
                    return collect()
                finally:
                    self.timers["collect_s"] += time.perf_counter() - t0

            self.sampler.collect = timed_collect

        async def _take_weights(self, at_least: int = 0) -> None:
            t0 = time.perf_counter()
            if variant == "fetch" and self._offer is not None:
                # Seed 003's sampler: pull the newest weights before every send, new or not.
                version, (ref,) = self._offer
                self.policy.set_weights(await ref, version)
                self.weights_fetched += 1
            else:
                await super()._take_weights(at_least)
            self.timers["weights_s"] += time.perf_counter() - t0

        async def run(self, replay, env_steps: int) -> dict:
            cpu0, t0 = time.process_time(), time.perf_counter()
            if variant == "overlap":
                out = await self._run_overlapped(replay, env_steps)
            else:
                out = await super().run(_TimedReplayHandle(replay, self.timers), env_steps)
            out = {**out, **self.timers, "loop_s": time.perf_counter() - t0, "cpu_s": time.process_time() - cpu0,
                   "pid": os.getpid()}
            await collector.put.remote("sampler", out)
            return out

        async def _run_overlapped(self, replay, env_steps: int) -> dict:
            """SamplerHost.run with one insert in flight while the next chunk is collected; the
            next is sent only after the previous one is in, so the replay sees each sampler's
            chunks in order as before. ``insert_s``: the time the loop waited on inserts."""
            from core.env.rate_limiter import LimiterClosed

            closed, pending = False, None
            clock = time.perf_counter
            while self.sampler.env_steps < env_steps and not self._stop:
                await self._take_weights()
                chunk = self.sampler.collect()
                self.rows += len(chunk)
                t0 = clock()
                try:
                    if pending is not None:
                        await pending
                except LimiterClosed:
                    pending, closed = None, True
                    break
                finally:
                    self.timers["insert_s"] += clock() - t0
                t0 = clock()
                pending = replay.insert_chunk.remote(chunk)
                self.timers["insert_s"] += clock() - t0
                self.timers["inserts"] += 1
            if pending is not None:
                t0 = clock()
                try:
                    await pending
                except LimiterClosed:
                    closed = True
                self.timers["insert_s"] += clock() - t0
            self.sampler.close()
            return {"env_steps": self.sampler.env_steps, "chunks": self.sampler.chunks, "rows": self.rows,
                    "weights_fetched": self.weights_fetched, "closed": closed}

    class TimedLearnerHost(LearnerHost):
        async def run(self, replay) -> dict:
            cpu0, t0 = time.process_time(), time.perf_counter()
            out = await super().run(replay)
            await collector.put.remote("learner", {"loop_s": time.perf_counter() - t0, "cpu_s": time.process_time() - cpu0,
                                                   "pid": os.getpid()})
            return out

    class TimedTransitionReplay(TransitionReplay):
        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            self._cpu0 = time.process_time()

        def stats(self) -> dict:
            return {**super().stats(), "cpu_s": time.process_time() - self._cpu0}

    return TimedSamplerHost, TimedLearnerHost, TimedTransitionReplay


class Collector:
    """Receives what the timed actors measured."""

    def __init__(self) -> None:
        self.items: list[tuple[str, dict]] = []

    def put(self, role: str, item: dict) -> None:
        self.items.append((role, item))

    def take(self) -> list[tuple[str, dict]]:
        items, self.items = self.items, []
        return items


def run_one(c: Config, env_steps: int, seed: int, collector) -> dict:
    """One async run of configuration ``c``; its figures as one flat row."""
    import ray

    import core.runtimes.ray_env as ray_env
    from core.model.config import with_changes
    from core.model.env_config import EnvScenario

    sc = with_changes(EnvScenario(), scenario_changes(c, env_steps))
    timed = _timed_classes(collector, c.variant)
    saved = ray_env.SamplerHost, ray_env.LearnerHost, ray_env.TransitionReplay
    load0 = load_average()
    stat0, _ = busy_cores_since(None)
    ray_env.SamplerHost, ray_env.LearnerHost, ray_env.TransitionReplay = timed
    try:
        t0 = time.perf_counter()
        curve = ray_env.run_async(sc, seed, stop_at_target=False)
        wall = time.perf_counter() - t0
    finally:
        ray_env.SamplerHost, ray_env.LearnerHost, ray_env.TransitionReplay = saved
    _, machine_cores = busy_cores_since(stat0)
    items = ray.get(collector.take.remote())
    samplers = [i for role, i in items if role == "sampler"]
    learner = next((i for role, i in items if role == "learner"), {})
    rp, ln = curve.replay, curve.learner
    train_s = curve.train_s
    steps = rp["env_steps"]

    def total(key: str) -> float:
        return float(sum(s[key] for s in samplers))

    loop = total("loop_s") or float("nan")
    pipeline_cpu = total("cpu_s") + learner.get("cpu_s", 0.0) + rp.get("cpu_s", 0.0)
    row = {
        **asdict(c), "baseline": c.is_baseline(), "samples_per_insert": sc.replay.samples_per_insert, "env_steps_budget": env_steps,
        "env_steps": steps, "train_s": train_s, "wall_s": wall,
        "env_steps_per_s": steps / train_s, "updates": curve.updates, "updates_per_s": curve.updates / train_s,
        "chunks": rp["chunks"], "chunks_per_s": rp["chunks"] / train_s,
        "samples_per_insert_measured": rp["samples_per_insert"],
        "insert_blocked_s": rp["insert_blocked_s"], "sample_blocked_s": rp["sample_blocked_s"],
        "learner_update_s": ln.get("update_s", 0.0), "learner_sample_wait_s": ln.get("sample_wait_s", 0.0),
        "weights_fetched": list(rp["weights_fetched"]), "versions": curve.versions,
        "policy_lag": float(np.mean(curve.policy_lag)) if curve.policy_lag else float("nan"),
        # Where the samplers' own loop went (summed over samplers).
        "sampler_loop_s": loop, "sampler_collect_s": total("collect_s"), "sampler_insert_s": total("insert_s"),
        "sampler_weights_s": total("weights_s"), "sampler_cpu_s": total("cpu_s"),
        "sampler_collect_rate": steps / total("collect_s") if samplers else float("nan"),
        "learner_cpu_s": learner.get("cpu_s", float("nan")), "replay_cpu_s": rp.get("cpu_s", float("nan")),
        "pipeline_cores": pipeline_cpu / train_s, "machine_cores": machine_cores,
        "loadavg_before": load0, "loadavg_after": load_average(),
    }
    return derive(row)


def derive(row: dict) -> dict:
    """Adds CPU microseconds per env step, per role and in all: what a configuration costs
    whatever share of the cores the machine's other load left it."""
    if "variant" not in row:  # rows.json of an earlier version of this script
        row["variant"] = "fetch" if row.pop("fetch_every_chunk", False) else ""
    steps = row["env_steps"]
    for role in ("sampler", "replay", "learner"):
        row[f"{role}_cpu_us_per_step"] = 1e6 * row[f"{role}_cpu_s"] / steps
    row["cpu_us_per_step"] = sum(row[f"{role}_cpu_us_per_step"] for role in ("sampler", "replay", "learner"))
    return row


# ---- report --------------------------------------------------------------------------------------

def table_rows(rows: list[dict]) -> list[list[str]]:
    """One line per configuration: means over repeats, the ratio to its regime's baseline."""
    env = ratios(rows)
    upd = ratios(rows, "updates_per_s")
    out = []
    for k, d in env.items():
        same = [r for r in rows if row_key(r) == k]
        m = lambda key: float(np.mean([r[key] for r in same]))  # noqa: E731
        fetched = np.mean([np.mean(r["weights_fetched"]) for r in same])
        spread = f" ({d['ratio_min']:.2f}..{d['ratio_max']:.2f})" if len(d["ratios"]) > 1 else ""
        out.append([
            k[0], str(k[1]), str(k[2]), VARIANTS[k[3]],
            f"{d['mean']:,.0f}", f"{d['ratio']:.2f}x{spread}", f"{upd[k]['mean']:,.0f}", f"{m('chunks_per_s'):,.0f}",
            f"{m('insert_blocked_s'):.1f}", f"{m('sample_blocked_s'):.1f}", f"{fetched:.1f}", f"{m('policy_lag'):.2f}",
            f"{m('cpu_us_per_step'):,.0f} ({m('sampler_cpu_us_per_step'):,.0f} / {m('replay_cpu_us_per_step'):,.0f} / "
            f"{m('learner_cpu_us_per_step'):,.0f})",
            f"{m('pipeline_cores'):.2f}", f"{m('machine_cores'):.2f}",
        ])
    return out


HEADER = ["rate limit", "send_every", "samplers", "sampler", "env steps/s", "ratio to baseline",
          "updates/s", "chunks/s", "sampler held back (s)", "learner held back (s)", "weights fetched per sampler",
          "policy lag", "CPU µs per env step (samplers / replay / learner)", "pipeline cores", "machine cores"]


def breakdown_rows(rows: list[dict]) -> list[list[str]]:
    """Where the samplers' loop went, sampler-bound, one sampler: stepping against the insert."""
    out = []
    for se in SEND_EVERY:
        for variant in VARIANTS:
            same = [r for r in rows if row_key(r) == ("sampler-bound", se, 1, variant)]
            if not same:
                continue
            loop = sum(r["sampler_loop_s"] for r in same)
            share = lambda key: sum(r[key] for r in same) / loop  # noqa: E731
            other = 1 - share("sampler_collect_s") - share("sampler_insert_s") - share("sampler_weights_s")
            out.append([
                str(se), VARIANTS[variant], f"{share('sampler_collect_s'):.0%}", f"{share('sampler_insert_s'):.0%}",
                f"{share('sampler_weights_s'):.0%}", f"{other:.0%}",
                f"{1e3 * sum(r['sampler_insert_s'] for r in same) / sum(r['chunks'] for r in same):.2f}",
                f"{np.mean([r['sampler_collect_rate'] for r in same]):,.0f}", f"{sum(r['sampler_cpu_s'] for r in same) / loop:.2f}",
            ])
    return out


BREAKDOWN_HEADER = ["send_every", "sampler", "collect (envs + policy)", "insert (encode + round trip; overlapped: the wait)",
                    "weights", "other", "ms per insert", "collect-only env steps/s in the actor", "sampler CPU / loop"]


def markdown(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def _band(env: dict, keys: list[tuple]) -> tuple[list[float], list[list[float]]]:
    ys = [env[k]["mean"] for k in keys]
    lo = [y - min(env[k]["values"]) for y, k in zip(ys, keys)]
    hi = [max(env[k]["values"]) - y for y, k in zip(ys, keys)]
    return ys, [lo, hi]


def plot(rows: list[dict], alone: list[dict], path: Path, meta: dict) -> None:
    """Four panels: env steps/s against send_every and against samplers (mean, min..max over
    repeats), where one sampler's loop went, and the CPU each env step cost per role. ``meta``:
    the run's, whose CPUs and load the title states (a plot rendered again elsewhere keeps them)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from harness.plots import MODE_COLORS

    env = ratios(rows)
    colors = {"sampler-bound": MODE_COLORS["async"], "learner-bound": MODE_COLORS["sync"]}
    fig, ((a, b), (c, d)) = plt.subplots(2, 2, figsize=(13, 8.5))
    for regime in REGIMES:
        for variant, style in (("", "o-"), ("fetch", "s--"), ("overlap", "D-.")):
            keys = [(regime, s, 1, variant) for s in SEND_EVERY if (regime, s, 1, variant) in env]
            if keys:
                ys, err = _band(env, keys)
                label = regime + (f", {VARIANTS[variant]}" if variant else "")
                a.errorbar([k[1] for k in keys], ys, yerr=err, fmt=style, color=colors[regime], label=label, capsize=3,
                           alpha=1.0 if not variant else 0.75)
        keys = [(regime, 10, n, "") for n in SAMPLERS if (regime, 10, n, "") in env]
        if keys:
            ys, err = _band(env, keys)
            b.errorbar([k[2] for k in keys], ys, yerr=err, fmt="o-", color=colors[regime], label=regime, capsize=3)
    if alone:
        a.plot([x["send_every"] for x in alone], [x["env_steps_per_s"] for x in alone], "^:", color="0.5",
               label="collect alone in the driver (no Ray, no insert)")
    a.set_xscale("log")
    a.set_xticks(SEND_EVERY, [str(s) for s in SEND_EVERY])
    a.set_xlabel("env.send_every (vector steps of 8 envs per chunk), 1 sampler")
    b.set_xticks(SAMPLERS, [str(n) for n in SAMPLERS])
    b.set_xlabel("env.samplers (send_every 10) on 2 CPUs")
    for ax in (a, b):
        ax.set_ylabel("env steps / s (mean, min..max)")
        ax.set_yscale("log")
        ax.legend(fontsize=7)
    # Where one sampler's loop went, sampler-bound.
    parts = (("sampler_collect_s", "collect (envs + policy)", MODE_COLORS["async"]),
             ("sampler_insert_s", "insert (encode + round trip)", MODE_COLORS["inflight"]),
             ("sampler_weights_s", "weights fetch", MODE_COLORS["partial"]))
    shares, labels = {}, []
    for se in SEND_EVERY:
        for variant in VARIANTS:
            same = [r for r in rows if row_key(r) == ("sampler-bound", se, 1, variant)]
            if same:
                loop = sum(r["sampler_loop_s"] for r in same)
                shares[(se, variant)] = [sum(r[k] for r in same) / loop for k, _, _ in parts]
                labels.append(f"{se}{SHORT[variant]}")
    keys = list(shares)
    ran = {r["variant"] for r in rows}
    legend = "; ".join(f"{SHORT[v].strip()}: {VARIANTS[v]}" for v in VARIANTS if v and v in ran)
    bottom = np.zeros(len(keys))
    for i, (_, name, color) in enumerate(parts):
        vals = np.array([shares[k][i] for k in keys])
        c.bar(range(len(keys)), vals, bottom=bottom, color=color, label=name)
        bottom += vals
    c.bar(range(len(keys)), 1 - bottom, bottom=bottom, color="#eeeeee", label="other")
    c.set_xticks(range(len(keys)), labels, fontsize=8)
    c.set_xlabel("send_every, sampler-bound, 1 sampler" + (f"; {legend}" if legend else ""))
    c.set_ylabel("share of the sampler's loop")
    c.set_ylim(0, 1)
    c.legend(fontsize=7, loc="lower right")
    # CPU per env step, by role, sampler-bound (learner-bound: the learner's ~2 ms per env step
    # dwarfs the rest; the table has it).
    confs = [k for k in env if k[0] == "sampler-bound"]
    roles = (("sampler_cpu_us_per_step", "samplers", MODE_COLORS["async"]), ("replay_cpu_us_per_step", "replay", MODE_COLORS["inflight"]),
             ("learner_cpu_us_per_step", "learner", MODE_COLORS["sync"]))
    bottom = np.zeros(len(confs))
    for key, name, color in roles:
        vals = np.array([np.mean([r[key] for r in rows if row_key(r) == k]) for k in confs])
        d.bar(range(len(confs)), vals, bottom=bottom, color=color, label=name)
        bottom += vals
    d.set_xticks(range(len(confs)), [f"{k[1]}/{k[2]}{SHORT[k[3]]}" for k in confs], fontsize=8, rotation=30)
    d.set_xlabel("send_every/samplers, sampler-bound" + (f"; {legend}" if legend else ""))
    d.set_ylabel("process CPU µs per env step (actors' own CPU)")
    d.legend(fontsize=7)
    for ax in (a, b, c, d):
        ax.grid(alpha=0.3)
    fig.suptitle(f"env pipeline throughput on Ray: CartPole DQN, 8 envs per sampler, {meta['cpus']} CPUs, "
                 f"load average {meta['loadavg_start']} .. {meta['loadavg_end']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--env-steps", type=int, default=24_000, help="env steps of each sampler-bound run")
    p.add_argument("--learner-bound-env-steps", type=int, default=6_000, help="env steps of each learner-bound run")
    p.add_argument("--repeats", type=int, default=2, help="passes over every configuration, interleaved")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path("runs/env-throughput"))
    p.add_argument("--overlap-only", action="store_true",
                   help="only the sampler-bound send_every sweep, as is and with the insert overlapped (proposed)")
    p.add_argument("--from-json", type=Path, help="only render the table and plot of an earlier run's rows.json")
    args = p.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    from rich.console import Console

    import ray

    from core.runtimes.ray_start import cluster

    console = Console(width=220)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.from_json:
        saved = json.loads(args.from_json.read_text())
        report(console, saved["meta"], saved["alone"], [derive(r) for r in saved["rows"]], args.out)
        return
    meta = {"commit": commit_label(), "command": " ".join(["python", *sys.argv]), "loadavg_start": load_average(),
            "cpus": os.cpu_count(), "sampler_bound_spi": SAMPLER_BOUND_SPI, "learner_bound_spi": LEARNER_BOUND_SPI,
            "sampler_num_cpus": SAMPLER_CPUS, "backend": __import__("ext.replay", fromlist=["BACKEND"]).BACKEND}
    console.print(f"commit {meta['commit']}, loadavg {meta['loadavg_start']}, {meta['cpus']} CPUs, replay backend {meta['backend']}")
    alone = [collect_alone(se, 20_000, args.seed) for se in SEND_EVERY]
    for a in alone:
        console.print(f"collect alone, send_every {a['send_every']}: {a['env_steps_per_s']:,.0f} env steps/s; "
                      f"a chunk's codec round trip {a['codec_roundtrip_s'] / a['collect_s']:.1%} of collect time")
    rows: list[dict] = []
    with cluster(None, 2):
        collector = ray.remote(num_cpus=0)(Collector).remote()
        meta["fetch"] = fetch_cost()
        console.print(f"one weights fetch (ray.get + set_weights) in the driver: {1e3 * meta['fetch']['fetch_s']:.3f} ms, "
                      f"{meta['fetch']['bytes'] / 1e3:.0f} kB")
        for rep in range(args.repeats):
            for c in configs(args.overlap_only):
                steps = args.env_steps if c.regime == "sampler-bound" else args.learner_bound_env_steps
                row = {**run_one(c, steps, args.seed, collector), "repeat": rep}
                rows.append(row)
                console.print(
                    f"[{rep}] {c.regime:<13} {c.label:<50} {row['env_steps_per_s']:>7,.0f} env steps/s "
                    f"{row['updates_per_s']:>6,.1f} upd/s  held back: sampler {row['insert_blocked_s']:.1f} s, "
                    f"learner {row['sample_blocked_s']:.1f} s  cores {row['pipeline_cores']:.2f}/{row['machine_cores']:.2f}  "
                    f"load {row['loadavg_after']}"
                )
                (args.out / "rows.json").write_text(json.dumps({"meta": meta, "alone": alone, "rows": rows}, indent=1))
        ray.kill(collector)
    meta["loadavg_end"] = load_average()
    (args.out / "rows.json").write_text(json.dumps({"meta": meta, "alone": alone, "rows": rows}, indent=1))
    report(console, meta, alone, rows, args.out)


def report(console, meta: dict, alone: list[dict], rows: list[dict], out: Path) -> None:
    from rich.table import Table

    t = Table(title=f"env throughput, commit {meta['commit']}")
    for h in HEADER:
        t.add_column(h, justify="right")
    for r in table_rows(rows):
        t.add_row(*r)
    console.print(t)
    md = markdown(HEADER, table_rows(rows)) + "\n\n" + markdown(BREAKDOWN_HEADER, breakdown_rows(rows)) + "\n"
    (out / "table.md").write_text(md)
    console.print(md)
    plot(rows, alone, out / "env-throughput.png", meta)
    console.print(f"loadavg at the end {meta['loadavg_end']}; rows, table and plot in {out}")


if __name__ == "__main__":
    main()
