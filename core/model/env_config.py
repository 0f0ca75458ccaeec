"""The env workload's scenario (seeds 001 and 003): environments, the sampler actors, the replay's
rate limit and the learner. Frozen and validated once; each default written here only.

Two learners: ``dqn`` (off-policy, from a prioritized replay) and ``ppo`` (on-policy, from a
staleness-gated queue, with V-trace's truncated importance weights for the policy lag).

The DQN defaults are rl-zoo's tuned DQN for CartPole-v1 (rl-baselines3-zoo, hyperparams/dqn.yml):
a 256x256 MLP, lr 2.3e-3, batches of 64, learning from 1,000 transitions, epsilon 1 -> 0.04
over the first 16 % of 50,000 steps, and 128 gradient steps per 256 env steps, which is 32
samples per inserted transition. Two changes, both from Ape-X (Horgan et al. 2018): 3-step
rows and prioritized replay.
"""

from __future__ import annotations

import math
from typing import Literal

from pydantic import Field, field_validator, model_validator

from core.model.config import (
    MAX_BYTES, MAX_DEVICES, MAX_DIM, MAX_ENV_STEPS, MAX_INT, MAX_SAMPLES, MAX_SEEDS, MAX_STEPS,
    ConfigError, LoggersSpec, RoleSpec, RunName, _Frozen, check_runs,
)

EnvMode = Literal["sync", "async"]
ENV_MODES: tuple[str, ...] = ("sync", "async")
LearnerKind = Literal["dqn", "ppo"]

MAX_ALPHA = 7.0
"""PER's largest priority exponent. The learner sends |TD error| + 1e-3 as a row's priority
(core/env/dqn.py MIN_PRIORITY), its TD error a finite float32, so a priority lies in [1e-3,
3.4e38]; the replay takes p ** alpha only up to the largest double over twice its sum tree's
leaves (ext/_replay_ref.py), 1.8e308 / 2**25 = 5.4e300 at its most rows (2**24 leaves). 3.4e38 **
7 = 5.3e269 fits; from 7.8 on a priority the learner can send would be refused mid-run. PER
uses 0.6 (Schaul et al. 2016); past a few, sampling already takes nearly only the top row."""


class EnvSpec(_Frozen):
    """The environments and the samplers that step them."""

    id: str = "CartPole-v1"
    """A gymnasium environment id with a vector observation (a Box of one dimension) and
    Discrete actions, or for PPO a Box of one dimension of float actions (core/env/wiring.py)."""
    samplers: int = Field(1, ge=1, le=MAX_DEVICES)
    """Sampler actors in async mode (sync mode steps one sampler's environments in the learner's thread)."""
    envs_per_sampler: int = Field(8, ge=1, le=MAX_SAMPLES)
    """Environments each sampler steps together, one policy forward pass for all of them."""
    send_every: int = Field(32, ge=1, le=MAX_STEPS)
    """Vector steps between two chunks a sampler sends; a sampler also takes new weights only then."""
    n_step: int = Field(3, ge=1, le=MAX_STEPS)
    """DQN: steps summed into one row's reward before bootstrapping (Ape-X uses 3). PPO sends
    whole segments of ``send_every`` steps per environment instead."""
    gamma: float = Field(0.99, ge=0, le=1)
    """Discount."""
    env_steps: int = Field(50_000, ge=1, le=MAX_ENV_STEPS)
    """Environment steps of a run, over all samplers (rl-zoo's budget for CartPole DQN)."""
    target_return: float = 475.0
    """The mean evaluation return a run is timed to reach (CartPole-v1's solved threshold)."""
    eval_episodes: int = Field(100, ge=1, le=MAX_SAMPLES)
    """Episodes per evaluation, one per environment, without exploration."""
    eval_every: int = Field(5_000, ge=1, le=MAX_ENV_STEPS)
    """Environment steps between two evaluations."""
    hold_for_eval: bool = True
    """Async mode: hold the samplers and the learner while an evaluation runs, and leave those
    seconds out of every time the run reports, as sync mode stops its clock. Evaluations that
    share training's cores slow it (on a 2-core machine, async PPO's learner took 0.16 s a
    version beside them, 0.07 s alone), so holding keeps time to target a measure of training
    alone, comparable across modes. false: evaluations run beside training, as on a cluster
    where they have cores of their own."""


