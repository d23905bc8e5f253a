"""Reuse the layout of the last state dict for the next one of the same structure.

A training loop stages state dicts of one structure again and again. A Planner keeps the layout
of the last one and checks the next against it: the same containers and keys, the same tensor
objects pattern (which places hold one object), and for each tensor the same class, dtype,
shape, stride, storage offset, device, layout, autograd flags and lazy conj/neg bits, the same
storage-sharing pattern, (for DTensors) the same placements, and the same kind of value (a NumPy
or CuPy array where one was, a tensor where a tensor was). Then offsets and manifest columns are
the old ones; only the copy rows' source addresses, the leaves and the DTensor specs are new. Any
difference falls back to a full plan.
"""

from __future__ import annotations

import copy
import dataclasses
import threading
from typing import Any

import numpy as np
import torch

from .. import _torch_private
from .._gc import gc_paused
from ..errors import UnsupportedValueError
from .arrays import ArrayTensors, array_flag, device_array_problem, numpy_problem
from .dtensors import Sharding, loaded_dtensor_type, shard_info
from .layout import ATOMIC, BlockMap, StagingPlan, lay_out, tensor_problem
from .manifest import (
    ARRAY,
    DICT,
    LEAF,
    LIST,
    NAMED_TUPLE,
    NUMPY,
    PICKLED,
    REDUCED,
    TUPLE,
    Container,
    Leaf,
    Manifest,
    Pickled,
)
from .signatures import tensor_flags, tensor_signature


@dataclasses.dataclass
class PlannerStats:
    """What a Planner did: full plans, plans reused, and why the last full plan was needed."""

    plans: int = 0
    reuses: int = 0
    last_replan: str | None = None  # None: no plan to reuse yet (or the last one was reused)


@dataclasses.dataclass
class _Template:
    """What a Planner keeps of its last full plan: the manifest and the map of its blocks."""

    manifest: Manifest
    blocks: BlockMap
    runs: dict[int, int] | None = None  # see tensor_runs; made by the first reuse
    arrays: dict[int, int] | None = None  # see array_flags; made by the first reuse

    def array_flags(self) -> dict[int, int]:
        """The tensors that were arrays: index -> NUMPY or CUPY."""
        if self.arrays is None:
            flags = self.manifest.flags & ARRAY
            rows = np.flatnonzero(flags)
            self.arrays = dict(zip(rows.tolist(), flags[rows].tolist(), strict=True))
        return self.arrays

    def tensor_runs(self) -> dict[int, int]:
        """The containers whose children are all plain tensors numbered start, start + 1, ...,
        each appearing nowhere else (by id of the tree node, which the template keeps alive):
        the first index of each. The matcher takes such children in one slice."""
        if self.runs is None:
            counts: dict[int, int] = {}
            containers: list[Container] = []
            _count_tensors(self.manifest.tree, counts, containers)
            runs = {}
            arrays = self.array_flags()
            for node in containers:
                children = node.children
                if not children or any(type(c) is not int for c in children):
                    continue
                start = children[0]
                if children == tuple(range(start, start + len(children))) and all(
                    counts[c] == 1 and c not in self.blocks.dtensors and c not in arrays
                    for c in children
                ):
                    runs[id(node)] = start
            self.runs = runs
        return self.runs


def _count_tensors(node: Any, counts: dict[int, int], containers: list[Container]) -> None:
    """How often each tensor index occurs under `node`, and its container nodes."""
    if type(node) is int:
        counts[node] = counts.get(node, 0) + 1
        return
    if type(node) is Leaf:
        return
    containers.append(node)
    for child in node.children:
        _count_tensors(child, counts, containers)


_PLAIN_TENSORS = frozenset({torch.Tensor, torch.nn.Parameter})


class _Mismatch(Exception):
    """The state dict differs from the template's; the reason goes to PlannerStats."""


