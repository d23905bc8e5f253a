"""pyshmckpt.storage.safetensors_header: dtype codes, build_header, and strict header parsing.

Interoperability tests check our headers against the reference `safetensors` package (they skip
where it is not installed); the hostile-input and property tests check that parsing raises
CheckpointCorruptError and nothing else, whatever the bytes.
"""

from __future__ import annotations

import io
import json
import struct
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from pyshmckpt.errors import CheckpointCorruptError
from pyshmckpt.storage.safetensors_header import (
    CODE_TO_DTYPE,
    DTYPE_TO_CODE,
    Header,
    HeaderEntry,
    build_header,
    code_itemsize,
    parse_header,
    read_header,
)

PATH = "some/dir/ckpt.safetensors"
CODES = sorted(CODE_TO_DTYPE)
PROPERTY = settings(
    max_examples=200,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


def raw(t: torch.Tensor) -> bytes:
    """A tensor's bytes in memory order (reshape first: 0-d tensors cannot change element size)."""
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def parse(data: bytes, path: str = PATH, **kw) -> Header:
    return parse_header(path, io.BytesIO(data), len(data), **kw)


def assemble(tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None) -> bytes:
    """A whole safetensors file made with build_header, tensors laid out in the order given."""
    entries, blobs, offset = [], [], 0
    for name, t in tensors.items():
        blob = raw(t)
        code = DTYPE_TO_CODE[t.dtype]
        entries.append(HeaderEntry(name, code, tuple(t.shape), offset, offset + len(blob)))
        blobs.append(blob)
        offset += len(blob)
    return build_header(entries, metadata) + b"".join(blobs)


def file_from(header: object, data: bytes = b"") -> bytes:
    """A file from a header given as JSON-able object, str or bytes, followed by `data`."""
    if isinstance(header, bytes):
        text = header
    elif isinstance(header, str):
        text = header.encode("utf-8", "surrogatepass")
    else:
        text = json.dumps(header).encode()
    return struct.pack("<Q", len(text)) + text + data


def entry(code: Any = "U8", shape: Any = (4,), offsets: Any = (0, 4)) -> dict[str, Any]:
    return {"dtype": code, "shape": list(shape), "data_offsets": list(offsets)}


def sample(dtype: torch.dtype, shape: tuple[int, ...], seed: int = 0) -> torch.Tensor:
    """Random bits of `dtype` (any bit pattern, NaNs included; bools 0/1)."""
    g = torch.Generator().manual_seed(seed)
    n = 1
    for d in shape:
        n *= d
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g, dtype=torch.uint8).bool()
    size = torch.empty(0, dtype=dtype).element_size()
    bits = torch.randint(0, 256, (n * size,), generator=g, dtype=torch.uint8)
    return bits.view(dtype).reshape(shape)


def bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and raw(a) == raw(b)


def consistent(h: Header, file_size: int) -> None:
    """What every successfully parsed header must satisfy."""
    assert h.data_start >= 8
    assert h.data_start + h.data_size == file_size
    at = 0
    for e in sorted(h.entries.values(), key=lambda e: (e.begin, e.end)):
        assert e.begin == at
        assert h.data_start + e.end <= file_size
        n = 1
        for d in e.shape:
            n *= d
        assert e.end - e.begin == n * code_itemsize(e.code)
        at = e.end
    assert at == h.data_size
    assert all(isinstance(k, str) and isinstance(v, str) for k, v in h.metadata.items())


# ------------------------------------------------------------------------------------ dtype tables


def test_dtype_tables_are_inverse_and_sizes_match_torch():
    core = {"BOOL", "U8", "I8", "I16", "I32", "I64", "F16", "BF16", "F32", "F64", "C64"}
    fp8 = {"F8_E4M3", "F8_E5M2", "F8_E4M3FNUZ", "F8_E5M2FNUZ", "F8_E8M0"}
    assert core <= set(CODES) <= core | fp8 | {"U16", "U32", "U64"}
    for code, dtype in CODE_TO_DTYPE.items():
        assert DTYPE_TO_CODE[dtype] == code
        assert code_itemsize(code) == torch.empty(0, dtype=dtype).element_size()
    assert len(DTYPE_TO_CODE) == len(CODE_TO_DTYPE)
    for bad in ("F4", "f32", "", None, ["F32"]):
        with pytest.raises(ValueError, match="unknown"):
            code_itemsize(bad)  # type: ignore[arg-type]


