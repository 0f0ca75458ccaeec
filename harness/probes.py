"""Two effects of the real runtimes that the sim's cost model has no term for, measured on
this machine by short probes (``harness.calibrate --probe``); they measure the machine,
never a run's held-out modes.

- The trainer's speed-up with devices: the sim scales a trainer's cost linearly with its
  devices; a torch trainer on CPU threads does not. The probe times the torch GRPO step on
  a batch of the calibrated run's own lengths (random tokens) at each device count the
  modes use, interleaved: ``calibrated.train_speedup``.
- In-process contention: the local runtime runs every engine and the trainer in one Python
  process, so what shares the interpreter lock with an engine changes its step time: sync's
  two engines on two cores slow each other more than async's one engine next to a trainer
  does. The sim's engines are independent. The probe times decode steps of the fitted mode's
  engines side by side, and of one engine next to a stepping one-device trainer (what async
  and partial run): the factor the fitted mode's decode costs are divided by.
"""

from __future__ import annotations

import asyncio
import time
from typing import Optional

import numpy as np

from core.api import Batch
from core.model.config import LearnSpec, Scenario
from core.model.model_dir import read_model_dir
from core.model.sample import Group, Sample
from core.real.engine_torch import TorchEngine
from core.real.grpo import TorchTrainBackend
from core.real.hf_model import ensure_model_dir


