"""Groups cross process boundaries as ext.codec bytes: exact round trips, no object pickles,
hostile bytes rejected."""

import math
import multiprocessing
import pickle

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from core.model.group_wire import KIND, attach_tokens, decode_group, encode_group, encode_tokens, to_record
from core.model.sample import Group, Sample
from ext import codec
from ext.errors import CodecError

FIELDS = (
    "uid", "prompt_id", "index", "n_prompt", "response_tokens", "logprobs", "n_response", "version_spans",
    "reward", "finished", "interrupts", "admitted_at", "started_at", "finished_at", "trained_at",
)


def same_float(a: float, b: float) -> bool:
    return (math.isnan(a) and math.isnan(b)) or a == b


def assert_same_group(a: Group, b: Group) -> None:
    assert (a.prompt_id, a.version, a.aborts, a.resumes) == (b.prompt_id, b.version, b.aborts, b.resumes)
    assert same_float(a.admitted_at, b.admitted_at) and same_float(a.finished_at, b.finished_at)
    assert len(a.samples) == len(b.samples)
    for x, y in zip(a.samples, b.samples):
        for f in FIELDS:
            u, v = getattr(x, f), getattr(y, f)
            if isinstance(u, float):
                assert same_float(u, v), f
            elif f == "logprobs":  # NaN logprobs compare by their bits
                assert u.dtype == v.dtype == np.float64 and u.tobytes() == v.tobytes(), f
            elif f == "response_tokens":
                assert u.dtype == v.dtype == np.int32 and np.array_equal(u, v), f
            else:
                assert u == v and type(u) is type(v), f
        if x.prompt_tokens is None:
            assert y.prompt_tokens is None
        else:
            assert np.array_equal(x.prompt_tokens, y.prompt_tokens)
            assert x.prompt_tokens.dtype == y.prompt_tokens.dtype


def a_group() -> Group:
    prompt = np.arange(5, dtype=np.int32)
    samples = []
    for i in range(3):
        s = Sample(uid=100 + i, prompt_id=7, index=i, n_prompt=5, prompt_tokens=prompt if i != 1 else None)
        s.add_tokens(2, version=3, tokens=[11 + i, 12], logprobs=[-0.5, -1.25])
        s.add_tokens(1, version=4, tokens=[13], logprobs=[-2.0])
        s.finished = i != 2
        s.reward = None if i == 0 else 0.5 * i
        s.interrupts = i
        s.admitted_at, s.started_at = 1.0, 1.5
        samples.append(s)
    return Group(prompt_id=7, samples=samples, version=3, admitted_at=1.0, aborts=1, resumes=1)


def test_a_group_round_trips_exactly():
    g = a_group()
    assert_same_group(g, decode_group(encode_group(g)))


def test_pickling_a_group_carries_codec_bytes_out_of_band():
    g = a_group()
    buffers = []
    stream = pickle.dumps(g, protocol=5, buffer_callback=buffers.append)
    assert len(buffers) == 1
    raw = buffers[0].raw()
    assert bytes(raw) == encode_group(g)  # the one buffer is exactly the codec encoding
    assert b"core.model.sample" not in stream  # no class of ours is pickled, only the decoder's name
    assert_same_group(g, pickle.loads(stream, buffers=buffers))


@pytest.mark.parametrize("protocol", [2, 4, 5])
def test_every_pickle_protocol_goes_through_the_codec(protocol):
    g = a_group()
    stream = pickle.dumps(g, protocol=protocol)
    assert b"core.model.sample" not in stream
    if protocol >= 3:  # protocol 2 spells bytes through latin-1 text
        assert encode_group(g) in stream
    assert_same_group(g, pickle.loads(stream))
    s = g.samples[2]
    back = pickle.loads(pickle.dumps(s, protocol=protocol))
    assert_same_group(Group(7, [s], -1, s.admitted_at), Group(7, [back], -1, back.admitted_at))


def _child_trains(group: Group) -> Group:
    """Runs in another process: what a trainer actor would do with a group it received."""
    for s in group.samples:
        s.trained_at = 9.0
    return group


def test_a_group_crosses_a_real_process_boundary():
    g = a_group()
    with multiprocessing.get_context("fork").Pool(1) as pool:
        back = pool.apply(_child_trains, (g,))
    assert [s.trained_at for s in back.samples] == [9.0] * 3
    for s in g.samples:
        s.trained_at = 9.0
    assert_same_group(g, back)


