"""atheris target: ``ext.codec.decode`` and ``core.model.group_wire.decode_group`` on the same bytes.

    .venv/bin/python -m fuzz.fuzz_codec CORPUS_DIR [SEED_DIR ...] [-runs=N] [libFuzzer flags]

(``make fuzz`` drives it through fuzz/run.py.) The only exception either decoder may raise
is ``ext.errors.CodecError``; anything else escapes and is a crash. On success:

* ``codec.encode(codec.decode(b)) == b`` (the encoding is canonical),
* ``decode_group`` accepts only what ``codec.decode`` accepts,
* a decoded group re-encodes, decodes again, and re-encodes to the same bytes.

The first input byte is the control byte of fuzz/common.py (repair the checksum or not).
The backend is ``ASYNCRL_PUREPYTHON``'s: with 1 the pure-Python decoder is instrumented for
coverage; with 0 the compiled decoder is not (it is not built with libFuzzer's
instrumentation), so coverage feedback comes from the Python code around it only.
"""

from __future__ import annotations

from fuzz import common

codec = group_wire = CodecError = None


def setup() -> None:
    """Bind the modules under test (imported here so ``main`` can instrument them first)."""
    global codec, group_wire, CodecError
    common.load()
    from core.model import group_wire
    from ext import codec
    from ext.errors import CodecError


def TestOneInput(data: bytes) -> None:
    buf = common.codec_payload(data)
    try:
        sample = codec.decode(buf)
    except CodecError:
        sample = None
    else:
        common.check(codec.encode(sample) == buf, "codec: encode(decode(b)) != b")
    try:
        group = group_wire.decode_group(buf)
    except CodecError:
        return
    common.check(sample is not None, "decode_group accepted bytes that codec.decode rejects")
    again = group_wire.encode_group(group)
    regroup = group_wire.decode_group(again)
    common.check(group_wire.encode_group(regroup) == again, "group: encode(decode(encode(g))) != encode(g)")
    common.check(
        (regroup.prompt_id, regroup.version, len(regroup.samples)) == (group.prompt_id, group.version, len(group.samples)),
        "group: round trip changed the group",
    )


def main(argv: list[str] | None = None) -> None:
    common.fuzz("fuzz_codec", setup, TestOneInput, argv)


if __name__ == "__main__":
    main()
