"""Log records of the writer process, forwarded to the trainer's logging over the channel.

The trainer sends the levels its loggers have when it spawns the writer (`current_levels`); the
writer sets the same levels and installs `ForwardingHandler` on its root logger, so exactly the
records the trainer's configuration would accept are sent. The trainer hands each one to the
logger of the same name (`emit_forwarded`): its handlers, formats and filters decide, and the
record keeps the writer's process id and name.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

PACKAGE = "pyshmckpt"


def current_levels() -> dict[str, int]:
    """The effective levels of the root logger and of pyshmckpt's, to apply in the writer."""
    return {
        "": logging.getLogger().getEffectiveLevel(),
        PACKAGE: logging.getLogger(PACKAGE).getEffectiveLevel(),
    }


class ForwardingHandler(logging.Handler):
    """Sends each record, made picklable, through `send` (which returns False once the channel
    is closed; the record is then dropped, as the trainer is gone)."""

    def __init__(self, send: Callable[[dict[str, Any]], bool]) -> None:
        super().__init__()
        self._send = send
        self._local = threading.local()

    def emit(self, record: logging.LogRecord) -> None:
        if getattr(self._local, "busy", False):  # a record logged while sending one
            return
        self._local.busy = True
        try:
            self._send(_picklable(record))
        except Exception:  # a log record must never fail the write that logged it
            self.handleError(record)  # logging's own report (stderr, when raiseExceptions)
        finally:
            self._local.busy = False


def install(levels: dict[str, int], send: Callable[[dict[str, Any]], bool]) -> None:
    """In the writer process: take the trainer's levels and forward every record."""
    root = logging.getLogger()
    root.setLevel(levels.get("", logging.WARNING))
    logging.getLogger(PACKAGE).setLevel(levels.get(PACKAGE, logging.WARNING))
    for handler in list(root.handlers):  # what the writer would print would bypass the trainer
        root.removeHandler(handler)
    root.addHandler(ForwardingHandler(send))


def emit_forwarded(fields: dict[str, Any]) -> None:
    """In the trainer: hand a forwarded record to the logger it was logged to."""
    record = logging.makeLogRecord(fields)
    logger = logging.getLogger(record.name)
    if logger.isEnabledFor(record.levelno):
        logger.handle(record)


def _picklable(record: logging.LogRecord) -> dict[str, Any]:
    fields: dict[str, Any] = {}
    for key, value in record.__dict__.items():  # extra= values may be any object
        plain = value is None or isinstance(value, (str, int, float, bool))
        fields[key] = value if plain else repr(value)
    fields["msg"] = record.getMessage()
    fields["args"] = None
    fields["exc_info"] = None
    if record.exc_info:
        fields["exc_text"] = logging.Formatter().formatException(record.exc_info)
    return fields


def to_stderr() -> None:
    """In the writer, once the trainer is gone: its WARNING and ERROR records go to stderr (the
    job's log, which the writer shares with the trainer), as nothing receives them any more."""
    handler = logging.StreamHandler()
    handler.setLevel(logging.WARNING)
    handler.setFormatter(
        logging.Formatter("pyshmckpt writer %(process)d: %(levelname)s %(name)s: %(message)s")
    )
    logging.getLogger().addHandler(handler)
