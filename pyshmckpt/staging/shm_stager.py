"""ShmStager: the SlotStager with torch's stager protocols (DCP's ``AsyncStager``, the
``_experimental`` ``CheckpointStager``).

A module of its own because those protocols live in ``torch.distributed.checkpoint``, whose import
loads DTensor, TorchDynamo and SymPy (seconds of CPU): the `Checkpointer` and the
`CheckpointProcess` stage with `SlotStager` and never load them; a caller that hands a stager to
DCP or to torch's checkpointers has loaded them already.
"""

from __future__ import annotations

from .. import _torch_private
from .stager import SlotStager

try:  # DCP's protocol (torch >= 2.4)
    from torch.distributed.checkpoint.staging import AsyncStager as _AsyncStager
except ImportError:  # pragma: no cover - torch built without distributed
    _AsyncStager = object  # type: ignore[assignment,misc]
_CheckpointStager = _torch_private.experimental_or_none("staging", "CheckpointStager") or object

_bases = tuple(dict.fromkeys(b for b in (_CheckpointStager, _AsyncStager) if b is not object))


class ShmStager(SlotStager, *_bases):  # type: ignore[misc]
    """Stage state dicts into a ring of shared-memory slots, for DCP and torch's checkpointers.

    `stage` copies every tensor (CPU: thread pool, GIL released; CUDA: batched device-to-host
    copies on a side stream) into a free slot and returns the same structure with CPU tensors
    that view the slot: a snapshot, which training may change right after. It implements DCP's
    ``AsyncStager`` (``dcp.async_save(..., async_stager=ShmStager())``) and the
    ``CheckpointStager`` of torch's ``_experimental`` checkpointer. Otherwise it is
    ``pyshmckpt.staging.SlotStager``, the stager the `Checkpointer` and the `CheckpointProcess`
    use (which loads none of DCP): the same arguments, methods and errors.

    The stager owns the shared memory: a slot stays busy while its staged tensors are
    referenced in this process or until `release` is called for it; `close` (or the end of a
    ``with`` block) frees the arenas, and staged tensors still held keep their own mapping of
    the memory.
    """

    @property
    def _synchronize_after_execute(self) -> bool:
        # What DCP's should_synchronize_after_execute reads: with async_staging, DCP leaves the
        # wait for the copies to the Future that stage() returns.
        return not self._async

    def synchronize_staging(self) -> None:
        """Block until the last asynchronous stage finished (DCP's ``AsyncStager`` protocol).

        Raises:
            PyshmckptError: what that stage failed with (see `stage`).
        """
        pending = self._pending
        if pending is not None:
            pending.result()
