"""Time to solve CartPole-v1 (mean greedy return >= 475 over 100 episodes): stable-baselines3's
DQN and PPO beside asyncrl's in sync and async mode, with the same settings, in one process run.

    python bench/time_to_475.py [--learners dqn ppo] [--seeds 0 1 2] [--json OUT.json]
                                [--also-async KEY=VALUE ...] [--per-update-only]

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

Per update, first: each learner's gradient step beside SB3's, in this process, on the same
batches of CartPole rows (collected by asyncrl's sampler) and from the same weights (asyncrl's
initial ones, copied into SB3's network). PPO: one ``learn`` call against one ``PPO.train``
(20 epochs of one 256-row minibatch, so 20 gradient steps each, GAE and the value pass on
asyncrl's side included). DQN: 128 ``DQNLearner.update`` calls against one
``DQN.train(gradient_steps=128, batch_size=64)``, whose replay hands out the same batches
(its sampling left out, as asyncrl's replay is not in its update); asyncrl's step is double DQN
(one more forward pass than SB3's plain DQN), with importance weights and priorities out. Both
after warm-up, alternated, reported per gradient step as the median and min of
``PER_UPDATE_REPS``. ``--json`` writes ``{"per_update": [...], "runs": [...]}``.

Every learner here runs on one torch thread with denormals flushed, as asyncrl's learner
process is set up (``core.env.wiring.learner_process``).
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
from core.env.wiring import EVAL_SEED, make_learner, make_policy, make_sampler  # noqa: E402
from core.runtimes.ray_start import start_cluster  # noqa: E402
from core.runtimes.ray_env import run_async  # noqa: E402
from harness.scenario import ScenarioError, load  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
ENVS, EVAL_EVERY, TARGET = 8, 5_000, 475.0
BUDGET = {"dqn": 50_000, "ppo": 100_000}
PER_UPDATE_REPS, PER_UPDATE_BATCHES = 30, 8


def learner_setup() -> None:
    """Every learner, asyncrl's or SB3's, on one core as asyncrl's learner actor is, with
    denormals flushed as asyncrl's learner process flushes them."""
    torch.set_num_threads(1)
    torch.set_flush_denormal(True)


def _sb3_logger():
    from stable_baselines3.common.logger import configure

    return configure(None, [])


def _timed_call(f) -> float:
    t0 = time.perf_counter()
    f()
    return time.perf_counter() - t0


def _alternated(ours, theirs, steps: int) -> dict:
    """Median and min microseconds per gradient step: ``ours()`` and ``theirs()`` each run
    ``steps`` steps and return the seconds of their timed part; warmed up, then alternated."""
    for _ in range(3):
        ours(), theirs()
    t: dict[str, list[float]] = {"asyncrl": [], "sb3": []}
    for _ in range(PER_UPDATE_REPS):
        t["asyncrl"].append(ours() / steps * 1e6)
        t["sb3"].append(theirs() / steps * 1e6)
    out = {f"{k}_{s}_us": float(fn(v)) for k, v in t.items() for s, fn in (("median", np.median), ("min", np.min))}
    out["ratio_median"] = out["sb3_median_us"] / out["asyncrl_median_us"]
    return out


