"""The fuzz targets (fuzz/) run in-process on a few thousand random, bit-flipped and
structurally mutated inputs, on whichever backend this run selected, without atheris: what
``make fuzz`` does at scale, small enough for every test run. And no library code reads
untrusted bytes with pickle."""

import random
import re
import traceback
from pathlib import Path

import pytest

from core.model import group_wire
from core.store import checkpoint
from ext import codec
from ext.errors import CodecError
from fuzz import common, fuzz_checkpoint, fuzz_codec, mutate

TARGETS = {"fuzz_codec": fuzz_codec, "fuzz_checkpoint": fuzz_checkpoint}
MAGICS = {"fuzz_codec": codec.MAGIC, "fuzz_checkpoint": checkpoint.MAGIC}
ROOT = Path(__file__).resolve().parent.parent

for _target in TARGETS.values():
    _target.setup()


def fuzz_inputs(target: str, n: int, seed: int):
    """``n`` inputs: random bytes, random bytes behind the right magic, byte mutations of
    the seeds, and chains of structural mutations (each output can seed the next)."""
    rng = random.Random(seed)
    pool = list(common.seeds()[target])
    for _ in range(n):
        r = rng.random()
        if r < 0.1:
            data = bytes(rng.randrange(256) for _ in range(rng.randrange(300)))
        elif r < 0.2:
            body = bytes(rng.randrange(256) for _ in range(rng.choice([56, 120, 184, 500])))
            data = bytes([rng.randrange(2)]) + MAGICS[target] + body
        elif r < 0.5:
            data = mutate.byte_mutate(rng.choice(pool), rng)
            if rng.random() < 0.5:
                data = bytes([data[0] | common.REPAIR]) + data[1:] if data else data
        else:
            data = mutate.structural(target, rng.choice(pool), rng) or mutate.byte_mutate(rng.choice(pool), rng)
            if len(pool) < 200:
                pool.append(data)
        yield data


@pytest.mark.parametrize("target, n", [("fuzz_codec", 2500), ("fuzz_checkpoint", 1500)])
def test_fuzz_target_survives_random_and_mutated_inputs(target, n):
    one_input = TARGETS[target].TestOneInput
    for i, data in enumerate(fuzz_inputs(target, n, seed=20240 + n)):
        try:
            one_input(data)
        except Exception:
            pytest.fail(f"{target} input {i} ({len(data)} bytes) crashed:\n{traceback.format_exc()}\ninput: {data.hex()}")


def test_the_seeds_are_valid_and_pass_the_targets():
    for target, seeds in common.seeds().items():
        assert len(seeds) >= 6
        for data in seeds:
            TARGETS[target].TestOneInput(data)
    for data in common.seeds()["fuzz_codec"]:
        group_wire.decode_group(common.codec_payload(data))
    slots = set()
    for data in common.seeds()["fuzz_checkpoint"]:
        snap = checkpoint.decode(common.checkpoint_payload(data))
        slots |= {s for s, gs in snap.groups.items() if gs}
    assert slots == set(checkpoint.SLOTS)  # groups in every slot


def test_repair_makes_a_mutated_record_pass_the_checksum():
    rec = bytearray(common.codec_payload(common.seeds()["fuzz_codec"][0]))
    rec[200] ^= 0xFF  # in the field table: now the checksum is wrong
    with pytest.raises(CodecError, match="checksum"):
        codec.decode(bytes(rec))
    with pytest.raises(CodecError) as raw:
        codec.decode(common.codec_payload(bytes([0]) + rec))
    assert "checksum" in str(raw.value)
    try:
        codec.decode(common.codec_payload(bytes([common.REPAIR]) + rec))
    except CodecError as exc:
        assert "checksum" not in str(exc)  # rejected, if at all, for its structure


