"""How a Group crosses a process boundary: one ``ext.codec`` record, never a pickle of objects.

``Group`` and ``Sample`` pickle through here (their ``__reduce_ex__``), so Ray, multiprocessing
or anything else that moves them between processes carries codec bytes: a checksummed,
pickle-free layout (docs/sample-format.md) whose decoder can only ever build a Group or raise
``CodecError``. At protocol 5 the bytes travel as one out-of-band buffer.

The record is columnar, one row per sample: fixed-size fields are arrays of length n;
variable-length ones (response tokens and logprobs, version spans, observation spans, prompt
tokens) are concatenated with an offsets array of length n + 1. Token ids are int32 (what
engines emit); logprobs, rewards and times stay float64 so a round trip is exact.
"""

from __future__ import annotations

import pickle

import numpy as np

from core.model.sample import LOGPROB_DTYPE, TOKEN_DTYPE, Group, Sample
from ext import codec

# /2 adds each sample's observation spans (an agent episode's tool output, never trained);
# a /1 record (written before them: a checkpoint's queue) reads as a group without any.
KIND_V1, KIND = "asyncrl.group/1", "asyncrl.group/2"
KINDS = (KIND_V1, KIND)
_TIMES = ("admitted_at", "started_at", "finished_at", "trained_at")


def _offsets(lengths: list[int]) -> np.ndarray:
    out = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=out[1:])
    return out


def _joined(parts: list, dtype) -> np.ndarray:
    """The samples' arrays end to end, in ``dtype``: one copy, no element in Python."""
    if not parts:
        return np.zeros(0, dtype)
    return np.concatenate([np.asarray(p) for p in parts], dtype=dtype, casting="same_kind")


def to_record(group: Group) -> codec.Sample:
    """The group as one codec record: the samples' token arrays concatenated, none read per token."""
    ss = group.samples
    prompts = [s.prompt_tokens for s in ss]
    has_prompt = np.fromiter((p is not None for p in prompts), bool, len(ss))
    prompt_parts = [np.asarray(p).ravel() for p in prompts if p is not None]
    arrays = {
        "uid": np.fromiter((s.uid for s in ss), np.int64, len(ss)),
        "index": np.fromiter((s.index for s in ss), np.int64, len(ss)),
        "n_prompt": np.fromiter((s.n_prompt for s in ss), np.int64, len(ss)),
        "n_response": np.fromiter((s.n_response for s in ss), np.int64, len(ss)),
        "finished": np.fromiter((s.finished for s in ss), bool, len(ss)),
        "interrupts": np.fromiter((s.interrupts for s in ss), np.int64, len(ss)),
        "has_reward": np.fromiter((s.reward is not None for s in ss), bool, len(ss)),
        "reward": np.fromiter((0.0 if s.reward is None else s.reward for s in ss), np.float64, len(ss)),
        "times": np.array([[getattr(s, t) for t in _TIMES] for s in ss], dtype=np.float64).reshape(len(ss), 4),
        "token_offsets": _offsets([len(s.response_tokens) for s in ss]),
        "tokens": _joined([s.response_tokens for s in ss], TOKEN_DTYPE),
        "logprob_offsets": _offsets([len(s.logprobs) for s in ss]),
        "logprobs": _joined([s.logprobs for s in ss], LOGPROB_DTYPE),
        "span_offsets": _offsets([len(s.version_spans) for s in ss]),
        "spans": np.array([sp for s in ss for sp in s.version_spans], dtype=np.int64).reshape(-1, 2),
        "obs_offsets": _offsets([len(s.observations) for s in ss]),
        "obs": np.array([o for s in ss for o in s.observations], dtype=np.int64).reshape(-1, 2),
        "has_prompt": has_prompt,
        "prompt_offsets": _offsets([len(p) for p in prompt_parts]),
        "prompt_tokens": np.concatenate(prompt_parts) if prompt_parts else np.zeros(0, np.int32),
    }
    meta = {
        "kind": KIND,
        "prompt_id": group.prompt_id,
        "version": group.version,
        "admitted_at": group.admitted_at,
        "finished_at": group.finished_at,
        "aborts": group.aborts,
        "resumes": group.resumes,
    }
    return codec.Sample(arrays=arrays, meta=meta)


# What to_record writes, field by field (the four offsets arrays: _check_offsets). A record with
# another kind, dtype or rank is not one of ours: reading it anyway failed outside CodecError
# (AttributeError, IndexError, OverflowError) or gave a Group that cannot be encoded again.
_ARRAY_FIELDS = {
    "uid": ("int64", 1), "index": ("int64", 1), "n_prompt": ("int64", 1), "n_response": ("int64", 1),
    "finished": ("bool", 1), "interrupts": ("int64", 1), "has_reward": ("bool", 1), "reward": ("float64", 1),
    "times": ("float64", 2), "tokens": ("int32", 1), "logprobs": ("float64", 1), "spans": ("int64", 2),
    "has_prompt": ("bool", 1), "prompt_tokens": (None, 1),
}
_META_FIELDS = {
    "prompt_id": (int,), "version": (int,), "aborts": (int,), "resumes": (int,),
    "admitted_at": (int, float), "finished_at": (int, float),
}