def per_update_ppo() -> dict:
    from stable_baselines3 import PPO
    from stable_baselines3.common.env_util import make_vec_env

    sc = scenario("ppo")
    learner = make_learner(sc, 0)
    policy = make_policy(sc, 0, 0)
    policy.set_weights(learner.weights(), 0)
    sampler = make_sampler(sc, 0, 0, policy)
    batches = [dict(sampler.collect().columns) for _ in range(PER_UPDATE_BATCHES)]
    sampler.close()
    model = PPO(
        "MlpPolicy", make_vec_env("CartPole-v1", n_envs=ENVS, seed=0), n_steps=32, batch_size=256, n_epochs=20,
        gamma=0.98, gae_lambda=0.8, ent_coef=0.0, learning_rate=lambda left: 1e-3 * left,
        clip_range=lambda left: 0.2 * left, seed=0, verbose=0,
    )
    model.set_logger(_sb3_logger())
    # asyncrl's pi.0, pi.2, pi.4 (head) and vf.* are SB3's policy_net.0, policy_net.2, action_net and value_net.*.
    sd = model.policy.state_dict()
    head = str(2 * len(sc.ppo.hidden))
    for k, v in learner.weights().items():
        net, layer, kind = k.split(".")
        if layer == head:
            sd[f"{'action_net' if net == 'pi' else 'value_net'}.{kind}"] = torch.from_numpy(v)
        else:
            sd[f"mlp_extractor.{'policy_net' if net == 'pi' else 'value_net'}.{layer}.{kind}"] = torch.from_numpy(v)
    model.policy.load_state_dict(sd)
    turn = [0, 0]

    def ours() -> float:
        turn[0] += 1
        return _timed_call(lambda: learner.learn(batches[turn[0] % len(batches)], 0))

    def theirs() -> float:
        # The buffer is filled as SB3's rollout fills it, untimed: only train() is the update.
        turn[1] += 1
        cols = batches[turn[1] % len(batches)]
        rb = model.rollout_buffer
        rb.reset()
        with torch.no_grad():
            for t in range(cols["obs"].shape[1]):
                rb.add(cols["obs"][:, t], cols["action"][:, t], cols["reward"][:, t], np.zeros(ENVS),
                       model.policy.predict_values(torch.as_tensor(cols["obs"][:, t])), torch.as_tensor(cols["logp"][:, t]))
            last = model.policy.predict_values(torch.as_tensor(cols["next_obs"][:, -1]))
        rb.compute_returns_and_advantage(last, cols["ended"][:, -1])
        return _timed_call(model.train)

    return {"learner": "ppo", "step": "one 256-row minibatch step (learn / PPO.train, 20 steps each)",
            **_alternated(ours, theirs, sc.ppo.epochs)}


def per_update_dqn() -> dict:
    from stable_baselines3 import DQN
    from stable_baselines3.common.env_util import make_vec_env
    from stable_baselines3.common.type_aliases import ReplayBufferSamples

    sc = scenario("dqn")
    d = sc.dqn
    learner = make_learner(sc, 0)
    policy = make_policy(sc, 0, 0)  # epsilon 1 at the start: random actions
    sampler = make_sampler(sc, 0, 0, policy)
    rows = []
    while sum(len(r["obs"]) for r in rows) < 128 * d.batch_size:
        rows.append(dict(sampler.collect().columns))
    sampler.close()
    cols = {k: np.concatenate([r[k] for r in rows])[:128 * d.batch_size] for k in rows[0]}
    batches = [{k: v[i:i + d.batch_size] for k, v in cols.items()} for i in range(0, 128 * d.batch_size, d.batch_size)]
    weights = np.ones(d.batch_size, np.float32)
    model = DQN(
        "MlpPolicy", make_vec_env("CartPole-v1", n_envs=ENVS, seed=0), learning_rate=2.3e-3, batch_size=64,
        buffer_size=100_000, learning_starts=1_000, gamma=0.99, target_update_interval=10, train_freq=256 // ENVS,
        gradient_steps=128, exploration_fraction=0.16, exploration_final_eps=0.04,
        policy_kwargs={"net_arch": [256, 256]}, seed=0, verbose=0,
    )
    model.set_logger(_sb3_logger())
    # asyncrl's net.<i> is SB3's q_net.<i>: the same layers.
    model.q_net.load_state_dict({"q_net." + k.split(".", 1)[1]: torch.from_numpy(v) for k, v in learner.weights().items()})
    model.q_net_target.load_state_dict(model.q_net.state_dict())
    t = torch.as_tensor
    samples = [ReplayBufferSamples(t(b["obs"]), t(b["action"][:, None]), t(b["next_obs"]),
                                   t((b["discount"] == 0).astype(np.float32)[:, None]), t(b["reward"][:, None]),
                                   t(np.ones((d.batch_size, 1), np.float32))) for b in batches]
    turn = [0]

    def draw(batch_size, env=None):
        turn[0] += 1
        return samples[turn[0] % len(samples)]

    model.replay_buffer.sample = draw

    def ours() -> float:
        def run() -> None:
            for b in batches:
                learner.update(b, weights)
        return _timed_call(run)

    def theirs() -> float:
        return _timed_call(lambda: model.train(gradient_steps=len(batches), batch_size=d.batch_size))

    return {"learner": "dqn", "step": "one 64-row gradient step (128 updates / DQN.train of 128 steps)",
            **_alternated(ours, theirs, len(batches))}


