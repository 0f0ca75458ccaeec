"""Report metrics of one run, each name defined once here, units in the name.

The sim runtime reports simulated seconds everywhere except ``sim/wall_s``. The real
runtimes (local, ray) report wall seconds, ``run/…`` instead of ``sim/…``, what the torch
trainer learned (``learn/…``) and its model FLOPs utilization; their pipeline bound is not
computed (it is the sim's cost model, not a measurement of this machine), and ``util/gpu``
says where it comes from: ``spans`` (engine and trainer busy time) or ``nvml`` (measured).
"""

from __future__ import annotations

import math
import resource

import numpy as np

from core.model.config import LearnSpec
from core.model.result import RunResult
from core.model.timeline import GENERATE
from core.sim.bound import Bound, pipeline_bound, step_draws, trained_lengths, trained_order
from core.sim.costs import active_params
from core.sim.workload import Workload

# Keys whose values depend on the machine, not on the scenario and seed.
WALL_CLOCK_KEYS = frozenset({"sim/wall_s", "mem/peak_rss_mb"})
# Points of learn/reward_at_samples: the same grid of trained samples in every mode.
REWARD_POINTS = 10
REACH_TOLERANCE = 1e-9


def _mean(xs: list[float]) -> float:
    return float(np.mean(xs)) if xs else 0.0


def bounds(result: RunResult) -> tuple[Bound, Bound] | None:
    """The sim's pipeline bounds of a run: (for the workload it trained, for the workload as
    planned); None on a real runtime. A run that evicts long samples, or leaves them in flight
    at its end, trains a shorter set than planned; its efficiency is taken against that set's
    own bound, so that dropping work never reads as speed. Groups a replay ring overwrote
    before training them were generated in full: that set counts them (without them, the
    bound would play the trained groups again in their place, not what the run generated)."""
    sc = result.scenario
    if sc.runtime != "sim":
        return None
    led = result.ledger
    planned = pipeline_bound(sc, result.mode)
    trained = [pid for pid, _, _ in led.trained_log]
    lengths = trained_lengths(sc, [*trained, *led.overwritten_ids])
    if lengths is None:
        return planned, planned
    if sc.replay.enabled:
        return pipeline_bound(sc, result.mode, lengths, draws=step_draws(sc, trained)), planned
    return pipeline_bound(sc, result.mode, lengths, order=trained_order(trained)), planned


def _length_bias(result: RunResult) -> float | None:
    """Mean response length of what was trained over that of what was admitted. The sim knows
    every admitted sample's length; a real engine never says how long a dropped one would
    have grown, so a real run reports None."""
    sc, led = result.scenario, result.ledger
    groups = led.produced // sc.workload.group_size
    if sc.runtime != "sim" or not led.trainings or not groups:
        return None
    admitted = Workload.of(sc).sample_lengths(groups)
    return (led.response_tokens / led.trainings) / float(admitted.mean())


