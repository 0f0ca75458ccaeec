"""The sample codec: the compiled module against its oracle, hostile input, and behaviour.

* Oracle tests build the same sample in ``ext._codec`` (compiled) and ``ext._codec_ref`` (the
  pure-Python reference) and require the same bytes, and the same exception type and message
  for every bad argument and every bad input. They are skipped only under
  ``ASYNCRL_PUREPYTHON=1``, where the compiled module is deliberately not used; anywhere else
  a missing compiled module fails them.
* Hostile-input tests (every truncation, every single-byte corruption, random bytes, mutated
  and crafted encodings with a correct checksum) and behaviour tests run against the backend
  that ``ext.codec`` selects. Whatever ``decode`` accepts must be canonical: encoding the
  result gives back the very same bytes.
"""

from __future__ import annotations

import gc
import importlib
import os
import pickle
import random
import re
import struct

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ext import _codec_ref, backend
from ext import codec as selected
from ext.codec import CodecError, Sample, decode, encode, encode_into, encoded_size

PURE = os.environ.get(backend.ENV_VAR, "").strip() == "1"

DTYPES = ["bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64", "float16", "float32", "float64"]


@pytest.fixture(scope="module")
def compiled():
    """The compiled module; skipped only when ASYNCRL_PUREPYTHON=1, an ImportError otherwise."""
    if PURE:
        pytest.skip("ASYNCRL_PUREPYTHON=1: the compiled module is deliberately not used")
    return importlib.import_module("ext._codec")


def _outcome(fn, *args):
    try:
        return ("ok", fn(*args))
    except Exception as exc:  # noqa: BLE001 - the exception is the answer being compared
        return ("raised", type(exc), str(exc))


def _decoded(module, buf):
    """decode() outcome, comparable across backends: the re-encoded bytes or the error."""
    got = _outcome(module.decode, buf)
    return ("ok", module.encode(got[1])) if got[0] == "ok" else got


# ---------------------------------------------------------------------------------------------
# samples: a backend-neutral spec, built in whichever module is asked


def build(module, spec):
    arrays, meta = spec
    return module.Sample(arrays, meta)


def rl_spec(n: int = 5, seed: int = 0):
    rng = np.random.default_rng(seed)
    arrays = {
        "tokens": rng.integers(0, 50_000, n).astype(np.int32),
        "logprobs": rng.standard_normal(n).astype(np.float32),
        "loss_mask": rng.integers(0, 2, n).astype(np.uint8),
    }
    return arrays, {"uid": 7, "prompt_id": 3, "version": 2, "reward": 0.5}


def small_specs():
    """A few small, varied samples (a few hundred bytes each) for the exhaustive loops."""
    return [
        rl_spec(5),
        ({"m": np.array([[True, False], [False, True]]), "z": np.zeros((0, 3), np.float16)}, {"s": "héllo", "n": None, "b": True, "i": -(2**63)}),
        ({}, {"only": 1.5}),
        ({"x": np.arange(3, dtype=np.uint64)}, {}),
    ]


def _utf8_len(s: str) -> int:
    try:
        return len(s.encode("utf-8"))
    except UnicodeEncodeError:
        return 10**9


names_st = st.one_of(
    st.text(min_size=1, max_size=12).filter(lambda s: 1 <= _utf8_len(s) <= 255),
    st.sampled_from(["x" * 255, "é" * 127 + "a", "\x00", "tokens", "a" * 254 + "b"]),
)

meta_value_st = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**63), 2**63 - 1),
    st.sampled_from([0, 1, -1, 2**63 - 1, -(2**63)]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([float("nan"), -0.0, 0.0, float("inf")]),
    st.text(max_size=20).filter(lambda s: _utf8_len(s) < 10**9),
)


