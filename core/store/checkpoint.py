"""Checkpoints on disk: one file of codec records, written atomically, read without pickle.

A checkpoint file is a 32-byte header and a run of records, each a u64 length and one
``ext.codec`` encoding (itself checksummed). Record 0 is the state (``asyncrl.checkpoint/1``:
a JSON string and a few arrays); every later record is a group (``core.model.group_wire``) with
a ``slot`` that says where it was: queued, interrupted (a partial generation), waiting to
be generated again after its worker died, or held by the trainer. Tensors (trainer weights and optimizer) go beside it as
safetensors files. ``decode`` is the only reader of the bytes, and it either returns a
``Snapshot`` or raises ``CheckpointError`` naming the file and the byte offset.

Layout of the header (little-endian):

    0   8  magic  b"\\x89ARLCKP\\n"
    8   2  u16    format version (1)
    10  2  u16    flags (0)
    12  4  u32    number of records
    16  8  u64    payload size: bytes after the header
    24  8         reserved, zero
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import struct
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

import numpy as np

from core.model.bounded_parse import loads_json
from core.model.group_wire import from_record, to_record
from core.model.sample import Group
from core.model.owned import discard_owned, is_owned, make_owned, remove_owned, remove_stale, umask_mode
from core.model.regular_file import UnreadableFile, read_regular
from ext import codec

log = logging.getLogger(__name__)

MAGIC = b"\x89ARLCKP\n"
FORMAT_VERSION = 1
HEADER = struct.Struct("<8sHHIQ8x")
FRAME = struct.Struct("<Q")
STATE_KIND = "asyncrl.checkpoint/1"
SLOTS = ("queued", "interrupted", "retry", "holding")
# Far above any real checkpoint; bounds what a crafted header can make a reader allocate.
MAX_RECORDS = 1 << 24
MAX_FILE_BYTES = 1 << 40  # what a checkpoint file may be: only a bound on what a wrong file makes a reader take
# The suffix of a file write_atomic has not yet renamed into place: one a killed process left.
PARTIAL = ".partial"


class CheckpointError(Exception):
    """A checkpoint that cannot be used: where (file, byte offset), what, and the fix."""

    def __init__(self, where: str, problem: str, fix: str, offset: Optional[int] = None) -> None:
        self.where, self.problem, self.fix, self.offset = where, problem, fix, offset
        at = f" byte {offset}:" if offset is not None else ""
        super().__init__(f"{where}:{at} {problem}; fix: {fix}")


CORRUPT_FIX = "delete this checkpoint to resume from the one before it, or start the run again"


@dataclass
class Snapshot:
    """What a checkpoint holds: the components' state, their groups by slot, arrays."""

    state: dict
    groups: dict[str, list[Group]] = field(default_factory=lambda: {s: [] for s in SLOTS})
    arrays: dict[str, np.ndarray] = field(default_factory=dict)


def encode(snap: Snapshot) -> bytes:
    """The checkpoint file's bytes."""
    head = codec.Sample(
        arrays=dict(snap.arrays),
        meta={"kind": STATE_KIND, "state": json.dumps(snap.state, allow_nan=True, separators=(",", ":"))},
    )
    records = [codec.encode(head)]
    for slot in SLOTS:
        for g in snap.groups.get(slot, []):
            rec = to_record(g)
            rec = codec.Sample(arrays=rec.arrays, meta={**rec.meta, "slot": slot})
            records.append(codec.encode(rec))
    payload = b"".join(FRAME.pack(len(r)) + r for r in records)
    return HEADER.pack(MAGIC, FORMAT_VERSION, 0, len(records), len(payload)) + payload


def decode(buf: bytes, where: str = "checkpoint") -> Snapshot:
    """A Snapshot from a checkpoint file's bytes; ``CheckpointError`` for anything else."""
    mv = memoryview(buf)
    n = len(mv)
    if n < HEADER.size:
        raise CheckpointError(where, f"truncated: {n} bytes, less than the {HEADER.size}-byte header", CORRUPT_FIX, n)
    magic, version, flags, count, size = HEADER.unpack_from(mv, 0)
    if magic != MAGIC:
        raise CheckpointError(where, "not an asyncrl checkpoint (bad magic)", "pass a checkpoint file or a run directory", 0)
    if version != FORMAT_VERSION:
        raise CheckpointError(
            where, f"format version {version}, this build reads {FORMAT_VERSION}",
            "resume with the asyncrl version that wrote it, or start the run again", 8,
        )
    if flags:
        raise CheckpointError(where, f"unknown flags {flags:#06x}", CORRUPT_FIX, 10)
    if n - HEADER.size != size:
        problem = "truncated" if n - HEADER.size < size else "trailing bytes"
        raise CheckpointError(where, f"{problem}: header says {size} payload bytes, file has {n - HEADER.size}", CORRUPT_FIX, n)
    if not 1 <= count <= MAX_RECORDS:
        raise CheckpointError(where, f"record count {count} out of range", CORRUPT_FIX, 12)
    snap = Snapshot(state={})
    at = HEADER.size
    for i in range(count):
        if n - at < FRAME.size:
            raise CheckpointError(where, f"record {i}: truncated frame", CORRUPT_FIX, at)
        (length,) = FRAME.unpack_from(mv, at)
        at += FRAME.size
        if length > n - at:
            raise CheckpointError(where, f"record {i}: length {length} runs past the end", CORRUPT_FIX, at - FRAME.size)
        try:
            rec = codec.decode(mv[at : at + length])
            if i == 0:
                _read_state(rec, snap)
            else:
                slot = rec["slot"] if "slot" in rec.meta else None
                if slot not in SLOTS:
                    raise codec.CodecError(f"group record with slot {slot!r}, expected one of {SLOTS}")
                snap.groups[slot].append(from_record(rec))
        except codec.CodecError as exc:
            raise CheckpointError(where, f"record {i}: {exc}", CORRUPT_FIX, at) from None
        at += length
    if at != n:
        raise CheckpointError(where, f"{n - at} bytes after the last record", CORRUPT_FIX, at)
    return snap


