"""One GRPO trainer step on 1 rank against 2 data-parallel ranks (gloo, 2 processes), on the same
batch, in one run: step time, the difference of loss and weights after the first step, and the
time in collectives.

    python bench/bench_trainer_ranks.py [--steps 5] [--groups 8] [--layers 2]

Configurations, each from the same initial weights and on the same batch:

* ``1 rank x 1 thread``   the baseline every 2-rank figure is compared with (same math, one process)
* ``1 rank x 2 threads``  the same cores as 2 ranks of 1 thread each, used by one process
* ``2 ranks x 1 thread``  2 processes, gloo over loopback

Per step, 2 ranks report ``comm_s`` (every collective of the step, waiting for the slower rank
included) and, after a barrier, the time of one all-reduce of the whole gradient alone. The
step-1 loss and weights of 2 ranks are compared with the 1-rank-1-thread step 1. Step time is the
median over ``--steps`` steps after one warm-up step (the weights move between steps; each
configuration sees the same sequence).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import pickle
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def _batch(model_dir: Path, groups: int, n: int, seed: int):
    """Whole groups of n responses: random prompts and responses from the model's vocabulary,
    behaviour log-probs near the model's, spread rewards (one group all equal: no signal)."""
    from core.api import Batch
    from core.model.sample import Group, Sample
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(model_dir).vocab_size
    rng = np.random.default_rng(seed)
    out, uid = [], 0
    for g in range(groups):
        samples = []
        prompt = rng.integers(3, vocab, 12).astype(np.int64)
        for j in range(n):
            L = int(rng.integers(24, 64))
            s = Sample(uid=uid, prompt_id=g, index=j, n_prompt=len(prompt), prompt_tokens=prompt)
            s.add_tokens(L, 0, rng.integers(3, vocab, L).tolist(), (-np.log(vocab) + rng.normal(0, 0.3, L)).tolist())
            s.reward = 0.5 if g == groups - 1 else float(rng.random())
            s.finished = True
            samples.append(s)
            uid += 1
        out.append(Group(prompt_id=g, samples=samples, version=0, admitted_at=0.0))
    return Batch(out)


def _steps(backend, batch, steps: int, time_allreduce: bool):
    """Warm-up + ``steps`` steps; per step (seconds, comm seconds, grad all-reduce seconds),
    and the step-1 (loss, weights)."""
    import torch

    ranks = backend.ranks
    rows, first = [], None
    for i in range(steps + 1):
        ranks.sum_(torch.zeros(1))  # a barrier: every rank starts the step together
        t0 = time.perf_counter()
        learned = backend.learn_part(backend.shards(copy.deepcopy(batch))[ranks.rank])
        dt = time.perf_counter() - t0
        info = backend.summary(batch, 0, learned, dt)
        if i == 0:
            first = (info["loss"], backend.weights())
        ar = 0.0
        if time_allreduce:
            params = list(backend.model.parameters())
            for p in params:
                p.grad = torch.ones_like(p)
            ranks.sum_(torch.zeros(1))
            t1 = time.perf_counter()
            ranks.sum_grads(params)
            ar = time.perf_counter() - t1
            for p in params:
                p.grad = None
        if i:
            rows.append((dt, info["comm_s"], ar))
    return rows, first


def _rank_main(rank: int, port: int, model_dir: str, batch_path: str, steps: int, out: str) -> None:
    from core.model.config import LearnSpec
    from core.real.grpo import TorchTrainBackend
    from core.real.rank_group import RankGroup

    batch = pickle.loads(Path(batch_path).read_bytes())
    ranks = RankGroup.join(f"127.0.0.1:{port}", rank, 2, "cpu", 120)
    b = TorchTrainBackend(model_dir, LearnSpec(), threads=1)
    b.join(ranks)
    rows, first = _steps(b, batch, steps, time_allreduce=True)
    ranks.leave()
    Path(f"{out}.{rank}").write_bytes(pickle.dumps((rows, first)))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--groups", type=int, default=8)
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--layers", type=int, default=2)
    args = ap.parse_args()
    import torch

    from core.model.config import LearnSpec, TinyModelSpec
    from core.real.grpo import TorchTrainBackend
    from core.real.tiny_model import ensure

    with tempfile.TemporaryDirectory(prefix="asyncrl-bench-ranks-") as tmp:
        model_dir = ensure(Path(tmp) / "tiny", TinyModelSpec(path=str(Path(tmp) / "tiny"), layers=args.layers))
        batch = _batch(model_dir, args.groups, args.group_size, 0)
        batch_path = Path(tmp) / "batch.pkl"
        batch_path.write_bytes(pickle.dumps(batch))
        results = {}
        for threads in (1, 2):
            torch.set_num_threads(threads)
            b = TorchTrainBackend(model_dir, LearnSpec(), threads=threads)
            results[f"1x{threads}"] = _steps(b, batch, args.steps, time_allreduce=False)
        params = b.params
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        out = str(Path(tmp) / "ranks")
        ctx = torch.multiprocessing.get_context("spawn")
        procs = [ctx.Process(target=_rank_main, args=(r, port, str(model_dir), str(batch_path), args.steps, out)) for r in range(2)]
        for p in procs:
            p.start()
        for p in procs:
            p.join()
        if any(p.exitcode for p in procs):
            raise SystemExit(f"a rank failed: exit codes {[p.exitcode for p in procs]}")
        r0, r1 = (pickle.loads(Path(f"{out}.{r}").read_bytes()) for r in range(2))

    def med(rows, k):
        return float(np.median([r[k] for r in rows]))

    base_rows, (loss1, w1) = results["1x1"]
    rows2, (loss2, w2) = r0
    _, (_, w2b) = r1
    tokens = sum(len(s.prompt_tokens) + len(s.response_tokens) for g in batch.groups for s in g.samples)
    report = {
        "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip(),
        "params": params,
        "groups": args.groups,
        "samples": args.groups * args.group_size,
        "tokens": tokens,
        "steps_timed": args.steps,
        "cpus": os.cpu_count(),
        "step_s_1rank_1thread": med(base_rows, 0),
        "step_s_1rank_2threads": med(results["1x2"][0], 0),
        "step_s_2ranks_1thread": med(rows2, 0),
        "comm_s_per_step_2ranks": med(rows2, 1),
        "grad_allreduce_s_2ranks": med(rows2, 2),
        "loss_abs_diff_step1": abs(loss2 - loss1),
        "weight_max_abs_diff_step1": max(float(np.abs(w2[n] - w1[n]).max()) for n in w1),
        "ranks_weights_identical": all(np.array_equal(w2[n], w2b[n]) for n in w2),
    }
    report["speedup_2ranks_vs_1rank_1thread"] = report["step_s_1rank_1thread"] / report["step_s_2ranks_1thread"]
    report["speedup_2ranks_vs_1rank_2threads"] = report["step_s_1rank_2threads"] / report["step_s_2ranks_1thread"]
    print(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
