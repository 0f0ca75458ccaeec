"""Structure-aware mutations: decode a valid input, change it the way a crafted file would
(a field's dtype, rank, length, values or kind; a field dropped, added or renamed; records
dropped, duplicated, reordered or moved to another slot; the state JSON replaced), and encode
it again, checksums and all. libFuzzer's byte mutations alone almost never get past the
checksums to these shapes. The fuzz targets use ``mutate`` as atheris's custom mutator, half
of the time, and libFuzzer's own byte mutations the other half; the smoke test
(tests/test_fuzz_smoke.py) uses it with a seeded ``random.Random`` and no atheris.
"""

from __future__ import annotations

import random
import struct
import warnings
from typing import Callable, Optional

import numpy as np

from fuzz import common

DTYPES = [np.dtype(t) for t in ("bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
                                "float16", "float32", "float64")]
# names the readers look up (group records, the checkpoint's state record) and a stranger
NAMES = [
    "uid", "index", "n_prompt", "n_response", "finished", "interrupts", "has_reward", "reward", "times",
    "token_offsets", "tokens", "logprob_offsets", "logprobs", "span_offsets", "spans", "has_prompt",
    "prompt_offsets", "prompt_tokens", "kind", "prompt_id", "version", "admitted_at", "finished_at", "aborts",
    "resumes", "slot", "state", "zz", "a",
]
INTS = [0, 1, -1, 2, 3, 7, 2**31 - 1, -(2**31), 2**32, 2**53 + 1, 2**63 - 1, -(2**63)]
FLOATS = [0.0, -0.0, 0.5, 1.0, -1.0, float("nan"), float("inf"), float("-inf"), 1e308, 5e-324, 2.0**63, -(2.0**64)]
STRS = [
    "", "queued", "interrupted", "holding", "unacked", "asyncrl.group/1", "asyncrl.checkpoint/1", "x", "12", "nan",
    "{}", "[]", "null", "1", '{"a": NaN}', '{"a": Infinity, "b": [1, {"c": null}]}', '{"a": 1e400}',
    '{"\\ud800": "\\udfff"}', '{"a": 1, "a": 2}', "[" * 5000 + "]" * 5000, '{"n": ' + "9" * 5000 + "}", "{",
    '{"step": 3.5, "x": "é"}',
]
_FRAME = struct.Struct("<Q")
_CKPT_HEAD = struct.Struct("<8sHHIQ8x")


def scalar(rng: random.Random):
    kind = rng.randrange(5)
    if kind == 0:
        return rng.choice(INTS) if rng.random() < 0.7 else rng.randrange(-(2**63), 2**63)
    if kind == 1:
        return rng.choice(FLOATS)
    if kind == 2:
        return rng.random() < 0.5
    if kind == 3:
        return None
    return rng.choice(STRS)


def _extreme(dt: np.dtype, rng: random.Random):
    if dt.kind == "b":
        return rng.random() < 0.5
    if dt.kind == "f":
        return rng.choice([np.nan, np.inf, -np.inf, 0.0, -1.0, np.finfo(dt).max, 1e6])
    info = np.iinfo(dt)
    return rng.choice([0, 1, -1 if dt.kind == "i" else 0, info.max, info.min, 2, rng.randrange(info.min, info.max)])


def small_array(rng: random.Random) -> np.ndarray:
    dt = rng.choice(DTYPES)
    shape = tuple(rng.randrange(4) for _ in range(rng.randrange(3)))
    a = np.zeros(shape, dt)
    with warnings.catch_warnings(), np.errstate(all="ignore"):
        warnings.simplefilter("ignore")  # an extreme value that overflows a narrow dtype
        for idx in np.ndindex(*shape):
            a[idx] = _extreme(dt, rng)
    return a


_MAX_EXTENT = 1 << 16  # elements: an empty array may declare (0, 2**60); never build from that