def test_dtype_codes_match_the_reference(tmp_path):
    st_torch = pytest.importorskip("safetensors.torch")
    for dtype, code in DTYPE_TO_CODE.items():
        p = tmp_path / f"{code}.safetensors"
        st_torch.save_file({"t": sample(dtype, (3,))}, str(p))
        assert read_header(p).entries["t"].code == code
    size = getattr(st_torch, "_SIZE", {})  # the reference's private table, where present
    for dtype, code in DTYPE_TO_CODE.items():
        if dtype in size:
            assert size[dtype] == code_itemsize(code)


# ------------------------------------------------------------------------------------ build/parse


@pytest.mark.parametrize("code", CODES)
def test_round_trip_every_code(code):
    size = code_itemsize(code)
    entries = [
        HeaderEntry("w", code, (2, 3), 0, 6 * size),
        HeaderEntry("scalar", code, (), 6 * size, 7 * size),
        HeaderEntry("empty", code, (0, 4), 7 * size, 7 * size),
        HeaderEntry("v", code, (5,), 7 * size, 12 * size),
    ]
    header = build_header(entries, {"format": "pt", "step": "7"})
    assert len(header) % 8 == 0
    data = header + b"\x01" * (12 * size)
    h = parse(data)
    assert list(h.entries) == ["w", "scalar", "empty", "v"]
    assert list(h.entries.values()) == entries
    assert h.metadata == {"format": "pt", "step": "7"}
    assert (h.data_start, h.data_size) == (len(header), 12 * size)


def test_build_header_is_compact_deterministic_and_padded():
    entries = [HeaderEntry("b", "F32", (2,), 0, 8), HeaderEntry("a", "U8", (1,), 8, 9)]
    h1 = build_header(entries)
    assert h1 == build_header(list(entries))
    (n,) = struct.unpack("<Q", h1[:8])
    text = h1[8:].decode()
    assert len(text) == n
    assert len(h1) % 8 == 0
    body = text.rstrip(" ")
    assert len(text) - len(body) < 8
    assert " " not in body
    assert body == (
        '{"b":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},'
        '"a":{"dtype":"U8","shape":[1],"data_offsets":[8,9]}}'
    )
    with_meta = build_header(entries, {"k": "v"})[8:].decode()
    assert with_meta.startswith('{"__metadata__":{"k":"v"},"b":')
    # entries may be listed in any order as long as their offsets tile the buffer
    assert parse(build_header(entries[::-1]) + bytes(9)).entries.keys() == {"a", "b"}
    # no entries at all: a header and an empty data buffer
    assert parse(build_header([])) == Header({}, {}, 8 + len(b"{}      "), 0)
    # non-ASCII names and metadata survive
    uni = [HeaderEntry("gewicht.ü.𝛼", "U8", (1,), 0, 1)]
    assert parse(build_header(uni, {"ключ": "значение"}) + b"x").entries["gewicht.ü.𝛼"] == uni[0]


