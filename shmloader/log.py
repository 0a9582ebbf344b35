"""The ``shmloader`` logger, and the one switch that sets its level.

Owns: ``logger`` (``logging.getLogger("shmloader")``; modules log through children of it, e.g.
``logging.getLogger("shmloader.transport.ring")``) and :func:`apply_log_level`. Runs in every process that
imports shmloader. Promises: importing prints nothing (a NullHandler, as libraries should); the
application's logging configuration is never changed unless a level is asked for (``log_level=`` or
``SHMLOADER_LOG_LEVEL``; a loader given neither leaves the ``shmloader`` level alone). Asking sets
the ``shmloader`` logger's level, and a level more verbose than WARNING while the root logger has
no handler attaches one stderr handler to ``shmloader``, so ``SHMLOADER_LOG_LEVEL=DEBUG`` is seen
without code changes.
"""

from __future__ import annotations

import logging

__all__ = ["logger", "apply_log_level", "LOG_FORMAT"]

LOG_FORMAT = "shmloader %(levelname)s [pid %(process)d] %(name)s: %(message)s"

logger = logging.getLogger("shmloader")
if not any(isinstance(h, logging.NullHandler) for h in logger.handlers):
    logger.addHandler(logging.NullHandler())


class _StderrHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """The handler apply_log_level() attaches; its own class so it is attached at most once."""


def apply_log_level(level: str | int) -> int:
    """Set the ``shmloader`` logger's level (a name in any case, or a number); returns the number.

    A bad name raises ConfigError. A level below WARNING attaches a stderr handler when the
    application configured no root handler; WARNING or above removes that handler again.
    """
    number = _level_number(level)
    logger.setLevel(number)
    ours = [h for h in logger.handlers if isinstance(h, _StderrHandler)]
    if number < logging.WARNING and not ours and not logging.getLogger().handlers:
        handler = _StderrHandler()
        handler.setFormatter(logging.Formatter(LOG_FORMAT))
        logger.addHandler(handler)
    elif number >= logging.WARNING:
        for handler in ours:
            logger.removeHandler(handler)
    return number


def _level_number(level: str | int) -> int:
    """A level number; a name is checked by the ``log_level`` option's own parser (one list, one message)."""
    if isinstance(level, int) and not isinstance(level, bool):
        return level
    from shmloader.config_fields import (
        FIELDS_BY_NAME,  # config_fields imports nothing of ours but errors
    )

    number = logging.getLevelName(FIELDS_BY_NAME["log_level"].from_argument(level))
    assert isinstance(number, int)
    return number