@st.composite
def array_st(draw):
    dtype = np.dtype(draw(st.sampled_from(DTYPES)))
    ndim = draw(st.integers(0, 8))
    # small dims (zero included) keep the total small even at 8 dimensions
    shape = tuple(draw(st.lists(st.integers(0, 3 if ndim > 3 else 6), min_size=ndim, max_size=ndim)))
    size = int(np.prod(shape)) if shape else 1
    raw = draw(st.binary(min_size=size * dtype.itemsize, max_size=size * dtype.itemsize))
    a = np.frombuffer(raw, dtype=dtype).reshape(shape).copy()
    if dtype.kind == "b":
        a = a.view(np.uint8).astype(bool)  # numpy bools are 0/1 bytes
    layout = draw(st.sampled_from(["c", "c", "reversed", "transposed", "strided", "big-endian"]))
    if layout == "reversed" and a.ndim:
        a = a[::-1]
    elif layout == "transposed":
        a = a.T
    elif layout == "strided" and a.ndim:
        a = np.repeat(a, 2, axis=-1)[..., ::2]
    elif layout == "big-endian" and dtype.itemsize > 1:
        a = a.astype(dtype.newbyteorder(">"))
    return a


@st.composite
def spec_st(draw):
    names = draw(st.lists(names_st, max_size=6, unique=True))
    n_arrays = draw(st.integers(0, len(names)))
    arrays = {name: draw(array_st()) for name in names[:n_arrays]}
    meta = {name: draw(meta_value_st) for name in names[n_arrays:]}
    return arrays, meta


# ---------------------------------------------------------------------------------------------
# round trips (selected backend)


@settings(max_examples=150, suppress_health_check=[HealthCheck.too_slow])
@given(spec=spec_st())
def test_round_trip(spec):
    s = build(selected, spec)
    b = encode(s)
    assert len(b) == encoded_size(s) and len(b) % 64 == 0
    d = decode(b)
    assert d == s and not (d != s)
    assert encode(d) == b  # canonical
    for name, a in spec[0].items():
        assert d[name].dtype == a.dtype.newbyteorder("=") and d[name].shape == a.shape
        assert d[name].tobytes() == a.astype(a.dtype.newbyteorder("=")).tobytes()
    assert list(d.meta) == list(s.meta) == sorted(spec[1])


def test_round_trip_of_every_dtype_and_scalar_kind():
    arrays = {dt: np.arange(6).astype(dt).reshape(2, 3) for dt in DTYPES}
    meta = {"i": -5, "f": float("nan"), "t": True, "F": False, "s": "ünïcødé ✓", "e": "", "none": None, "big": 2**63 - 1}
    s = Sample(arrays, meta)
    d = decode(encode(s))
    assert d == s
    assert [type(v) for v in d.meta.values()] == [type(v) for v in s.meta.values()]
    assert list(d.arrays) == sorted(arrays) and list(d.meta) == sorted(meta)


def test_limits_are_accepted():
    name = "n" * 255
    a = np.zeros((1,) * 8, np.int8)
    s = Sample({name: a}, {"é" * 127 + "a": 1})
    assert decode(encode(s)) == s


def test_large_and_non_contiguous_arrays():
    """Copies long enough to release the GIL, through the fused kernel and through numpy."""
    rng = np.random.default_rng(1)
    big = rng.standard_normal((300, 257))
    s = Sample({"c": big, "f": big.T, "r": big[::-1, ::3], "tail": np.arange(100_003, dtype=np.uint8)}, {"k": 1})
    d = decode(encode(s))
    assert d == s
    np.testing.assert_array_equal(d["f"], big.T)
    np.testing.assert_array_equal(d["r"], big[::-1, ::3])


# ---------------------------------------------------------------------------------------------
# oracle: compiled and reference side by side


@settings(max_examples=150, suppress_health_check=[HealthCheck.too_slow])
@given(spec=spec_st())
def test_same_bytes_as_reference(compiled, spec):
    b = compiled.encode(build(compiled, spec))
    assert b == _codec_ref.encode(build(_codec_ref, spec))
    assert compiled.encoded_size(build(compiled, spec)) == len(b)
    assert compiled.checksum(b) == _codec_ref.checksum(b)
    assert compiled.encode(compiled.decode(b)) == b
    assert _codec_ref.encode(_codec_ref.decode(b)) == b