@pytest.mark.parametrize(
    ("entries", "metadata", "match"),
    [
        ([HeaderEntry("", "U8", (1,), 0, 1)], None, "name"),
        ([HeaderEntry("__metadata__", "U8", (1,), 0, 1)], None, "name"),
        ([HeaderEntry(3, "U8", (1,), 0, 1)], None, "name"),  # type: ignore[arg-type]
        ([HeaderEntry("\ud800", "U8", (1,), 0, 1)], None, "name"),
        (
            [HeaderEntry("a", "U8", (1,), 0, 1), HeaderEntry("a", "U8", (1,), 1, 2)],
            None,
            "duplicate",
        ),
        ([HeaderEntry("a", "F4", (2,), 0, 1)], None, "dtype"),
        ([HeaderEntry("a", ["U8"], (1,), 0, 1)], None, "dtype"),  # type: ignore[arg-type]
        ([HeaderEntry("a", "U8", (-1,), 0, 0)], None, "shape"),
        ([HeaderEntry("a", "U8", (True,), 0, 1)], None, "shape"),
        ([HeaderEntry("a", "U8", (1.0,), 0, 1)], None, "shape"),  # type: ignore[arg-type]
        ([HeaderEntry("a", "U8", "1", 0, 1)], None, "shape"),  # type: ignore[arg-type]
        ([HeaderEntry("a", "U8", (1 << 63,), 0, 0)], None, "shape"),
        ([HeaderEntry("a", "U8", (1 << 32, 1 << 32), 0, 0)], None, "shape"),
        ([HeaderEntry("a", "U8", (2,), 0, 1)], None, "needs 2"),
        ([HeaderEntry("a", "F32", (2,), 0, 2)], None, "needs 8"),
        ([HeaderEntry("a", "U8", (1,), -1, 0)], None, "offsets"),
        ([HeaderEntry("a", "U8", (0,), 1, 0)], None, "offsets"),
        ([HeaderEntry("a", "U8", (1,), False, True)], None, "offsets"),
        ([HeaderEntry("a", "U8", (1,), 1, 2)], None, "gap"),
        (
            [HeaderEntry("a", "U8", (2,), 0, 2), HeaderEntry("b", "U8", (2,), 1, 3)],
            None,
            "overlap",
        ),
        (
            [HeaderEntry("a", "U8", (2,), 0, 2), HeaderEntry("b", "U8", (2,), 3, 5)],
            None,
            "gap",
        ),
        (
            [HeaderEntry("a", "U8", (4,), 0, 4), HeaderEntry("b", "U8", (0,), 2, 2)],
            None,
            "overlap",
        ),
        ([("a", "U8", (1,), 0, 1)], None, "HeaderEntry"),
        ([], {"k": 1}, "metadata"),
        ([], {1: "v"}, "metadata"),
        ([], ["k", "v"], "metadata"),
    ],
)
def test_build_header_rejects_bad_input(entries, metadata, match):
    with pytest.raises(ValueError, match=match):
        build_header(entries, metadata)


# ------------------------------------------------------------------------ interop with reference


def interop_tensors() -> dict[str, torch.Tensor]:
    specs = [
        ("f32", torch.float32, (3, 4)),
        ("bf16", torch.bfloat16, (5,)),
        ("f16", torch.float16, (2, 2, 2)),
        ("f64", torch.float64, ()),
        ("i64", torch.int64, (3,)),
        ("i8", torch.int8, (7,)),
        ("u8", torch.uint8, (1, 9)),
        ("bool", torch.bool, (6,)),
        ("empty_f32", torch.float32, (0,)),
        ("empty_2d", torch.bfloat16, (3, 0)),
        ("scalar_i32", torch.int32, ()),
        ("c64", torch.complex64, (2,)),
    ]
    covered = {dtype for _, dtype, _ in specs}  # and every other mapped dtype (fp8, U16, ...)
    specs += [(c, dtype, (3, 1)) for dtype, c in DTYPE_TO_CODE.items() if dtype not in covered]
    return {name: sample(dtype, shape, seed=i) for i, (name, dtype, shape) in enumerate(specs)}


def test_files_written_by_the_reference_parse(tmp_path):
    st_torch = pytest.importorskip("safetensors.torch")
    tensors = interop_tensors()
    p = tmp_path / "ref.safetensors"
    st_torch.save_file(tensors, str(p), metadata={"format": "pt", "note": "ü"})
    h = read_header(p)
    data = p.read_bytes()
    consistent(h, len(data))
    assert h.metadata == {"format": "pt", "note": "ü"}
    assert h.data_start % 8 == 0
    assert set(h.entries) == set(tensors)
    for name, t in tensors.items():
        e = h.entries[name]
        assert (e.name, CODE_TO_DTYPE[e.code], e.shape) == (name, t.dtype, tuple(t.shape))
        assert data[h.data_start + e.begin : h.data_start + e.end] == raw(t)


