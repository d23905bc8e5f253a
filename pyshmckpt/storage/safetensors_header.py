"""The `.safetensors` header: dtype codes, building a header, and parsing one strictly.

A safetensors file is an unsigned little-endian 64-bit length N, then N bytes of UTF-8 JSON (an
object), then the data buffer. The JSON maps each tensor name to
``{"dtype": CODE, "shape": [ints], "data_offsets": [begin, end]}`` (offsets relative to the start
of the data buffer) and may hold a ``"__metadata__"`` object of str -> str. Entries sorted by
offsets must tile the buffer exactly: no gaps, no overlaps, nothing after the last one.

This module owns only the header. `build_header` returns the bytes that precede the tensor data
(padded with spaces, as the reference writer does, so that the data starts at a multiple of 8);
`parse_header`/`read_header` validate a header against the file size and raise
`CheckpointCorruptError` for every problem, whatever the bytes are. It imports torch only when
dtype objects are asked for (`CODE_TO_DTYPE`, `DTYPE_TO_CODE`): the writer process works from
dtype names (`NAME_TO_CODE`) and never loads torch.

Compared with the reference reader (safetensors 0.8), parsing is stricter in a few places that no
conforming writer hits: duplicate JSON keys, unknown fields in an entry, a ``null``
``__metadata__`` and unpaired surrogates in names are rejected; and a shape's non-zero dimensions
must multiply to at most 2**63 - 1 (what torch can allocate), even when another dimension is 0.
Like the reference, it accepts a data buffer that does not start 8-aligned and an empty name.
"""

from __future__ import annotations

import functools
import json
import os
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, NamedTuple

from .._lazy import no_attribute
from ..errors import CheckpointCorruptError, ConfigError

if TYPE_CHECKING:
    import torch

    CODE_TO_DTYPE: dict[str, torch.dtype]  # (module __getattr__, below)
    DTYPE_TO_CODE: dict[torch.dtype, str]

__all__ = [
    "CODE_TO_DTYPE",
    "DTYPE_TO_CODE",
    "METADATA_KEY",
    "NAME_TO_CODE",
    "Header",
    "HeaderEntry",
    "build_header",
    "code_itemsize",
    "parse_header",
    "read_header",
]

METADATA_KEY = "__metadata__"
_ALIGN = 8  # the reference writer pads the header so that the data buffer starts 8-aligned
_MAX_DIM = (1 << 63) - 1  # torch sizes are int64
_FIELDS = frozenset(("dtype", "shape", "data_offsets"))

# Codes as written by the installed safetensors (0.8.0). Packed sub-byte codes (F4, F6_*) are left
# out: their shape counts sub-byte elements, which this byte-per-item model does not describe.
_CODES: dict[str, tuple[str, int]] = {  # code -> (torch dtype attribute, itemsize in bytes)
    "BOOL": ("bool", 1),
    "U8": ("uint8", 1),
    "I8": ("int8", 1),
    "U16": ("uint16", 2),
    "I16": ("int16", 2),
    "U32": ("uint32", 4),
    "I32": ("int32", 4),
    "U64": ("uint64", 8),
    "I64": ("int64", 8),
    "F16": ("float16", 2),
    "BF16": ("bfloat16", 2),
    "F32": ("float32", 4),
    "F64": ("float64", 8),
    "F8_E4M3": ("float8_e4m3fn", 1),
    "F8_E5M2": ("float8_e5m2", 1),
    "F8_E4M3FNUZ": ("float8_e4m3fnuz", 1),
    "F8_E5M2FNUZ": ("float8_e5m2fnuz", 1),
    "F8_E8M0": ("float8_e8m0fnu", 1),
    "C64": ("complex64", 8),
}

#: safetensors dtype code of each torch dtype name ("bfloat16": "BF16"); no torch needed.
NAME_TO_CODE: dict[str, str] = {attr: code for code, (attr, _) in _CODES.items()}
_ITEMSIZE: dict[str, int] = {code: itemsize for code, (_, itemsize) in _CODES.items()}


@functools.cache
def _torch_codes() -> tuple[dict[str, torch.dtype], dict[torch.dtype, str]]:
    """CODE_TO_DTYPE and DTYPE_TO_CODE, for the codes whose dtype this torch has (older torch
    lacks some). torch is imported here, on first use: the writer process works from names."""
    import torch

    to_dtype = {
        code: getattr(torch, attr) for code, (attr, _) in _CODES.items() if hasattr(torch, attr)
    }
    return to_dtype, {dtype: code for code, dtype in to_dtype.items()}


