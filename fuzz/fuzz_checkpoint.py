"""atheris target: ``core.store.checkpoint.decode``, the reader of checkpoint files.

    .venv/bin/python -m fuzz.fuzz_checkpoint CORPUS_DIR [SEED_DIR ...] [-runs=N] [libFuzzer flags]

(``make fuzz`` drives it through fuzz/run.py.) The only exception ``decode`` may raise is
``core.store.checkpoint.CheckpointError``; anything else escapes and is a crash. On success,
``encode(snapshot)`` decodes again to an equal snapshot (state, arrays, groups by slot), and
encoding that gives the same bytes.

The first input byte is the control byte of fuzz/common.py (repair the header's payload
size and every record's checksum, or not). Backends as in fuzz/fuzz_codec.py.
"""

from __future__ import annotations

from fuzz import common

checkpoint = group_wire = None


def setup() -> None:
    """Bind the modules under test (imported here so ``main`` can instrument them first)."""
    global checkpoint, group_wire
    common.load()
    from core.model import group_wire
    from core.store import checkpoint


def TestOneInput(data: bytes) -> None:
    buf = common.checkpoint_payload(data)
    try:
        snap = checkpoint.decode(buf, "fuzz")
    except checkpoint.CheckpointError:
        return
    again = checkpoint.encode(snap)
    back = checkpoint.decode(again, "fuzz re-encoded")
    common.check(common.same_state(snap.state, back.state), "checkpoint: state changed in a round trip")
    common.check(common.same_arrays(snap.arrays, back.arrays), "checkpoint: arrays changed in a round trip")
    for slot in checkpoint.SLOTS:
        mine = [group_wire.encode_group(g) for g in snap.groups[slot]]
        theirs = [group_wire.encode_group(g) for g in back.groups[slot]]
        common.check(mine == theirs, f"checkpoint: groups in slot {slot!r} changed in a round trip")
    common.check(checkpoint.encode(back) == again, "checkpoint: encode(decode(encode(s))) != encode(s)")


def main(argv: list[str] | None = None) -> None:
    common.fuzz("fuzz_checkpoint", setup, TestOneInput, argv)


if __name__ == "__main__":
    main()
