"""What both fuzz targets share: the input framing, checksum repair, seed corpora, and the
round-trip comparisons.

Every codec record carries a checksum over its whole encoding, so nearly every byte a
mutator changes is rejected at the checksum check and the parser behind it is never
reached. The first byte of every fuzz input is therefore a control byte: when its low bit
is set the harness *repairs* the payload before decoding it (the codec header's total size
is set to the payload length and the checksum recomputed; in a checkpoint, the header's
payload size, and every record its frames lead to), so mutations of the field table,
shapes, offsets and values reach the structural checks and the group and checkpoint
readers. With the bit clear the payload is decoded exactly as given. Seeds come in both
forms.

Imports of ``core``/``ext`` happen in ``load()``, so a target's ``main`` can instrument
them (``atheris.instrument_imports``) before they are first imported.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

REPAIR = 0x01
_U64 = struct.Struct("<Q")
_CODEC_TOTAL_AT, _CODEC_CHECKSUM_AT = 16, 32
_CKPT_HEADER, _CKPT_SIZE_AT, _CKPT_FRAME = 32, 16, 8


class FuzzFailure(AssertionError):
    """A decoded input that breaks a round-trip property (a finding, like a crash)."""


def load():
    """Import the modules under test (call inside ``atheris.instrument_imports``)."""
    from core.model import group_wire  # noqa: F401
    from core.store import checkpoint  # noqa: F401
    from ext import codec  # noqa: F401


# ---------------------------------------------------------------------------------------------
# input framing


def _repair_record(buf: bytearray, lo: int, hi: int) -> None:
    """Fix the total size and checksum of the codec record in ``buf[lo:hi]``, where it can
    have one (a positive whole number of 64-byte blocks)."""
    from ext import codec

    n = hi - lo
    if n < 64 or n % 64:
        return
    _U64.pack_into(buf, lo + _CODEC_TOTAL_AT, n)
    _U64.pack_into(buf, lo + _CODEC_CHECKSUM_AT, codec.checksum(memoryview(buf)[lo:hi]))


def codec_payload(data: bytes) -> bytes:
    """The codec bytes a fuzz input stands for."""
    if not data:
        return b""
    if not data[0] & REPAIR:
        return data[1:]
    buf = bytearray(data[1:])
    _repair_record(buf, 0, len(buf))
    return bytes(buf)


def checkpoint_payload(data: bytes) -> bytes:
    """The checkpoint file bytes a fuzz input stands for."""
    if not data:
        return b""
    if not data[0] & REPAIR:
        return data[1:]
    buf = bytearray(data[1:])
    n = len(buf)
    if n < _CKPT_HEADER:
        return bytes(buf)
    _U64.pack_into(buf, _CKPT_SIZE_AT, n - _CKPT_HEADER)
    at = _CKPT_HEADER
    while n - at >= _CKPT_FRAME:
        (length,) = _U64.unpack_from(buf, at)
        at += _CKPT_FRAME
        if length > n - at:
            break
        _repair_record(buf, at, at + length)
        at += length
    return bytes(buf)


# ---------------------------------------------------------------------------------------------
# seeds: valid encodings for the mutator to start from


def seed_groups() -> list:
    """A few groups covering the record's shapes: prompts or none, rewards or none, NaN
    times, empty token lists, a group of none."""
    import numpy as np

    from core.model.sample import Group, Sample

    prompt = np.arange(5, dtype=np.int32)
    rich = []
    for i in range(3):
        s = Sample(uid=100 + i, prompt_id=7, index=i, n_prompt=5, prompt_tokens=prompt if i != 1 else None)
        s.add_tokens(2, version=3, tokens=[11 + i, 12], logprobs=[-0.5, -1.25])
        s.add_tokens(1, version=4, tokens=[13], logprobs=[float("nan")])
        s.finished = i != 2
        s.reward = None if i == 0 else 0.5 * i
        s.interrupts = i
        s.admitted_at, s.started_at = 1.0, 1.5
        rich.append(s)
    counted = Sample(uid=5, prompt_id=2, index=0, n_prompt=12, n_response=40, version_spans=[[0, 40]], finished=True)
    return [
        Group(prompt_id=7, samples=rich, version=3, admitted_at=1.0, aborts=1, resumes=1),
        Group(prompt_id=2, samples=[counted], version=0, admitted_at=0.0, finished_at=9.5),
        Group(prompt_id=-1, samples=[], version=-1, admitted_at=float("inf")),
    ]


def seed_snapshots() -> list:
    """A few checkpoints: groups in every slot, state JSON with nesting and non-finite floats,
    arrays of several dtypes, and one without groups or arrays."""
    import numpy as np

    from core.store.checkpoint import SLOTS, Snapshot

    g = seed_groups()
    full = Snapshot(
        state={"step": 12, "version": 3, "rng": [1, 2, 3], "queue": {"lead": 1.5, "nan": float("nan")}, "name": "é"},
        groups={slot: [g[i % len(g)]] for i, slot in enumerate(SLOTS)},
        arrays={"seen": np.arange(4, dtype=np.int64), "loss": np.array([0.5, float("inf")]), "mask": np.ones((2, 2), bool)},
    )
    two = Snapshot(state={"step": 1}, groups={**{s: [] for s in SLOTS}, "queued": [g[1], g[2]], "unacked": [g[0]]})
    empty = Snapshot(state={})
    return [full, two, empty]


def seeds() -> dict[str, list[bytes]]:
    """Seed inputs (control byte included) per target name."""
    from core.store.checkpoint import encode
    from core.model.group_wire import encode_group

    groups = [encode_group(g) for g in seed_groups()]
    ckpts = [encode(s) for s in seed_snapshots()]
    return {
        "fuzz_codec": [bytes([c]) + b for b in groups for c in (0, REPAIR)],
        "fuzz_checkpoint": [bytes([c]) + b for b in ckpts for c in (0, REPAIR)],
    }


def write_seeds(target: str, directory: Path) -> int:
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    items = seeds()[target]
    for i, b in enumerate(items):
        (directory / f"seed-{i:02d}").write_bytes(b)
    return len(items)


# ---------------------------------------------------------------------------------------------
# comparisons


def check(ok: bool, what: str) -> None:
    if not ok:
        raise FuzzFailure(what)


def same_state(a: dict, b: dict) -> bool:
    """Equal JSON state (NaN equal to NaN: compared through their JSON text)."""
    dump = lambda s: json.dumps(s, allow_nan=True, separators=(",", ":"))  # noqa: E731
    return dump(a) == dump(b)


def same_arrays(a: dict, b: dict) -> bool:
    if list(a) != list(b):
        return False
    return all(a[k].dtype == b[k].dtype and a[k].shape == b[k].shape and a[k].tobytes() == b[k].tobytes() for k in a)


def fuzz(target: str, setup, test_one_input, argv: list[str] | None = None) -> None:
    """Run one target under libFuzzer: ``core``/``ext`` instrumented as ``setup`` imports
    them, half of the mutations structural (``fuzz/mutate.py``)."""
    import sys

    import atheris

    with atheris.instrument_imports(include=["core", "ext"]):
        setup()
    from fuzz.mutate import custom_mutator

    mutator = custom_mutator(target, lambda data, max_size: atheris.Mutate(data, max_size))
    atheris.Setup(sys.argv if argv is None else argv, test_one_input, custom_mutator=mutator)
    atheris.Fuzz()