def __getattr__(name: str) -> Any:
    # CODE_TO_DTYPE: safetensors code -> torch dtype; DTYPE_TO_CODE: the reverse.
    if name == "CODE_TO_DTYPE":
        return _torch_codes()[0]
    if name == "DTYPE_TO_CODE":
        return _torch_codes()[1]
    raise no_attribute(__name__, name)


def code_itemsize(code: str) -> int:
    """Bytes per element of dtype `code`; ValueError for a code this module does not map."""
    try:
        return _ITEMSIZE[code]
    except (KeyError, TypeError):
        raise ConfigError(f"unknown safetensors dtype code {code!r}") from None


class HeaderEntry(NamedTuple):
    """One tensor: its name, dtype code, shape and byte range within the data buffer."""

    name: str
    code: str
    shape: tuple[int, ...]
    begin: int
    end: int


@dataclass(frozen=True)
class Header:
    """A validated header. The data buffer is bytes [data_start, data_start + data_size)."""

    entries: dict[str, HeaderEntry]  # in the order of the JSON
    metadata: dict[str, str]
    data_start: int
    data_size: int


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _short(x: object, limit: int = 80) -> str:
    """repr(x), cut to `limit` characters: hostile headers must not make huge messages."""
    r = repr(x)
    return r if len(r) <= limit else r[: limit - 3] + "..."


def _is_text(x: object) -> bool:
    """A str that is valid Unicode (JSON escapes can produce unpaired surrogates)."""
    if not isinstance(x, str):
        return False
    try:
        x.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _shape_nbytes(shape: Any, itemsize: int, cap: int) -> tuple[int | None, str | None]:
    """Byte size of a shape, or (None, reason). A size above `cap` gives (None, "exceeds").

    One pass over the dimensions (it runs for every tensor of every header read). Never
    multiplies unbounded numbers: the product stops growing once it passes int64's range.
    """
    if not isinstance(shape, (list, tuple)):
        return None, "shape must be a list of non-negative integers"
    above = zero = False
    numel = 1
    for d in shape:
        if (type(d) is not int and not _is_int(d)) or d < 0:
            return None, "shape must be a list of non-negative integers"
        if d > _MAX_DIM:
            above = True
        elif not d:
            zero = True
        elif numel <= _MAX_DIM:  # at most ~64 multiplications by d >= 2 get here
            numel *= d
    if above:
        return None, "shape has a dimension above 2**63-1"
    if numel > _MAX_DIM:
        return None, "shape's element count overflows int64"
    if zero:
        return 0, None
    nbytes = numel * itemsize
    return (None, "exceeds") if nbytes > cap else (nbytes, None)


def _check_tiling(
    entries: list[tuple[str, int, int]], total: int | None
) -> tuple[str | None, str] | None:
    """Check (name, begin, end) ranges tile [0, last end) (and [0, total) if given).

    Returns (name, reason) for the first problem, or None; name is None for trailing bytes.
    """
    expected, prev = 0, None
    for name, begin, end in sorted(entries, key=lambda e: (e[1], e[2])):
        if begin < expected:
            return name, f"overlap: [{begin}, {end}] overlaps {prev!r}, which ends at {expected}"
        if begin > expected:
            return name, f"gap: [{begin}, {end}] begins after the previous end {expected}"
        expected, prev = end, name
    if total is not None and expected != total:
        return None, f"trailing bytes: tensors end at {expected} of {total} data bytes"
    return None


# --------------------------------------------------------------------------------------- building


