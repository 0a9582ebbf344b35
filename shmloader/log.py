"""The ``shmloader`` logger, and the one switch that sets its level.

Owns: ``logger`` (``logging.getLogger("shmloader")``; modules log through children of it, e.g.
``logging.getLogger("shmloader.transport.ring")``) and :func:`apply_log_level`. Runs in every process that
imports shmloader. Promises: importing prints nothing (a NullHandler, as libraries should); the
application's logging configuration is never changed unless a level is asked for (``log_level=`` or
``SHMLOADER_LOG_LEVEL``; a loader given neither leaves the ``shmloader`` level alone). Asking sets
the ``shmloader`` logger's level, and a level more verbose than WARNING while the root logger has
no handler attaches one stderr handler to ``shmloader``, so ``SHMLOADER_LOG_LEVEL=DEBUG`` is seen
without code changes.

Workers: a forked worker inherits all of this. A spawned or forkserver worker starts a fresh
interpreter, where only the NullHandler is there, so ``WorkerLogSetup`` (taken in the main process
by :func:`worker_log_setup`, applied in the worker by :func:`apply_worker_log_setup`) carries the
logger's effective level and whether, and from which level, a handler of the main process shows a
``shmloader`` record: the worker then shows and hides records as the main process does.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

__all__ = ["logger", "apply_log_level", "LOG_FORMAT", "WorkerLogSetup", "worker_log_setup",
           "apply_worker_log_setup"]

LOG_FORMAT = "shmloader %(levelname)s [pid %(process)d] %(name)s: %(message)s"



class _GuardedLogger(logging.Logger):
    """The ``shmloader`` logger's class: a handler that raises (an application's own, which unlike
    the standard ones does not catch its errors) is reported as logging reports its handlers'
    errors, ``--- Logging error ---`` on stderr, and the loader's work goes on. Raised out of a
    log call, it had stopped a worker's start and cut a shutdown short part-way
    (tests/test_log_handler_raises.py)."""

    def callHandlers(self, record: logging.LogRecord) -> None:  # noqa: N802 (logging's name)
        try:
            super().callHandlers(record)
        except Exception:
            _REPORTER.handleError(record)


_REPORTER = logging.Handler()  # only its handleError: prints the error as logging's handlers do
logger = logging.getLogger("shmloader")
logger.__class__ = _GuardedLogger  # the registered instance, made before or now: every log call of ours
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


@dataclass(frozen=True)
class WorkerLogSetup:
    """What a worker needs to log as the main process does (plain values: it travels with the spec)."""

    level: int  # the ``shmloader`` logger's effective level in the main process
    shown_from: int | None  # lowest level a handler of the main process shows; None: none shows any


def worker_log_setup() -> WorkerLogSetup:
    """The main process's ``shmloader`` logging, as a worker should copy it."""
    levels = [h.level for h in _real_handlers()]
    if not levels and not _any_handler() and logging.lastResort is not None:
        levels = [logging.lastResort.level]  # logging's own last resort shows WARNING and above
    return WorkerLogSetup(logger.getEffectiveLevel(), min(levels) if levels else None)


def apply_worker_log_setup(setup: WorkerLogSetup | None) -> None:
    """In a worker: log at the main process's level; where the main process shows records and this
    process has no handler of its own (spawn, forkserver), show them on stderr. A forked worker
    already has the main process's handlers: nothing is added there."""
    if setup is None:
        return
    logger.setLevel(setup.level)
    if setup.shown_from is None or _real_handlers():
        return
    handler = _StderrHandler()
    handler.setLevel(setup.shown_from)
    handler.setFormatter(logging.Formatter(LOG_FORMAT))
    logger.addHandler(handler)


def _chain() -> list[logging.Logger]:
    """``shmloader`` and the ancestors its records propagate to (logging's own walk)."""
    chain: list[logging.Logger] = []
    current: logging.Logger | None = logger
    while current is not None:
        chain.append(current)
        current = current.parent if current.propagate else None
    return chain


def _real_handlers() -> list[logging.Handler]:
    """The handlers a ``shmloader`` record reaches that can show it (not NullHandlers)."""
    return [h for lg in _chain() for h in lg.handlers if not isinstance(h, logging.NullHandler)]


def _any_handler() -> bool:
    """Whether a ``shmloader`` record reaches any handler (else logging uses its last resort)."""
    return any(lg.handlers for lg in _chain())