def _what(v) -> str:
    return f"{v.dtype}{list(v.shape)}" if isinstance(v, np.ndarray) else type(v).__name__


def _check_fields(rec: codec.Sample) -> None:
    for name, (dtype, ndim) in _ARRAY_FIELDS.items():
        a = rec[name]
        if not isinstance(a, np.ndarray) or (dtype is not None and a.dtype != dtype) or a.ndim != ndim:
            wanted = f"a {ndim}-d {dtype or 'numeric'} array"
            raise codec.CodecError(f"group record: {name} must be {wanted}, got {_what(a)}")
    for name, types in _META_FIELDS.items():
        if type(rec[name]) not in types:
            wanted = " or ".join(t.__name__ for t in types)
            raise codec.CodecError(f"group record: {name} must be {wanted}, got {_what(rec[name])}")


def from_record(rec: codec.Sample) -> Group:
    """The group a record describes; ``CodecError`` if it is not a well-formed group record."""
    try:
        if rec["kind"] not in KINDS:
            raise codec.CodecError(f"not a group record: kind {rec['kind']!r}, expected {KIND!r}")
        _check_fields(rec)
        obs_of = _observations(rec, n := len(rec["uid"]))
        tok_off, lp_off, sp_off = rec["token_offsets"], rec["logprob_offsets"], rec["span_offsets"]
        has_prompt, pr_off = rec["has_prompt"], rec["prompt_offsets"]
        tokens, logprobs, spans, prompt_tokens = rec["tokens"], rec["logprobs"], rec["spans"], rec["prompt_tokens"]
        times = rec["times"]
        _check_offsets("token_offsets", tok_off, n, len(tokens))
        _check_offsets("logprob_offsets", lp_off, n, len(logprobs))
        _check_offsets("span_offsets", sp_off, n, len(spans))
        _check_offsets("prompt_offsets", pr_off, int(has_prompt.sum()), len(prompt_tokens))
        if times.shape != (n, 4) or spans.ndim != 2 or spans.shape[1] != 2:
            raise codec.CodecError(f"group record: times {times.shape} or spans {spans.shape} malformed")
        columns = [rec[k] for k in ("index", "n_prompt", "n_response", "finished", "interrupts", "has_reward", "reward")]
        if any(len(c) != n for c in (*columns, has_prompt)):
            raise codec.CodecError("group record: per-sample columns differ in length")
        samples = []
        p = 0
        for i in range(n):
            prompt = None
            if has_prompt[i]:
                prompt = prompt_tokens[pr_off[p] : pr_off[p + 1]]
                p += 1
            s = Sample(
                uid=int(rec["uid"][i]),
                prompt_id=int(rec["prompt_id"]),
                index=int(columns[0][i]),
                n_prompt=int(columns[1][i]),
                prompt_tokens=prompt,
                # Views into the record: no copy, no element in Python.
                response_tokens=tokens[tok_off[i] : tok_off[i + 1]],
                logprobs=logprobs[lp_off[i] : lp_off[i + 1]],
                n_response=int(columns[2][i]),
                version_spans=spans[sp_off[i] : sp_off[i + 1]].tolist(),
                reward=float(columns[6][i]) if columns[5][i] else None,
                finished=bool(columns[3][i]),
                interrupts=int(columns[4][i]),
                observations=obs_of(i),
            )
            if s.observations and not _within(s.observations, s.n_response):
                raise codec.CodecError(f"group record: sample {s.uid}'s observations {s.observations} leave its {s.n_response} response tokens")
            s.admitted_at, s.started_at, s.finished_at, s.trained_at = (float(x) for x in times[i])
            samples.append(s)
        return Group(
            prompt_id=int(rec["prompt_id"]),
            samples=samples,
            version=int(rec["version"]),
            admitted_at=float(rec["admitted_at"]),
            finished_at=float(rec["finished_at"]),
            aborts=int(rec["aborts"]),
            resumes=int(rec["resumes"]),
        )
    except KeyError as exc:
        raise codec.CodecError(f"group record: missing field {exc.args[0]!r}") from None
    except (TypeError, ValueError) as exc:
        if isinstance(exc, codec.CodecError):
            raise
        raise codec.CodecError(f"group record: {exc}") from None


def _observations(rec: codec.Sample, n: int):
    """Sample ``i``'s observation spans (None: it has none), as a function of ``i``."""
    if rec["kind"] == KIND_V1:
        return lambda i: None
    off, obs = rec["obs_offsets"], rec["obs"]
    if not isinstance(obs, np.ndarray) or obs.dtype != np.int64 or obs.ndim != 2 or obs.shape[1] != 2:
        raise codec.CodecError(f"group record: obs must be a 2-d int64 array of (start, n) rows, got {_what(obs)}")
    _check_offsets("obs_offsets", off, n, len(obs))
    return lambda i: obs[off[i] : off[i + 1]].tolist() if off[i + 1] > off[i] else None