def test_our_files_load_in_the_reference_bitwise(tmp_path):
    safetensors = pytest.importorskip("safetensors")
    from safetensors.torch import load_file

    tensors = interop_tensors()
    p = tmp_path / "ours.safetensors"
    p.write_bytes(assemble(tensors, {"format": "pt"}))
    loaded = load_file(str(p))
    assert loaded.keys() == tensors.keys()
    for name, t in tensors.items():
        assert bits_equal(loaded[name], t), name
    with safetensors.safe_open(str(p), framework="pt") as f:
        assert f.metadata() == {"format": "pt"}
        assert set(f.keys()) == set(tensors)
        for name, t in tensors.items():
            assert bits_equal(f.get_tensor(name), t), name
    consistent(read_header(p), p.stat().st_size)


# ---------------------------------------------------------------------------------- hostile input

GOOD = {"a": entry("U8", (4,), (0, 4)), "b": entry("F32", (2,), (4, 12))}


def hostile_cases() -> list[tuple[str, bytes, str, str | None]]:
    """(id, file bytes, expected text in the reason, tensor named in the error)."""
    good = file_from(GOOD, bytes(12))
    ok_n = struct.unpack("<Q", good[:8])[0]

    def with_entry(name, e, data=bytes(12), **more):
        return file_from({**GOOD, **more, name: e}, data)

    return [
        ("empty file", b"", "shorter than", None),
        ("seven bytes", b"\x02\x00\x00\x00\x00\x00\x00", "shorter than", None),
        ("length beyond limit", struct.pack("<Q", 2**64 - 1) + good[8:], "limit", None),
        ("length beyond file", struct.pack("<Q", ok_n + 20) + good[8:], "truncated", None),
        ("header cut short", good[: 8 + ok_n - 1], "truncated", None),
        ("zero length", struct.pack("<Q", 0) + bytes(12), "JSON", None),
        ("not utf-8", file_from(b'{"\xff\xfe":1}'), "UTF-8", None),
        ("not json", file_from(b"{'a': 1}"), "JSON", None),
        ("garbage", file_from(b"\x00" * 16), "JSON", None),
        ("json array", file_from([1, 2]), "not an object", None),
        ("json string", file_from('"hello"'), "not an object", None),
        ("json null", file_from(None), "not an object", None),
        ("deep nesting", file_from(b"[" * 200_000 + b"]" * 200_000), "nested", None),
        ("deep in entry", file_from(b'{"a":' + b"[" * 200_000), "nested", None),
        ("duplicate key", file_from(b'{"a":{},"a":{}}'), "duplicate", None),
        ("nan", file_from(b'{"a":{"dtype":"U8","shape":[NaN],"data_offsets":[0,0]}}'), "NaN", None),
        ("infinity", file_from(b'{"a":{"dtype":"U8","shape":[-Infinity],"data_offsets":[0,1]}}'),
         "non-finite", None),
        ("huge float",
         file_from(b'{"a":{"dtype":"U8","shape":[1e999],"data_offsets":[0,1]}}', b"x"),
         "shape", "a"),
        ("huge int literal", file_from(b'{"a":{"dtype":"U8","shape":[' + b"9" * 5000 + b'],'
         b'"data_offsets":[0,1]}}', b"x"), "", None),
        ("surrogate name", file_from('{"\\ud800":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}}',
         b"x"), "Unicode", "'\\ud800'"),
        ("control char", file_from(b'{"a\x01":1}'), "JSON", None),
        ("entry not object", with_entry("c", [1, 2]), "not an object", "c"),
        ("entry null", with_entry("c", None), "not an object", "c"),
        ("missing field", with_entry("c", {"dtype": "U8", "shape": [0]}), "missing", "c"),
        ("extra field", with_entry("c", {**entry("U8", (0,), (12, 12)), "x": 1}),
         "unexpected", "c"),
        ("unknown dtype", with_entry("c", entry("Q9", (0,), (12, 12))), "dtype", "c"),
        ("packed dtype", with_entry("c", entry("F4", (0,), (12, 12))), "dtype", "c"),
        ("dtype not str", with_entry("c", entry(7, (0,), (12, 12))), "dtype", "c"),
        ("dtype is list", with_entry("c", {**entry(), "dtype": ["U8"]}), "dtype", "c"),
        ("shape not list", with_entry("c", {**entry(), "shape": 4}), "shape", "c"),
        ("shape is dict", with_entry("c", {**entry(), "shape": {"0": 4}}), "shape", "c"),
        ("shape negative", with_entry("c", entry("U8", (-1,), (12, 12))), "shape", "c"),
        ("shape bool", with_entry("c", entry("U8", (True,), (12, 13)), bytes(13)), "shape", "c"),
        ("shape float", with_entry("c", entry("U8", (1.0,), (12, 13)), bytes(13)), "shape", "c"),
        ("shape str", with_entry("c", entry("U8", ("1",), (12, 13)), bytes(13)), "shape", "c"),
        ("shape dim > int64", with_entry("c", entry("U8", (2**63, 0), (12, 12))), "shape", "c"),
        ("shape numel > int64", with_entry("c", entry("U8", (2**40, 2**40, 0), (12, 12))),
         "overflows", "c"),
        ("shape bigger than file", with_entry("c", entry("F64", (2**20, 2**20), (12, 12))),
         "mismatch", "c"),
        ("shape and offsets past end", with_entry("c", entry("F64", (2**20,), (12, 2**23 + 12))),
         "truncated", "c"),
        ("many huge dims", with_entry("c", entry("U8", [2**62] * 10_000, (12, 12))),
         "overflows", "c"),
        ("offsets not list", with_entry("c", {**entry(), "data_offsets": 12}), "data_offsets", "c"),
        ("offsets too long", with_entry("c", entry("U8", (0,), (12, 12, 12))), "data_offsets", "c"),
        ("offsets too short", with_entry("c", entry("U8", (0,), (12,))), "data_offsets", "c"),
        ("offsets negative", with_entry("c", entry("U8", (0,), (-1, -1))), "data_offsets", "c"),
        ("offsets reversed", with_entry("c", entry("U8", (0,), (13, 12))), "data_offsets", "c"),
        ("offsets bool", with_entry("c", entry("U8", (1,), (False, True))), "data_offsets", "c"),
        ("offsets float", with_entry("c", entry("U8", (0,), (12.0, 12.0))), "data_offsets", "c"),
        ("size mismatch", with_entry("c", entry("U8", (3,), (12, 14)), bytes(14)), "mismatch", "c"),
        ("size mismatch dtype", with_entry("b", entry("F64", (2,), (4, 12))), "mismatch", "b"),
        ("past end of file", file_from(GOOD, bytes(11)), "truncated", "b"),
        ("huge offsets", with_entry("c", entry("U8", (0,), (2**70, 2**70))), "truncated", "c"),
        ("overlap", with_entry("c", entry("U8", (2,), (10, 12)), bytes(12)), "overlap", "c"),
        ("overlap inside",
         file_from({"a": entry("U8", (4,), (0, 4)), "e": entry("U8", (0,), (2, 2))}, bytes(4)),
         "overlap", "e"),
        ("same range", file_from({"a": entry("U8", (4,), (0, 4)), "b": entry("I8", (4,), (0, 4))},
         bytes(4)), "overlap", "b"),
        ("gap at start", file_from({"a": entry("U8", (4,), (4, 8))}, bytes(8)), "gap", "a"),
        ("gap between", with_entry("c", entry("U8", (2,), (14, 16)), bytes(16)), "gap", "c"),
        ("trailing bytes", file_from(GOOD, bytes(13)), "trailing bytes", None),
        ("only trailing bytes", file_from({}, b"x"), "trailing bytes", None),
        ("metadata list", with_entry("c", entry("U8", (0,), (12, 12)), __metadata__=["k"]),
         "__metadata__", None),
        ("metadata null", with_entry("c", entry("U8", (0,), (12, 12)), __metadata__=None),
         "__metadata__", None),
        ("metadata int value", with_entry("c", entry("U8", (0,), (12, 12)), __metadata__={"k": 1}),
         "__metadata__", None),
        ("metadata nested", with_entry("c", entry("U8", (0,), (12, 12)), __metadata__={"k": {}}),
         "__metadata__", None),
    ]  # fmt: skip


