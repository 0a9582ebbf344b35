"""The worker's reading of its task pipe: the frames that arrive, in order.

Owns one ``select.poll`` on the task pipe, kept for the worker's life, and the frames read but not
yet taken. Runs in each worker. Promises: ``next`` returns each frame once, in the order written;
``QUIET`` when none came within the wait (the worker then checks on the main process), None once
the pipe is closed.
"""

from __future__ import annotations

import select
from collections import deque
from multiprocessing.connection import Connection
from typing import Any

from shmloader.transport import wire

__all__ = ["QUIET", "TaskFrames"]

QUIET: Any = object()  # no frame within the wait: time to check on the main process


class TaskFrames:
    """The frames on the task pipe, in order: one ``select.poll`` kept for the worker's life and
    one read for every frame that has arrived (issue 16), where ``Connection.poll`` builds a
    selector per call and ``recv_bytes`` reads twice per message."""

    def __init__(self, tasks: Connection) -> None:
        self._reader = wire.FrameReader(tasks.fileno())
        self._poller = select.poll()
        self._poller.register(tasks.fileno(), select.POLLIN)
        self._ready: deque[bytes] = deque()

    def next(self, timeout_s: float) -> Any:
        """The next frame; ``QUIET`` when none came within ``timeout_s``; None once the pipe is closed."""
        while not self._ready:
            if not self._poller.poll(timeout_s * 1000):
                return QUIET
            try:
                self._ready.extend(self._reader.read())
            except (EOFError, OSError):
                return None
        return self._ready.popleft()
