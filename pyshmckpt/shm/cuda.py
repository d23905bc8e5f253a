"""Whether this process can pin memory and stage CUDA tensors."""

from __future__ import annotations

import torch

from . import native


def cuda_compiled() -> bool:
    """Whether the extension was built with the CUDA path.

    Returns:
        True when device-to-host staging is compiled in. Never raises.
    """
    return native.cuda_compiled()


def cuda_available() -> bool:
    """Whether device-to-host staging and pinning can run here.

    Returns:
        True when the CUDA path is compiled in, a driver and at least one device are present,
        and torch sees CUDA too. Never raises.
    """
    return cuda_compiled() and native.cuda_device_count() > 0 and torch.cuda.is_available()