def test_every_kernel_computes_the_same_checksum(compiled):
    rng = random.Random(5)
    buf = bytes(rng.getrandbits(8) for _ in range(64 * 70 + 64))
    previous = compiled._use_kernel("scalar")
    try:
        for kernel in compiled._kernels():
            compiled._use_kernel(kernel)
            for blocks in (1, 2, 3, 4, 7, 8, 17, 70):  # the 4-block steps and every remainder
                for shift in (0, 1, 8, 63):  # unaligned starts
                    data = buf[shift : shift + 64 * blocks]
                    assert compiled.checksum(data) == _codec_ref.checksum(data), (kernel, blocks, shift)
            spec = ({"a": np.arange(1000, dtype=np.int64), "b": np.arange(77, dtype=np.int8)[::2]}, {"x": 1})
            assert compiled.encode(build(compiled, spec)) == _codec_ref.encode(build(_codec_ref, spec)), kernel
    finally:
        compiled._use_kernel(previous)


BAD_SAMPLE_ARGS = [
    ((), {"arrays": [1, 2]}),
    ((), {"meta": 5}),
    (({1: np.zeros(2)},), {}),
    (({"": np.zeros(2)},), {}),
    (({"x" * 256: np.zeros(2)},), {}),
    (({"é" * 128: np.zeros(2)},), {}),
    (({"\ud800": np.zeros(2)},), {}),
    (({"a": [1, 2]},), {}),
    (({"a": np.ma.zeros(2)},), {}),
    (({"a": np.zeros(2, complex)},), {}),
    (({"a": np.array(["x"])},), {}),
    (({"a": np.array([object()])},), {}),
    (({"a": np.zeros(2, "M8[s]")},), {}),
    (({"a": np.zeros(2, np.longdouble)},), {}),
    (({"a": np.zeros(2, [("f", "i4")])},), {}),
    (({"a": np.zeros((1,) * 9)},), {}),
    (({"a": np.zeros(2)}, {"a": 1}), {}),
    (({}, {"m": 2**63}), {}),
    (({}, {"m": -(2**63) - 1}), {}),
    (({}, {"m": 10**5000}), {}),
    (({}, {"m": np.uint64(2**64 - 1)}), {}),
    (({}, {"m": b"bytes"}), {}),
    (({}, {"m": [1]}), {}),
    (({}, {"m": 1j}), {}),
    (({}, {"m": np.longdouble(1)}), {}),
    (({}, {"m": "\udcff"}), {}),
    (({}, {2: 1}), {}),
]


@pytest.mark.parametrize("args, kwargs", BAD_SAMPLE_ARGS)
def test_bad_sample_arguments_match_reference(compiled, args, kwargs):
    got = _outcome(lambda: compiled.Sample(*args, **kwargs))
    want = _outcome(lambda: _codec_ref.Sample(*args, **kwargs))
    assert got[0] == want[0] == "raised"
    assert got == want


@pytest.mark.parametrize("args, kwargs", BAD_SAMPLE_ARGS)
def test_bad_sample_arguments_raise(args, kwargs):
    with pytest.raises((TypeError, ValueError)):
        Sample(*args, **kwargs)


def test_bad_call_arguments_match_reference(compiled):
    bad_buffers = [42, "text", None, memoryview(bytes(256))[::2], np.zeros((8, 32), np.uint8)[:, ::2], [1, 2]]
    for module in (compiled, _codec_ref):
        s = module.Sample(*rl_spec())
        into = lambda buf, s=s, m=module: m.encode_into(s, buf)  # noqa: E731
        for fn, arg in [(module.encode, 42), (module.encoded_size, "s"), (module.encode, None), (into, 42), (into, b"")]:
            assert _outcome(fn, arg)[0] == "raised"
    for buf in bad_buffers + [bytes(10), bytes(100)]:
        assert _outcome(compiled.decode, buf) == _outcome(_codec_ref.decode, buf)
        assert _outcome(compiled.checksum, buf) == _outcome(_codec_ref.checksum, buf)
    for buf in bad_buffers + [bytes(512), bytearray(10), np.zeros(10, np.uint8), np.zeros(512, np.uint8)[::2]]:
        got = _outcome(compiled.encode_into, compiled.Sample(*rl_spec()), buf)
        want = _outcome(_codec_ref.encode_into, _codec_ref.Sample(*rl_spec()), buf)
        assert got == want
    for fn in ("encode", "encoded_size", "decode"):
        got = _outcome(getattr(compiled, fn), 42)
        assert got == _outcome(getattr(_codec_ref, fn), 42)
    # a Sample of the other backend is a clear TypeError, not a crash
    assert _outcome(compiled.encode, _codec_ref.Sample())[1] is TypeError


