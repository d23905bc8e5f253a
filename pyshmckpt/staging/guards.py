"""Keeping a state whole while it is staged and training goes on (``Checkpointer(overlap=True)``).

While an overlapped save's copies run, the tensors they read must not change. Two global hooks
make torch's in-place writers of training state wait for the copies to land:

- every torch optimizer's step (optimizer state and parameters). It is registered once and stays
  for the life of the process: torch walks these hooks lazily during a step, so removing one
  while another thread steps could break that step; with nothing in flight it returns at once;
- the forward of a module that has buffers, in training mode (BatchNorm updates its running
  statistics in place). It is registered only while a staging runs (a global forward hook puts
  every module call on torch's slower path) and removed by the last staging to finish; torch
  copies these hooks before calling them, so removal from another thread is safe.

Anything else that changes the state in place (an EMA update, a hand-written parameter
update, `load(into=...)` of this process, which waits by itself) must wait first
(`Checkpointer.wait_staged`, or `wait_all`).
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
from concurrent.futures import Future
from typing import Any

from ..errors import StagingTimeoutError

logger = logging.getLogger(__name__)

_lock = threading.Lock()
# Each staging in flight, with the monotonic time by which it has surely ended (its own waits
# are bounded: a free slot, the device copies).
_in_flight: dict[Future[Any], float] = {}
_step_hook: Any = None
_forward_hook: Any = None


def track(staged: Future[Any], bound: float) -> None:
    """Guard the state being staged until `staged` resolves (at most `bound` seconds)."""
    global _step_hook, _forward_hook
    from torch.nn.modules.module import register_module_forward_pre_hook
    from torch.optim.optimizer import register_optimizer_step_pre_hook

    with _lock:
        _in_flight[staged] = time.monotonic() + bound
        if _step_hook is None:
            _step_hook = register_optimizer_step_pre_hook(_before_step)
        if _forward_hook is None:
            _forward_hook = register_module_forward_pre_hook(_before_forward)
    staged.add_done_callback(_untrack)


def in_flight() -> int:
    """How many stagings are in flight in this process."""
    return len(_in_flight)


def wait_all(reason: str = "a caller") -> None:
    """Wait until no staging of this process reads its state any more (a failed staging counts
    as ended: its save reports the error).

    Raises:
        StagingTimeoutError: a staging did not end within its bound.
    """
    with _lock:
        pending = dict(_in_flight)
    if not pending:
        return
    started = time.monotonic()
    left = max(pending.values()) - started
    _, not_done = concurrent.futures.wait(list(pending), timeout=max(left, 0.0))
    if not_done:
        raise StagingTimeoutError(
            f"{reason} waited {time.monotonic() - started:.1f} s for {len(not_done)} overlapped "
            "save(s) to finish copying the state; it is still being read"
        )
    logger.debug("%s waited %.1f ms for staging", reason, 1e3 * (time.monotonic() - started))


def _untrack(staged: Future[Any]) -> None:
    global _forward_hook
    with _lock:
        _in_flight.pop(staged, None)
        if not _in_flight and _forward_hook is not None:
            _forward_hook.remove()
            _forward_hook = None


def _before_step(optimizer: Any, args: Any, kwargs: Any) -> None:
    if _in_flight:
        wait_all(f"{type(optimizer).__name__}.step")


def _before_forward(module: Any, args: Any) -> None:
    if _in_flight and module.training and module._buffers:
        wait_all(f"the forward of {type(module).__name__} (it has buffers)")
