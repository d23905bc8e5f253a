"""What the CUDA path can do in this process, and the side streams staging copies run on."""

from __future__ import annotations

import threading

import torch

from . import _C


def cuda_compiled() -> bool:
    """True when the extension was built with the CUDA path."""
    return bool(_C.cuda_compiled())


def cuda_available() -> bool:
    """True when device-to-host staging and pinning can run here: the CUDA path is compiled in, a
    driver and at least one device are present, and torch sees CUDA too. Never raises."""
    return cuda_compiled() and _C.cuda_device_count() > 0 and torch.cuda.is_available()


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
