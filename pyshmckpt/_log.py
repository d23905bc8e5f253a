"""Logging helpers shared by every layer. Each module logs through its own
``logging.getLogger(__name__)``; nothing is printed unless the application configures logging."""

from __future__ import annotations

import logging
import threading

_warned: set[tuple[str, str]] = set()
_warned_lock = threading.Lock()


def warn_once(logger: logging.Logger, cause: str, message: str, *args: object) -> bool:
    """Log `message` at WARNING the first time `cause` happens in this process for `logger`;
    later occurrences are logged at DEBUG. Returns True when this call logged the warning."""
    key = (logger.name, cause)
    with _warned_lock:
        first = key not in _warned
        _warned.add(key)
    logger.log(logging.WARNING if first else logging.DEBUG, message, *args)
    return first