class _Matcher:
    """Walks a state dict along a template's tree: collects its tensors in tree order, takes fresh
    copies of the leaves and raises _Mismatch at the first structural difference."""

    def __init__(
        self, count: int, dtensors: frozenset[int], runs: dict[int, int], arrays: dict[int, int]
    ) -> None:
        self.seen: list[Any] = [None] * count  # tensor index -> the object found there
        # The tensor to copy (a DTensor's local shard, the tensor viewing an array).
        self.tensors: list[Any] = [None] * count
        self.dtensors = dtensors
        self.runs = runs  # see _Template.tensor_runs
        self.arrays = arrays  # see _Template.array_flags
        self.array_tensors: ArrayTensors | None = None  # made for the first array
        self.found: dict[int, tuple[Any, Any]] = {}  # index -> (DTensor, ShardInfo)
        self.memo: dict[int, Any] = {}

    def match(self, obj: Any, node: Any) -> Any:
        if type(node) is int:
            self._tensor(obj, node)
            return node
        kind = node.kind
        cls = type(obj)
        if kind == DICT:
            keys = node.keys
            if (
                cls is not dict
                or len(obj) != len(keys)
                or tuple(obj) != keys
                or any(type(a) is not type(b) for a, b in zip(obj, keys, strict=True))
            ):  # (1 == True == 1.0: the types too)
                raise _Mismatch("a dict's keys changed")
            return self._children(obj.values(), node)
        if kind == LIST or kind == TUPLE:
            if cls is not (list if kind == LIST else tuple) or len(obj) != len(node.children):
                raise _Mismatch("a list or tuple changed type or length")
            return self._children(obj, node)
        if kind == NAMED_TUPLE:
            if cls is not node.factory or len(obj) != len(node.children):
                raise _Mismatch("a named tuple changed type or length")
            return self._children(obj, node)
        if kind == LEAF:
            return self._leaf(obj, node)
        if kind == REDUCED:
            return self._reduced(obj, node)
        return self._pickled(obj)

    def _children(self, values: Any, node: Container) -> Container:
        children = node.children
        start = self.runs.get(id(node))
        if start is not None:  # plain tensors only, in one slice (else: the loop names the change)
            objs = list(values)
            if len(objs) == len(children) and _PLAIN_TENSORS.issuperset(map(type, objs)):
                stop = start + len(objs)
                self.seen[start:stop] = objs
                self.tensors[start:stop] = objs
                return node
        out = None
        match = self.match
        for i, (value, child) in enumerate(zip(values, children, strict=True)):
            if type(child) is int:
                self._tensor(value, child)
                continue
            new = match(value, child)
            if new is not child:
                if out is None:
                    out = list(children)
                out[i] = new
        if out is None:
            return node  # only tensors and unchanged atoms below: the old node serves
        return node._replace(children=tuple(out))

    def _tensor(self, obj: Any, index: int) -> None:
        seen = self.seen[index]
        if seen is not None:
            if seen is not obj:
                raise _Mismatch("a tensor appearing twice is now two tensors")
            return
        cls = type(obj)
        flag = self.arrays.get(index)
        if flag is not None:
            self.tensors[index] = self._array(obj, flag)
        elif index in self.dtensors:
            if cls is not loaded_dtensor_type():
                raise _Mismatch("a DTensor is now something else")
            try:
                info = shard_info(obj)
            except UnsupportedValueError:
                raise _Mismatch("a DTensor's shard cannot be described") from None
            self.found[index] = (obj, info)
            self.tensors[index] = _torch_private.local_tensor(obj)
        elif cls is torch.Tensor or cls is torch.nn.Parameter:
            self.tensors[index] = obj
        elif array_flag(obj):
            raise _Mismatch("a tensor is now an array")
        else:
            raise _Mismatch("a tensor is now something else")
        self.seen[index] = obj

    def _array(self, obj: Any, flag: int) -> torch.Tensor:
        """The tensor viewing `obj`, where the template had an array of kind `flag`."""
        found = array_flag(obj)
        if found != flag:
            if isinstance(obj, torch.Tensor):
                raise _Mismatch("an array is now a tensor")
            raise _Mismatch("an array is now something else")
        if self.array_tensors is None:
            self.array_tensors = ArrayTensors()
        if flag == NUMPY:
            if numpy_problem(obj) is not None:
                raise _Mismatch("an array can no longer be staged")
            return self.array_tensors.numpy(obj)
        try:
            return self.array_tensors.device(obj)
        except UnsupportedValueError:
            raise _Mismatch("an array can no longer be staged") from None

    def _leaf(self, obj: Any, node: Leaf) -> Leaf:
        cls = type(obj)
        if cls in ATOMIC:
            # Only the same object: equal is not enough (0.0 == -0.0, 1 == True).
            return node if node.value is obj else Leaf(LEAF, obj)
        if isinstance(obj, (torch.Tensor, dict, list, tuple)) or array_flag(obj):
            raise _Mismatch("a leaf is now a tensor, an array or a container")
        try:
            return Leaf(LEAF, copy.deepcopy(obj, self.memo))
        except Exception as exc:
            raise _Mismatch(f"a leaf cannot be copied: {exc!r}") from None

    def _reduced(self, obj: Any, node: Container) -> Container:
        keys, children, func = node.keys, node.children, node.factory
        cls = type(obj)
        if (
            cls is dict
            or cls is list
            or not isinstance(obj, (dict, list))
            or isinstance(obj, dict) != (keys is not None)
        ):
            raise _Mismatch("a container changed type")
        try:
            reduced = obj.__reduce_ex__(4)
            func_now, args, state, listitems, dictitems = (*reduced, None, None, None)[:5]
            if func_now is not func:
                raise _Mismatch("a container changed type")
            args, state = copy.deepcopy((args, state), self.memo)
            if keys is not None:
                items = list(dictitems) if dictitems is not None else []
                if len(items) != len(keys) or tuple([k for k, _ in items]) != keys:
                    raise _Mismatch("a dict's keys changed")
                values: list[Any] = [v for _, v in items]
            else:
                values = list(listitems) if listitems is not None else []
                if len(values) != len(children):
                    raise _Mismatch("a list changed length")
        except _Mismatch:
            raise
        except Exception as exc:
            raise _Mismatch(f"a container cannot be reduced: {exc!r}") from None
        new = self._children(values, node)
        return Container(REDUCED, keys, new.children, func, args, state)

    def _pickled(self, obj: Any) -> Leaf:
        flag = array_flag(obj)
        if flag == NUMPY:
            problem = numpy_problem(obj)
        elif flag:
            # Whether torch can view it is known only by trying: a full plan does.
            problem = device_array_problem(obj)
        elif not isinstance(obj, torch.Tensor) or type(obj) is loaded_dtensor_type():
            raise _Mismatch("a pickled value changed kind")
        else:
            problem = tensor_problem(obj)
        if problem is None:
            raise _Mismatch("a value that travelled pickled can now be staged")
        try:
            return Leaf(PICKLED, Pickled.snapshot(obj))
        except Exception as exc:
            raise _Mismatch(f"a value cannot be pickled: {exc!r}") from None