@pytest.mark.parametrize(("data", "reason", "tensor"), [c[1:] for c in hostile_cases()],
                         ids=[c[0] for c in hostile_cases()])  # fmt: skip
def test_parse_header_rejects_hostile_input(data, reason, tensor):
    with pytest.raises(CheckpointCorruptError) as info:
        parse(data)
    err = info.value
    assert type(err) is CheckpointCorruptError
    assert err.path == PATH
    assert str(err).startswith(PATH)
    assert reason in err.reason
    if tensor is None:
        assert err.tensor is None
    else:
        assert err.tensor == tensor
        assert f"[{tensor}]" in str(err)


def test_parse_header_limit_and_truncation_of_real_files(tmp_path):
    data = assemble({"w": sample(torch.float32, (4, 4)), "b": sample(torch.bfloat16, (3,))})
    n = struct.unpack("<Q", data[:8])[0]
    assert parse(data, max_header_bytes=n).entries.keys() == {"w", "b"}
    with pytest.raises(CheckpointCorruptError, match="limit"):
        parse(data, max_header_bytes=n - 1)
    for cut in (len(data) - 1, len(data) - 6, 8 + n + 1, 8 + n):
        with pytest.raises(CheckpointCorruptError, match="truncated") as info:
            parse(data[:cut])
        assert info.value.tensor in ("w", "b")
    # a file_size larger than what can be read is a truncation too
    with pytest.raises(CheckpointCorruptError, match="truncated"):
        parse_header(PATH, io.BytesIO(data[:10]), len(data))
    # file objects are read from the start whatever their position
    f = io.BytesIO(data)
    f.seek(17)
    assert parse_header(PATH, f, len(data)).entries.keys() == {"w", "b"}