def _corruptions(b: bytes):
    """Every truncation, and every single-byte corruption by three different values."""
    for n in range(len(b)):
        yield b[:n]
    for i in range(len(b)):
        for x in (0xFF, 0x01, 0x80):
            c = bytearray(b)
            c[i] ^= x
            yield bytes(c)


def test_every_truncation_and_corruption_matches_reference(compiled):
    for spec in small_specs():
        b = compiled.encode(build(compiled, spec))
        for bad in _corruptions(b):
            got = _outcome(compiled.decode, bad)
            want = _outcome(_codec_ref.decode, bad)
            assert got[0] == "raised" and got == want, (bad.hex(), got, want)


# ---------------------------------------------------------------------------------------------
# hostile input (selected backend)


def test_every_truncation_and_single_byte_corruption_is_caught():
    for spec in small_specs():
        b = encode(build(selected, spec))
        assert len(b) <= 512
        for bad in _corruptions(b):
            with pytest.raises(CodecError):
                decode(bad)


def test_codec_error_is_a_value_error():
    assert issubclass(CodecError, ValueError)
    with pytest.raises(ValueError):
        decode(b"\0" * 64)


def _accepts_only_canonical(buf) -> None:
    """decode() gives CodecError or a Sample whose encoding is exactly ``buf``."""
    try:
        s = decode(buf)
    except CodecError:
        return
    assert encode(s) == bytes(buf)


@settings(max_examples=200)
@given(data=st.binary(max_size=400))
def test_random_bytes(data):
    _accepts_only_canonical(data)


@settings(max_examples=200)
@given(data=st.binary(max_size=300))
def test_random_bytes_behind_a_valid_header(data):
    """A correct magic, version and size, so that the checksum is what has to catch it."""
    body = data + bytes(-len(data) % 64)
    total = 64 + len(body)
    buf = bytearray(struct.pack("<8sHHIQQQ", b"\x89ASAMP\r\n", 1, 0, 3, total, len(data), 0) + bytes(24) + body)
    _accepts_only_canonical(buf)
    struct.pack_into("<Q", buf, 32, _codec_ref.checksum(buf))  # now structure must catch it
    _accepts_only_canonical(buf)


mutation_st = st.lists(
    st.tuples(st.sampled_from(["flip", "set", "insert", "delete"]), st.integers(0, 10**6), st.integers(0, 255)),
    min_size=1,
    max_size=4,
)


def _mutate(b: bytes, mutations) -> bytearray:
    out = bytearray(b)
    for op, at, value in mutations:
        if not out:
            break
        i = at % len(out)
        if op == "flip":
            out[i] ^= value or 1
        elif op == "set":
            out[i] = value
        elif op == "insert":
            out[i:i] = bytes([value])
        else:
            del out[i]
    return out


@settings(max_examples=300)
@given(which=st.integers(0, len(small_specs()) - 1), mutations=mutation_st, fix_checksum=st.booleans())
def test_mutated_encodings(which, mutations, fix_checksum):
    b = encode(build(selected, small_specs()[which]))
    bad = _mutate(b, mutations)
    if fix_checksum and len(bad) >= 64 and len(bad) % 64 == 0:
        struct.pack_into("<Q", bad, 32, _codec_ref.checksum(bad))
    _accepts_only_canonical(bad)