def test_corrupted_group_bytes_raise_codec_errors():
    data = bytearray(encode_group(a_group()))
    for pos in range(0, len(data), 7):
        bad = bytearray(data)
        bad[pos] ^= 0x5A
        with pytest.raises(CodecError):
            decode_group(bytes(bad))
    for cut in (0, 10, len(data) // 2, len(data) - 1):
        with pytest.raises(CodecError):
            decode_group(bytes(data[:cut]))


def _record_with(**changes) -> bytes:
    rec = to_record(a_group())
    arrays, meta = dict(rec.arrays), dict(rec.meta)
    for k, v in changes.items():
        if v is None:
            arrays.pop(k, None)
            meta.pop(k, None)
        elif isinstance(v, np.ndarray):
            meta.pop(k, None)
            arrays[k] = v
        else:
            arrays.pop(k, None)
            meta[k] = v
    return codec.encode(codec.Sample(arrays=arrays, meta=meta))


@pytest.mark.parametrize(
    "changes, reason",
    [
        ({"kind": "something/else"}, "not a group record"),
        ({"uid": None}, "missing field 'uid'"),
        ({"token_offsets": np.array([0, 3, 2, 9], np.int64)}, "token_offsets are not a partition"),
        ({"token_offsets": np.array([0, 3, 6, 90], np.int64)}, "token_offsets are not a partition"),
        ({"span_offsets": np.array([0, 2, 4], np.int64)}, "span_offsets must be int64[4]"),
        ({"prompt_offsets": np.array([0, 5, 10], np.int32)}, "prompt_offsets must be int64[3]"),
        ({"reward": np.zeros(2)}, "columns differ in length"),
        ({"times": np.zeros((3, 3))}, "times"),
        ({"version": "three"}, "group record"),
        # found by `make fuzz`: these raised AttributeError, IndexError or OverflowError out of
        # decode_group, or decoded to a Group that encode_group could not write back
        ({"token_offsets": 3}, "token_offsets must be int64[4], got int"),
        ({"has_prompt": "x"}, "has_prompt must be a 1-d bool array, got str"),
        ({"times": 1.0}, "times must be a 2-d float64 array, got float"),
        ({"has_prompt": np.array([True, True])}, "columns differ in length"),
        ({"tokens": np.full(9, 3_000_000_000, np.uint32)}, "tokens must be a 1-d int32 array, got uint32[9]"),
        ({"uid": np.full(3, np.inf)}, "uid must be a 1-d int64 array, got float64[3]"),
        ({"prompt_id": float("inf")}, "prompt_id must be int, got float"),
        ({"prompt_tokens": "abc"}, "prompt_tokens must be a 1-d numeric array, got str"),
    ],
)
def test_well_formed_codec_bytes_that_are_not_a_group_raise_codec_errors(changes, reason):
    with pytest.raises(CodecError, match=reason.replace("[", r"\[").replace("]", r"\]")):
        decode_group(_record_with(**changes))


def test_the_record_is_tagged_with_its_kind():
    assert to_record(a_group())["kind"] == KIND


finite = st.floats(allow_nan=False, allow_infinity=False, width=64)


@st.composite
def groups(draw):
    n = draw(st.integers(0, 4))
    samples = []
    for i in range(n):
        prompt = draw(st.one_of(st.none(), st.lists(st.integers(0, 2**31 - 1), max_size=6)))
        s = Sample(
            uid=draw(st.integers(0, 2**62)), prompt_id=3, index=i, n_prompt=draw(st.integers(0, 10**6)),
            prompt_tokens=None if prompt is None else np.asarray(prompt, dtype=np.int32),
        )
        for _ in range(draw(st.integers(0, 3))):
            k = draw(st.integers(1, 4))
            s.add_tokens(
                k, draw(st.integers(-5, 5)),
                tokens=draw(st.lists(st.integers(-(2**31), 2**31 - 1), min_size=k, max_size=k)),
                logprobs=draw(st.lists(st.floats(width=64), min_size=k, max_size=k)),
            )
        s.reward = draw(st.one_of(st.none(), st.floats(width=64)))
        s.finished = draw(st.booleans())
        s.interrupts = draw(st.integers(0, 9))
        s.admitted_at, s.started_at, s.finished_at, s.trained_at = draw(st.lists(st.floats(width=64), min_size=4, max_size=4))
        samples.append(s)
    return Group(prompt_id=3, samples=samples, version=draw(st.integers(-1, 2**40)), admitted_at=draw(finite),
                 finished_at=draw(st.floats(width=64)), aborts=draw(st.integers(0, 5)), resumes=draw(st.integers(0, 5)))


@settings(max_examples=150)
@given(g=groups())
def test_random_groups_round_trip_through_bytes_and_pickle(g):
    assert_same_group(g, decode_group(encode_group(g)))
    assert_same_group(g, pickle.loads(pickle.dumps(g, protocol=5)))


# -- the tokens record: a group's tokens alone, moved apart from its metadata ---------------------
def test_the_trainer_side_refuses_tokens_of_another_group():
    g = _group_from_lists(3, [[1, 2, 3], [4]])
    other = _group_from_lists(4, [[1, 2, 3], [4]])
    short = _group_from_lists(3, [[1, 2], [4]])

    with pytest.raises(CodecError, match="not the tokens of prompt 4"):
        attach_tokens(other.without_tokens(), encode_tokens(g))
    meta = short.without_tokens()
    with pytest.raises(CodecError, match=r"\[3, 1\] tokens for \[2, 1\] generated"):
        attach_tokens(meta, encode_tokens(g))
    meta = g.without_tokens()
    assert all(len(s.response_tokens) == 0 and s.n_response for s in meta.samples)
    attach_tokens(meta, encode_tokens(g))
    assert [s.response_tokens.tolist() for s in meta.samples] == [[1, 2, 3], [4]]


def _group_from_lists(pid: int, responses: list[list[int]]) -> Group:
    samples = []
    for i, r in enumerate(responses):
        s = Sample(pid * 10 + i, pid, i, 0)
        s.add_tokens(len(r), 0, r, [-0.5] * len(r))
        samples.append(s)
    return Group(prompt_id=pid, samples=samples, version=0, admitted_at=0.0)