def test_read_header(tmp_path):
    p = tmp_path / "x.safetensors"
    p.write_bytes(assemble({"w": sample(torch.float16, (2, 3))}, {"k": "v"}))
    for arg in (p, str(p)):
        h = read_header(arg)
        assert h.entries["w"] == HeaderEntry("w", "F16", (2, 3), 0, 12)
        assert h.metadata == {"k": "v"}
        assert h.data_start + h.data_size == p.stat().st_size
    missing = tmp_path / "nope.safetensors"
    with pytest.raises(CheckpointCorruptError, match="missing") as info:
        read_header(missing)
    assert info.value.path == str(missing)
    assert info.value.reason == "missing"
    with pytest.raises(CheckpointCorruptError):
        read_header(tmp_path)
    p.write_bytes(b"\x01\x00")
    with pytest.raises(CheckpointCorruptError, match="shorter"):
        read_header(p)


# ------------------------------------------------------------------------------ property tests


def expect_parse_or_corrupt(data: bytes, **kw) -> Header | None:
    """Parse `data`: success must be consistent, and the only failure is CheckpointCorruptError."""
    err: CheckpointCorruptError | None = None
    try:
        h = parse(data, **kw)
    except CheckpointCorruptError as e:
        err = e
    if err is not None:
        assert type(err) is CheckpointCorruptError
        assert err.path == PATH
        assert str(err).startswith(PATH)
        event(f"corrupt: {err.reason.split(':')[0][:20]}")
        return None
    consistent(h, len(data))
    event("parsed")
    return h


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
    lambda children: st.lists(children, max_size=4)
    | st.dictionaries(
        st.sampled_from(["dtype", "shape", "data_offsets", "a", ""]) | st.text(max_size=4),
        children,
        max_size=4,
    ),
    max_leaves=20,
)  # fmt: skip