def collect(
    result: RunResult, bound: tuple[Bound, Bound] | None = None, gpu: dict | None = None,
) -> dict[str, float | int | str | None]:
    """Every metric of a finished run (``bound``: the run's ``bounds``, if already computed;
    ``gpu``: what an NVML sampler measured during the run, if a GPU was visible). A pure
    function of its arguments, but for ``mem/peak_rss_mb``, the process's high-water mark."""
    sc, led, place = result.scenario, result.ledger, result.placement
    end = result.end_s
    ps = result.sync
    engines = result.engines
    trained = led.trained  # distinct samples
    trainings = led.trainings  # as many as trained, unless a replay stage reuses samples
    engine_busy = sum(e.busy_s for e in engines)
    trainer_compute = result.trainer.compute_s
    generated = sum(e.tokens_generated for e in engines)
    dropped = led.dropped_total
    observed = result.in_flight
    e2e = np.asarray(led.e2e_s) if led.e2e_s else np.zeros(1)
    real = sc.runtime != "sim"
    if bound is None and not real:
        bound = bounds(result)
    bound, planned = bound if bound is not None else (None, None)
    thr = trainings / end if end > 0 else 0.0
    tok = (led.prompt_tokens + led.response_tokens) / end if end > 0 else 0.0
    gpu_s = place.total_gpus * end
    rollout_gpus = len(engines) * place.gpus_per_engine
    if place.colocated:
        sync_gpu_s = sum(ps.pause_s) * place.total_gpus
    else:  # the trainer waits out the whole sync; engines stop only while weights move
        sync_gpu_s = sum(ps.pause_s) * place.trainer_gpus + sum(ps.transfer_s) * rollout_gpus
    share = {
        "generate": engine_busy * place.gpus_per_engine,
        "train": trainer_compute * place.trainer_gpus,
        "sync": sync_gpu_s,
    }
    share = {k: v / gpu_s if gpu_s else 0.0 for k, v in share.items()}
    share["idle"] = max(0.0, 1.0 - sum(share.values()))

    m: dict[str, float | int | str] = {
        "throughput/trained_samples_per_s": thr,
        "throughput/fresh_samples_per_s": trained / end if end > 0 else 0.0,
        "throughput/trained_tokens_per_s": tok,
        "throughput/generated_tokens_per_s": generated / end if end else 0.0,
        "latency/sample_e2e_p50_s": float(np.percentile(e2e, 50)),
        "latency/sample_e2e_p99_s": float(np.percentile(e2e, 99)),
        "latency/step_mean_s": end / max(1, result.trainer.step),
        "sync/count": len(ps.pause_s),
        "sync/pause_mean_s": _mean(ps.pause_s),
        "sync/drain_mean_s": _mean(ps.drain_s),
        "sync/transfer_mean_s": _mean(ps.transfer_s),
        **({"sync/bytes_mean": _mean(ps.bytes)} if ps.bytes else {}),
        "util/rollout_busy": engine_busy / (len(engines) * end) if end else 0.0,
        "util/rollout_batch_mean": sum(e.seq_s for e in engines) / engine_busy if engine_busy else 0.0,
        "util/trainer_busy": trainer_compute / end if end else 0.0,
        "trainer/wait_s": result.trainer.wait_s,
        "util/gpu": share["generate"] + share["train"],
        "util/gpu_source": "spans" if real else "modeled",
        "gpu_time/generate": share["generate"],
        "gpu_time/train": share["train"],
        "gpu_time/sync": share["sync"],
        "gpu_time/idle": share["idle"],
        "staleness/mean": led.staleness_sum / trainings if trainings else 0.0,
        # Per token the policy sampled: an agent episode's observation tokens have no staleness.
        "staleness/token_mean": led.token_staleness_sum / sampled if (sampled := led.response_tokens - led.observation_tokens) else 0.0,
        # Of those, the share sampled by an older policy than the one trained (off-policy).
        "staleness/offpolicy_token_share": led.offpolicy_tokens / sampled if sampled else 0.0,
        "staleness/max": led.staleness_max,
        "staleness/bound": led.max_staleness,
        "partial/ratio": led.interrupted / trained if trained else 0.0,
        "partial/interrupts": led.interrupts,
        "partial/resumes": led.resumes,
        "samples/produced": led.produced,
        "samples/trained": trained,
        "samples/trainings": trainings,
        "samples/dropped": dropped,
        "samples/in_flight": observed,
        "samples/lost": led.produced - trained - dropped - observed,
        "tokens/generated": generated,
        "tokens/wasted": led.wasted_tokens,
        "tokens/wasted_share": led.wasted_tokens / generated if generated else 0.0,
        "samples/length_bias": _length_bias(result),
        "tokens/trained_response": led.response_tokens,
        "tokens/masked_observation": led.observation_tokens,  # of those, context from tools: loss mask 0
        "tokens/prefill": sum(e.prefill_tokens for e in engines),
        "rollout/preemptions": sum(e.preemptions for e in engines),
        "tokens/recomputed_prefill": (recomputed := sum(e.recomputed_tokens for e in engines)),
        # Of the prefill the engines did, the share spent again on context that a full KV cache
        # preempted: long contexts' cost beyond their quadratic attention.
        "tokens/recomputed_prefill_share": recomputed / prefilled if (prefilled := sum(e.prefill_tokens for e in engines)) else 0.0,
        "rollout/sticky_resumes": sum(e.sticky_resumes for e in engines),
        "rollout/moved_resumes": sum(e.moved_resumes for e in engines),
        "trainer/steps": result.trainer.step,
        "trainer/final_version": result.trainer.version,
    }
    if bound is not None:
        per = bound.tokens_per_sample
        m.update({
            "bound/trained_samples_per_s": bound.trained_samples_per_s,
            "bound/trained_tokens_per_s": bound.trained_tokens_per_s,
            "bound/resource_tokens_per_s": bound.resource_samples_per_s * per,
            "bound/rollout_tokens_per_s": bound.rollout_samples_per_s * per,
            "bound/trainer_tokens_per_s": bound.trainer_samples_per_s * per,
            "bound/resource_samples_per_s": bound.resource_samples_per_s,
            "bound/rollout_samples_per_s": bound.rollout_samples_per_s,
            "bound/trainer_samples_per_s": bound.trainer_samples_per_s,
            "bound/limited_by": bound.limited_by,
            "bound/version_bubble_s": bound.version_bubble_s,
            "bound/efficiency": tok / bound.trained_tokens_per_s if bound.trained_tokens_per_s else 0.0,
            "bound/planned_trained_samples_per_s": planned.trained_samples_per_s,
            "bound/planned_trained_tokens_per_s": planned.trained_tokens_per_s,
        })
    else:
        m.update({
            "bound/trained_samples_per_s": None, "bound/trained_tokens_per_s": None, "bound/efficiency": None,
            "bound/limited_by": "not computed on a real runtime",
        })
    if real:
        m.update(_learned(result, end))
        if gpu:
            m["util/gpu_spans"] = m["util/gpu"]
            m.update(gpu)  # util/gpu and util/gpu_source: nvml, per-device figures
        m["run/duration_s"] = end
        m["run/wall_s"] = result.wall_s
    else:
        m["sim/duration_s"] = end
        m["sim/wall_s"] = result.wall_s
    # Time to reward, wherever the trainer reports rewards (real runtimes); absent on the sim.
    plan = sc.trainer.steps * sc.trainer.batch_size
    m.update(reward_progress(result.trainer.step_info, sc.target_reward, sc.learn.reward_window, plan))
    m.update(version_reward(result.trainer.step_info, sc.trainer.steps, sc.staleness.max_staleness))
    # The process's high-water mark so far (Linux: KiB), not this run's alone: what a load
    # run must show stays flat.
    m["mem/peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    m.update(implied_mfu(result))
    m["samples/requeued"] = led.requeued
    m.update(result.faults.metrics())
    for reason, n in sorted(led.dropped.items()):
        m[f"samples/dropped_{reason}"] = n
    if sc.filter is not None:  # dropped by dynamic sampling, every reason
        m["samples/filtered"] = sum(n for reason, n in led.dropped.items() if reason.startswith("filter_"))
    for name, n in result.queue_counters.items():
        m[f"queue/{name}_groups"] = n
    if result.replay_counters is not None:
        for name, v in result.replay_counters.items():
            m[f"replay/{name}"] = v
    if result.agent is not None:
        m.update(agent_metrics(result, gpu_s))
    return m


def agent_metrics(result: RunResult, gpu_s: float) -> dict:
    """Agent episodes: how they ended, their turns and tool calls, the GPU time that engines
    stood idle while a tool ran for one of their episodes (``gpu_time/waiting_on_tools``, a
    share of all GPU time, inside ``gpu_time/idle``), and on the real runtimes the share of
    responses that earned any reward over the first and the last ``learn.reward_window`` steps
    (on the arithmetic task, those that called the tool right)."""
    a = result.agent
    ended = {k.removeprefix("ended/"): n for k, n in a["ended"].items()}
    episodes = sum(ended.values())
    counts = a.get("box", {}).get("counts", {})
    errors = sum(n for k, n in counts.items() if k.startswith("error/"))
    idle = 0.0
    for e in result.engines:
        busy = [(a0, b0) for kind, a0, b0 in result.timeline.spans.get(e.name, ()) if kind == GENERATE]
        idle += _uncovered(a["tool_spans"].get(e.name, ()), busy)
    idle_gpu_s = idle * result.placement.gpus_per_engine
    out = {
        "agent/episodes": episodes,
        "agent/turns_per_episode": a["turns"] / episodes if episodes else 0.0,
        "agent/tool_calls": a["tool_calls"],
        "agent/tool_s": a["tool_s"],
        "agent/tool_errors": errors,
        "agent/gpu_idle_on_tools_s": idle_gpu_s,
        "gpu_time/waiting_on_tools": idle_gpu_s / gpu_s if gpu_s else 0.0,
    }
    out.update({f"agent/ended_{k}": n for k, n in sorted(ended.items())})
    if "box" in a:  # real runtimes: calls executed, and those answered from the record instead
        out["agent/tool_calls_executed"] = counts.get("executed", 0)
        out["agent/tool_calls_replayed"] = counts.get("replayed", 0) + counts.get("joined", 0)
        out.update({f"agent/tool_errors_{k.removeprefix('error/')}": n for k, n in sorted(counts.items()) if k.startswith("error/")})
    shares = [i["reward_positive_share"] for i in result.trainer.step_info if "reward_positive_share" in i]
    if shares:  # real runtimes: the trainer saw the rewards
        w = result.scenario.learn.reward_window
        out["agent/reward_positive_first"] = float(np.mean(shares[:w]))
        out["agent/reward_positive_last"] = float(np.mean(shares[-w:]))
    return out


def _uncovered(spans, busy: list) -> float:
    """Time in ``spans`` (disjoint, in order) that no interval of ``busy`` (disjoint, in order) covers."""
    total, j = 0.0, 0
    for a0, b0 in spans:
        t = a0
        while j < len(busy) and busy[j][1] <= t:
            j += 1
        k = j
        while t < b0:
            if k < len(busy) and busy[k][0] < b0:
                if busy[k][0] > t:
                    total += busy[k][0] - t
                t = max(t, busy[k][1])
                k += 1
            else:
                total += b0 - t
                t = b0
    return total


def implied_mfu(result: RunResult) -> dict[str, float | None]:
    """Model FLOPs done over the GPU-seconds each role was busy, at BF16 peak: what the run's
    times imply about its GPUs. The trainer counts what the algorithm needs (forward, backward
    and a log-prob forward where the mode recomputes them; no activation recompute, as MFU is
    usually stated); the engines 2 x the matmul parameters a token is multiplied by (a mixture of
    experts' active ones) per token generated or prefilled
    (attention left out). The engines' figure is the sim's only (a real run's engines serve a
    model the scenario's ``model:`` does not describe)."""
    be, sc, place = result.trainer, result.scenario, result.placement
    trainer = be.flops / (be.compute_s * be.peak_flops) if be.compute_s and be.peak_flops else None
    rollout = None
    busy_gpu_s = sum(e.busy_s for e in result.engines) * place.gpus_per_engine
    if sc.runtime == "sim" and busy_gpu_s:
        tokens = sum(e.tokens_generated + e.prefill_tokens for e in result.engines)
        rollout = 2.0 * active_params(sc.model) * tokens / (busy_gpu_s * sc.gpu.bf16_tflops * 1e12)
    return {"util/implied_trainer_mfu": trainer, "util/implied_rollout_mfu": rollout}


def _learned(result: RunResult, end: float) -> dict:
    """What the real trainer learned and how hard it worked."""
    led, be = result.ledger, result.trainer
    info = be.step_info
    rewards = [i["reward_mean"] for i in info if "reward_mean" in i]
    k = max(1, len(rewards) // 5)
    peak = be.peak_flops
    trainer_devices = result.placement.trainer_gpus
    m = {
        "learn/reward_mean": led.reward_sum / led.rewarded if led.rewarded else 0.0,
        "learn/reward_first_steps": float(np.mean(rewards[:k])) if rewards else 0.0,
        "learn/reward_last_steps": float(np.mean(rewards[-k:])) if rewards else 0.0,
        "util/mfu": be.flops / (end * peak) if end and peak else 0.0,
        "util/mfu_busy": be.flops / (be.compute_s * peak) if be.compute_s and peak else 0.0,
        "util/mfu_peak_tflops": peak / 1e12,
        "util/mfu_devices": trainer_devices,
    }
    m.update(learning_stability(info))
    evals = result.evaluations
    if evals:
        m["eval/count"] = len(evals)
        m["eval/reward_first"] = evals[0]["reward_mean"]
        m["eval/reward_last"] = evals[-1]["reward_mean"]
    return m


def step_response_len(info: dict) -> float | None:
    """A trainer step's mean response length; None where the backend does not report lengths."""
    lens = info.get("response_lens")
    return float(np.mean(lens)) if lens else None


def learning_stability(step_info: list[dict]) -> dict:
    """Two figures that say whether stale data destabilised learning. ``learn/behaviour_kl``: the
    mean over steps of KL(behaviour || trained policy) per response token, how far the weights
    moved between sampling a token and training on it. ``learn/length_swing``: over the second
    half of the steps, the spread (std / mean) of the step's mean response length; on the real
    task a delayed length signal makes the policy overshoot long, then short, and this grows
    with staleness (docs/results/2026-11-30-staleness-drift.md)."""
    m: dict = {}
    kl = [float(i["behaviour_kl"]) for i in step_info if "behaviour_kl" in i]
    if kl:
        m["learn/behaviour_kl"] = math.fsum(kl) / len(kl)
    # What the off-policy correction did to the trained tokens, over the run: the share whose
    # importance weight it truncated, that it masked out (weight 0), and that PPO's clip held.
    ntok = [(i, float(i["response_tokens"])) for i in step_info if "clip_frac" in i and i.get("response_tokens")]
    total = math.fsum(n for _, n in ntok)
    if total > 0:
        for key, frac in (("truncated", "is_truncated_frac"), ("masked", "masked_frac"), ("clipped", "clip_frac")):
            m[f"learn/{key}_share"] = math.fsum(float(i[frac]) * n for i, n in ntok) / total
    lens = [x for x in map(step_response_len, step_info) if x is not None]
    late = lens[len(lens) // 2:]
    if len(late) >= 2 and np.mean(late) > 0:
        m["learn/length_swing"] = float(np.std(late) / np.mean(late))
    return m


def trailing_rewards(rewards: list[float], window: int) -> list[float]:
    """Each step's mean batch reward over its last ``window`` steps (fewer at the start)."""
    out = []
    for i in range(len(rewards)):
        last = rewards[max(0, i + 1 - window):i + 1]
        out.append(math.fsum(last) / len(last))
    return out


def reward_progress(step_info: list[dict], target: float, window: int, planned_samples: int) -> dict:
    """Time, trained samples and tokens to ``target``: at the end of the first step whose
    trailing mean batch reward over ``window`` steps (only once that many exist) reaches it,
    on the run's clock (zero at its start). Not reached: None, and ``learn/reached_target`` 0.
    Empty when no step has a reward (the sim)."""
    info = [i for i in step_info if "reward_mean" in i]
    if not info:
        return {}
    rewards = [float(i["reward_mean"]) for i in info]
    trail = trailing_rewards(rewards, window)
    # Within float rounding: three batches of 0.3, 0.4, 0.5 average to 0.4 and reach a target of 0.4.
    hit = next((k for k in range(window - 1, len(info)) if trail[k] >= target - REACH_TOLERANCE), None)
    m: dict = {
        "learn/target_reward": target,
        "learn/reward_window": window,
        "learn/reached_target": int(hit is not None),
        "learn/time_to_target_s": None if hit is None else float(info[hit]["end_s"]),
        "learn/samples_to_target": None if hit is None else int(info[hit]["trainings"]),
    }
    if all("tokens" in i for i in info):
        m["learn/tokens_to_target"] = None if hit is None else int(sum(i["tokens"] for i in info[:hit + 1]))
    m["learn/final_reward"] = math.fsum(rewards[-window:]) / len(rewards[-window:])
    # Every mode trains the same samples per step: the mean over the second half of the steps
    # compares modes at equal trained samples, with ten times fewer seeds' worth of noise than
    # the last few batches.
    late = rewards[len(rewards) // 2:]
    m["learn/reward_second_half"] = math.fsum(late) / len(late)
    m["learn/reward_at_samples"] = reward_at_samples([int(i["trainings"]) for i in info], trail, planned_samples)
    return m


def version_reward(step_info: list[dict], steps: int, max_staleness: int) -> dict:
    """``learn/version_reward_second_half``: the mean over policy versions ``steps // 2`` ..
    ``steps - 1 - max_staleness`` of the mean reward of the trained responses each version
    sampled. Version v has been trained on v steps' samples in every mode, and every mode trains
    what those versions sampled before the run ends, so this compares modes at equal trained
    samples. The batch reward does not: a step of async trains what a policy up to
    ``max_staleness`` versions older sampled, so its curve lags by that many steps by construction.
    Empty without per-response rewards (the sim) or when the range is empty."""
    lo, hi = steps // 2, steps - 1 - max_staleness
    per: dict[int, list[float]] = {}
    for i in step_info:
        for v, r in zip(i.get("sample_versions", ()), i.get("rewards", ())):
            if lo <= v <= hi:
                per.setdefault(int(v), []).append(float(r))
    if not per:
        return {}
    means = [math.fsum(r) / len(r) for r in per.values()]
    return {"learn/version_reward_second_half": math.fsum(means) / len(means)}


def reward_at_samples(trainings: list[int], trail: list[float], planned: int, points: int = REWARD_POINTS) -> dict:
    """Trailing reward at ``points`` evenly spaced counts of trained samples up to ``planned``
    (the run's whole plan, the same in every mode): each the last step's at or below that count,
    None before the first step. Modes compare at equal samples, whatever their speed."""
    grid = [round(planned * (j + 1) / points) for j in range(points)]
    reward = []
    for s in grid:
        k = int(np.searchsorted(trainings, s, side="right")) - 1
        reward.append(trail[k] if k >= 0 else None)
    return {"trained_samples": grid, "reward": reward}


def reward_curve(rep: dict) -> dict | None:
    """A report's trailing batch reward against its run's seconds and trained samples; None
    without rewards (the sim)."""
    s = rep.get("series", {})
    if not s.get("learn_reward_mean"):
        return None
    # A report written before learn.reward_window existed was averaged over the default.
    window = rep["scenario"].get("learn", {}).get("reward_window", LearnSpec().reward_window)
    return {
        "time_s": list(s["learn_step_end_s"]),
        "samples": list(s["learn_trained_samples"]),
        "reward": trailing_rewards(s["learn_reward_mean"], window),
    }


def series(result: RunResult) -> dict[str, list]:
    """Time series for plots and report.json."""
    led = result.ledger
    out = {
        "step_end_s": [t for t, _ in led.step_ends],
        "trained_samples": [n for _, n in led.step_ends],
        "staleness_per_group": [tv - gv for _, gv, tv in led.trained_log],
    }
    info = [i for i in result.trainer.step_info if "reward_mean" in i]
    if info:
        # Reward of each step's batch, against trained samples and against wall time.
        out["learn_step_end_s"] = [i["end_s"] for i in info]
        out["learn_trained_samples"] = [i["trainings"] for i in info]
        out["learn_reward_mean"] = [i["reward_mean"] for i in info]
        out["learn_loss"] = [i.get("loss") for i in info]
        out["learn_behaviour_kl"] = [i.get("behaviour_kl") for i in info]
        out["learn_response_len"] = [step_response_len(i) for i in info]
    if result.evaluations:
        out["eval"] = list(result.evaluations)
    if result.faults.records:
        out["faults"] = result.faults.state()
    if result.nodes:
        out["nodes"] = dict(result.nodes)
    return out