def craft(fields: bytes, n_fields: int, data: bytes = b"", *, table: int | None = None, total: int | None = None,
          flags: int = 0, version: int = 1, reserved: bytes = bytes(24), pad: int | None = None) -> bytearray:
    """An encoding with the given field table and data, a chosen header, and a CORRECT
    checksum, so that only the structural validation can refuse it."""
    table = len(fields) if table is None else table
    body = fields + bytes((-(64 + len(fields)) % 64) if pad is None else pad) + data
    body += bytes(-len(body) % 64)
    total = 64 + len(body) if total is None else total
    buf = bytearray(struct.pack("<8sHHIQQQ", b"\x89ASAMP\r\n", version, flags, n_fields, total, table, 0) + reserved + body)
    struct.pack_into("<Q", buf, 32, _codec_ref.checksum(buf))
    return buf


def arr_field(name: bytes, code: int, shape, kind: int = 1) -> bytes:
    return bytes([kind, len(name)]) + name + bytes([code, len(shape)]) + struct.pack(f"<{len(shape)}Q", *shape)


def int_field(name: bytes, v: int = 1) -> bytes:
    return bytes([2, len(name)]) + name + struct.pack("<q", v)


U64 = 2**64 - 1
CRAFTED = [
    # (encoding, expected message fragment)
    (craft(b"", 0, flags=1), "unsupported flags 0x0001"),
    (craft(b"", 0, reserved=b"\1" + bytes(23)), "reserved header bytes"),
    (craft(b"", 0, table=U64), "overruns"),
    (craft(b"", 0, table=2**63), "overruns"),
    (craft(b"", 0, table=1), "field table of 1 bytes overruns the 64-byte encoding"),
    (craft(b"\0", 0), "field table has 1 unused bytes"),
    (craft(b"", 2**32 - 1), "field 0: runs past the end"),
    (craft(int_field(b"a"), 2), "field 1: runs past the end"),
    (craft(int_field(b"a"), 0), "field table has 11 unused bytes"),
    (craft(bytes([2, 0]) + bytes(8), 1), "empty name"),
    (craft(bytes([2, 255]) + b"ab", 1), "runs past the end"),
    (craft(bytes([2, 2]) + b"\xff\xfe" + bytes(8), 1), "name is not valid utf-8"),
    (craft(bytes([2, 3]) + b"\xed\xa0\x80" + bytes(8), 1), "name is not valid utf-8"),  # a surrogate
    (craft(int_field(b"b") + int_field(b"a"), 2), "not in sorted order"),
    (craft(int_field(b"a") + int_field(b"a"), 2), "duplicate field name 'a'"),
    (craft(bytes([9, 1]) + b"a", 1), "unknown kind 9"),
    (craft(bytes([0, 1]) + b"a", 1), "unknown kind 0"),
    (craft(arr_field(b"a", 99, [1]), 1, bytes(64)), "unknown dtype code 99"),
    (craft(arr_field(b"a", 0, [1]), 1, bytes(64)), "unknown dtype code 0"),
    (craft(arr_field(b"a", 1, [1] * 9), 1, bytes(64)), "9 dimensions (at most 8)"),
    (craft(arr_field(b"a", 1, [U64]), 1), "overflows"),
    (craft(arr_field(b"a", 5, [2**60]), 1), "overflows"),
    (craft(arr_field(b"a", 1, [2**32, 2**32]), 1), "overflows"),
    (craft(arr_field(b"a", 1, [0, 2**62, 2**62]), 1), "overflows"),
    (craft(arr_field(b"a", 1, [2**62]), 1), "out of bounds"),
    (craft(arr_field(b"a", 4, [17]), 1, bytes(64)), "out of bounds"),
    (craft(arr_field(b"a", 1, [1]), 1, b"\1" + bytes(62) + b"\1"), "nonzero padding byte at offset 191"),
    (craft(int_field(b"a"), 1, pad=0, data=b"\0" * 50 + b"\1"), "nonzero padding byte at offset 125"),
    (craft(arr_field(b"a", 1, [64]), 1, bytes(128)), "64 bytes after the last field"),
    (craft(int_field(b"a"), 1, data=bytes(64)), "64 bytes after the last field"),
    (craft(bytes([4, 1]) + b"a" + b"\2", 1), "bool byte 2 is not 0 or 1"),
    (craft(bytes([5, 1]) + b"a" + struct.pack("<I", 2**32 - 1), 1), "runs past the end"),
    (craft(bytes([5, 1]) + b"a" + struct.pack("<I", 2) + b"\xc3\x28", 1), "str value is not valid utf-8"),
    (craft(bytes([3, 1]) + b"a" + bytes(4), 1), "runs past the end"),
    (craft(b"", 0, total=2**64 - 64), "truncated: header says"),
    (craft(b"", 0, version=7), "unsupported format version 7 (this build reads 1)"),
    (craft(b"", 0, version=0), "unsupported format version 0"),
    (craft(b"", 0)[:63], "truncated: buffer has 63 bytes"),
    (craft(b"", 0) + bytes(64), "trailing bytes: header says 64 bytes, buffer has 128"),
    (craft(b"", 0)[:32] + bytes(32), "checksum mismatch"),
    (b"\x89ASAMP\r\x0a" + bytes(56), "unsupported format version 0"),
    (b"GIF89a" + bytes(58), "bad magic"),
    (pickle.dumps({"x": 1}) + bytes(64), "bad magic"),
]


