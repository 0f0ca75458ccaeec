"""Component costs from a paper's published per-phase times.

A published table (a small YAML file, e.g. ``scenarios/published/verl-fully-async-7b.yaml``)
gives, for one setup, the per-step times of a colocated run (generation, log-prob recompute,
actor update, the rest) and of a separated one (actor update). ``fit_phases`` turns them
into the scenario changes that make the cost model reproduce them:

- the response lengths' median: the separated update time fixes the tokens a sample holds,
  given the separated trainer's MFU and the lengths' sigma (assumptions the table states);
- ``rollout.decode_overhead_s``: the colocated generation time, a wait for the window's
  longest responses on a thinning batch, fixes what a decode step costs beyond its roofline;
- ``trainer.colocated_mfu`` from the colocated update and log-prob times at those lengths;
- ``sync.colocated_switch_s`` from what the colocated step spends outside the three phases.

Nothing is fitted to an end-to-end step time or speedup. The table's format::

    scenario: {...}          # the scenario inputs the fit completes (a scenario file's keys)
    samples_per_step: 8192   # samples one published step trains
    fit: "16:16"             # the setup whose phase times are fitted
    setups:
      "16:16": {rollout_gpus: 16, trainer_gpus: 16, colocated_gpus: 32,
                colocated: {gen_s: ..., old_log_prob_s: ..., update_actor_s: ..., step_s: ...},
                separated: {update_actor_s: ..., step_s: ...}}
"""

from __future__ import annotations

import math

import numpy as np

from core.model.config import Scenario, with_changes
from core.model.phase_table import PhaseTable
from core.sim.costs import DecodeCost, TrainCost, TransferCost, dp_comm_s
from core.sim.workload import Workload

# Windows whose times are averaged: a fit to one window would fit that window's tail.
WINDOWS = 4
# Search range of the fitted decode step overhead: beyond it a step is not a decode step.
MAX_DECODE_OVERHEAD_S = 0.2


def window_generate_s(sc: Scenario, engines: int, first_group: int, groups: int) -> float:
    """Seconds a colocated sync window takes to generate ``groups`` groups from ``first_group``,
    whole groups dealt round-robin to ``engines`` engines that all start at once: each engine
    prefills its prompts, then decodes until its longest response ends, its batch thinning
    as responses finish; the window waits for the slowest engine."""
    decode = DecodeCost(sc, sc.resources.gpus_per_engine, colocated=True)
    w = Workload.of(sc)
    lengths = w.sample_lengths(first_group + groups)[first_group:]
    p = sc.workload.prompt_tokens
    slowest = 0.0
    for e in range(min(engines, groups)):
        mine = lengths[e::engines]
        flat = np.sort(mine.ravel())
        k = np.arange(int(flat[-1]))
        running = (len(flat) - np.searchsorted(flat, k, side="right")).astype(np.float64)
        decode_s = float((decode.base_s_many(running) + decode.kv_s_per_token * running * (p + k)).sum())
        slowest = max(slowest, decode_s + len(mine) * decode.prefill_s(0, p))
    return slowest


def _window_tokens(sc: Scenario, samples: int) -> tuple[float, float]:
    """Mean tokens and squared tokens of a window of ``samples`` samples (prompt + response)."""
    n = sc.workload.group_size
    groups = samples // n
    t = sc.workload.prompt_tokens + Workload.of(sc).sample_lengths(groups * WINDOWS).astype(np.float64)
    return float(t.sum()) / WINDOWS, float((t * t).sum()) / WINDOWS


