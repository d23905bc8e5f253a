"""Whether this process can pin memory and stage CUDA tensors, and what was found when looking.

The CUDA path is in every build: the extension opens the CUDA driver (``libcuda.so.1``, or the
library ``PYSHMCKPT_CUDA_DRIVER`` names) when it is first needed, so that nothing of CUDA is
needed to build or import pyshmckpt.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from .. import knobs
from . import native

_PIN_PROBE_BYTES = 2 << 20


def cuda_compiled() -> bool:
    """Whether the extension has the CUDA path (every build has it: the driver is loaded at run
    time).

    Returns:
        True. Never raises.
    """
    return True


def cuda_available() -> bool:
    """Whether device-to-host staging and pinning can run here.

    Returns:
        True when the CUDA driver loaded, sees at least one device, and torch sees CUDA too.
        Never raises.
    """
    if native.cuda_device_count() == 0:
        return False
    import torch

    return bool(torch.cuda.is_available())


def driver_status() -> dict[str, Any]:
    """What loading the CUDA driver found: usable, path, reason, version, devices, missing,
    batched_copies, copy_method."""
    return dict(native.cuda_driver_status())


def unavailable_reason() -> str | None:
    """Why CUDA tensors cannot be staged here, in words; None when they can."""
    status = driver_status()
    if not status["usable"]:
        return str(status["reason"])
    import torch

    if not torch.cuda.is_available():
        return "torch reports no CUDA (a CPU build of torch, or CUDA_VISIBLE_DEVICES hides them)"
    return None


@dataclasses.dataclass(frozen=True)
class CudaInfo:
    """What `cuda_info` found (``pyshmckpt cuda-info`` prints its `lines`).

    Attributes:
        driver_loaded: the driver library was opened and has every function pyshmckpt uses.
        driver_path: the library opened ("" when none could be).
        driver_version: such as "12.8" ("" when unknown).
        devices: the device names, by ordinal.
        torch_cuda: torch's CUDA version ("" for a CPU build of torch).
        torch_sees_cuda: torch reports a usable device.
        pinning: "works", or why a test buffer could not be pinned.
        copy_method: how device-to-host copies are queued: one batched driver call per device
            and stage (``cuMemcpyBatchAsync``, drivers of CUDA 12.8 and newer), or one call per
            copy, and why.
        usable: CUDA tensors can be staged here.
        reason: why not, in words ("" when usable).
    """

    driver_loaded: bool
    driver_path: str
    driver_version: str
    devices: list[str]
    torch_cuda: str
    torch_sees_cuda: bool
    pinning: str
    copy_method: str
    usable: bool
    reason: str

    def lines(self) -> list[str]:
        """The report, one fact per line."""
        return [
            "CUDA path: in this build (driver loaded at run time)",
            f"driver: {self.driver_path or 'not loaded'}"
            + (f" (version {self.driver_version})" if self.driver_version else ""),
            "devices: " + (", ".join(f"{i}: {n}" for i, n in enumerate(self.devices)) or "none"),
            f"torch: CUDA {self.torch_cuda or 'none (CPU build)'}, "
            f"{'sees' if self.torch_sees_cuda else 'does not see'} a device",
            f"pinning a test buffer: {self.pinning}",
            f"device-to-host copies: {self.copy_method}",
            "CUDA staging: " + ("usable" if self.usable else f"not usable: {self.reason}"),
        ]


def cuda_info() -> CudaInfo:
    """Look for CUDA the way staging does, and pin a small test buffer.

    Returns:
        What was found: the driver library and its version, the devices, what torch sees,
        whether pinning works, and when CUDA tensors cannot be staged, why. Never raises for a
        missing or broken CUDA: that is what it reports.
    """
    import torch

    status = driver_status()
    version = int(status["version"])
    pinning = _pin_probe() if status["usable"] else f"not tried ({status['reason']})"
    reason = unavailable_reason() or ""
    return CudaInfo(
        driver_loaded=bool(status["path"]) and not status["missing"],
        driver_path=str(status["path"]),
        driver_version=f"{version // 1000}.{version % 1000 // 10}" if version else "",
        devices=list(status["devices"]),
        torch_cuda=torch.version.cuda or "",
        torch_sees_cuda=bool(torch.cuda.is_available()),
        pinning=pinning,
        copy_method=str(status["copy_method"]),
        usable=not reason,
        reason=reason,
    )


def _pin_probe() -> str:
    segment = native.Segment.create(_PIN_PROBE_BYTES, knobs.segment_prefix(), True)
    try:
        if segment.pin(_PIN_PROBE_BYTES):
            return "works"
        return f"fails: {segment.pin_error}"
    finally:
        segment.close()
