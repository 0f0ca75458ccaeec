"""Time to solve CartPole-v1 (mean greedy return >= 475 over 100 episodes): stable-baselines3's
DQN beside asyncrl's DQN in sync and async mode, with the same settings, in one process run.

    python bench/time_to_475.py [--seeds 0 1 2] [--json OUT.json]

Every implementation gets rl-zoo's tuned CartPole DQN (hyperparams/dqn.yml: 256x256, lr
2.3e-3, batch 64, buffer 100k, learning from 1,000 transitions, 128 gradient steps per 256
transitions, epsilon 1 -> 0.04 over 8,000 steps, the target net refreshed before each burst
of updates) on 8 environments. Every implementation is evaluated with the same function
(``core.env.evaluation.episode_returns``: 100 episodes, one per environment, greedy) every
5,000 env steps, and its clock stops while it evaluates. asyncrl adds 3-step rows and
prioritized replay (its defaults); SB3's DQN has neither. Not part of ``make test``: a run takes
minutes, and what it measures belongs in docs/results.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from core.env.evaluation import episode_returns  # noqa: E402
from core.env.sync_loop import run_sync  # noqa: E402
from core.env.wiring import EVAL_SEED  # noqa: E402
from core.model.env_config import EnvScenario  # noqa: E402
from core.runtimes.ray import start_cluster  # noqa: E402
from core.runtimes.ray_env import run_async  # noqa: E402

ENVS, EVAL_EVERY, TARGET, BUDGET = 8, 5_000, 475.0, 50_000


def sb3_dqn(seed: int) -> dict:
    """SB3's DQN with the zoo's settings on 8 envs; train_freq counts vector steps, so 32 of them
    are the zoo's 256 transitions."""
    from stable_baselines3 import DQN
    from stable_baselines3.common.callbacks import BaseCallback
    from stable_baselines3.common.env_util import make_vec_env

    class Timed(BaseCallback):
        def __init__(self) -> None:
            super().__init__()
            self.next_eval, self.eval_s, self.hit = EVAL_EVERY, 0.0, None
            self.curve: list[tuple[int, float, float]] = []

        def _on_training_start(self) -> None:
            self.t0 = time.perf_counter()

        def _on_step(self) -> bool:
            if self.num_timesteps < self.next_eval:
                return True
            self.next_eval += EVAL_EVERY
            start = time.perf_counter()
            act = lambda obs: self.model.predict(obs, deterministic=True)[0]  # noqa: E731
            score = float(episode_returns(act, "CartPole-v1", 100, seed * 7919 + EVAL_SEED).mean())
            self.curve.append((self.num_timesteps, start - self.t0 - self.eval_s, score))
            self.eval_s += time.perf_counter() - start
            return score < TARGET

    env = make_vec_env("CartPole-v1", n_envs=ENVS, seed=seed)
    model = DQN(
        "MlpPolicy", env, learning_rate=2.3e-3, batch_size=64, buffer_size=100_000, learning_starts=1_000,
        gamma=0.99, target_update_interval=10, train_freq=256 // ENVS, gradient_steps=128,
        exploration_fraction=0.16, exploration_final_eps=0.04, policy_kwargs={"net_arch": [256, 256]},
        seed=seed, verbose=0,
    )
    cb = Timed()
    model.learn(total_timesteps=BUDGET, callback=cb)
    return _row("sb3 DQN", seed, cb.curve)


def asyncrl(mode: str, seed: int) -> dict:
    sc = EnvScenario()
    curve = asyncio.run(run_sync(sc, seed)) if mode == "sync" else run_async(sc, seed)
    return _row(f"asyncrl {mode}", seed, list(zip(curve.env_steps, curve.wall_s, curve.eval_return)))


def _row(name: str, seed: int, curve: list[tuple[int, float, float]]) -> dict:
    hit = next((c for c in curve if c[2] >= TARGET), None)
    return {"impl": name, "seed": seed, "time_to_475_s": hit[1] if hit else None,
            "env_steps_to_475": hit[0] if hit else None, "curve": curve}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    start_cluster(None, None)
    rows = []
    for seed in args.seeds:
        for run in (lambda: sb3_dqn(seed), lambda: asyncrl("sync", seed), lambda: asyncrl("async", seed)):
            torch.set_num_threads(1)  # every learner on one core, as asyncrl's learner actor is
            rows.append(run())
            r = rows[-1]
            t = "not reached" if r["time_to_475_s"] is None else f"{r['time_to_475_s']:.1f} s, {r['env_steps_to_475']:,} env steps"
            print(f"seed {seed}  {r['impl']:<14} {t}", flush=True)
    print()
    for impl in dict.fromkeys(r["impl"] for r in rows):
        ts = [r["time_to_475_s"] for r in rows if r["impl"] == impl]
        got = [t for t in ts if t is not None]
        spread = f"{np.mean(got):.1f} s ({min(got):.1f}..{max(got):.1f})" if got else "-"
        print(f"{impl:<14} reached {len(got)}/{len(ts)}  time to 475: {spread}")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