class DQNSpec(_Frozen):
    """The off-policy learner: double DQN on n-step rows (core/env/dqn.py)."""

    hidden: tuple[int, ...] = (256, 256)
    """Widths of the Q-network's hidden layers."""
    lr: float = Field(2.3e-3, gt=0)
    """Adam learning rate."""
    batch_size: int = Field(64, ge=1, le=MAX_SAMPLES)
    """Rows per update."""
    target_every: int = Field(128, ge=1, le=MAX_STEPS)
    """Updates between two copies of the online net into the target net."""
    grad_clip: float = Field(10.0, gt=0)
    """Global gradient-norm clip."""
    eps_start: float = Field(1.0, ge=0, le=1)
    """Exploration probability at the first step."""
    eps_end: float = Field(0.04, ge=0, le=1)
    """Exploration probability after ``eps_decay_steps`` env steps (per sampler)."""
    eps_decay_steps: int = Field(8_000, ge=1, le=MAX_ENV_STEPS)
    """Env steps over which epsilon falls linearly."""
    publish_every: int = Field(128, ge=1, le=MAX_STEPS)
    """Updates between two weight versions sent to the samplers."""
    batches_per_call: int = Field(8, ge=1, le=MAX_SAMPLES)
    """Async mode: minibatches the learner takes from the replay actor in one call, and whose
    priorities it sends back together; one round trip per this many updates, as Ape-X's learner
    prefetches. Sync mode takes one at a time."""


class PPOSpec(_Frozen):
    """The on-policy learner: PPO on segments, with a correction for policy lag (core/env/ppo.py). The defaults are rl-zoo's
    tuned PPO for CartPole-v1 (rl-baselines3-zoo, hyperparams/ppo.yml: 8 envs x 32 steps, 20 epochs
    of one 256-row minibatch, lr and clip range falling linearly to 0, GAE lambda 0.8) on
    stable-baselines3's default policy (separate 64x64 tanh MLPs for policy and value)."""

    hidden: tuple[int, ...] = (64, 64)
    """Widths of the hidden layers, the same for the policy and the value network."""
    lr: float = Field(1e-3, gt=0)
    """Adam learning rate at the start."""
    clip: float = Field(0.2, gt=0)
    """PPO's clip range on the ratio (to the behaviour policy, or to the learner's own policy at
    the batch's start under ``vtrace``)."""
    anneal: bool = True
    """Lower the learning rate and the clip range linearly to 0 over ``env.env_steps``."""
    epochs: int = Field(20, ge=1, le=MAX_STEPS)
    """Passes over each batch."""
    minibatch: int = Field(256, ge=1, le=MAX_SAMPLES)
    """Rows per gradient step."""
    gae_lambda: float = Field(0.8, ge=0, le=1)
    """GAE's lambda (under ``vtrace``, the trace-cutting c is lambda x the truncated ratio)."""
    lag_correction: Literal["clip", "vtrace"] = "clip"
    """How a row acted by an older policy (mu) is corrected. ``clip``: PPO's ratio is taken to mu,
    so its clip truncates the importance weight pi/mu, and advantages are GAE(lambda)'s (PPO run
    off-policy by a step, as verl and slime do for LLMs). ``vtrace``: IMPALA's truncated weights
    pi_prox/mu in the targets and advantages, and the clip taken to the learner's policy at the
    batch's start, pi_prox (decoupled PPO). On CartPole at a lag of one version, ``vtrace`` needed
    2.3x the env steps of ``clip``, and ``clip`` as many as no lag (bench/ppo_lag_sim.py,
    docs/env.md); with no lag the two are the same."""
    rho_bar: float = Field(1.0, gt=0)
    """``vtrace``: the truncation of the importance ratio in the TD errors (IMPALA uses 1)."""
    c_bar: float = Field(1.0, gt=0)
    """``vtrace``: the truncation of the importance ratio in the trace (IMPALA uses 1)."""
    vf_coef: float = Field(0.5, ge=0)
    """Weight of the value loss."""
    ent_coef: float = Field(0.0, ge=0)
    """Weight of the entropy bonus."""
    grad_clip: float = Field(0.5, gt=0)
    """Global gradient-norm clip."""
    log_std_init: float = 0.0
    """Continuous actions: the Gaussian's log standard deviation at the start."""
    chunks_per_batch: int = Field(1, ge=1, le=MAX_SAMPLES)
    """Sampler chunks (``env.envs_per_sampler`` x ``env.send_every`` steps each) in one batch."""
    max_staleness: int = Field(1, ge=0, le=MAX_STEPS)
    """Async mode: a chunk acted by a version older than the learner's minus this is dropped, not
    trained (counted)."""
    queue_chunks: int = Field(1, ge=1, le=MAX_SAMPLES)
    """Async mode: places in the queue, for chunks queued or being collected; a sampler waits for
    one before it acts. At least ``env.samplers`` lets every sampler act at once."""