def _change_array(a: np.ndarray, rng: random.Random) -> np.ndarray:
    if int(np.prod([d for d in a.shape if d], dtype=object)) > _MAX_EXTENT:
        return small_array(rng)
    op = rng.randrange(6)
    with warnings.catch_warnings(), np.errstate(all="ignore"):
        warnings.simplefilter("ignore")
        if op == 0:  # another dtype, values converted
            return a.astype(rng.choice(DTYPES))
        if op == 1:  # another rank
            flat = a.reshape(-1)
            choices = [flat, flat[None], flat[:, None], flat.reshape(1, 1, -1)]
            if flat.size % 2 == 0:
                choices.append(flat.reshape(-1, 2))
            if flat.size == 1:
                choices.append(flat.reshape(()))
            return rng.choice(choices)
        if op == 2 and a.ndim and a.shape[0]:  # shorter
            k = rng.randrange(a.shape[0])
            return a[k:] if rng.random() < 0.5 else a[:k]
        if op == 3 and a.ndim:  # longer
            extra = a[: rng.randrange(1, 3)] if a.shape[0] else np.zeros((1, *a.shape[1:]), a.dtype)
            return np.concatenate([a, extra]) if rng.random() < 0.5 else np.concatenate([extra, a])
        if op == 4 and a.size:  # extreme values
            b = a.copy()
            for _ in range(rng.randrange(1, 3)):
                b.reshape(-1)[rng.randrange(b.size)] = _extreme(b.dtype, rng)
            return b
        if op == 5 and a.size > 1:  # values moved around
            b = a.reshape(-1).copy()
            rng.shuffle(b)
            return b.reshape(a.shape)
    return small_array(rng)


def mutate_sample(arrays: dict, meta: dict, rng: random.Random, n_ops: int = 0) -> tuple[dict, dict]:
    """``arrays``/``meta`` with one to three structural changes (new dicts)."""
    arrays, meta = dict(arrays), dict(meta)
    for _ in range(n_ops or rng.randint(1, 3)):
        names = list(arrays) + list(meta)
        op = rng.randrange(8)
        name = rng.choice(names) if names else rng.choice(NAMES)
        if op <= 2 and arrays:
            k = rng.choice(list(arrays))
            arrays[k] = _change_array(arrays[k], rng)
        elif op == 3 and meta:
            meta[rng.choice(list(meta))] = scalar(rng)
        elif op == 4:  # a field changes kind: array <-> scalar
            if name in arrays:
                del arrays[name]
                meta[name] = scalar(rng)
            else:
                meta.pop(name, None)
                arrays[name] = small_array(rng)
        elif op == 5 and names:  # dropped
            arrays.pop(name, None)
            meta.pop(name, None)
        elif op == 6:  # added, or replaced
            new = rng.choice(NAMES)
            arrays.pop(new, None)
            meta.pop(new, None)
            if rng.random() < 0.5:
                arrays[new] = small_array(rng)
            else:
                meta[new] = scalar(rng)
        elif op == 7 and names:  # renamed
            new = rng.choice(NAMES)
            value = arrays.pop(name) if name in arrays else meta.pop(name)
            arrays.pop(new, None)
            meta.pop(new, None)
            (arrays if isinstance(value, np.ndarray) else meta)[new] = value
    return arrays, meta


def _encode(arrays: dict, meta: dict) -> Optional[bytes]:
    from ext import codec

    try:
        return codec.encode(codec.Sample(arrays, meta))
    except (TypeError, ValueError):  # e.g. a str that is not valid UTF-8
        return None


def mutate_record(rec: bytes, rng: random.Random) -> Optional[bytes]:
    """A structural mutation of one codec record; None if ``rec`` does not decode."""
    from ext import codec

    try:
        s = codec.decode(rec)
    except codec.CodecError:
        return None
    return _encode(*mutate_sample(s.arrays, s.meta, rng))