class Planner:
    """Plans state dicts like `layout.plan()`, reusing the layout of the last one when the next
    has the same structure (see this module's notes); `stats` says how often it did.

    The cached layout holds no tensor, so it keeps no training memory alive. Thread-safe.
    """

    def __init__(self, *, pickle_unsupported: bool = False, reuse: bool = True) -> None:
        self.pickle_unsupported = pickle_unsupported
        self.reuse = reuse
        self.stats = PlannerStats()
        self._template: _Template | None = None
        self._lock = threading.Lock()

    def plan(self, state_dict: Any, *, defer_flags: bool = False) -> StagingPlan:
        """A StagingPlan for `state_dict`; raises UnsupportedValueError as `plan()` does.

        With `defer_flags`, a reused plan is returned once everything its copies read by is
        checked, and its ``recheck`` checks the rest (the tensors' flags): the caller starts the
        copies, calls it meanwhile, and on a reason abandons them and calls `replan`.
        """
        with self._lock, gc_paused():
            template = self._template
            if template is not None and self.reuse:
                try:
                    reused = _reuse(template, state_dict, defer_flags)
                except _Mismatch as exc:
                    self.stats.last_replan = str(exc)
                else:
                    self.stats.reuses += 1
                    self.stats.last_replan = None
                    return reused
            return self._full_plan(state_dict)

    def replan(self, state_dict: Any, stale: StagingPlan, reason: str) -> StagingPlan:
        """A full plan of `state_dict`, whose plan `stale` was abandoned for `reason` (its
        recheck's, when it was a reused plan: that reuse is then taken back)."""
        with self._lock, gc_paused():
            if stale.recheck is not None:  # a reused plan with its flags deferred
                self.stats.reuses -= 1  # counted when it was handed out
            self.stats.last_replan = reason
            return self._full_plan(state_dict)

    def _full_plan(self, state_dict: Any) -> StagingPlan:
        self._template = None  # a state dict that fails to plan leaves nothing to reuse
        staging_plan, blocks = lay_out(state_dict, self.pickle_unsupported)
        self._template = _Template(staging_plan.manifest, blocks)
        self.stats.plans += 1
        return staging_plan

    def forget(self) -> None:
        """Drop the cached layout: the next state dict is planned in full."""
        with self._lock:
            self._template = None