def build_header(
    entries: list[HeaderEntry], metadata: dict[str, str] | None = None, alignment: int = _ALIGN
) -> bytes:
    """The bytes before the tensor data: length prefix, compact JSON, spaces to a multiple of
    `alignment` (8 by default; a multiple of 8), which is where the data starts.

    Entries appear in the order given (after ``__metadata__``, if any). They must tile the data
    buffer from offset 0 without gaps or overlaps; ValueError describes any invalid input.
    """
    obj: dict[str, Any] = {}
    if metadata is not None:
        if not isinstance(metadata, Mapping) or not all(
            _is_text(k) and _is_text(v) for k, v in metadata.items()
        ):
            raise ConfigError("metadata must map str to str")
        obj[METADATA_KEY] = dict(metadata)
    ranges = []
    for e in entries:
        if not isinstance(e, HeaderEntry):
            raise ConfigError(f"expected a HeaderEntry, got {type(e).__name__}")
        if not _is_text(e.name) or not e.name or e.name == METADATA_KEY:
            raise ConfigError(f"invalid tensor name {e.name!r}")
        if e.name in obj:
            raise ConfigError(f"duplicate tensor name {e.name!r}")
        if not isinstance(e.code, str) or e.code not in _ITEMSIZE:
            raise ConfigError(f"{e.name}: unknown dtype code {_short(e.code)}")
        nbytes, why = _shape_nbytes(e.shape, _ITEMSIZE[e.code], _MAX_DIM)
        if nbytes is None:
            why = "byte size above 2**63-1" if why == "exceeds" else why
            raise ConfigError(f"{e.name}: invalid shape {_short(e.shape)}: {why}")
        if not (_is_int(e.begin) and _is_int(e.end) and 0 <= e.begin <= e.end):
            raise ConfigError(f"{e.name}: invalid offsets [{e.begin!r}, {e.end!r}]")
        if e.end - e.begin != nbytes:
            raise ConfigError(
                f"{e.name}: offsets [{e.begin}, {e.end}] hold {e.end - e.begin} bytes, "
                f"but {e.code}{list(e.shape)} needs {nbytes}"
            )
        obj[e.name] = {"dtype": e.code, "shape": list(e.shape), "data_offsets": [e.begin, e.end]}
        ranges.append((e.name, e.begin, e.end))
    problem = _check_tiling(ranges, None)
    if problem is not None:
        raise ConfigError(f"{problem[0]}: {problem[1]}")
    text = json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    if not _is_int(alignment) or alignment < _ALIGN or alignment % _ALIGN:
        raise ConfigError(f"alignment must be a positive multiple of {_ALIGN}, not {alignment!r}")
    text += b" " * (-(8 + len(text)) % alignment)
    return struct.pack("<Q", len(text)) + text


# ---------------------------------------------------------------------------------------- parsing


class _Invalid(ValueError):
    """Raised inside json.loads hooks; turned into CheckpointCorruptError."""


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    obj = dict(pairs)  # in C: a header holds one object per tensor
    if len(obj) != len(pairs):
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                raise _Invalid(f"duplicate key {ascii(key)}")
            seen.add(key)
    return obj


def _no_constants(name: str) -> Any:
    raise _Invalid(f"non-finite number {name} in JSON")


def _read_exact(fileobj: IO[bytes], n: int) -> bytes:
    chunks, got = [], 0
    while got < n:
        chunk = fileobj.read(n - got)
        if not chunk:
            break
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