def split_checkpoint(buf: bytes) -> Optional[list[bytes]]:
    """The records of a well-framed checkpoint, or None."""
    if len(buf) < _CKPT_HEAD.size:
        return None
    *_, count, _ = _CKPT_HEAD.unpack_from(buf, 0)
    records, at = [], _CKPT_HEAD.size
    for _ in range(count):
        if len(buf) - at < _FRAME.size:
            return None
        (n,) = _FRAME.unpack_from(buf, at)
        at += _FRAME.size
        if n > len(buf) - at:
            return None
        records.append(buf[at : at + n])
        at += n
    return records


def join_checkpoint(records: list[bytes]) -> bytes:
    from core.store.checkpoint import FORMAT_VERSION, MAGIC

    payload = b"".join(_FRAME.pack(len(r)) + r for r in records)
    return _CKPT_HEAD.pack(MAGIC, FORMAT_VERSION, 0, len(records), len(payload)) + payload


def mutate_checkpoint_records(records: list[bytes], rng: random.Random) -> list[bytes]:
    records = list(records)
    op = rng.randrange(6)
    if op <= 2 and records:  # one record changed structurally
        i = rng.randrange(len(records))
        new = mutate_record(records[i], rng)
        if new is not None:
            records[i] = new
    elif op == 3 and records:  # dropped
        del records[rng.randrange(len(records))]
    elif op == 4 and records:  # duplicated
        i = rng.randrange(len(records))
        records.insert(rng.randrange(len(records) + 1), records[i])
    elif op == 5 and len(records) > 1:  # swapped
        i, j = rng.sample(range(len(records)), 2)
        records[i], records[j] = records[j], records[i]
    return records


def byte_mutate(data: bytes, rng: random.Random) -> bytes:
    """A few bit flips, byte sets, deletions or insertions (the smoke test's stand-in for
    libFuzzer's mutators)."""
    b = bytearray(data)
    for _ in range(rng.randint(1, 4)):
        op = rng.randrange(4)
        if op == 0 and b:
            b[rng.randrange(len(b))] ^= 1 << rng.randrange(8)
        elif op == 1 and b:
            b[rng.randrange(len(b))] = rng.choice([0, 1, 0x7F, 0x80, 0xFF, rng.randrange(256)])
        elif op == 2 and len(b) > 1:
            i = rng.randrange(len(b))
            del b[i : i + rng.randint(1, 64)]
        else:
            i = rng.randrange(len(b) + 1)
            b[i:i] = bytes(rng.randrange(256) for _ in range(rng.randint(1, 8)))
    return bytes(b)


def structural(target: str, data: bytes, rng: random.Random) -> Optional[bytes]:
    """A structural mutation of fuzz input ``data`` for ``target`` (control byte: repair on);
    None where ``data`` is not well-formed enough to start from, or the change cannot be made."""
    try:
        if target == "fuzz_codec":
            rec = mutate_record(common.codec_payload(data), rng)
            return None if rec is None else bytes([common.REPAIR]) + rec
        records = split_checkpoint(common.checkpoint_payload(data))
        if records is None:
            return None
        return bytes([common.REPAIR]) + join_checkpoint(mutate_checkpoint_records(records, rng))
    except (MemoryError, ValueError, TypeError, OverflowError):  # the mutator's, not the target's
        return None


def custom_mutator(target: str, byte_level: Callable[[bytes, int], bytes]):
    """atheris's ``custom_mutator`` for ``target``: half structural, half ``byte_level``
    (``atheris.Mutate``), which also takes over where the structure does not parse."""

    def mutator(data: bytes, max_size: int, seed: int) -> bytes:
        rng = random.Random(seed)
        if rng.random() < 0.5:
            out = structural(target, data, rng)
            if out is not None and len(out) <= max_size:
                return out
        out = byte_level(data, max_size)
        if out and rng.random() < 0.1:  # sometimes flip the control byte's repair bit
            out = bytes([out[0] ^ common.REPAIR]) + out[1:]
        return out

    return mutator