def test_structural_mutations_reach_the_group_and_checkpoint_readers():
    rng = random.Random(7)
    outcomes = {"decoded": 0, "group record": 0}
    seeds = common.seeds()
    for _ in range(300):
        data = mutate.structural("fuzz_codec", rng.choice(seeds["fuzz_codec"]), rng)
        try:
            group_wire.decode_group(common.codec_payload(data))
            outcomes["decoded"] += 1
        except CodecError as exc:
            outcomes["group record"] += "group record" in str(exc)
    assert outcomes["decoded"] > 10 and outcomes["group record"] > 30, outcomes
    decoded = rejected = 0
    for _ in range(150):
        data = mutate.structural("fuzz_checkpoint", rng.choice(seeds["fuzz_checkpoint"]), rng)
        try:
            checkpoint.decode(common.checkpoint_payload(data))
            decoded += 1
        except checkpoint.CheckpointError as exc:
            rejected += "record" in str(exc)
    assert decoded > 10 and rejected > 10, (decoded, rejected)


def test_a_checkpoint_with_a_malformed_group_record_raises_checkpoint_error():
    # Found by `make fuzz`: a group record whose token_offsets was a scalar raised
    # AttributeError out of checkpoint.decode (from group_wire.from_record).
    g = common.seed_groups()[0]
    rec = group_wire.to_record(g)
    arrays = {k: v for k, v in rec.arrays.items() if k != "token_offsets"}
    bad = codec.encode(codec.Sample(arrays, {**rec.meta, "token_offsets": True, "slot": "queued"}))
    good = mutate.split_checkpoint(checkpoint.encode(checkpoint.Snapshot(state={"step": 1})))
    with pytest.raises(checkpoint.CheckpointError, match="record 1: group record: token_offsets must be int64"):
        checkpoint.decode(mutate.join_checkpoint(good + [bad]), "ckpt")


# ---------------------------------------------------------------------------------------------
# nothing unpickles untrusted bytes

UNSAFE_READS = [
    (re.compile(r"\b(c?pickle|_pickle|cloudpickle|dill|joblib)\s*\.\s*(load|loads|Unpickler)\b"), "unpickling"),
    (re.compile(r"\bfrom\s+(c?pickle|_pickle|cloudpickle|dill)\s+import\b[^\n]*\b(load|loads|Unpickler)\b"), "unpickling"),
    (re.compile(r"\btorch\s*\.\s*load\b"), "torch.load (a pickle)"),
    (re.compile(r"\ballow_pickle\s*=\s*True\b"), "numpy.load(allow_pickle=True)"),
    (re.compile(r"\bmarshal\s*\.\s*loads?\b"), "marshal"),
    (re.compile(r"\bshelve\s*\.\s*open\b"), "shelve (a pickle)"),
]


def unsafe_reads(text: str) -> list[str]:
    return [f"line {text.count(chr(10), 0, m.start()) + 1}: {what}: {m.group(0)}"
            for rx, what in UNSAFE_READS for m in rx.finditer(text)]


def test_the_scanner_sees_unpickling_and_allows_pickling():
    for bad in ("pickle.loads(b)", "x = pickle.load(f)", "pickle.Unpickler(f).load()", "from pickle import loads",
                "torch.load(path)", "np.load(f, allow_pickle=True)", "marshal.loads(b)", "cloudpickle.loads(b)"):
        assert unsafe_reads(bad), bad
    for fine in ("pickle.dumps(g, protocol=5)", "pickle.PickleBuffer(data)", "np.load(f)",
                 "np.load(f, allow_pickle=False)", "safetensors.numpy.load(b)", "codec.decode(buf)"):
        assert not unsafe_reads(fine), fine


def test_no_library_code_reads_untrusted_bytes_with_pickle():
    sources = [p for d in ("core", "ext", "harness") for ext in ("py", "pyx", "pxd") for p in (ROOT / d).rglob(f"*.{ext}")]
    assert len(sources) > 30
    found = {str(p.relative_to(ROOT)): hits for p in sources if (hits := unsafe_reads(p.read_text()))}
    assert found == {}
