"""Layer 2, staging: lay a state dict out in a slot and copy it there.

`layout.plan` validates a state dict and assigns every storage a block of the slot (`StagingPlan`, whose
`Manifest` describes the result); `SlotStager` takes a free slot from its arena, runs the copies
(CPU: native thread pool, GIL released; CUDA: batched device-to-host on a side stream) and hands
out the staged state dict, or leases the slot to a consumer. `SlotViews` rebuilds a staged state
dict from a mapped slot in the writer process. `ShmStager` is a SlotStager with torch's stager
protocols (DCP's ``AsyncStager``, the ``_experimental`` ``CheckpointStager``), in a module of its
own because those load DCP.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .._lazy import exports

if TYPE_CHECKING:
    from .layout import StagingPlan, plan
    from .manifest import Manifest, TensorEntry
    from .shm_stager import ShmStager
    from .stager import SlotStager, StagedHandle, lease_staged
    from .views import SlotViews

# Imported on first use (see _lazy): the writer process loads only the modules it runs.
__getattr__, __dir__ = exports(
    __name__,
    {
        "StagingPlan": "layout",
        "plan": "layout",
        "Manifest": "manifest",
        "TensorEntry": "manifest",
        "ShmStager": "shm_stager",
        "SlotStager": "stager",
        "StagedHandle": "stager",
        "lease_staged": "stager",
        "SlotViews": "views",
    },
)

__all__ = [
    "Manifest",
    "ShmStager",
    "SlotStager",
    "SlotViews",
    "StagedHandle",
    "StagingPlan",
    "TensorEntry",
    "lease_staged",
    "plan",
]