class ReplayLimitSpec(_Frozen):
    """The transition replay and its sample-to-insert rate limit (core/env/rate_limiter.py)."""

    capacity: int = Field(100_000, ge=1, le=MAX_SAMPLES)
    """Rows the replay holds; the oldest are overwritten."""
    prioritized: bool = True
    """Draw rows in proportion to priority ** alpha (PER), else uniformly."""
    alpha: float = Field(0.6, ge=0, le=MAX_ALPHA)
    """PER's priority exponent, at most ``MAX_ALPHA``."""
    beta_start: float = Field(0.4, ge=0, le=1)
    """PER's importance-weight exponent at the start; it rises linearly to 1 over the run."""
    samples_per_insert: float = Field(32.0, gt=0)
    """Rows sampled per row inserted, on average over the run."""
    min_size_to_sample: int = Field(1_000, ge=1, le=MAX_SAMPLES)
    """Rows inserted before the first sample."""
    durable: bool = False
    """Async mode: journal the store actor (to the run's directory), so that one restarted after a
    crash rebuilds what it held and its counts. DQN's replay: every chunk it took (priorities
    restart at the maximum). PPO's queue: its chunks, those handed to the learner and not yet
    acknowledged, and every arrival's counts."""
    error_buffer: float | None = Field(None, ge=0)
    """How far, in samples, the run may drift from the ratio before the side ahead waits. None: the
    smallest band that holds one chunk's insert and one sample, the tightest that cannot deadlock."""

    @field_validator("alpha", mode="before")
    @classmethod
    def _alpha_fits(cls, value: object) -> object:
        # Before the bound and the magnitude rule, so that the line says why, not only how far.
        try:
            a = float(value) if isinstance(value, (int, float, str)) and not isinstance(value, bool) else math.nan
        except (ValueError, OverflowError):
            return value  # not a number: pydantic's type error says so
        if math.isfinite(a) and a > MAX_ALPHA:
            raise ConfigError(
                "replay.alpha", value, f"every priority is raised to alpha, and above {MAX_ALPHA:g} one the learner can send "
                "(|TD error| + 0.001, up to float32's 3.4e38) would overflow the replay's sum tree mid-run",
                f"use at most {MAX_ALPHA:g} (PER uses 0.6)",
            )
        return value


