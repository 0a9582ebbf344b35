"""Helpers of the adversarial exactly-once tests (tests/test_adv2_*.py)."""

from __future__ import annotations

import select
import signal
from typing import Any


def exited_within(fd: int, deadline_s: float) -> bool:
    """Whether the process whose pidfd (or sentinel) is ``fd`` exits within ``deadline_s``; it is
    not reaped, so the loader still sees the death its own way."""
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    return bool(poller.poll(int(deadline_s * 1000)))


def kill_and_wait(worker: Any) -> int:
    """SIGKILL a worker (an ``engine.workers.WorkerHandle``) and wait until it has exited; its pid."""
    pid = worker.pid
    worker.signal(signal.SIGKILL)
    assert exited_within(worker.exit_fd, 10), f"worker {worker.id} (pid {pid}) still alive 10 s after SIGKILL"
    return int(pid)
