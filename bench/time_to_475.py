"""Time to solve CartPole-v1 (mean greedy return >= 475 over 100 episodes): stable-baselines3's
DQN and PPO beside asyncrl's in sync and async mode, with the same settings, in one process run.

    python bench/time_to_475.py [--learners dqn ppo] [--seeds 0 1 2] [--json OUT.json]
                                [--also-async KEY=VALUE ...]

``--also-async ppo.lag_correction=vtrace env.hold_for_eval=false`` adds one async run per
change, each the scenario with that one setting changed, beside the others in the same run.

asyncrl runs scenarios/cartpole-dqn.yaml and scenarios/cartpole-ppo.yaml, as a user would.

PPO: every implementation gets rl-zoo's tuned CartPole PPO (hyperparams/ppo.yml: 8 envs x 32
steps, 20 epochs of one 256-row minibatch, gamma 0.98, GAE lambda 0.8, lr 1e-3 and clip 0.2
both falling linearly to 0 over 100,000 steps) on SB3's default policy (64x64 tanh, separate
policy and value nets). asyncrl's async mode acts one version behind its learner and corrects
with V-trace (docs/env.md).

DQN: every implementation gets rl-zoo's tuned CartPole DQN (hyperparams/dqn.yml: 256x256, lr
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
from core.runtimes.local_env import run_sync  # noqa: E402
from core.env.wiring import EVAL_SEED  # noqa: E402
from core.runtimes.ray_start import start_cluster  # noqa: E402
from core.runtimes.ray_env import run_async  # noqa: E402
from harness.scenario import ScenarioError, load  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
ENVS, EVAL_EVERY, TARGET = 8, 5_000, 475.0
BUDGET = {"dqn": 50_000, "ppo": 100_000}


def _timed(seed: int):
    """An SB3 callback that evaluates every EVAL_EVERY env steps as asyncrl does, clock stopped."""
    from stable_baselines3.common.callbacks import BaseCallback

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

    return Timed()


def sb3_dqn(seed: int) -> dict:
    """SB3's DQN with the zoo's settings on 8 envs; train_freq counts vector steps, so 32 of them
    are the zoo's 256 transitions."""
    from stable_baselines3 import DQN
    from stable_baselines3.common.env_util import make_vec_env

    env = make_vec_env("CartPole-v1", n_envs=ENVS, seed=seed)
    model = DQN(
        "MlpPolicy", env, learning_rate=2.3e-3, batch_size=64, buffer_size=100_000, learning_starts=1_000,
        gamma=0.99, target_update_interval=10, train_freq=256 // ENVS, gradient_steps=128,
        exploration_fraction=0.16, exploration_final_eps=0.04, policy_kwargs={"net_arch": [256, 256]},
        seed=seed, verbose=0,
    )
    cb = _timed(seed)
    model.learn(total_timesteps=BUDGET["dqn"], callback=cb)
    return _row("sb3 DQN", seed, cb.curve)


def sb3_ppo(seed: int) -> dict:
    """SB3's PPO with the zoo's settings on 8 envs (n_steps counts vector steps: 32 x 8 = 256)."""
    from stable_baselines3 import PPO
    from stable_baselines3.common.env_util import make_vec_env

    env = make_vec_env("CartPole-v1", n_envs=ENVS, seed=seed)
    model = PPO(
        "MlpPolicy", env, n_steps=32, batch_size=256, n_epochs=20, gamma=0.98, gae_lambda=0.8, ent_coef=0.0,
        learning_rate=lambda left: 1e-3 * left, clip_range=lambda left: 0.2 * left, seed=seed, verbose=0,
    )
    cb = _timed(seed)
    model.learn(total_timesteps=BUDGET["ppo"], callback=cb)
    return _row("sb3 PPO", seed, cb.curve)


def scenario(learner: str, change: str = ""):
    """The learner's CartPole scenario, with one ``KEY=VALUE`` change (refused here if bad)."""
    sc = load(ROOT / "scenarios" / f"cartpole-{learner}.yaml", [change] if change else [])
    assert sc.env.env_steps == BUDGET[learner] and sc.env.eval_every == EVAL_EVERY
    return sc


def asyncrl(learner: str, mode: str, seed: int, change: str = "") -> dict:
    sc = scenario(learner, change)
    curve = asyncio.run(run_sync(sc, seed)) if mode == "sync" else run_async(sc, seed)
    name = f"asyncrl {learner.upper()} {mode}" + (f" {change}" if change else "")
    return _row(name, seed, list(zip(curve.env_steps, curve.wall_s, curve.eval_return)))


def _row(name: str, seed: int, curve: list[tuple[int, float, float]]) -> dict:
    hit = next((c for c in curve if c[2] >= TARGET), None)
    return {"impl": name, "seed": seed, "time_to_475_s": hit[1] if hit else None,
            "env_steps_to_475": hit[0] if hit else None, "curve": curve}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--learners", nargs="+", choices=("dqn", "ppo"), default=["dqn", "ppo"])
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--json", type=Path)
    p.add_argument("--also-async", nargs="+", default=[], metavar="KEY=VALUE",
                   help="one more async run per change, e.g. ppo.lag_correction=vtrace")
    args = p.parse_args()
    for change in args.also_async:
        if "=" not in change:
            p.error(f"--also-async {change!r}: expected KEY=VALUE, e.g. ppo.lag_correction=vtrace")
        for learner in args.learners:
            try:
                scenario(learner, change)
            except ScenarioError as err:
                p.error(str(err))
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    start_cluster(None, None)
    rows = []
    sb3 = {"dqn": sb3_dqn, "ppo": sb3_ppo}
    for seed in args.seeds:
        for learner in args.learners:
            runs = [lambda: sb3[learner](seed), lambda: asyncrl(learner, "sync", seed), lambda: asyncrl(learner, "async", seed)]
            runs += [lambda c=c: asyncrl(learner, "async", seed, c) for c in args.also_async]
            for run in runs:
                torch.set_num_threads(1)  # every learner on one core, as asyncrl's learner actor is
                rows.append(run())
                r = rows[-1]
                t = "not reached" if r["time_to_475_s"] is None else f"{r['time_to_475_s']:.1f} s, {r['env_steps_to_475']:,} env steps"
                print(f"seed {seed}  {r['impl']:<40} {t}", flush=True)
    print()
    for impl in dict.fromkeys(r["impl"] for r in rows):
        ts = [r["time_to_475_s"] for r in rows if r["impl"] == impl]
        got = [t for t in ts if t is not None]
        spread = f"{np.mean(got):.1f} s ({min(got):.1f}..{max(got):.1f})" if got else "-"
        steps = [r["env_steps_to_475"] for r in rows if r["impl"] == impl and r["env_steps_to_475"] is not None]
        mean_steps = f"{np.mean(steps):,.0f}" if steps else "-"
        print(f"{impl:<40} reached {len(got)}/{len(ts)}  time to 475: {spread}  env steps: {mean_steps}")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