def print_per_update(rows: list[dict]) -> None:
    print("per gradient step, same batches, same weights, one thread (us):")
    print(f"  {'learner':<8} {'asyncrl median':>15} {'(min)':>8} {'SB3 median':>11} {'(min)':>8} {'SB3 / asyncrl':>14}")
    for r in rows:
        print(f"  {r['learner']:<8} {r['asyncrl_median_us']:>15.0f} {r['asyncrl_min_us']:>8.0f} "
              f"{r['sb3_median_us']:>11.0f} {r['sb3_min_us']:>8.0f} {r['ratio_median']:>13.2f}x", flush=True)
    print()


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
    p.add_argument("--per-update-only", action="store_true", help="time the gradient steps side by side, and stop")
    args = p.parse_args()
    for change in args.also_async:
        if "=" not in change:
            p.error(f"--also-async {change!r}: expected KEY=VALUE, e.g. ppo.lag_correction=vtrace")
        for learner in args.learners:
            try:
                scenario(learner, change)
            except ScenarioError as err:
                p.error(str(err))
    learner_setup()
    per_update = [{"ppo": per_update_ppo, "dqn": per_update_dqn}[learner]() for learner in args.learners]
    print_per_update(per_update)
    if args.per_update_only:
        if args.json:
            args.json.write_text(json.dumps({"per_update": per_update, "runs": []}, indent=1))
        return
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    start_cluster(None, None)
    rows = []
    sb3 = {"dqn": sb3_dqn, "ppo": sb3_ppo}
    for seed in args.seeds:
        for learner in args.learners:
            runs = [lambda: sb3[learner](seed), lambda: asyncrl(learner, "sync", seed), lambda: asyncrl(learner, "async", seed)]
            runs += [lambda c=c: asyncrl(learner, "async", seed, c) for c in args.also_async]
            for run in runs:
                learner_setup()
                rows.append(run())
                r = rows[-1]
                t = "not reached" if r["time_to_475_s"] is None else f"{r['time_to_475_s']:.1f} s, {r['env_steps_to_475']:,} env steps"
                print(f"seed {seed}  {r['impl']:<40} {t}", flush=True)
    print()
    print_per_update(per_update)
    for impl in dict.fromkeys(r["impl"] for r in rows):
        ts = [r["time_to_475_s"] for r in rows if r["impl"] == impl]
        got = [t for t in ts if t is not None]
        spread = f"{np.mean(got):.1f} s (sd {np.std(got):.1f}, {min(got):.1f}..{max(got):.1f})" if got else "-"
        steps = [r["env_steps_to_475"] for r in rows if r["impl"] == impl and r["env_steps_to_475"] is not None]
        mean_steps = f"{np.mean(steps):,.0f}" if steps else "-"
        print(f"{impl:<40} reached {len(got)}/{len(ts)}  time to 475: {spread}  env steps: {mean_steps}{_beats(rows, impl)}")
    if args.json:
        args.json.write_text(json.dumps({"per_update": per_update, "runs": rows}, indent=1))


def _beats(rows: list[dict], impl: str) -> str:
    """For an asyncrl row: on how many seeds it reached 475 sooner than SB3's same learner (a run
    that never reached it counts as never sooner)."""
    if not impl.startswith("asyncrl "):
        return ""
    ref = "sb3 " + impl.split()[1]
    never = float("inf")
    mine = {r["seed"]: r["time_to_475_s"] or never for r in rows if r["impl"] == impl}
    theirs = {r["seed"]: r["time_to_475_s"] or never for r in rows if r["impl"] == ref}
    won = sum(mine[s] < theirs[s] for s in mine if s in theirs)
    return f"  sooner than {ref} on {won}/{len(mine)} seeds"


if __name__ == "__main__":
    main()