def _read_state(rec: codec.Sample, snap: Snapshot) -> None:
    if "kind" not in rec.meta or rec["kind"] != STATE_KIND:
        raise codec.CodecError(f"first record is not the state ({STATE_KIND})")
    text = rec["state"] if "state" in rec.meta else None
    if not isinstance(text, str):
        raise codec.CodecError("state record without its JSON")
    try:
        state = loads_json(text)
    except (ValueError, RecursionError) as exc:
        raise codec.CodecError(f"state JSON unreadable: {exc}") from None
    if not isinstance(state, dict):
        raise codec.CodecError("state JSON is not an object")
    snap.state = state
    snap.arrays = {k: np.array(v) for k, v in rec.arrays.items()}


# -- files -------------------------------------------------------------------------------------
def write_atomic(path: Path, data: bytes) -> None:
    """Write, fsync, rename, fsync the directory: the file is there whole or not at all."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=PARTIAL, dir=path.parent)
    try:
        os.fchmod(fd, umask_mode(0o666))  # mkstemp's 0600 would hide the file from its readers
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    fsync_dir(path.parent)


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


STATE_FILE = "state.ckpt"


SHARDS_DIR = "shards"


def save(root: Path, step: int, snap: Snapshot, tensors: Optional[dict[str, dict]] = None, keep: Optional[int] = 2,
         shards: Optional[Callable[[Path], None]] = None) -> Path:
    """Write checkpoint ``root/step-NNNNNN/`` atomically (built aside, fsynced, renamed) and
    keep the newest ``keep`` (None: prune nothing; the caller does once the checkpoint is
    complete). ``tensors`` maps a file stem to a safetensors dict; ``shards`` writes a sharded
    trainer's files (every rank's) into the directory it is given, before the rename."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step-{step:06d}"
    remove_stale(root, ("checkpoint",))
    tmp = make_owned(root, f".{final.name}.", "checkpoint")
    try:
        write_atomic(tmp / STATE_FILE, encode(snap))
        for stem, tens in (tensors or {}).items():
            from safetensors.numpy import save as st_save

            write_atomic(tmp / f"{stem}.safetensors", st_save({k: np.ascontiguousarray(v) for k, v in tens.items()}))
        if shards is not None:
            (tmp / SHARDS_DIR).mkdir()
            shards(tmp / SHARDS_DIR)
            for f in (tmp / SHARDS_DIR).iterdir():
                with open(f, "rb") as fh:
                    os.fsync(fh.fileno())
            fsync_dir(tmp / SHARDS_DIR)
        remove_owned(final, "checkpoint")
        os.rename(tmp, final)
        fsync_dir(root)
    except BaseException:
        discard_owned(tmp, "checkpoint")
        raise
    if keep is not None:
        prune(root, keep)
    return final


def prune(root: Path, keep: int) -> None:
    """Remove all but the newest ``keep`` checkpoints in ``root``: only those asyncrl stamped."""
    for old in checkpoints(root)[:-keep]:
        if is_owned(old, "checkpoint"):
            remove_owned(old, "checkpoint")
        else:  # written before checkpoints were stamped, or not by asyncrl: never removed
            log.warning("%s: not stamped as asyncrl's checkpoint; left in place", old)


def checkpoints(root: Path) -> list[Path]:
    """Complete checkpoints under ``root``, oldest first (directories being written start with '.')."""
    root = Path(root)
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if p.is_dir() and p.name.startswith("step-") and p.name[5:].isdigit())


def latest(root: Path) -> Optional[Path]:
    found = checkpoints(root)
    return found[-1] if found else None


def read_file(f: Path, fix: str = "resume from a run directory that has checkpoints") -> bytes:
    """A checkpoint file's bytes; ``CheckpointError`` if it is missing or is not a regular file
    (a FIFO in its place would block the read forever)."""
    try:
        return read_regular(f, MAX_FILE_BYTES, fix)
    except UnreadableFile as exc:
        raise CheckpointError(str(f), exc.problem, exc.fix) from None


def load(path: Path) -> Snapshot:
    """Read ``path/state.ckpt``; every problem is a ``CheckpointError``."""
    f = Path(path) / STATE_FILE
    return decode(read_file(f), str(f))


def load_tensors(path: Path, stem: str) -> dict[str, np.ndarray]:
    """A safetensors file of a checkpoint (safetensors holds raw tensors: no code runs on load)."""
    from safetensors import SafetensorError
    from safetensors.numpy import load as st_load

    f = Path(path) / f"{stem}.safetensors"
    data = read_file(f, CORRUPT_FIX)
    try:
        return st_load(data)
    except (SafetensorError, ValueError) as exc:
        raise CheckpointError(str(f), f"not a valid safetensors file ({exc})", CORRUPT_FIX) from None