@pytest.mark.parametrize("buf, message", CRAFTED, ids=[m for _, m in CRAFTED])
def test_crafted_encodings_are_refused(buf, message):
    with pytest.raises(CodecError, match=re.escape(message)):
        decode(bytes(buf))


@pytest.mark.parametrize("buf, message", CRAFTED, ids=[m for _, m in CRAFTED])
def test_crafted_encodings_match_reference(compiled, buf, message):
    for b in (bytes(buf), bytearray(buf), np.frombuffer(bytes(buf), np.uint8)):
        assert _outcome(compiled.decode, b) == _outcome(_codec_ref.decode, b)


def test_crafted_valid_encoding_is_accepted():
    """The crafting helper itself makes valid encodings when asked for valid ones."""
    buf = craft(arr_field(b"a", 4, [3]) + int_field(b"b", -2), 2, struct.pack("<3i", 1, 2, 3))
    s = decode(bytes(buf))
    assert s == Sample({"a": np.array([1, 2, 3], np.int32)}, {"b": -2})
    assert encode(s) == bytes(buf)


@pytest.mark.parametrize("seed", range(4))
def test_random_samples_random_corruptions_match_reference(compiled, seed):
    rng = random.Random(seed)
    for _ in range(60):
        spec = rl_spec(rng.randrange(0, 40), seed=rng.randrange(1000))
        b = bytearray(compiled.encode(build(compiled, spec)))
        for _ in range(rng.randrange(1, 4)):
            b[rng.randrange(len(b))] = rng.randrange(256)
        if rng.random() < 0.5:
            struct.pack_into("<Q", b, 32, _codec_ref.checksum(b))
        assert _decoded(compiled, bytes(b)) == _decoded(_codec_ref, bytes(b))


# ---------------------------------------------------------------------------------------------
# zero copy, buffers, alignment


def test_decoded_arrays_are_views_into_the_buffer():
    s = Sample(*rl_spec(100))
    b = encode(s)
    d = decode(b)
    raw = np.frombuffer(b, np.uint8)
    for a in d.arrays.values():
        assert np.shares_memory(a, raw)
        assert not a.flags.writeable
        assert a.flags.c_contiguous
        assert (a.__array_interface__["data"][0] - raw.__array_interface__["data"][0]) % 64 == 0
    ba = bytearray(b)
    d = decode(ba)
    for a in d.arrays.values():
        assert np.shares_memory(a, np.frombuffer(ba, np.uint8)) and a.flags.writeable
    d["tokens"][0] = 123  # writes through to the buffer, whose checksum is now stale
    assert np.frombuffer(ba, np.uint8)[d["tokens"].__array_interface__["data"][0] - np.frombuffer(ba, np.uint8).__array_interface__["data"][0]] == 123
    with pytest.raises(CodecError, match="checksum"):
        decode(bytes(ba))
    with pytest.raises(BufferError):
        ba.extend(b"x")  # the views hold the buffer's export


