"""Executing a staging plan: the copies that fill a slot, and waiting for them.

Host rows go to a background native copy, device rows to device-to-host batches on a side
stream per device (ordered after the producers' work), and tensors that are not dense are
gathered into the slot. `Copies` waits for all of them, bounded, or, after a failure, until
nothing writes into the slot any more.
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import torch

from .. import knobs
from .._unfilled import unfilled
from ..errors import StagingTimeoutError
from ..shm import Slot
from . import layout
from .manifest import contiguous_stride


def start(
    staging_plan: layout.StagingPlan,
    slot: Slot,
    streams: SideStreams,
    producers: dict[int, torch.cuda.Event] | None,
) -> Copies:
    """Start every copy of `staging_plan` into `slot`; the device copies on `streams`, after
    `producers` (an event per device), or after each device's current stream when None. A host
    copy into a slot made for this stage fills it at once (its first fill)."""
    copies = Copies(slot)
    size = staging_plan.manifest.size
    if slot.reserved < size:  # the first stage into a slot made for it (see Arena)
        if not staging_plan.device and not staging_plan.gathers:
            slot.fill_from_host(staging_plan.host, size)
            return copies
        slot.reserve(size)
    try:
        for device, rows in staging_plan.device.items():
            stream = _wait_producers(streams, device, producers)
            copies.events.append(slot.copy_from_device(rows, stream.cuda_stream, device))
        if len(staging_plan.host):
            copies.host = slot.copy_from_host_async(staging_plan.host)
        for index, source in staging_plan.gathers:
            offset = int(staging_plan.manifest.offset[index])  # from the slot's start
            if source.is_cuda:
                device = source.get_device()
                stream = _wait_producers(streams, device, producers)
                with torch.cuda.stream(stream):
                    dense = unfilled(source.shape, source.dtype, source.device)
                    dense.copy_(source)
                copies.keepalive.append(dense)
                row = np.array([[dense.data_ptr(), offset, dense.nbytes]], dtype=np.uint64)
                copies.events.append(slot.copy_from_device(row, stream.cuda_stream, device))
            else:
                _gather_into(slot, source, slot.offset + offset)
    except BaseException as exc:
        note_cleanup_error(exc, copies.abandon())
        raise
    return copies


def _wait_producers(
    streams: SideStreams, device: int, producers: dict[int, torch.cuda.Event] | None
) -> torch.cuda.Stream:
    """The side stream of `device`, ordered after the work that produced the state."""
    stream = streams.get(device)
    if producers is None:
        stream.wait_stream(torch.cuda.current_stream(device))
    else:
        stream.wait_event(producers[device])
    return stream


def _gather_into(slot: Slot, source: torch.Tensor, offset: int) -> None:
    """Copy the elements of a non-dense CPU tensor densely to byte `offset` of the slot."""
    dtype = source.dtype
    bits = layout.INT_OF_SIZE.get(dtype.itemsize)
    if bits is not None and not (source.is_conj() or source.is_neg()):
        # Copy bit patterns through a same-size integer view: exact for every dtype, including
        # those torch has no copy kernel for (sub-byte and float4 types). complex128 and lazy
        # conjugate/negative views take torch's own copy, which resolves them.
        dtype = bits
        source = source.view(dtype)
    base = slot.base(dtype)
    stride = contiguous_stride(tuple(source.shape))
    with torch.no_grad():  # never tie the slot's base into the source's autograd graph
        base.as_strided(source.shape, stride, offset // base.itemsize).copy_(source.detach())


class Copies:
    """The copies filling one slot: a background host copy and device-to-host batches."""

    def __init__(self, slot: Slot) -> None:
        self.slot = slot
        self.host: Any = None
        self.events: list[Any] = []
        self.keepalive: list[torch.Tensor] = []

    def wait(self) -> None:
        if self.host is not None:
            self.host.wait()
        timeout = knobs.device_copy_timeout()
        for event in self.events:
            if not event.wait(timeout):
                raise StagingTimeoutError(
                    f"device-to-host copies into {self.slot.name} did not finish in {timeout}s"
                )
        self.keepalive.clear()

    def abandon(self) -> BaseException | None:
        """After a failure: wait until no host copy writes into the slot; return its error."""
        if self.host is not None:
            try:
                self.host.wait()
            except Exception as exc:
                return exc
        return None


def note_cleanup_error(exc: BaseException, cleanup: BaseException | None) -> None:
    """Attach an error raised while cleaning up to the failure being reported."""
    if cleanup is None:
        return
    note = f"while cleaning up after this failure: {cleanup!r}"
    if hasattr(exc, "add_note"):
        exc.add_note(note)
    else:  # Python 3.10
        exc.args = (*exc.args, note)


class SideStreams:
    """One staging stream per device, created lazily on first use."""

    def __init__(self) -> None:
        self._streams: dict[int, torch.cuda.Stream] = {}
        self._lock = threading.Lock()

    def get(self, device: int) -> torch.cuda.Stream:
        with self._lock:
            stream = self._streams.get(device)
            if stream is None:
                stream = torch.cuda.Stream(device=device)
                self._streams[device] = stream
            return stream