def probe_batch(prompt_lens: list[int], response_lens: list[int], group_size: int, batch_size: int, vocab: int, seed: int = 0) -> Batch:
    """``batch_size`` samples with the given lengths (cycled), random tokens, rewards that
    differ within each group so that every group has a gradient."""
    rng = np.random.default_rng(seed)
    groups = []
    for g in range(batch_size // group_size):
        samples = []
        for j in range(group_size):
            k = g * group_size + j
            p, r = int(prompt_lens[k % len(prompt_lens)]), max(1, int(response_lens[k % len(response_lens)]))
            s = Sample(uid=k, prompt_id=g, index=j, n_prompt=p, prompt_tokens=rng.integers(0, vocab, p))
            s.add_tokens(r, 0, [int(t) for t in rng.integers(0, vocab, r)], [-1.0] * r)
            s.reward = float(j % 2)
            s.finished = True
            samples.append(s)
        groups.append(Group(prompt_id=g, samples=samples, version=0, admitted_at=0.0))
    return Batch(groups)


def step_seconds(model_dir: str, learn: LearnSpec, batch: Batch, threads: list[int], repeats: int = 3) -> dict[int, float]:
    """Median seconds of a trainer step at each thread count (one warm-up step each first)."""
    backends = {n: TorchTrainBackend(model_dir, learn, threads=n) for n in threads}
    times: dict[int, list[float]] = {n: [] for n in threads}
    for n, be in backends.items():
        asyncio.run(be.train_step(batch, 0))
    for _ in range(repeats):
        for n, be in backends.items():  # interleaved: a load change hits every count alike
            t0 = time.perf_counter()
            asyncio.run(be.train_step(batch, 0))
            times[n].append(time.perf_counter() - t0)
    return {n: float(np.median(t)) for n, t in times.items()}


def train_speedup(sc: Scenario, prompt_lens: list[int], response_lens: list[int], fitted_devices: int, devices: list[int]) -> tuple[dict[int, float], dict[int, float]]:
    """(speed relative to ``fitted_devices``, seconds per step) for every count in ``devices``."""
    model_dir = ensure_model_dir(sc)  # the model the measured run trained
    vocab = read_model_dir(model_dir).vocab
    # Samples spread evenly over the run: lengths change as the policy learns.
    pick = np.linspace(0, len(response_lens) - 1, sc.trainer.batch_size).round().astype(int)
    batch = probe_batch([prompt_lens[i] for i in pick], [response_lens[i] for i in pick],
                        sc.workload.group_size, sc.trainer.batch_size, vocab)
    counts = sorted(set(devices) | {fitted_devices})
    secs = step_seconds(str(model_dir), sc.learn, batch, counts)
    return {n: secs[fitted_devices] / secs[n] for n in counts if n != fitted_devices}, secs


def _groups(n_groups: int, group_size: int, prompt_len: int, vocab: int, first_id: int, seed: int) -> list[Group]:
    rng = np.random.default_rng(seed)
    out = []
    for g in range(n_groups):
        prompt = rng.integers(0, vocab, prompt_len)
        samples = [Sample(uid=(first_id + g) * group_size + j, prompt_id=first_id + g, index=j, n_prompt=prompt_len,
                          prompt_tokens=prompt) for j in range(group_size)]
        out.append(Group(prompt_id=first_id + g, samples=samples, version=0, admitted_at=0.0))
    return out


async def _decode_rows(model_dir: str, engines: int, samples: int, group_size: int, prompt_len: int, max_len: int,
                       vocab: int, seed: int, trainer: Optional[tuple[TorchTrainBackend, Batch]] = None) -> list:
    """Decode steps of ``engines`` torch engines (one thread each) in this process, each
    generating ``samples`` responses at once; with ``trainer``, that trainer steps meanwhile."""
    es = [TorchEngine(f"probe{i}", model_dir, max_num_seqs=samples, seed=seed + i, threads=1) for i in range(engines)]
    await asyncio.gather(*(e.start() for e in es))
    n_groups = max(1, samples // group_size)
    stop = asyncio.Event()

    async def train() -> None:
        while not stop.is_set():
            await trainer[0].train_step(trainer[1], 0)

    side = asyncio.create_task(train()) if trainer is not None else None
    await asyncio.gather(*(
        e.generate(g, max_len)
        for i, e in enumerate(es)
        for g in _groups(n_groups, group_size, prompt_len, vocab, i * n_groups, seed + i)
    ))
    if side is not None:
        stop.set()
        await side
    return [r for e in es for r in e.decode_steps]


def engine_contention(sc: Scenario, engines: int, prompt_lens: list[int], response_lens: list[int], samples: int,
                      max_len: int, repeats: int = 3) -> tuple[float, float, float]:
    """(factor, ms per step alone, ms per step side by side): the mean decode step of the
    fitted mode's ``engines`` engines side by side in one process, over that of one engine
    in the process the other modes give it (one engine next to a one-device trainer that
    steps meanwhile), at equal batch sizes, alternated ``repeats`` times."""
    model_dir = str(ensure_model_dir(sc))
    vocab = read_model_dir(model_dir).vocab
    pick = np.linspace(0, len(response_lens) - 1, sc.trainer.batch_size).round().astype(int)
    batch = probe_batch([prompt_lens[i] for i in pick], [response_lens[i] for i in pick],
                        sc.workload.group_size, sc.trainer.batch_size, vocab)
    trainer = (TorchTrainBackend(model_dir, sc.learn, threads=1), batch)
    prompt_len = max(1, round(float(np.mean(prompt_lens))))
    alone, many = [], []
    for r in range(repeats):
        alone += asyncio.run(_decode_rows(model_dir, 1, samples, sc.workload.group_size, prompt_len, max_len, vocab, 100 * r, trainer))
        many += asyncio.run(_decode_rows(model_dir, engines, samples, sc.workload.group_size, prompt_len, max_len, vocab, 100 * r))
    # Compared at equal batch sizes: responses end at different steps in the two runs.
    a, b = np.asarray(alone, dtype=np.float64), np.asarray(many, dtype=np.float64)
    ratios, weights = [], []
    for n in np.intersect1d(a[:, 0], b[:, 0]):
        sa, sb = a[a[:, 0] == n, 2], b[b[:, 0] == n, 2]
        ratios.append(sb.mean() / sa.mean())
        weights.append(len(sb))
    factor = float(np.average(ratios, weights=weights)) if ratios else 1.0
    return factor, float(a[:, 2].mean() * 1e3), float(b[:, 2].mean() * 1e3)