class EnvRaySpec(_Frozen):
    """Async mode's Ray instance and what each role reserves."""

    address: str | None = None
    """Join this cluster (e.g. `auto`); None starts a local instance for the run and stops it after."""
    num_cpus: int | None = Field(None, ge=1, le=MAX_DEVICES)
    """CPUs of the local instance; None gives it every core of the machine."""
    sampler: RoleSpec = RoleSpec(num_cpus=1.0, max_concurrency=4)
    """Each sampler actor: its environments and the policy's forward pass."""
    learner: RoleSpec = RoleSpec(num_cpus=1.0, max_concurrency=4)
    """The learner actor."""
    replay: RoleSpec = RoleSpec(num_cpus=0.0, max_concurrency=64)
    """The store actor (DQN's replay, PPO's queue): bookkeeping and sampling, no network."""
    max_restarts: int = Field(3, ge=0, le=MAX_STEPS)
    """Times Ray restarts a sampler, replay or (checkpointed) learner actor that died, per actor."""
    recovery_timeout_s: float = Field(60.0, gt=0)
    """How long a caller retries a restarting actor before the run fails with an error naming it."""


class EnvCheckpointSpec(_Frozen):
    """Checkpoints of a run, in its directory: what ``--resume RUN_DIR`` goes on from."""

    every: int = Field(0, ge=0, le=MAX_STEPS)
    """Learner versions between checkpoints of the learner (its networks, optimizer and counts);
    the store (DQN's replay, PPO's queue) then journals everything it takes. A run with them is
    written in place and resumes with ``--resume`` from where it stopped; in async mode a
    learner actor that dies also comes back from its latest, numbering its versions past any
    it published since. 0: none (a dead learner ends the run)."""


class EnvFaultSpec(_Frozen):
    """One injected fault of an async run: an actor's process killed once the run has taken
    ``at_env_steps`` env steps. Ray restarts the actor (``ray.max_restarts``) and the run goes on."""

    kind: Literal["kill"] = "kill"
    """What happens: the actor's process ends."""
    target: Literal["sampler", "replay", "learner"] = "sampler"
    """A sampler actor (it resumes at its next chunk; the one it was collecting was never sent),
    the store actor, DQN's replay or PPO's queue (it rebuilds from its journal: needs
    `replay.durable` or checkpoints), or the learner actor (it goes on from its latest checkpoint:
    needs `checkpoint.every`)."""
    sampler: int = Field(0, ge=0, le=MAX_DEVICES)
    """Which sampler, from 0."""
    at_env_steps: int = Field(..., ge=1, le=MAX_ENV_STEPS)
    """When: the first poll of the driver that sees the store past this many env steps."""


