"""JSON encoding of a manifest's structure tree (containers, keys, leaves, tensor slots).

Plain data (None, bool, int, float, str, bytes, dicts/lists/tuples of them, torch dtypes and
sizes) is encoded as JSON that any tool can read. Anything else (custom objects, namedtuples,
Counter, defaultdict, ...) needs pickle, which the writer refuses unless the caller opts in, and
which the reader refuses to unpickle unless its caller opts in too.
"""

from __future__ import annotations

import base64
import collections
import math
import pickle
import sys
from typing import Any

from ..errors import CheckpointCorruptError, PickleNotAllowedError, UnsupportedValueError
from ..staging.manifest import (
    DICT,
    LEAF,
    LIST,
    NAMED_TUPLE,
    PICKLED,
    REDUCED,
    TUPLE,
    Container,
    dtype_name,
    reconstruct,
    torch_dtypes,
)


class _Malformed(Exception):
    """Raised inside decoding; `decode` reports it as CheckpointCorruptError."""


class _PickleRequired(Exception):
    """Raised inside encoding: the value is not plain data and pickling was not allowed."""

    def __init__(self, what: str) -> None:
        super().__init__(what)
        self.what = what


def _encode_leaf(value: Any, allow_pickle: bool) -> Any:
    if value is None or isinstance(value, (bool, str)):
        return {"v": value}
    if isinstance(value, int) and type(value) is int:
        return {"v": value}
    if type(value) is float:
        return {"v": value} if math.isfinite(value) else {"float": repr(value)}
    if type(value) is bytes:
        return {"bytes": base64.b64encode(value).decode()}
    # A torch dtype or Size exists only once torch is loaded; a process without it has neither.
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(value, torch.dtype):
        return {"dtype": dtype_name(value)}
    if torch is not None and type(value) is torch.Size:
        return {"size": list(value)}
    if type(value) in (list, tuple, dict, collections.OrderedDict):
        # Plain containers inside a leaf (betas=(0.9, 0.999) in param_groups, _metadata).
        if isinstance(value, dict):
            kind = "leafdict" if type(value) is dict else "leafodict"
            pairs = [
                [_encode_leaf(k, allow_pickle), _encode_leaf(v, allow_pickle)]
                for k, v in value.items()
            ]
            return {kind: pairs}
        kind = "leaflist" if type(value) is list else "leaftuple"
        return {kind: [_encode_leaf(v, allow_pickle) for v in value]}
    if not allow_pickle:
        raise _PickleRequired(
            f"a value of type {type(value).__module__}.{type(value).__qualname__}"
        )
    return {"pickle": base64.b64encode(pickle.dumps(value)).decode()}


def encode(node: Any, allow_pickle: bool = False) -> Any:
    """JSON-ready form of a manifest's tree. Without allow_pickle, raises UnsupportedValueError
    for parts that are not plain data."""
    if allow_pickle:
        return _encode(node, True)
    try:
        return _encode(node, False)
    except _PickleRequired as exc:
        raise UnsupportedValueError(
            "state_dict",
            f"{exc.what} is not plain data (None/bool/int/float/str/bytes and containers of "
            "them); pass allow_pickle=True to store it with pickle",
        ) from None


def check_plain(tree: Any) -> None:
    """Raise UnsupportedValueError if the tree needs pickle to be stored."""
    if not _only_plain_values(tree):
        encode(tree, allow_pickle=False)  # raises, naming what needs pickle (or finds it plain)


# Leaf and key types that encode as plain JSON values whatever their value.
_SCALARS = frozenset({type(None), bool, int, float, str})


def _only_plain_values(tree: Any) -> bool:
    """True for a tree of dicts (OrderedDicts with plain attributes too), lists and tuples whose
    keys and leaves are None, bool, int, float or str, checked without building its encoding (a
    state dict's usual shape, which this answers far faster than `encode` would); False means
    `encode` must decide."""
    stack = [tree]
    while stack:
        node = stack.pop()
        if type(node) is int:  # a tensor
            continue
        kind = node.kind
        if kind == LEAF:
            if type(node.value) not in _SCALARS:
                return False
            continue
        if kind == DICT or kind == REDUCED:
            if not _SCALARS.issuperset(map(type, node.keys or ())):
                return False
            if kind == REDUCED and not _plain_odict(node):
                return False
        elif kind != LIST and kind != TUPLE:
            return False
        children = node.children
        if not {int}.issuperset(map(type, children)):
            stack.extend(children)
    return True


def _plain_odict(node: Container) -> bool:
    """Whether a REDUCED node is an OrderedDict whose attributes are plain (a module's state dict
    and its ``_metadata``)."""
    if node.factory is not collections.OrderedDict or node.args:
        return False
    try:
        _encode_leaf(node.state, False)
    except _PickleRequired:
        return False
    return True


