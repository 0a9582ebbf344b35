"""Helpers of the adversarial exactly-once tests (tests/test_adv2_*.py)."""

from __future__ import annotations

import select
import signal
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest


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


def lost_kept_batch(loader: Any, error: type[BaseException], pid: Callable[[], int]) -> None:
    """Iterate ``loader`` of ``adv2_datasets.BigThenEnds`` (batch_size=1) up to ``error``, which
    must name the IterableDataset and the pid ``pid()`` returns then (the worker that kept the big
    batch, 2.0, and died): no batch came twice, and the big one did not come at all."""
    got: list[float] = []
    with pytest.raises(error, match="IterableDataset") as err:
        for b in loader:
            got.append(float(np.asarray(b)[0, 0]))
            assert len(got) < 20
    assert getattr(err.value, "pid", None) == pid()
    assert sorted(got) == sorted(set(got)), f"a batch came twice: {got}"
    assert 2.0 not in got