class EnvSimSpec(_Frozen):
    """What the sim runtime charges for each part of the env pipeline (core/sim/env_pipeline.py).
    Sizes in bytes, times in seconds. The cost defaults are CartPole-v1 with this file's DQN
    defaults on the quiet 2-core development machine: the replay's measured alone
    (bench/env_sim_costs.py); the sampler's compute, the round trip and the learner's update as the
    Ray pipeline paid them (bench/env_sim_check.py --fit), 1.2-1.4x what they cost alone:
    docs/results/2026-12-02-env-sim.md."""

    machines: int = Field(1, ge=1, le=MAX_DEVICES)
    """Machines the samplers are spread over, round-robin from machine 0. The replay and the learner
    sit on machine 0 (Ray's head node), so that machine's samplers send without crossing a NIC."""
    cores_per_machine: int | None = Field(None, ge=1, le=MAX_DEVICES)
    """CPU cores of each machine; the samplers on a machine, and the learner on machine 0, share
    them, and a sampler's compute slows by how far they oversubscribe them. None: a core each."""
    nic_gbit_s: float = Field(10.0, gt=0)
    """Each machine's network link, each way (full duplex), in Gbit/s (seed 003: 10 Gbit/s). A
    transfer holds the sender's outgoing and the receiver's incoming link at once, first come first served."""
    rpc_latency_s: float = Field(2.3e-3, ge=0)
    """What one actor call costs its caller beyond its bytes and the replay's own work: Ray's submit,
    the codec record both ways, the round trip. Per chunk and per weight fetch (fitted: a sampler's
    insert of an 80-row CartPole chunk in the pipeline, one machine; 1.6 ms alone)."""
    env_step_s: float = Field(3.0e-5, ge=0)
    """One environment's step, with the sampler's own bookkeeping of its row (CartPole-v1: a
    sampler's collect less its forward passes, per env, measured alone and scaled as fitted)."""
    forward_s: float = Field(1.4e-4, ge=0)
    """The policy's forward pass per vector step, fixed part (the 256x256 MLP with epsilon-greedy,
    one torch thread; measured alone and scaled as ``env_step_s``)."""
    forward_env_s: float = Field(2.8e-6, ge=0)
    """The forward pass's added cost per environment in the batch (as ``forward_s``)."""
    learner_update_s: float = Field(3.0e-3, gt=0)
    """One learner update on one minibatch of ``dqn.batch_size`` rows, its share of publishing
    included (fitted: the learner actor's updates, 64 rows, one torch thread; 2.4 ms alone)."""
    replay_call_s: float = Field(2.4e-5, ge=0)
    """The replay's own work per call (insert or sample), one call at a time: it is one actor
    (measured: TransitionReplay.insert and sample + update_priorities in process, one line
    through both)."""
    replay_insert_row_s: float = Field(2.7e-7, ge=0)
    """The replay's added work per row inserted (measured, as ``replay_call_s``)."""
    replay_sample_row_s: float = Field(1.2e-7, ge=0)
    """The replay's added work per row sampled, its new priority included (measured, as ``replay_call_s``)."""
    row_bytes: int | None = Field(None, ge=1, le=MAX_BYTES)
    """Bytes of one row on the wire. None: the replay's columns for ``env.id`` (core/env/wiring.py
    replay_spec): two float32 observations, an int64 action, float32 reward, discount and log-prob,
    an int64 version, 8 x obs + 28 bytes; ``env.id`` is made once to read its observation size."""
    param_bytes: int | None = Field(None, ge=1, le=MAX_BYTES)
    """Bytes of one weight version a sampler fetches. None: the float32 Q-network of ``dqn.hidden``
    on ``env.id``'s observation size and action count."""
    jitter: float = Field(0.05, ge=0, lt=1)
    """Each chunk's compute time is scaled by a seeded draw from 1 ± jitter: real samplers drift
    apart, and equal costs would keep simulated ones in lockstep, all sending at once."""