def _encode(node: Any, allow_pickle: bool) -> Any:
    if type(node) is int:
        return {"t": node}
    kind = node.kind
    if kind == LEAF:
        return _encode_leaf(node.value, allow_pickle)
    if kind == PICKLED:  # already pickle bytes: stored as they came
        if not allow_pickle:
            raise _PickleRequired(f"a {node.value.type_name} (carried pickled)")
        return {"pickle": base64.b64encode(node.value.data).decode()}
    children = [_encode(child, allow_pickle) for child in node.children]
    keys = node.keys
    if kind == DICT:
        return {
            "dict": [
                [_encode_leaf(k, allow_pickle), c] for k, c in zip(keys, children, strict=True)
            ]
        }
    if kind == LIST:
        return {"list": children}
    if kind == TUPLE:
        return {"tuple": children}
    func, args, state = node.factory, node.args, node.state
    if kind == REDUCED and func is collections.OrderedDict and not args and not state:
        return {
            "odict": [
                [_encode_leaf(k, allow_pickle), c] for k, c in zip(keys, children, strict=True)
            ]
        }
    if kind == REDUCED and func is collections.OrderedDict and not args:
        # A module state dict's OrderedDict carries _metadata (plain data): keep it as JSON.
        return {
            "odict": [
                [_encode_leaf(k, allow_pickle), c] for k, c in zip(keys, children, strict=True)
            ],
            "attrs": _encode_leaf(state, allow_pickle),
        }
    if not allow_pickle:
        name = getattr(func, "__qualname__", repr(func))
        raise _PickleRequired(f"a container of type {name}")
    header = func if kind == NAMED_TUPLE else (func, args, state)
    encoded: dict[str, Any] = {
        "reduced" if kind == REDUCED else "namedtuple": base64.b64encode(
            pickle.dumps(header)
        ).decode(),
        "children": children,
    }
    if kind == REDUCED and keys is not None:
        encoded["keys"] = [_encode_leaf(k, allow_pickle) for k in keys]
    return encoded


def _decode_leaf(value: Any, allow_pickle: bool) -> Any:
    if not isinstance(value, dict) or len(value) != 1:
        raise _Malformed(f"malformed leaf {value!r:.80}")
    ((kind, payload),) = value.items()
    if kind == "v":
        if payload is not None and type(payload) not in (bool, int, float, str):
            raise _Malformed("malformed plain leaf")
        return payload
    if kind == "float":
        return float(payload)
    if kind == "bytes":
        return base64.b64decode(payload, validate=True)
    if kind == "dtype":
        return torch_dtypes()[payload]
    if kind == "size":
        import torch

        return torch.Size(int(d) for d in payload)
    if kind in ("leafdict", "leafodict"):
        pairs = [(_decode_leaf(k, allow_pickle), _decode_leaf(v, allow_pickle)) for k, v in payload]
        return dict(pairs) if kind == "leafdict" else collections.OrderedDict(pairs)
    if kind == "leaflist":
        return [_decode_leaf(v, allow_pickle) for v in payload]
    if kind == "leaftuple":
        return tuple(_decode_leaf(v, allow_pickle) for v in payload)
    if kind == "pickle":
        return _unpickle(payload, allow_pickle)
    raise _Malformed(f"unknown leaf kind {kind!r}")


def _unpickle(payload: str, allow_pickle: bool) -> Any:
    if not allow_pickle:
        raise PickleNotAllowedError(
            "the checkpoint holds pickled values; pass allow_pickle=True to load them"
        )
    return pickle.loads(base64.b64decode(payload, validate=True))  # noqa: S301 (opted in)


def _decode(value: Any, tensors: list[Any], allow_pickle: bool) -> Any:
    """Rebuild the structure from its JSON form, with tensor slots taken from `tensors`."""
    if not isinstance(value, dict):
        raise _Malformed(f"malformed node {value!r:.80}")
    if "t" in value:
        index = value["t"]
        if type(index) is not int or not 0 <= index < len(tensors):
            raise _Malformed(f"tensor index {index!r} out of range")
        return tensors[index]
    if "dict" in value or "odict" in value:
        items = value["dict"] if "dict" in value else value["odict"]
        if not isinstance(items, list):
            raise _Malformed("malformed dict node")
        pairs = [
            (_decode_leaf(k, allow_pickle), _decode(c, tensors, allow_pickle)) for k, c in items
        ]
        if "dict" in value:
            return dict(pairs)
        out = collections.OrderedDict(pairs)
        if "attrs" in value:
            attrs = _decode_leaf(value["attrs"], allow_pickle)
            if attrs is not None and not isinstance(attrs, dict):
                raise _Malformed("malformed attributes of an OrderedDict")
            out.__dict__.update(attrs or {})
        return out
    if "list" in value:
        return [_decode(c, tensors, allow_pickle) for c in value["list"]]
    if "tuple" in value:
        return tuple(_decode(c, tensors, allow_pickle) for c in value["tuple"])
    if "reduced" in value or "namedtuple" in value:
        children = [_decode(c, tensors, allow_pickle) for c in value["children"]]
        if "namedtuple" in value:
            return _unpickle(value["namedtuple"], allow_pickle)(*children)
        func, args, state = _unpickle(value["reduced"], allow_pickle)
        keys = (
            tuple(_decode_leaf(k, allow_pickle) for k in value["keys"]) if "keys" in value else None
        )
        return reconstruct(Container(REDUCED, keys, (), func, args, state), children)
    return _decode_leaf(value, allow_pickle)


def decode(value: Any, tensors: list[Any], *, allow_pickle: bool, where: str) -> Any:
    """Rebuild the structure from its JSON form, with tensor slots taken from `tensors`.

    Raises PickleNotAllowedError for pickled parts without allow_pickle (nothing is unpickled)
    and CheckpointCorruptError naming `where` for a malformed structure.
    """
    try:
        return _decode(value, tensors, allow_pickle)
    except PickleNotAllowedError:
        raise
    except (_Malformed, ValueError, KeyError, TypeError, IndexError, RecursionError) as exc:
        raise CheckpointCorruptError(where, f"malformed structure: {exc}") from None