@pytest.mark.parametrize("kind", ["bytes", "bytearray", "numpy", "memoryview", "readonly-numpy"])
def test_decoded_arrays_keep_the_buffer_alive(kind):
    s = Sample(*rl_spec(50))
    b = encode(s)
    buf = {
        "bytes": lambda: bytes(b),
        "bytearray": lambda: bytearray(b),
        "numpy": lambda: np.frombuffer(bytearray(b), np.uint8),
        "memoryview": lambda: memoryview(bytearray(b)),
        "readonly-numpy": lambda: np.frombuffer(bytes(b), np.uint8),
    }[kind]()
    d = decode(buf)
    assert all(a.flags.writeable == (kind in ("bytearray", "numpy", "memoryview")) for a in d.arrays.values())
    del buf
    gc.collect()
    junk = [bytearray(len(b)) for _ in range(20)]  # reuse freed memory, if it was freed
    assert d == s
    del junk


def test_unaligned_buffers():
    """A buffer that is not 64-byte (or even dtype-) aligned still decodes; numpy just gets
    unaligned views."""
    s = Sample({"f8": np.arange(10.0), "i2": np.arange(5, dtype=np.int16)}, {"k": 1})
    b = encode(s)
    for shift in (1, 2, 8, 17):
        store = bytearray(len(b) + shift)
        mv = memoryview(store)[shift:]
        assert encode_into(s, mv) == len(b)
        assert bytes(mv) == b
        d = decode(mv)
        assert d == s
        np.testing.assert_array_equal(d["f8"], np.arange(10.0))


def test_pickle_protocol_5_out_of_band_is_zero_copy():
    s = Sample({**rl_spec(1000)[0], "nc": np.arange(20.0)[::2], "z": np.zeros((0, 2))}, rl_spec()[1])
    buffers = []
    data = pickle.dumps(s, protocol=5, buffer_callback=buffers.append)
    assert len(buffers) == 5
    assert len(data) < 1000  # the arrays are not in the stream
    by_name = dict(zip(sorted(s.arrays), buffers))
    for name in ("tokens", "logprobs", "loss_mask"):
        raw = by_name[name].raw()
        assert np.shares_memory(np.frombuffer(raw, np.uint8), s[name])  # the array's own memory
    copy = pickle.loads(data, buffers=buffers)
    assert type(copy) is Sample and copy == s
    assert np.shares_memory(copy["tokens"], s["tokens"])  # in-process: still no copy


@pytest.mark.parametrize("protocol", range(pickle.HIGHEST_PROTOCOL + 1))
def test_pickle_in_band(protocol):
    s = Sample({**rl_spec(30)[0], "t": np.arange(6.0).reshape(2, 3).T}, {"n": None, "s": "x"})
    copy = pickle.loads(pickle.dumps(s, protocol=protocol))
    assert copy == s
    assert copy["tokens"].flags.writeable


def test_encode_into_reuses_a_buffer():
    buf = np.zeros(4096, np.uint8)
    for n in (3, 50, 1, 0, 200):
        s = Sample(*rl_spec(n, seed=n))
        size = encode_into(s, buf)
        assert size == encoded_size(s) == len(encode(s))
        assert buf[:size].tobytes() == encode(s)
        assert decode(buf[:size]) == s
    ba = bytearray(b"\xee" * 600)
    s = Sample(*rl_spec(10))
    size = encode_into(s, ba)
    assert ba[:size] == encode(s) and ba[size:] == b"\xee" * (600 - size)  # padding zeroed, rest untouched


