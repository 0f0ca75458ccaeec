"""Moving one finished group from an engine actor to the trainer: the serialization on the way.

A group of 8 responses, 2,048 or 32,768 response tokens in all (plus 64 prompt tokens each).

* ``before``  the path before issue 16 (commit 096d0ed): tokens in Python lists; the engine
              encodes the group (lists made arrays per token), the rollout actor decodes it
              (arrays made lists per token), encodes it again for the trainer, which decodes it.
* ``after``   tokens in arrays from the engine; the engine encodes the tokens record (what it
              puts in the object store) and the metadata; the rollout actor decodes and encodes
              the metadata only; the trainer decodes the metadata and maps the tokens record
              (zero-copy views).

What Ray adds on top (the actor calls, ``ray.put`` and the object store) is not timed here:
``bench/group_move_ray.py`` times the two paths through real actors. ``extra_info`` records the
ratio before/after measured in the same process (``speedup``).
"""

from __future__ import annotations

import numpy as np
import pytest

from core.model import group_wire
from core.model.sample import Group, Sample
from ext import codec

SIZES = [2048, 32768]
SAMPLES = 8
_means: dict = {}


def make_group(total: int, as_lists: bool) -> Group:
    rng = np.random.default_rng(total)
    prompt = rng.integers(0, 150_000, 64).astype(np.int32)
    samples = []
    for i in range(SAMPLES):
        n = total // SAMPLES
        s = Sample(total + i, 7, i, len(prompt), prompt)
        tokens = rng.integers(0, 150_000, n).astype(np.int32)
        logprobs = -rng.random(n)
        s.add_tokens(n, 3, tokens, logprobs)
        if as_lists:  # the engine's output as it was: Python lists
            s.response_tokens, s.logprobs = tokens.tolist(), logprobs.tolist()
        s.finished, s.reward = True, 0.5
        samples.append(s)
    return Group(prompt_id=7, samples=samples, version=3, admitted_at=0.0)


def _encode_before(g: Group) -> bytes:
    """group_wire.encode_group as it was: every token read from a list into the arrays."""
    rec = group_wire.to_record(g.without_tokens())
    ss = g.samples
    arrays = dict(rec.arrays)
    arrays["token_offsets"] = group_wire._offsets([len(s.response_tokens) for s in ss])
    arrays["tokens"] = np.array([t for s in ss for t in s.response_tokens], dtype=np.int32)
    arrays["logprob_offsets"] = group_wire._offsets([len(s.logprobs) for s in ss])
    arrays["logprobs"] = np.array([x for s in ss for x in s.logprobs], dtype=np.float64)
    return codec.encode(codec.Sample(arrays=arrays, meta=dict(rec.meta)))


def _decode_before(buf) -> Group:
    """group_wire.decode_group as it was: the arrays made lists, token by token."""
    g = group_wire.decode_group(buf)
    for s in g.samples:
        s.response_tokens, s.logprobs = s.response_tokens.tolist(), s.logprobs.tolist()
    return g


def move_before(g: Group) -> Group:
    at_rollout = _decode_before(_encode_before(g))  # engine actor -> rollout actor
    return _decode_before(_encode_before(at_rollout))  # rollout actor -> trainer


def move_after(g: Group) -> Group:
    tokens = group_wire.encode_tokens(g)  # put in the object store by the engine actor
    meta = group_wire.encode_group(g.without_tokens())  # the reply to the rollout actor
    at_rollout = group_wire.decode_group(meta)
    at_trainer = group_wire.decode_group(group_wire.encode_group(at_rollout))
    group_wire.attach_tokens(at_trainer, tokens)  # the trainer resolves the reference
    return at_trainer


@pytest.mark.parametrize("path", ["before", "after"])
@pytest.mark.parametrize("n", SIZES)
def test_group_move(benchmark, n, path):
    g = make_group(n, as_lists=path == "before")
    move = move_before if path == "before" else move_after
    out = benchmark(move, g)
    assert sum(len(s.response_tokens) for s in out.samples) == n
    assert [list(s.response_tokens[:3]) for s in out.samples] == [list(s.response_tokens[:3]) for s in g.samples]
    _means[(n, path)] = benchmark.stats.stats.mean
    benchmark.extra_info["tokens"] = n
    if (n, "before") in _means and (n, "after") in _means:  # whichever ran second
        benchmark.extra_info["speedup"] = _means[(n, "before")] / _means[(n, "after")]