def _within(spans: list[list[int]], n_response: int) -> bool:
    """Spans in order, each of at least one token, none past the response."""
    end = 0
    for start, k in spans:
        if start < end or k < 1:
            return False
        end = start + k
    return end <= n_response


def _check_offsets(name: str, off: np.ndarray, rows: int, total: int) -> None:
    if not isinstance(off, np.ndarray) or off.dtype != np.int64 or off.shape != (rows + 1,):
        raise codec.CodecError(f"group record: {name} must be int64[{rows + 1}], got {_what(off)}")
    if off[0] != 0 or off[-1] != total or (rows and np.any(np.diff(off) < 0)):
        raise codec.CodecError(f"group record: {name} are not a partition of {total} items")


def encode_group(group: Group) -> bytes:
    return codec.encode(to_record(group))


def decode_group(buf) -> Group:
    """A Group from codec bytes; anything else raises ``CodecError``."""
    return from_record(codec.decode(buf))


def _pickled(group: Group, protocol: int):
    """The group's codec bytes as a pickle argument: out of band from protocol 5 on."""
    data = encode_group(group)
    return pickle.PickleBuffer(data) if protocol >= 5 else data


def _decode_with_payload(buf, payload) -> Group:
    group = decode_group(buf)
    group.payload = payload
    return group


def reduce_group(group: Group, protocol: int) -> tuple:
    """``Group.__reduce_ex__``: codec bytes, out of band at protocol 5; a payload (an object
    reference) rides beside them, for the pickler that moves it (Ray's) to track."""
    if group.payload is not None:
        return _decode_with_payload, (_pickled(group, protocol), group.payload)
    return decode_group, (_pickled(group, protocol),)


# -- a group's tokens alone: what an engine hands the trainer by reference ----------------------
TOKENS_KIND = "asyncrl.tokens/1"


def tokens_record(group: Group) -> codec.Sample:
    """The samples' response tokens and logprobs, concatenated, with their offsets."""
    ss = group.samples
    arrays = {
        "token_offsets": _offsets([len(s.response_tokens) for s in ss]),
        "tokens": _joined([s.response_tokens for s in ss], TOKEN_DTYPE),
        "logprobs": _joined([s.logprobs for s in ss], LOGPROB_DTYPE),
    }
    return codec.Sample(arrays=arrays, meta={"kind": TOKENS_KIND, "prompt_id": group.prompt_id})


def encode_tokens(group: Group) -> np.ndarray:
    """``tokens_record`` as codec bytes in a uint8 array: what Ray stores and maps back without a copy."""
    return np.frombuffer(codec.encode(tokens_record(group)), dtype=np.uint8)


def read_tokens(buf, prompt_id: int, n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(offsets, tokens, logprobs) of the ``n`` samples of prompt ``prompt_id`` that
    ``encode_tokens`` wrote, as views into ``buf``; ``CodecError`` for anything else."""
    rec = codec.decode(buf)
    try:
        if rec["kind"] != TOKENS_KIND or rec["prompt_id"] != prompt_id:
            raise codec.CodecError(f"not the tokens of prompt {prompt_id}: {rec['kind']!r}, prompt {rec['prompt_id']!r}")
        off, tokens, logprobs = rec["token_offsets"], rec["tokens"], rec["logprobs"]
    except KeyError as exc:
        raise codec.CodecError(f"tokens record: missing field {exc.args[0]!r}") from None
    for name, a, dtype in (("tokens", tokens, TOKEN_DTYPE), ("logprobs", logprobs, LOGPROB_DTYPE)):
        if not isinstance(a, np.ndarray) or a.dtype != dtype or a.ndim != 1:
            raise codec.CodecError(f"tokens record: {name} must be a 1-d {np.dtype(dtype)} array, got {_what(a)}")
    if len(tokens) != len(logprobs):
        raise codec.CodecError(f"tokens record: {len(tokens)} tokens, {len(logprobs)} logprobs")
    _check_offsets("token_offsets", off, n, len(tokens))
    return off, tokens, logprobs


def attach_tokens(group: Group, buf) -> None:
    """Give ``group``'s samples the tokens ``encode_tokens`` wrote (views into ``buf``, no copy);
    ``CodecError`` if it is not a tokens record of this group, a sample's count included."""
    off, tokens, logprobs = read_tokens(buf, group.prompt_id, group.size)
    counts = np.diff(off)
    want = np.fromiter((s.n_response for s in group.samples), np.int64, group.size)
    if not np.array_equal(counts, want):
        raise codec.CodecError(f"tokens record of prompt {group.prompt_id}: {counts.tolist()} tokens for {want.tolist()} generated")
    for s, a, b in zip(group.samples, off[:-1], off[1:]):
        s.response_tokens, s.logprobs = tokens[a:b], logprobs[a:b]


def _sample_from_wire(buf) -> Sample:
    return decode_group(buf).samples[0]


def reduce_sample(sample: Sample, protocol: int) -> tuple:
    """``Sample.__reduce_ex__``: a lone sample travels as a group of one."""
    alone = Group(prompt_id=sample.prompt_id, samples=[sample], version=-1, admitted_at=sample.admitted_at)
    return _sample_from_wire, (_pickled(alone, protocol),)
