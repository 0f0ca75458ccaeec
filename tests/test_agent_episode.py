"""An agent episode's tokens on a Sample: the model's turns and what tools answered, in one
response; the observation tokens are context for later turns and never trained (loss mask 0),
counted apart by the ledger, kept across processes by the group record."""

from __future__ import annotations

import numpy as np
import pytest

from core.model.group_wire import KIND_V1, decode_group, encode_group, from_record, to_record
from core.model.ledger import Ledger
from core.model.sample import Group, Sample
from ext import codec


def episode(uid: int = 0, version: int = 0) -> Sample:
    """A model turn of 5 tokens (version 0), a tool's answer of 3, a model turn of 4 (version 1,
    a sync landed during the tool call), a second answer of 2, a last model token."""
    s = Sample(uid, 0, uid, 4, np.arange(4, dtype=np.int32))
    s.add_tokens(5, version, [10, 11, 12, 13, 14], [-0.5] * 5)
    s.add_observation([900, 901, 902], version)
    s.add_tokens(4, version + 1, [15, 16, 17, 18], [-0.25] * 4)
    s.add_observation([903, 904], version + 1)
    s.add_tokens(1, version + 1, [19], [-1.0])
    s.finished = True
    return s


def test_an_episode_keeps_its_turns_in_one_response_and_masks_what_tools_wrote():
    s = episode()
    assert s.n_response == len(s.response_tokens) == len(s.logprobs) == 15
    assert s.observations == [[5, 3], [12, 2]] and s.observed == 5
    assert s.response_tokens[5:8].tolist() == [900, 901, 902] and s.logprobs[5:8].tolist() == [0.0] * 3
    assert s.loss_mask().tolist() == [1] * 5 + [0] * 3 + [1] * 4 + [0] * 2 + [1]
    # Versions: every token has one (the arrays stay aligned); the policy's own are 5 at 0, 5 at 1.
    assert s.version_spans == [[0, 8], [1, 7]]
    assert s.sampled_spans() == [[0, 5], [1, 5]]
    # Two answers in a row are one span; an empty one adds nothing.
    s.add_observation([905], 1)
    s.add_observation([906, 907], 1)
    s.add_observation([], 1)
    assert s.observations == [[5, 3], [12, 2], [15, 3]] and s.n_response == 18


def test_a_single_completion_has_no_observations_and_no_list_for_them():
    s = Sample(0, 0, 0, 4)
    s.add_tokens(3, 0, [1, 2, 3], [-1.0] * 3)
    assert s.observations == () and s.observed == 0
    assert s.sampled_spans() is s.version_spans and s.loss_mask().tolist() == [1.0] * 3


def test_sampled_spans_are_the_versions_of_exactly_the_unmasked_tokens():
    """Against the per-token reading, over random episodes: turns of random lengths and
    versions, answers of random lengths, in any order."""
    rng = np.random.default_rng(7)
    for _ in range(300):
        s, v = Sample(0, 0, 0, 1), 0
        for _ in range(int(rng.integers(1, 8))):
            v += int(rng.integers(0, 2))
            k = int(rng.integers(0, 5))
            if rng.random() < 0.5:
                s.add_tokens(k, v, rng.integers(0, 50, k), np.full(k, -1.0))
            else:
                s.add_observation(rng.integers(0, 50, k), v)
        per_token = s.token_versions()[s.loss_mask() == 1.0]
        spans = s.sampled_spans()
        assert np.array_equal(np.repeat([a for a, _ in spans], [k for _, k in spans]).astype(np.int64), per_token)
        assert all(k > 0 for _, k in spans) and all(a[0] != b[0] for a, b in zip(spans, spans[1:]))


def test_observations_cross_processes_with_the_group_and_without_its_tokens():
    g = Group(0, [episode(0), episode(1, version=2)], version=0, admitted_at=0.0)
    back = decode_group(encode_group(g))
    for a, b in zip(g.samples, back.samples):
        assert b.observations == a.observations and b.version_spans == a.version_spans
        assert np.array_equal(b.response_tokens, a.response_tokens) and np.array_equal(b.loss_mask(), a.loss_mask())
    plain = decode_group(encode_group(Group(0, [Sample(5, 0, 0, 4)], version=0, admitted_at=0.0)))
    assert plain.samples[0].observations == ()
    bare = g.without_tokens()
    assert bare.samples[1].observations == g.samples[1].observations
    assert bare.samples[1].observations is not g.samples[1].observations  # a copy: the holder's stay its own
    fresh = Group(0, [Sample(0, 0, 0, 4), Sample(1, 0, 1, 4)], version=0, admitted_at=0.0)
    fresh.take_generation(back)
    assert fresh.samples[0].observations == [[5, 3], [12, 2]]


def test_a_record_of_the_first_kind_reads_as_a_group_without_observations():
    """A checkpoint's queue written before observations existed still loads."""
    s = Sample(3, 0, 0, 4)
    s.add_tokens(2, 0, [1, 2], [-1.0, -1.0])
    rec = to_record(Group(0, [s], version=0, admitted_at=0.0))
    arrays = {k: v for k, v in rec.arrays.items() if k not in ("obs", "obs_offsets")}
    old = codec.Sample(arrays=arrays, meta={**rec.meta, "kind": KIND_V1})
    back = from_record(codec.decode(codec.encode(old)))
    assert back.samples[0].observations == () and back.samples[0].response_tokens.tolist() == [1, 2]


@pytest.mark.parametrize("obs", [
    np.array([[2, 14]], dtype=np.int64),  # past the response
    np.array([[5, 3], [6, 1]], dtype=np.int64),  # overlapping
    np.array([[5, 0]], dtype=np.int64),  # empty
    np.array([[5, 3]], dtype=np.int32),  # not int64
])
def test_observations_that_do_not_fit_the_response_are_refused(obs):
    rec = to_record(Group(0, [episode()], version=0, admitted_at=0.0))
    arrays = dict(rec.arrays)
    arrays["obs"], arrays["obs_offsets"] = obs, np.array([0, len(obs)], dtype=np.int64)
    with pytest.raises(codec.CodecError, match="obs"):
        from_record(codec.decode(codec.encode(codec.Sample(arrays=arrays, meta=rec.meta))))


def test_the_ledger_counts_observation_tokens_apart_and_their_staleness_not_at_all():
    led = Ledger(max_staleness=4)
    g = Group(0, [episode(0), episode(1)], version=0, admitted_at=0.0)
    led.admitted(g)
    led.trained_groups([g], version=3, now=1.0)
    assert led.response_tokens == 30 and led.observation_tokens == 10
    # The policy's tokens: 5 at version 0 and 5 at version 1 per sample, trained at 3.
    assert led.token_staleness_sum == 2 * (5 * 3 + 5 * 2)
    # A checkpoint written before the count restores it as zero; one written since, as it was.
    state = led.state()
    again = Ledger(max_staleness=4)
    again.restore(state)
    assert again.observation_tokens == 10
    del state["observation_tokens"]
    older = Ledger(max_staleness=4)
    older.restore(state)
    assert older.observation_tokens == 0 and older.response_tokens == 30
