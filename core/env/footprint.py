"""What an env run would hold in memory, worked out from its scenario before anything is built,
and the refusal of a run that could not fit the machine it starts on.

Each figure follows how the code allocates. Where Python objects or a process set the cost, a
constant measured on the development machine says how much (CPython 3.11, torch 2.13 CPU).
Environments are counted at CartPole's size, activations and Ray's own daemons not at all, so
every figure is a lower bound: a run refused here could not have run; one accepted may still
need more. In bytes, ``obs`` is one observation as the env returns it, ``row`` one replay row
(``wiring.replay_columns``: 8 x obs numbers + 28), ``net`` the float32 weights of the network:

    replay (dqn)   capacity x (row + 9) + 32 x leaves      9: the replay's draw count and filled
                                                           flag per slot; PER's sum and min trees,
                                                           2 x leaves float64 each
                   + samplers x chunk rows x row           async: a chunk per sampler in flight
    chunk (dqn)    envs x (send_every + n_step - 1) rows   the most one chunk releases
                   x (PY_ROW + obs + copies x row)         the rows as NStepRows holds them, the
                                                           observation batches they view, their
                                                           columns, and (async) their codec record
    chunk (ppo)    envs x send_every steps x (raw + copies x step columns)
    sampler        [process] + envs x (ENV + 2 x obs) + its chunk + 2 x net
    queue (ppo)    [process] + ppo.queue_chunks x chunk columns (sync: ppo.chunks_per_batch)
    learner        [process] + copies of net + its batch twice (the arrays and their tensors)
    evaluation     [process] + eval_episodes x (ENV + 2 x obs)

[process] is ``ACTOR_BYTES``, in async mode only, where every part is an actor of its own.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Callable, Optional

import numpy as np

from core.env.wiring import EnvSpace, replay_columns
from core.model.config import ConfigError
from core.model.env_config import EnvScenario

ACTOR_BYTES = 180 * 2**20
"""A Ray actor's process before it holds anything: the private memory of a Python process that
imported ray, torch and gymnasium, as each actor of core/runtimes/ray_env.py does (178 MiB of
Private_Dirty in /proc/self/smaps_rollup; the libraries' shared pages are not counted)."""
ENV_BYTES = 5 * 2**10
"""One environment of a vector env (CartPole-v1: 5.4 kB each, tracemalloc over 1,000 of them);
heavier environments take more."""
PY_ROW_BYTES = 480
"""One n-step row while ``NStepRows`` builds it: its tuple, its Python scalars and the two array
views of observation batches (tracemalloc: 492 bytes a row at 4 observation numbers, of which 16
are the batch it views)."""
NET_COPIES = {"dqn": 5, "ppo": 4}
"""Copies of the weights a learner holds: online net, gradients and Adam's two moments, and for
DQN its target net."""


@dataclass(frozen=True)
class Part:
    """One part of a run and the bytes it would hold."""

    name: str
    bytes: int
    how: str = ""
    """How the figure is made, for the error line; empty: not worth a line."""


def available_memory() -> Optional[tuple[int, str]]:
    """(bytes this machine can give a run now, where that figure was read); None if unknown."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024, "MemAvailable in /proc/meminfo"
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"), "free pages by os.sysconf"
    except (ValueError, OSError, AttributeError):
        return None


def local_modes(sc: EnvScenario) -> list[str]:
    """The modes whose parts would all sit on this machine: sync (in this process) and async on a
    local Ray instance; a joined cluster places its actors where it will, and the sim builds nothing."""
    if sc.runtime != "ray":
        return []
    return [m for m in sc.modes if m == "sync" or sc.ray.address is None]


def mlp_params(inp: int, hidden: tuple[int, ...], out: int) -> int:
    """Weights and biases of an MLP of these widths (QNetwork, and each half of ActorCritic)."""
    widths = (inp, *hidden, out)
    return sum(a * b + b for a, b in zip(widths, widths[1:]))


def parts(sc: EnvScenario, space: EnvSpace, mode: str) -> list[Part]:
    """What each part of a ``mode`` run of ``sc`` would hold, in bytes (the module docstring's formulas)."""
    asyn = mode == "async"
    proc = ACTOR_BYTES if asyn else 0
    copies = 2 if asyn else 1  # async sends each chunk as a codec record besides its columns
    e = sc.env
    samplers = e.samplers if asyn else 1
    obs = space.obs_dim * space.obs_itemsize
    envs = e.envs_per_sampler * (ENV_BYTES + 2 * obs)
    evaluation = Part("evaluation", proc + e.eval_episodes * (ENV_BYTES + 2 * obs), f"{e.eval_episodes:,} environments")
    if sc.learner == "dqn":
        d = sc.dqn
        net = 4 * mlp_params(space.obs_dim, d.hidden, space.actions)
        row = sum(math.prod(shape) * np.dtype(dt).itemsize for shape, dt in replay_columns(space.obs_dim).values())
        rows = sc.max_chunk_rows()
        per_row = PY_ROW_BYTES + obs + copies * row
        sampler = proc + envs + rows * per_row + 2 * net
        leaves = 1 << max(0, sc.replay.capacity - 1).bit_length()
        replay = (proc + sc.replay.capacity * (row + 9) + (32 * leaves if sc.replay.prioritized else 0)
                  + (samplers * rows * row if asyn else 0))
        batch = (d.batches_per_call if asyn else 1) * d.batch_size * row
        return [
            Part(_samplers(samplers), samplers * sampler,
                 f"each holds chunks of up to {rows:,} rows x {per_row:,} bytes and {e.envs_per_sampler:,} environments"),
            Part("the replay", replay, f"{sc.replay.capacity:,} rows x {row + 9:,} bytes"),
            Part("the learner", proc + NET_COPIES["dqn"] * net + 2 * batch,
                 f"{NET_COPIES['dqn']} x {net:,} bytes of weights and 2 x {batch:,} of batches"),
            evaluation,
        ]
    p = sc.ppo
    net = 4 * (mlp_params(space.obs_dim, p.hidden, space.actions) + mlp_params(space.obs_dim, p.hidden, 1)
               + (0 if space.discrete else space.actions))
    act = 8 if space.discrete else 4 * space.actions  # int64 indices, or float32 vectors
    step_cols = 8 * space.obs_dim + act + 16  # obs and next_obs float32; reward, terminated, ended, logp
    raw = obs + act + 14  # SegmentRows keeps each step's arrays; a step's next_obs is the next one's obs
    steps = e.envs_per_sampler * e.send_every
    chunk = steps * step_cols + 8 * e.envs_per_sampler
    sampler = proc + envs + steps * raw + copies * chunk + 2 * net
    held = p.queue_chunks if asyn else p.chunks_per_batch
    return [
        Part(_samplers(samplers), samplers * sampler,
             f"each holds chunks of {steps:,} env steps x {raw + copies * step_cols:,} bytes and {e.envs_per_sampler:,} environments"),
        Part("the queue", proc + held * chunk, f"{held:,} chunks x {chunk:,} bytes"),
        Part("the learner", proc + NET_COPIES["ppo"] * net + 2 * p.chunks_per_batch * chunk,
             f"{NET_COPIES['ppo']} x {net:,} bytes of weights and 2 x {p.chunks_per_batch:,} chunks of {chunk:,} bytes"),
        evaluation,
    ]


def total(sc: EnvScenario, space: EnvSpace, mode: str) -> int:
    return sum(p.bytes for p in parts(sc, space, mode))


def check_memory(sc: EnvScenario, space: EnvSpace, available: Optional[tuple[int, str]] = None) -> None:
    """Refuse a run whose parts on this machine would take more memory than it has available,
    naming the setting that costs the most and the largest value of it that fits."""
    modes = local_modes(sc)
    have = available or (available_memory() if modes else None)
    if have is None:
        return
    limit, source = have
    for mode in modes:
        need = total(sc, space, mode)
        if need <= limit:
            continue
        key, fix = _culprit(sc, space, mode, limit)
        shares = sorted(parts(sc, space, mode), key=lambda p: -p.bytes)
        top = shares[0]
        listed = ", ".join(f"{p.name} {_human(p.bytes)}" for p in shares if p.bytes)
        how = f"; {top.name}: {top.how}" if top.how else ""
        raise ConfigError(
            key, _value(sc, key), f"{'an' if mode == 'async' else 'a'} {mode} run would hold at least {need:,} bytes ({listed}{how}), "
            f"and this machine has {limit:,} bytes available ({source})", fix,
        )


# The settings a run's memory is a product of, each with the least value a fix may suggest.
_KEYS: dict[str, Callable[[EnvScenario], int]] = {
    "env.samplers": lambda sc: 1, "env.envs_per_sampler": lambda sc: 1, "env.send_every": lambda sc: 1,
    "env.n_step": lambda sc: 1, "env.eval_episodes": lambda sc: 1,
    "replay.capacity": lambda sc: sc.replay.min_size_to_sample, "dqn.batch_size": lambda sc: 1,
    "dqn.batches_per_call": lambda sc: 1, "dqn.hidden": lambda sc: 1,
    "ppo.queue_chunks": lambda sc: sc.ppo.chunks_per_batch, "ppo.chunks_per_batch": lambda sc: 1, "ppo.hidden": lambda sc: 1,
}


def _keys(sc: EnvScenario, mode: str) -> list[str]:
    other = "ppo." if sc.learner == "dqn" else ("dqn.", "replay.", "env.n_step")
    return [k for k in _KEYS if not k.startswith(other) and (k != "env.samplers" or mode == "async")]


def _culprit(sc: EnvScenario, space: EnvSpace, mode: str, limit: int) -> tuple[str, str]:
    """(the key whose lowering saves the most, the fix): first among those set above their
    default (what the user raised), back to the default; else lowered to its least."""
    need = total(sc, space, mode)
    keys = _keys(sc, mode)

    def saved(key: str, value) -> int:
        return need - total(_with(sc, key, value), space, mode)

    best = max(keys, key=lambda k: saved(k, _default(k)))
    if saved(best, _default(best)) <= 0:
        best = max(keys, key=lambda k: saved(k, _scaled(sc, k, _KEYS[k](sc))))
    hidden = best.endswith(".hidden")
    lo, hi = _KEYS[best](sc), max(_value(sc, best)) if hidden else _value(sc, best)
    fits = lambda v: total(_with(sc, best, _scaled(sc, best, v)), space, mode) <= limit  # noqa: E731
    if not fits(lo):
        others = ", ".join(k for k in keys if k != best and saved(k, _scaled(sc, k, _KEYS[k](sc))) > 0)
        also = f"lower {others} too, or " if others else ""
        return best, f"even at {lo:,} it does not fit: {also}run where more memory is free"
    while lo < hi:  # the largest value that fits; the total grows with each of these settings
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid - 1)
    if hidden:
        return best, f"use layers of at most {lo:,} wide, or run where more memory is free"
    return best, f"use at most {lo:,}, or run where more memory is free"


def _value(sc: EnvScenario, key: str):
    section, name = key.split(".")
    return getattr(getattr(sc, section), name)


def _default(key: str):
    section, name = key.split(".")
    return type(getattr(EnvScenario(), section)).model_fields[name].default


def _scaled(sc: EnvScenario, key: str, v: int):
    """``v`` as a value of ``key``: layers of width ``v`` for the networks' hidden sizes."""
    return (v,) * max(1, len(_value(sc, key))) if key.endswith(".hidden") else v


def _with(sc: EnvScenario, key: str, value) -> EnvScenario:
    # Not validated: only the sizes are read, and a smaller value may break a rule a fix must not hide.
    section, name = key.split(".")
    return sc.model_copy(update={section: getattr(sc, section).model_copy(update={name: value})})


def _samplers(n: int) -> str:
    return f"{n:,} sampler{'s' if n != 1 else ''}"


def _human(n: int) -> str:
    for unit, size in (("PB", 10**15), ("TB", 10**12), ("GB", 10**9), ("MB", 10**6), ("kB", 10**3)):
        if n >= size:
            return f"{n / size:,.1f} {unit}"
    return f"{n} bytes"


__all__ = ["ACTOR_BYTES", "ENV_BYTES", "NET_COPIES", "PY_ROW_BYTES", "Part", "available_memory", "check_memory",
           "local_modes", "parts", "total"]
