"""The analytic pipeline bound: the most trained samples per second a mode could reach with
the scenario's GPUs, its cost model and the concurrency its staleness budget allows.

Everything is per sync window of W samples (one version).

Rollout: allowed = min(max_concurrency, (1 + lead) * W) samples may be in flight (W for
sync), routed as whole groups of n: min(engines, allowed / n) engines each decode a steady
full batch B = min(max_num_seqs, ceil(allowed / n / busy engines) * n). A
running sequence holds on average P + E[L^2] / (2 E[L]) context tokens (long responses
stay in the batch longer), so an engine finishes one sample every
E[L] * step(B, B * ctx) / B seconds, plus its share of the group's prompt prefill.

Training: one sample costs k (2 N E[T] + 2 layers * hidden * E[T^2]) / (GPUs * peak * MFU), k = 3 passes
(forward + backward), 4 where the mode recomputes log-probs,
T = prompt + response tokens, plus the per-step overhead spread over the batch.

Staleness budget: rollout may only admit groups while admitted <= (version + 1 + lead) * W,
so the trainer often waits for groups admitted at the last version bump, and a straggler
admitted long ago holds budget until it finishes. The bound plays the run out at group
level: each group, in the run's own prompt order, is admitted as soon as the budget allows
and finishes when its longest response does, on the fastest clock it can have: alone on
an engine (groups are routed whole, and any other sequence on the engine only makes a step
slower), reaching decode step k after sum_{i<k} step(B(i), B(i) * (P + i)) seconds, B(i)
being its members longer than i. The trainer takes groups in finishing order and trains each
step at its exact FLOP cost; for a run's trained set, also in the run's own order (in which
every step of the played-out run ends no later than the run's), and the faster is the bound.
In partial mode every group still generating at a sync is paused for the transfer and
prefilled again (the cost model recomputes KV after a weight
update), that stall spread evenly over the engines (in inflight mode they are paused for the
transfer only); how far each group got is read off a
shared cohort clock (a cohort of window / engines sequences thinning by the whole length
distribution), an estimate.

Left out, which makes the bound higher: engines shared between groups, prefill of other
groups, an uneven spread of re-prefill. The stall estimate can err either way; with a
replay ring the draw can be cheaper than the ring's mean (below). What the budget adds to
the bare steps is reported as the version bubble.

Separated (async, partial, inflight): the lower of W / (W / rollout + transfer) and the played-out
run's rate. Colocated sync: W / rollout + W * train + transfer, in turn.
The bound is for the workload it is given: the planned one, or (harness.metrics.bounds) the
groups a run trained, which are shorter than planned when it evicts stale samples.
With a replay stage, a step trains ``reuse`` times as many samples as it takes fresh from
rollout: the rollout terms and the budget count fresh samples (W = fresh per window), the
training terms count trained ones, replayed groups costing what fresh ones cost on average,
and the rates are trained samples per second. The first step takes a whole batch fresh
to fill the ring, which the budget admits on top of the windows, as the Rollouter does.
The played-out run keeps the ring too (the last ``capacity_groups`` fresh groups) and prices
each step at the ring's mean group: the expected cost of the draw. Given ``draws`` (the
tokens and squared tokens each step of a run actually trained, ``step_draws``), every step is
priced at its own draw instead, as a run without replay is priced at its own groups: priced
at the draws' mean, a run whose long draws fall where the trainer would have waited anyway
beat its bound (by 3.4 % with two-valued lengths and a ring of one batch).
``resource_samples_per_s`` drops the staleness-budget term: what the GPUs could do if
rollout were free to run ahead.
With a filter or over-provisioning, admission runs beyond the budget (by 1 / min_pass_rate,
plus the surplus) and the bound lets the trained groups use all of it; it leaves out the
generation of groups filtered or cut, so it stays an upper bound, a looser one.
The bound assumes every engine always holds a full batch. The long tail is what breaks
that in sync mode (a few long responses keep a window open while most engines idle), and
the drain at each sync is what breaks it in async mode.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from dataclasses import asdict, dataclass

import numpy as np

from core.model.config import Placement, Scenario
from core.model.run_plan import RunPlan
from core.sim.costs import DecodeCost, TrainCost, TransferCost
from core.sim.workload import Workload


@dataclass(frozen=True)
class Bound:
    trained_samples_per_s: float
    resource_samples_per_s: float
    rollout_samples_per_s: float
    trainer_samples_per_s: float
    version_bubble_s: float
    batch_per_engine: int
    limited_by: str
    tokens_per_sample: float  # prompt + response tokens of the mean sample of the workload played out

    @property
    def trained_tokens_per_s(self) -> float:
        return self.trained_samples_per_s * self.tokens_per_sample

    def as_dict(self) -> dict:
        return {**asdict(self), "trained_tokens_per_s": self.trained_tokens_per_s}


# Groups in flight at a sync: paused for the transfer (inflight), or paused and prefilled again
# (partial). The bound lets async's go on (its drain is what the bound leaves out).
PAUSE_IN_BOUND = {"partial": "abort", "inflight": "keep"}


def planned_lengths(sc: Scenario) -> np.ndarray:
    """Response lengths of the workload a run plans, one row per group in prompt order."""
    prompts = min(262144, max(1024, sc.trainer.steps * sc.trainer.batch_size // sc.workload.group_size))
    return Workload.of(sc).sample_lengths(prompts)


def trained_lengths(sc: Scenario, prompt_ids) -> np.ndarray | None:
    """Response lengths of the groups ``prompt_ids`` (each once, in prompt order): those a
    run trained or generated in full; None if none."""
    ids = np.unique(np.fromiter(prompt_ids, dtype=np.int64))
    if not len(ids):
        return None
    return Workload.of(sc).sample_lengths(int(ids[-1]) + 1)[ids]


def trained_order(prompt_ids: list[int]) -> np.ndarray:
    """The rows of ``trained_lengths(sc, prompt_ids)`` in the order ``prompt_ids`` were trained
    (each group once: a run without replay)."""
    ids = np.asarray(prompt_ids, dtype=np.int64)
    return np.searchsorted(np.unique(ids), ids)


def step_draws(sc: Scenario, prompt_ids: list[int]) -> np.ndarray:
    """(prompt + response) tokens and their squares that each trainer step trained, one row
    a step: ``prompt_ids`` are the groups in the order trained (a replayed group again each
    time), ``groups_per_step`` of them a step."""
    g = sc.groups_per_step
    ids = np.asarray(prompt_ids, dtype=np.int64)[: len(prompt_ids) // g * g]
    if not len(ids):
        return np.zeros((0, 2))
    t = (sc.workload.prompt_tokens + Workload.of(sc).sample_lengths(int(ids.max()) + 1)[ids]).astype(np.float64)
    per_group = np.stack((t.sum(axis=1), (t**2).sum(axis=1)), axis=1)
    return per_group.reshape(-1, g, 2).sum(axis=1)


def pipeline_bound(
    sc: Scenario, mode: str, lengths: np.ndarray | None = None, draws: np.ndarray | None = None,
    order: np.ndarray | None = None,
) -> Bound:
    """The bound for the planned workload, or for ``lengths`` (groups x responses, in the order
    they are admitted): a run that evicts or cannot finish long samples trains a shorter set,
    whose own bound is higher; its efficiency is measured against that one. ``draws``: with a
    replay ring, the (prompt + response) tokens and squared tokens each step of a run trained
    (``step_draws``), each training counted. ``order``: without replay, the rows of ``lengths``
    in the order a run trained them; the run is played out twice, its trainer taking groups in
    finishing order and in that order, and the faster of the two is the bound."""
    run_plan = RunPlan.of(sc, mode)
    place, lead = run_plan.placement, run_plan.lead
    over, surplus = 1.0 / run_plan.pass_floor, run_plan.surplus
    w = sc.workload
    lengths = (planned_lengths(sc) if lengths is None else lengths).astype(np.float64)
    mean_l, mean_l2 = float(lengths.mean()), float((lengths**2).mean())
    p = float(w.prompt_tokens)
    window = sc.window  # fresh samples per version
    trained_window = sc.trainer.batch_size * sc.trainer.sync_every

    allowed = sc.rollout.max_concurrency or max(w.group_size, place.engines * sc.rollout.max_num_seqs)
    allowed = min(allowed, math.floor((1 + lead) * window * over + 1e-9) + surplus)
    # Groups are routed whole: too few of them leave engines empty and fill the others.
    groups = max(1, allowed // w.group_size)
    busy = min(place.engines, groups)
    batch = min(sc.rollout.max_num_seqs, math.ceil(groups / busy) * w.group_size)
    decode = DecodeCost(sc, place.gpus_per_engine, colocated=place.colocated)
    step = decode.step_s(batch, batch * (p + mean_l2 / (2 * mean_l)))
    prefill = decode.prefill_s(0, w.prompt_tokens)
    rollout = busy / (mean_l * step / batch + prefill / w.group_size)

    train = TrainCost(sc, place.trainer_gpus, mode in sc.trainer.recompute_logprobs, colocated=place.colocated)
    mean_t = p + mean_l
    mean_t2 = p * p + 2 * p * mean_l + mean_l2
    if draws is not None and (not len(draws) or not sc.replay.enabled):
        draws = None
    if draws is not None:
        mean_t, mean_t2 = draws.sum(axis=0) / (len(draws) * sc.trainer.batch_size)
    if train.micro is None:
        train_per_sample = train.sample_flops(mean_t, mean_t2) / train.flops + train.fixed_s / sc.trainer.batch_size
        if train.alltoall_s_per_token:  # an expert-parallel trainer's all-to-alls
            train_per_sample += train.alltoall_s_per_token * mean_t
    else:  # micro-batches: a step is not linear in its tokens, so a whole step of the mean sample
        bs = sc.trainer.batch_size
        train_per_sample = train.step_s(bs * mean_t, bs * mean_t2) / bs
    transfer = TransferCost(sc, colocated=place.colocated).seconds()

    if place.colocated:
        window_s = window / rollout + trained_window * train_per_sample + transfer
        resource_s = window_s
        bubble = 0.0
        limited = "serial generate + train"
    else:
        cohort = max(1, min(sc.rollout.max_num_seqs, math.ceil(window / place.engines)))
        reach = _cohort_clock(np.sort(lengths.ravel()), cohort, decode, p)
        whole = lengths.astype(np.int64)
        played = [
            _budget_paced_run(
                sc, whole, reach, decode, place.engines, train, transfer, lead,
                pause=PAUSE_IN_BOUND.get(mode), draws=draws, order=taken, over=over, surplus=surplus,
            )
            for taken in ([None] if order is None or sc.replay.enabled else [None, order])
        ]
        paced_s, busy_s = min(played)  # the faster: each order is a schedule the GPUs could run
        per_window = sc.trainer.sync_every / sc.trainer.steps
        paced_window_s = paced_s * per_window  # trainer paced by the budget
        busy_window_s = busy_s * per_window  # trainer never waiting for data
        roll_s = window / rollout + transfer
        window_s = max(roll_s, paced_window_s)
        resource_s = max(roll_s, busy_window_s)
        bubble = max(0.0, paced_window_s - busy_window_s)
        limited = "rollout" if roll_s > paced_window_s else ("trainer + version bubble" if bubble > 0 else "trainer")
    return Bound(
        float(trained_window / window_s), float(trained_window / resource_s), float(rollout),
        float(1.0 / train_per_sample),
        float(bubble), batch, limited, float(mean_t),
    )


def _cohort_clock(sorted_lengths: np.ndarray, cohort: int, decode: DecodeCost, prompt: float) -> np.ndarray:
    """Seconds for a cohort of ``cohort`` sequences, started together, to reach each step."""
    top = int(sorted_lengths[-1])
    k = np.arange(top + 1)
    alive = 1.0 - np.searchsorted(sorted_lengths, k, side="right") / len(sorted_lengths)
    running = cohort * alive
    step = decode.base_s_many(running)
    step += decode.kv_s_per_token * running * (prompt + k)
    return np.concatenate(([0.0], np.cumsum(step)))


def _lone_group_s(lengths: np.ndarray, decode: DecodeCost, prompt: float) -> np.ndarray:
    """Seconds each group takes to decode alone on an engine: the fastest it can finish, since
    groups are routed whole and any other sequence on the engine only slows a step. Step i
    runs the B(i) members longer than i, holding B(i) (prompt + i) context tokens; between two
    members' lengths B is constant, so the sum is closed-form per segment."""
    ends = np.sort(lengths, axis=1).astype(np.float64)
    starts = np.concatenate((np.zeros((len(ends), 1)), ends[:, :-1]), axis=1)
    seg = ends - starts
    running = np.arange(ends.shape[1], 0, -1, dtype=np.float64)  # members alive in each segment
    steps = seg * decode.base_s_many(running)
    context = seg * prompt + (starts + ends - 1.0) * seg / 2.0
    return (steps + decode.kv_s_per_token * running * context).sum(axis=1)