def parse_header(
    path: str, fileobj: IO[bytes], file_size: int, *, max_header_bytes: int = 100 << 20
) -> Header:
    """Read and validate the header of the safetensors file open as `fileobj` (`file_size` bytes).

    `path` only labels errors. Any problem (short file, oversized or malformed header, bad entry,
    gaps, overlaps, truncation, trailing bytes) raises CheckpointCorruptError, naming the tensor
    concerned when there is one. Read errors of `fileobj` itself (OSError) propagate.
    """
    path = str(os.fspath(path))

    def corrupt(reason: str, tensor: str | None = None) -> CheckpointCorruptError:
        return CheckpointCorruptError(path, reason, tensor=tensor)

    if file_size < 8:
        raise corrupt(f"file is {file_size} bytes, shorter than the 8-byte header length")
    fileobj.seek(0)
    prefix = _read_exact(fileobj, 8)
    if len(prefix) < 8:
        raise corrupt(f"truncated: could read only {len(prefix)} of the 8-byte header length")
    (n,) = struct.unpack("<Q", prefix)
    if n > max_header_bytes:
        raise corrupt(f"header length {n} exceeds the limit of {max_header_bytes} bytes")
    if n > file_size - 8:
        raise corrupt(f"truncated: header length {n} exceeds the {file_size - 8} bytes after it")
    raw = _read_exact(fileobj, n)
    if len(raw) < n:
        raise corrupt(f"truncated: could read only {len(raw)} of the {n}-byte header")
    try:
        obj = json.loads(
            raw.decode("utf-8"), object_pairs_hook=_no_duplicates, parse_constant=_no_constants
        )
    except UnicodeDecodeError as e:
        raise corrupt(f"header is not valid UTF-8 ({e.reason} at byte {e.start})") from None
    except RecursionError:
        raise corrupt("header JSON is nested too deeply") from None
    except ValueError as e:  # JSONDecodeError, _Invalid, int too long to convert
        raise corrupt(f"header is not valid JSON: {e}") from None
    if not isinstance(obj, dict):
        raise corrupt(f"header JSON is a {type(obj).__name__}, not an object")

    data_start = 8 + n
    data_size = file_size - data_start
    metadata: dict[str, str] = {}
    entries: dict[str, HeaderEntry] = {}
    for name, info in obj.items():
        if not _is_text(name):
            raise corrupt("tensor name is not valid Unicode", tensor=ascii(name))
        if name == METADATA_KEY:
            if not isinstance(info, dict) or not all(
                _is_text(k) and _is_text(v) for k, v in info.items()
            ):
                raise corrupt("__metadata__ must be an object mapping str to str")
            metadata = info
            continue
        if not isinstance(info, dict):
            raise corrupt(f"entry is a {type(info).__name__}, not an object", tensor=name)
        if info.keys() != _FIELDS:
            missing, extra = sorted(_FIELDS - info.keys()), sorted(info.keys() - _FIELDS)
            reason = f"entry fields: missing {missing}, unexpected {_short(extra)}"
            raise corrupt(reason, tensor=name)
        code, shape, offsets = info["dtype"], info["shape"], info["data_offsets"]
        itemsize = _ITEMSIZE.get(code) if type(code) is str else None
        if itemsize is None:
            raise corrupt(f"unknown or unsupported dtype {_short(code)}", tensor=name)
        if not (
            type(offsets) is list
            and len(offsets) == 2
            and type(offsets[0]) is int
            and type(offsets[1]) is int
            and 0 <= offsets[0] <= offsets[1]
        ):
            raise corrupt(
                "data_offsets must be two non-negative integers [begin, end] with begin <= end",
                tensor=name,
            )
        begin, end = offsets
        nbytes, why = _shape_nbytes(shape, itemsize, data_size)  # never past data_size
        if why is not None and why != "exceeds":
            raise corrupt(f"invalid shape {_short(shape)}: {why}", tensor=name)
        if end > data_size:
            raise corrupt(
                f"truncated: data_offsets [{begin}, {end}] extend past the end of the file "
                f"(data buffer has {data_size} bytes)",
                tensor=name,
            )
        if nbytes != end - begin:
            needs = f"more than the {data_size} data bytes" if nbytes is None else f"{nbytes}"
            raise corrupt(
                f"byte size mismatch: data_offsets [{begin}, {end}] hold {end - begin} bytes, "
                f"{code}{_short(shape)} needs {needs}",
                tensor=name,
            )
        entries[name] = HeaderEntry(name, code, tuple(shape), begin, end)
    problem = _check_tiling([(e.name, e.begin, e.end) for e in entries.values()], data_size)
    if problem is not None:
        raise corrupt(problem[1], tensor=problem[0])
    return Header(entries, metadata, data_start, data_size)


def read_header(path: str | os.PathLike[str]) -> Header:
    """Open `path` and parse its header; a missing file raises CheckpointCorruptError("missing")."""
    spath = str(os.fspath(path))
    try:
        f = Path(spath).open("rb")
    except FileNotFoundError:
        raise CheckpointCorruptError(spath, "missing") from None
    except IsADirectoryError:
        raise CheckpointCorruptError(spath, "not a regular file") from None
    with f:
        return parse_header(spath, f, os.fstat(f.fileno()).st_size)


def expected_crcs(
    st_path: Path, header: Any, recorded: Any, only: set[str] | None = None
) -> dict[str, int]:
    """The recorded CRC32C of every entry of the file (of those in `only`, when given), in the
    header's order; raises when one is missing on either side."""
    if not isinstance(recorded, dict):
        raise CheckpointCorruptError(str(st_path), "the manifest records no checksums")
    expected = {}
    for name in header.entries:
        if only is not None and name not in only:
            continue
        crc = recorded.get(name, {}).get("crc32c") if isinstance(recorded.get(name), dict) else None
        if type(crc) is not int:
            raise CheckpointCorruptError(str(st_path), "no checksum recorded", tensor=name)
        expected[name] = crc
    missing = set(recorded) - set(header.entries)
    if only is not None:
        missing &= only
    if missing:
        raise CheckpointCorruptError(
            str(st_path), "entry missing from the file", tensor=sorted(missing)[0]
        )
    return expected