def test_encode_into_errors():
    s = Sample(*rl_spec(100))
    need = encoded_size(s)
    with pytest.raises(ValueError, match=f"needs {need} bytes, the buffer has {need - 1}"):
        encode_into(s, bytearray(need - 1))
    with pytest.raises(TypeError, match="writable"):
        encode_into(s, bytes(need))
    with pytest.raises(TypeError, match="bytes-like"):
        encode_into(s, 12)
    with pytest.raises(TypeError, match="C-contiguous"):
        encode_into(s, np.zeros(2 * need, np.uint8)[::2])
    with pytest.raises(TypeError, match="Sample"):
        encode_into({"tokens": 1}, bytearray(need))


def test_encode_into_refuses_the_buffer_a_sample_views():
    buf = bytearray(encode(Sample(*rl_spec(20))))
    d = decode(buf)
    with pytest.raises(ValueError, match="overlaps the memory of array"):
        encode_into(d, buf)
    assert encode_into(d, bytearray(len(buf))) == len(buf)


# ---------------------------------------------------------------------------------------------
# the Sample type


def test_sample_api():
    a = np.arange(4, dtype=np.int32)
    s = Sample({"z": a, "b": np.zeros(2)}, {"m": 1, "c": "x"})
    assert s["z"] is a  # held by reference
    assert s["m"] == 1 and "c" in s and "nope" not in s
    with pytest.raises(KeyError):
        s["nope"]
    assert list(s.arrays) == ["b", "z"] and list(s.meta) == ["c", "m"]
    with pytest.raises(TypeError):
        s.arrays["q"] = a  # read-only view
    assert Sample() == Sample({}, {}) == Sample(arrays=None, meta=None)
    assert "int32[4]" in repr(s) and "'c': 'x'" in repr(s)
    with pytest.raises(TypeError):
        hash(s)
    assert s != "not a sample"


def test_sample_converts_scalars_and_byte_order():
    s = Sample({"be": np.arange(3, dtype=">i4")}, {"b": np.bool_(True), "i": np.int16(-3), "u": np.uint64(7), "f": np.float32(0.5), "d": np.float64(2.5)})
    assert s["be"].dtype == np.dtype("=i4") and list(s["be"]) == [0, 1, 2]
    assert [type(s[k]) for k in "biufd"] == [bool, int, int, float, float]
    assert decode(encode(s)) == s


def test_equality_is_bitwise():
    nan = Sample({}, {"x": float("nan")})
    assert nan == Sample({}, {"x": float("nan")})
    assert Sample({}, {"x": 0.0}) != Sample({}, {"x": -0.0})
    assert Sample({}, {"x": 1}) != Sample({}, {"x": True}) != Sample({}, {"x": 1.0})
    a = np.array([np.nan, 1.0])
    assert Sample({"a": a}) == Sample({"a": a.copy()})
    assert Sample({"a": a}) != Sample({"a": a.astype(np.float32)})
    assert Sample({"a": a}) != Sample({"a": a.reshape(2, 1)})
    assert Sample({"a": a}) != Sample({"b": a})
    assert Sample({"a": a}) != Sample({}, {"a": 1})


def test_encode_rechecks_arrays_changed_after_construction():
    a = np.zeros(1, np.float64)
    s = Sample({"a": a})
    a.shape = (1,) * 9  # in-place reshape of the array the sample holds
    with pytest.raises(ValueError, match="9 dimensions"):
        encode(s)


def test_the_test_vector_in_the_docs():
    s = Sample({"t": np.array([1, 2, 3], np.int32)}, {"uid": 7})
    b = encode(s)
    assert b.hex() == DOC_VECTOR
    assert decode(b) == s


DOC_VECTOR = (  # docs/sample-format.md, "Test vector"
    "894153414d500d0a0100000002000000c0000000000000001a00000000000000"
    "2cfc51256ac358ef000000000000000000000000000000000000000000000000"
    "0101740401030000000000000002037569640700000000000000000000000000"
    "0000000000000000000000000000000000000000000000000000000000000000"
    "0100000002000000030000000000000000000000000000000000000000000000"
    "0000000000000000000000000000000000000000000000000000000000000000"
)