def _take_in_order(ready: list, idx: np.ndarray, t: float) -> tuple[list[int], float]:
    """The groups ``idx`` off the heap ``ready`` for a step, and when it can start: once the
    trainer is free (``t``) and the last of them has finished. The played-out run trains a
    run's groups in the run's own order: with every group generated at least as fast as the
    run could and every step's groups the same, each step starts and ends no later than the
    run's, and so does each version bump and the admission it opens (taken in finishing
    order, a run whose trainer happened to take cheap groups first beat the bound by 2.8 %:
    async, lengths at the floor or the cap, so that groups finish together and which of them
    a step trains decides when the next window is admitted)."""
    want = {int(g) for g in idx}
    finish = {g: f for f, g in ready if g in want}
    if len(finish) < len(want):
        raise ValueError(f"the run trained groups {sorted(want - set(finish))} before the bound admitted them")
    ready[:] = [(f, g) for f, g in ready if g not in want]
    heapq.heapify(ready)
    return [int(g) for g in idx], max(t, max(finish.values()))


def _budget_paced_run(sc: Scenario, lengths: np.ndarray, reach: np.ndarray, decode: DecodeCost, engines: int,
                      train: TrainCost, transfer: float, lead: float, pause: str | None,
                      draws: np.ndarray | None = None, order: np.ndarray | None = None,
                      over: float = 1.0, surplus: int = 0) -> tuple[float, float]:
    """Seconds the run takes when only the staleness budget and training pace it, and the
    seconds of it the trainer is busy (steps and transfers).

    With ``pause`` every group still generating at a sync is paused for the transfer: "keep"
    (inflight) only that; "abort" (partial rollout) then prefills it again, as the cost model
    charges: its prompt once and every unfinished response's tokens so far, spread evenly over
    the engines. Groups admitted at the bump queue behind that re-prefill. ``over`` and
    ``surplus``: what admission may run beyond the budget (a filter's expected pass rate,
    over-provisioning); the bound lets the trained groups use it all."""
    n = sc.workload.group_size
    p = sc.workload.prompt_tokens
    prefill = decode.prefill_s(0, p)
    per_step = sc.fresh_groups_per_step
    trained_groups = sc.groups_per_step
    warm_up = sc.warm_up_groups
    ring = deque(maxlen=sc.replay.capacity_groups) if sc.replay.enabled else None  # groups the replay ring holds
    window_groups = sc.window / n
    plan = sc.trainer.steps * per_step + warm_up
    finish_offset = prefill + _lone_group_s(lengths, decode, p)
    tokens = (p + lengths).sum(axis=1).astype(np.float64)
    tokens_sq = ((p + lengths).astype(np.float64) ** 2).sum(axis=1)
    started = np.zeros(len(lengths))  # when the group's cohort clock started, pauses included
    ready: list[tuple[float, int]] = []
    admitted = 0
    t = 0.0
    engines_free = 0.0  # new groups start behind the re-prefill of resumed ones
    version = 0
    busy = 0.0
    mean_draw = draws.mean(axis=0) if draws is not None and len(draws) else None
    for step in range(sc.trainer.steps):
        limit = min(plan, math.floor((version + 1 + lead) * window_groups * over + 1e-9) + warm_up + surplus // n)
        while admitted < limit:
            g = admitted % len(lengths)
            started[g] = max(t, engines_free)
            heapq.heappush(ready, (started[g] + float(finish_offset[g]), g))
            admitted += 1
        k = per_step + (warm_up if step == 0 else 0)
        if order is not None and (step + 1) * k <= len(order):
            idx, start = _take_in_order(ready, order[step * k : (step + 1) * k], t)
        else:
            batch = [heapq.heappop(ready) for _ in range(k)]
            start = max(t, batch[-1][0])
            idx = [g for _, g in batch]
        if ring is None:
            dt = train.step_s(float(tokens[idx].sum()), float(tokens_sq[idx].sum()))
        elif draws is not None and step < len(draws):  # the run's own draw for this step
            dt = train.step_s(float(draws[step, 0]), float(draws[step, 1]))
        elif draws is not None:  # past the steps the run trained: their mean
            dt = train.step_s(float(mean_draw[0]), float(mean_draw[1]))
        else:  # the step trains a draw from the ring: priced at the ring's mean group
            ring.extend(idx)
            dt = train.step_s(trained_groups * float(tokens[ring].mean()), trained_groups * float(tokens_sq[ring].mean()))
        t = start + dt
        busy += dt
        if (step + 1) % sc.trainer.sync_every == 0 and step + 1 < sc.trainer.steps:
            version += 1
            paused_at = t
            t += transfer
            busy += transfer
            if pause is not None:
                stall = 0.0
                for finish, g in ready if pause == "abort" else ():
                    if finish <= paused_at:
                        continue
                    done = int(np.searchsorted(reach, paused_at - started[g] - prefill, side="right")) - 1
                    if done > 0:
                        open_members = int((lengths[g] > done).sum())
                        stall += decode.prefill_s(0, p + done) + (open_members - 1) * decode.prefill_s(p, p + done)
                stall /= engines
                for j, (finish, g) in enumerate(ready):
                    if finish > paused_at:
                        ready[j] = (finish + transfer + stall, g)
                        started[g] += transfer + stall
                heapq.heapify(ready)
                engines_free = t + stall
    return t, busy