def phase_times(sc: Scenario, setup: dict, samples: int) -> dict[str, float]:
    """The cost model's per-step phase times for a published setup: what ``fit_phases`` matches.

    Colocated: ``gen_s`` (mean window generation), ``old_log_prob_s`` and ``update_actor_s``
    (the log-prob forward is 1 of the colocated trainer's passes), ``other_s`` (the weight
    transfer with its switch). Separated: ``update_actor_s``."""
    steps = samples / sc.trainer.batch_size
    tokens, tokens_sq = _window_tokens(sc, samples)
    g = setup["colocated_gpus"]
    colo = with_changes(sc, {"resources.rollout_gpus": g // 2 + g % 2, "resources.trainer_gpus": g // 2})
    train_c = TrainCost(colo, g, recompute_logprobs=True, colocated=True)
    flops_s = train_c.sample_flops(tokens, tokens_sq) / train_c.flops
    groups = samples // sc.workload.group_size
    engines = g // sc.resources.gpus_per_engine
    gen = float(np.mean([window_generate_s(colo, engines, i * groups, groups) for i in range(WINDOWS)]))
    logprob_comm = steps * (dp_comm_s(colo, g, True) - dp_comm_s(colo, g, False))
    return {
        "colocated.gen_s": gen,
        "colocated.old_log_prob_s": flops_s / train_c.passes + logprob_comm,
        "colocated.update_actor_s": flops_s * (1 - 1 / train_c.passes) + steps * train_c.fixed_s - logprob_comm,
        "colocated.other_s": TransferCost(colo, colocated=True).seconds(),
        "separated.update_actor_s": _separated_update_s(sc, setup["trainer_gpus"], steps, tokens, tokens_sq),
    }


def _bisect(f, lo: float, hi: float, target: float, iters: int = 40, log: bool = False) -> float:
    """x in [lo, hi] with f(x) = target, f increasing; the nearer end when out of range."""
    if f(lo) >= target:
        return lo
    if f(hi) <= target:
        return hi
    for _ in range(iters):
        mid = math.sqrt(lo * hi) if log else (lo + hi) / 2
        if f(mid) < target:
            lo = mid
        else:
            hi = mid
    return math.sqrt(lo * hi) if log else (lo + hi) / 2


def fit_phases(table: dict) -> tuple[dict[str, object], list[str]]:
    """The scenario dotted-key changes that give the cost components of the table's fitted setup
    (checked whole first: ``PhaseTable``), and a line per fitted value saying what it came from
    and how well the phases are reproduced."""
    checked = PhaseTable.model_validate(table)
    base, samples, label = checked.scenario, checked.samples_per_step, checked.fit
    table = checked.model_dump(exclude={"scenario"})
    setup = table["setups"][label]
    colo, sep = setup["colocated"], setup["separated"]
    sc = with_changes(base, {"resources.rollout_gpus": setup["rollout_gpus"], "resources.trainer_gpus": setup["trainer_gpus"]})
    lines = [f"fit to the {label} phase times only ({samples:,} samples a step); assumed: trainer.mfu "
             f"{sc.trainer.mfu:.2f} (separated), activation_recompute {sc.trainer.activation_recompute}, "
             f"prompt {sc.workload.prompt_tokens} tokens, response sigma {sc.workload.response_sigma}, "
             f"max response {sc.workload.max_response_len}"]

    def with_median(median: float) -> Scenario:
        return with_changes(sc, {"workload.response_median": max(1, round(median))})

    median = _bisect(lambda m: phase_times_trainer(with_median(m), setup, samples), 1.0,
                     float(sc.workload.max_response_len), sep["update_actor_s"], iters=30, log=True)
    fitted = with_median(median)

    def gen(overhead: float) -> float:
        return phase_times(with_changes(fitted, {"rollout.decode_overhead_s": overhead}), setup, samples)["colocated.gen_s"]

    overhead = _bisect(gen, 0.0, MAX_DECODE_OVERHEAD_S, colo["gen_s"], iters=24)
    fitted = with_changes(fitted, {"rollout.decode_overhead_s": round(overhead, 6)})
    # The colocated trainer's MFU: its update and log-prob times at those lengths.
    g = setup["colocated_gpus"]
    steps = samples / sc.trainer.batch_size
    tokens, tokens_sq = _window_tokens(fitted, samples)
    train_c = TrainCost(fitted, g, recompute_logprobs=True, colocated=True)
    busy = colo["update_actor_s"] + colo["old_log_prob_s"] - steps * train_c.fixed_s
    if busy <= 0:
        lines.append(f"NO FIT: the colocated update and log-prob ({colo['update_actor_s'] + colo['old_log_prob_s']:.2f} s) are shorter "
                     f"than their fixed costs ({steps * train_c.fixed_s:.2f} s): the assumed interconnect or step overhead cannot be right")
        busy = 1e-9
    colocated_mfu = train_c.sample_flops(tokens, tokens_sq) / (train_c.peak_flops * busy)
    changes: dict[str, object] = {
        "workload.response_median": max(1, round(median)),
        "rollout.decode_overhead_s": round(overhead, 6),
        "trainer.colocated_mfu": round(min(1.0, colocated_mfu), 4),
    }
    fitted = with_changes(fitted, {"trainer.colocated_mfu": changes["trainer.colocated_mfu"]})
    # The switch: what the colocated step spends outside generation, log-probs and update.
    other = colo["step_s"] - colo["gen_s"] - colo["old_log_prob_s"] - colo["update_actor_s"]
    colo_sc = with_changes(fitted, {"resources.rollout_gpus": g // 2 + g % 2, "resources.trainer_gpus": g // 2, "sync.colocated_switch_s": 0.0})
    switch = max(0.0, other - TransferCost(colo_sc, colocated=True).seconds())
    changes["sync.colocated_switch_s"] = round(switch, 3)
    fitted = with_changes(fitted, {"sync.colocated_switch_s": changes["sync.colocated_switch_s"]})

    if sc.gpu.interconnect_gb_s is not None:
        sep_comm = steps * TrainCost(fitted, setup["trainer_gpus"]).comm_s
        lines.append(f"data-parallel collectives (assumed gpu.interconnect_gb_s {sc.gpu.interconnect_gb_s:g}, "
                     f"{samples // (sc.trainer.minibatch_size or sc.trainer.batch_size)} optimizer steps): "
                     f"{sep_comm:.2f} s of the separated update on {setup['trainer_gpus']} GPUs, "
                     f"{steps * train_c.comm_s:.2f} s of the colocated update and log-prob on {g}")
    mean_t = tokens / samples
    lines.extend(_no_fit(sc, median, overhead, colo, sep))
    lines.append(
        f"workload.response_median {changes['workload.response_median']} (sigma {sc.workload.response_sigma} assumed; "
        f"mean {mean_t - sc.workload.prompt_tokens:,.0f} response tokens): from the separated update's {sep['update_actor_s']:.2f} s"
    )
    lines.append(
        f"rollout.decode_overhead_s {1e3 * overhead:.2f} ms per decode step: from the colocated generation's "
        f"{colo['gen_s']:.2f} s (the roofline alone gives {gen(sc.rollout.decode_overhead_s):.2f} s at "
        f"{1e3 * sc.rollout.decode_overhead_s:.1f} ms)"
    )
    sep_mfu = sc.trainer.mfu
    lines.append(
        f"trainer.colocated_mfu {colocated_mfu:.3f} against {sep_mfu:.3f} separated: "
        f"{sep_mfu / colocated_mfu:.2f}x more work per GPU-second separated"
        + (" (above 100 %: clipped to 1; the assumed lengths or MFU cannot be right)" if colocated_mfu > 1 else "")
    )
    lines.append(
        f"sync.colocated_switch_s {switch:.2f} s: {other:.2f} s outside the phases less the transfer "
        f"(the switch from bytes would be {TransferCost(with_changes(colo_sc, {'sync.colocated_switch_s': None}), colocated=True).switch_s:.2f} s)"
    )
    lines.extend(_reproduced(phase_times(fitted, setup, samples), colo, sep))
    return changes, lines


def _no_fit(sc: Scenario, median: float, overhead: float, colo: dict, sep: dict) -> list[str]:
    """What the searches could not fit: each a line that says which assumption cannot be right."""
    lines = []
    if median <= 1.0 or median >= sc.workload.max_response_len:
        lines.append(f"NO FIT: no response median gives the separated update's {sep['update_actor_s']:.2f} s "
                     f"at trainer.mfu {sc.trainer.mfu}: the assumed MFU or prompt length cannot be right")
    if overhead <= 0.0 or overhead >= MAX_DECODE_OVERHEAD_S:
        lines.append(f"NO FIT: no decode step overhead in [0, {MAX_DECODE_OVERHEAD_S}] s gives the colocated generation's {colo['gen_s']:.2f} s")
    return lines


def _reproduced(model: dict, colo: dict, sep: dict) -> list[str]:
    """How well the fitted costs give back each published phase time."""
    return [
        f"{key}: model {model[key]:.2f} s, published {published:.2f} s ({100 * (model[key] / published - 1):+.1f} %)"
        for key, published in (("colocated.gen_s", colo["gen_s"]), ("colocated.old_log_prob_s", colo["old_log_prob_s"]),
                               ("colocated.update_actor_s", colo["update_actor_s"]), ("separated.update_actor_s", sep["update_actor_s"]))
    ]


def phase_times_trainer(sc: Scenario, setup: dict, samples: int) -> float:
    """The separated update time alone (cheap: no generation), for the length search."""
    tokens, tokens_sq = _window_tokens(sc, samples)
    return _separated_update_s(sc, setup["trainer_gpus"], samples / sc.trainer.batch_size, tokens, tokens_sq)


def _separated_update_s(sc: Scenario, gpus: int, steps: float, tokens: float, tokens_sq: float) -> float:
    t = TrainCost(sc, gpus, recompute_logprobs=False, colocated=False)
    return steps * t.fixed_s + t.sample_flops(tokens, tokens_sq) / t.flops