@PROPERTY
@given(
    data=st.one_of(
        st.binary(max_size=200),  # anything at all
        st.binary(max_size=200).map(lambda b: struct.pack("<Q", len(b)) + b),  # any header text
        st.tuples(json_values, st.binary(max_size=32)).map(  # any JSON as header
            lambda t: file_from(json.dumps(t[0]).encode(), t[1])
        ),
        st.tuples(
            st.dictionaries(st.text(max_size=6), json_values, max_size=4), st.binary(max_size=32)
        ).map(lambda t: file_from(json.dumps(t[0]).encode(), t[1])),
    )
)
def test_property_arbitrary_bytes(data):
    expect_parse_or_corrupt(data)


UTF8 = st.characters(codec="utf-8")  # no unpaired surrogates


@st.composite
def valid_files(draw) -> tuple[bytes, list[HeaderEntry]]:
    """A valid file from build_header: random names, codes, shapes (incl. 0-d and empty)."""
    names = draw(st.lists(st.text(UTF8, min_size=1, max_size=6), max_size=5, unique=True))
    entries, offset = [], 0
    for name in names:
        code = draw(st.sampled_from(CODES))
        shape = tuple(draw(st.lists(st.integers(0, 4), max_size=3)))
        n = 1
        for d in shape:
            n *= d
        size = n * code_itemsize(code)
        entries.append(HeaderEntry(name, code, shape, offset, offset + size))
        offset += size
    if draw(st.booleans()):
        entries.reverse()  # header order need not be offset order
    meta = draw(st.none() | st.dictionaries(st.text(UTF8, max_size=3), st.text(UTF8, max_size=3)))
    header = build_header(entries, meta)
    return header + draw(st.binary(min_size=offset, max_size=offset)), entries


@PROPERTY
@given(file=valid_files())
def test_property_build_parse_round_trip(file):
    data, entries = file
    h = expect_parse_or_corrupt(data)
    assert h is not None
    assert list(h.entries.values()) == entries
    assert len(data) - h.data_size == h.data_start
    assert h.data_start % 8 == 0


@PROPERTY
@given(file=valid_files(), how=st.sampled_from(["flip", "digit", "truncate", "prefix", "offset"]),
       r=st.randoms(use_true_random=False))  # fmt: skip
def test_property_mutated_valid_file(file, how, r):
    data, entries = file
    n = struct.unpack("<Q", data[:8])[0]
    buf = bytearray(data)
    if how == "flip":  # one byte anywhere in the length prefix or header
        i = r.randrange(8 + n)
        buf[i] ^= r.randrange(1, 256)
    elif how == "digit":  # a digit of the header JSON: more mutants get past the JSON parser
        digits = [i for i in range(8, 8 + n) if chr(buf[i]).isdigit()]
        if digits:
            buf[r.choice(digits)] = ord(str(r.randrange(10)))
    elif how == "truncate":
        del buf[r.randrange(len(buf) + 1) :]
    elif how == "prefix":
        value = r.choice([r.randrange(2**64), r.randrange(n + 16), n - 1, n + 1])
        buf[:8] = struct.pack("<Q", max(value, 0))
    else:  # replace one number in the JSON (offsets, or a shape dimension) by a random int
        text = buf[8 : 8 + n].decode()
        obj = json.loads(text)
        names = [k for k in obj if k != "__metadata__"]
        if names:
            e = obj[r.choice(names)]
            e["data_offsets"][r.randrange(2)] = r.choice(
                [r.randrange(-5, 50), r.randrange(2**70), -(2**65)]
            )
        new = json.dumps(obj, separators=(",", ":")).encode()
        buf[: 8 + n] = struct.pack("<Q", len(new)) + new
    event(how)
    expect_parse_or_corrupt(bytes(buf))


def test_header_entry_and_header_are_frozen():
    e = HeaderEntry("a", "U8", (1,), 0, 1)
    with pytest.raises(AttributeError):
        e.name = "b"  # type: ignore[misc]
    h = parse(build_header([e]) + b"x")
    with pytest.raises(AttributeError):
        h.data_start = 0  # type: ignore[misc]


def test_module_is_documented():
    import pyshmckpt.storage.safetensors_header as m

    assert m.__doc__
    for name in m.__all__:
        obj = getattr(m, name)
        if callable(obj):
            assert obj.__doc__, name
    assert Path(m.__file__).read_text().count("assert ") == 0  # validation must survive -O