class EnvScenario(_Frozen):
    """One env workload, run in one or more modes."""

    kind: Literal["env"] = "env"
    """Marks the scenario as an env workload (an LLM scenario has no `kind`)."""
    name: RunName = "env"
    """A label for reports and the default run directory: letters, digits, '-', '_' and '.'."""
    seed: int = Field(0, ge=0, le=MAX_INT)
    """Seeds environments, networks and the replay."""
    seeds: tuple[int, ...] = Field((), max_length=MAX_SEEDS)
    """Run every mode once per seed and report mean and spread; empty: `seed` alone."""
    modes: tuple[EnvMode, ...] = ("sync", "async")
    """`sync`: sampler and learner take turns in one thread; `async`: sampler actors, the replay actor
    and the learner actor run at once on Ray."""
    env: EnvSpec = EnvSpec()
    """Environments and samplers."""
    learner: LearnerKind = "dqn"
    """`dqn`: off-policy, samplers feed a prioritized replay; `ppo`: on-policy, samplers feed a
    staleness-gated queue and each segment is trained once."""
    dqn: DQNSpec = DQNSpec()
    """The DQN learner (read when `learner` is dqn)."""
    ppo: PPOSpec = PPOSpec()
    """The PPO learner (read when `learner` is ppo)."""
    replay: ReplayLimitSpec = ReplayLimitSpec()
    """The DQN replay and its rate limit (read when `learner` is dqn)."""
    ray: EnvRaySpec = EnvRaySpec()
    """Async mode's Ray instance and actors."""
    checkpoint: EnvCheckpointSpec = EnvCheckpointSpec()
    """Checkpoints of the run, for ``--resume`` and for a learner actor that dies."""
    faults: tuple[EnvFaultSpec, ...] = ()
    """Faults injected into async runs (a sync run has no actors to kill)."""
    runtime: Literal["ray", "sim"] = "ray"
    """Where async mode runs: ``ray`` as actors; ``sim`` models both modes on the virtual clock from
    the ``sim`` costs (no environment is stepped, nothing is learned)."""
    sim: EnvSimSpec = EnvSimSpec()
    """The sim runtime's costs and machines."""
    report: LoggersSpec = LoggersSpec()
    """Where the run's live figures go (each mode's metrics.jsonl is always written)."""

    @model_validator(mode="after")
    def _sim_fits(self) -> "EnvScenario":
        s = self.sim
        if self.runtime != "sim":
            return self
        if self.learner != "dqn":
            raise ConfigError(
                "learner", self.learner, "the sim runtime models the replay pipeline (samplers, replay, learner), not PPO's queue",
                "use learner: dqn with replay.samples_per_insert as the epochs (scenarios/seed003-sim.yaml), or runtime: ray",
            )
        if self.faults:
            raise ConfigError("faults", "[...]", "the sim runtime has no actors to kill", "remove faults, or use runtime: ray")
        if self.checkpoint.every:
            raise ConfigError("checkpoint.every", self.checkpoint.every, "the sim runtime learns nothing to checkpoint",
                              "set it to 0, or use runtime: ray")
        if "async" in self.modes and s.machines > self.env.samplers:
            raise ConfigError(
                "sim.machines", s.machines, f"is more machines than env.samplers = {self.env.samplers}, so some would hold no sampler",
                f"use at most {self.env.samplers} machines, or more samplers",
            )
        if s.env_step_s == 0 and s.forward_s == 0 and s.forward_env_s == 0:
            raise ConfigError(
                "sim.env_step_s", 0.0, "with sim.forward_s and sim.forward_env_s also 0, a sampler steps in no time at all",
                "give the environment step or the forward pass a cost",
            )
        return self

    @model_validator(mode="after")
    def _consistent(self) -> "EnvScenario":
        check_runs(self.modes, self.seeds, ENV_MODES)
        self._check_faults()
        if self.learner == "ppo":
            p = self.ppo
            if not p.hidden or min(p.hidden) < 1 or max(p.hidden) > MAX_DIM:
                raise ConfigError("ppo.hidden", list(p.hidden), f"every layer needs a width of at least 1 and at most {MAX_DIM:,}", "e.g. [64, 64]")
            if p.queue_chunks < p.chunks_per_batch:
                raise ConfigError(
                    "ppo.queue_chunks", p.queue_chunks, f"holds fewer chunks than one batch takes (ppo.chunks_per_batch = "
                    f"{p.chunks_per_batch}), so the learner would wait forever", f"use at least {p.chunks_per_batch}",
                )
            rows = self.env.envs_per_sampler * self.env.send_every * p.chunks_per_batch
            if p.minibatch > rows:
                raise ConfigError(
                    "ppo.minibatch", p.minibatch, f"is more rows than one batch holds ({rows}: env.envs_per_sampler x "
                    "env.send_every x ppo.chunks_per_batch)", f"use at most {rows}",
                )
            return self
        d, r = self.dqn, self.replay
        if not d.hidden or min(d.hidden) < 1 or max(d.hidden) > MAX_DIM:
            raise ConfigError("dqn.hidden", list(d.hidden), f"every layer needs a width of at least 1 and at most {MAX_DIM:,}", "e.g. [256, 256]")
        if d.eps_end > d.eps_start:
            raise ConfigError("dqn.eps_end", d.eps_end, f"is above dqn.eps_start = {d.eps_start}", "make eps_end <= eps_start")
        if r.min_size_to_sample < self.max_sample_rows():
            raise ConfigError(
                "replay.min_size_to_sample", r.min_size_to_sample,
                f"is fewer rows than one learner call takes ({d.batches_per_call} x {d.batch_size})",
                f"use at least dqn.batches_per_call x dqn.batch_size = {self.max_sample_rows()}",
            )
        if r.min_size_to_sample > r.capacity:
            raise ConfigError(
                "replay.min_size_to_sample", r.min_size_to_sample, f"is more rows than replay.capacity = {r.capacity} holds",
                "lower it or raise the capacity",
            )
        need = self.band_needed()
        if r.error_buffer is not None and 2 * r.error_buffer < need:
            raise ConfigError(
                "replay.error_buffer", r.error_buffer,
                f"the band cannot hold one chunk of {self.max_chunk_rows()} rows and one learner call of "
                f"{self.max_sample_rows()}, so both sides could wait forever",
                f"use at least {need / 2:g}, or leave it out",
            )
        return self

    def _check_faults(self) -> None:
        if self.faults and "async" not in self.modes:
            raise ConfigError("faults", "[...]", "faults are injected into async runs, and modes has none", "add async to modes, or remove faults")
        for i, f in enumerate(self.faults):
            key = f"faults.{i}"
            if f.target == "sampler" and f.sampler >= self.env.samplers:
                raise ConfigError(f"{key}.sampler", f.sampler, f"there are {self.env.samplers} samplers (env.samplers)",
                                  f"use a sampler index below {self.env.samplers}")
            if f.target == "learner" and not self.checkpoint.every:
                raise ConfigError(f"{key}.target", f.target, "a learner that keeps no checkpoint cannot come back",
                                  "set checkpoint.every, e.g. 10")
            if f.target == "replay" and not self.durable_store():
                raise ConfigError(f"{key}.target", f.target, "a store (replay or queue) that is not journaled loses its rows when it dies",
                                  "set replay.durable: true")
        kills: dict[str, int] = {}
        for f in self.faults:
            name = f"sampler {f.sampler}" if f.target == "sampler" else f"the {f.target}"
            kills[name] = kills.get(name, 0) + 1
        most = max(kills.items(), key=lambda kv: kv[1], default=None)
        if most is not None and most[1] > self.ray.max_restarts:
            # Ray restarts an actor max_restarts times; one more kill ends the run.
            name, n = most
            raise ConfigError("ray.max_restarts", self.ray.max_restarts, f"{n} fault{'s kill' if n > 1 else ' kills'} {name}, "
                              "and a killed actor past its restarts would not come back", f"use at least {n}, or fewer kills")

    def durable_store(self) -> bool:
        """Whether the store journals what it takes: asked for, or needed by checkpoints."""
        return self.replay.durable or bool(self.checkpoint.every)

    def max_chunk_rows(self) -> int:
        """The most rows one chunk carries: every env's steps, plus rows a finished episode releases."""
        e = self.env
        return e.envs_per_sampler * (e.send_every + e.n_step - 1)

    def max_sample_rows(self) -> int:
        """The most rows one learner call samples."""
        return self.dqn.batch_size * self.dqn.batches_per_call

    def band_needed(self) -> float:
        """The narrowest band (both sides together) that holds one chunk's insert and one learner call's sample."""
        return self.max_chunk_rows() * self.replay.samples_per_insert + self.max_sample_rows()

    def error_buffer(self) -> float:
        return self.replay.error_buffer if self.replay.error_buffer is not None else self.band_needed() / 2

    def run_seeds(self) -> tuple[int, ...]:
        return self.seeds or (self.seed,)