def _reuse(template: _Template, state_dict: Any, defer_flags: bool = False) -> StagingPlan:
    """`template`'s layout with `state_dict`'s tensors and leaves; _Mismatch if it differs (or,
    with `defer_flags`, if it differs in more than flags: the plan's recheck looks at those)."""
    manifest = template.manifest
    blocks = template.blocks
    n = len(manifest)
    matcher = _Matcher(n, blocks.dtensors, template.tensor_runs(), template.array_flags())
    tree = matcher.match(state_dict, manifest.tree)
    tensors = matcher.tensors
    if n and len(set(map(id, matcher.seen))) != n:
        raise _Mismatch("two tensors are now one object")
    try:
        signature = tensor_signature(tensors)
    except Exception as exc:  # no strides: sparse, nested and the like
        raise _Mismatch(f"a tensor has no strided layout: {exc!r}") from None
    if signature != blocks.signature:
        raise _Mismatch("a tensor's class, dtype, shape, stride, offset or device changed")

    def recheck() -> str | None:
        if tensor_flags(tensors) != blocks.flags:
            return "a tensor's layout, requires_grad or lazy conj/neg bit changed"
        return None

    if not defer_flags and (reason := recheck()) is not None:
        raise _Mismatch(reason)
    sharding = None
    if blocks.dtensors:
        sharding = Sharding.of(matcher.found)
        if manifest.sharding is None or sharding.digest() != manifest.sharding.digest():
            raise _Mismatch("a DTensor's placement changed")
    # Storage addresses, element 0 less its offset (cheaper than untyped_storage()). Tensors that
    # shared a storage must still share one, and no two blocks may now share one.
    pointers = np.fromiter(map(torch.Tensor.data_ptr, tensors), dtype=np.uint64, count=n)
    storage = pointers - blocks.start
    block_storage = storage[blocks.block_first]
    if not np.array_equal(storage[blocks.member], block_storage[blocks.member_block]):
        raise _Mismatch("tensors that shared a storage no longer do")
    # Blocks at the addresses of the last plan are distinct as they were then.
    if not np.array_equal(block_storage, blocks.storage):
        ordered = np.sort(block_storage)
        if (ordered[1:] == ordered[:-1]).any():
            raise _Mismatch("tensors that did not share a storage now do")
    host, device = blocks.rows(block_storage)
    blocks.storage, blocks.host, blocks.device = block_storage, host, device
    gathers = [(i, tensors[i]) for i in blocks.gathers.tolist()]
    replanned = manifest.with_tree(tree, sharding)
    return StagingPlan(
        manifest=replanned,
        host=host,
        device=device,
        gathers=gathers,
        sources=tensors,
        recheck=recheck if defer_flags else None,
    )
