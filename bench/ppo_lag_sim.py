"""PPO's lag corrections in one process: the sampler acts with the weights from ``--lag``
versions before the learner's, deterministically, so the algorithm's cost of lag is measured
apart from async mode's timing (which varies from run to run).

    python bench/ppo_lag_sim.py [--lags 0 1 2] [--corrections clip vtrace] [--seeds 0 ... 9]

Each run is scenarios/cartpole-ppo.yaml's sync loop (rl-zoo's CartPole PPO) with that one
change, evaluated every 5,000 env steps (100 greedy episodes, the newest weights) until a mean
return of 475; it prints the env steps to 475 per seed. Not part of ``make test``: it takes
minutes, and what it measures belongs in docs/results.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Optional

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from core.env.segment_queue import batch_columns  # noqa: E402
from core.env.evaluation import greedy_return  # noqa: E402
from core.env.wiring import make_learner, make_policy, make_sampler  # noqa: E402
from harness.scenario import load  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


def env_steps_to_target(correction: str, lag: int, seed: int) -> Optional[int]:
    sc = load(ROOT / "scenarios" / "cartpole-ppo.yaml", [f"ppo.lag_correction={correction}"])
    policy = make_policy(sc, seed, 0)
    sampler = make_sampler(sc, seed, 0, policy)
    learner = make_learner(sc, seed)
    newest = make_policy(sc, seed, 1)  # what is evaluated: the learner's latest weights
    evaluate = greedy_return(sc, seed)
    versions = [learner.weights()]
    policy.set_weights(versions[0], 0)
    v = 0
    next_eval = sc.env.eval_every
    try:
        while sampler.env_steps < sc.env.env_steps:
            chunk = sampler.collect()
            learner.learn(batch_columns([chunk]), sampler.env_steps)
            v += 1
            versions.append(learner.weights())
            if len(versions) > lag + 1:  # the oldest kept is the one the sampler acts with
                versions.pop(0)
            policy.set_weights(versions[0], max(0, v - lag))
            if sampler.env_steps >= next_eval:
                next_eval += sc.env.eval_every
                newest.set_weights(versions[-1], v)
                if evaluate(newest) >= sc.env.target_return:
                    return sampler.env_steps
        return None
    finally:
        sampler.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--lags", type=int, nargs="+", default=[0, 1])
    p.add_argument("--corrections", nargs="+", choices=("clip", "vtrace"), default=["clip", "vtrace"])
    p.add_argument("--seeds", type=int, nargs="+", default=list(range(10)))
    args = p.parse_args()
    if min(args.lags) < 0:
        p.error(f"--lags {args.lags}: a lag is a number of versions, >= 0")
    torch.set_num_threads(1)
    for lag in args.lags:
        for correction in args.corrections if lag else args.corrections[:1]:  # with no lag they are the same
            got = [env_steps_to_target(correction, lag, s) for s in args.seeds]
            hit = [g for g in got if g is not None]
            mean = f"{np.mean(hit):,.0f} (sd {np.std(hit):,.0f})" if hit else "-"
            print(f"lag {lag}  {correction:<6}  reached {len(hit)}/{len(got)}  env steps to 475: {mean}  per seed: {got}",
                  flush=True)


if __name__ == "__main__":
    main()
