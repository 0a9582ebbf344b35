"""``close()`` gives workers torch's time to exit on their own before it terminates them.

torch's DataLoader joins each worker for up to 5 s (``MP_STATUS_CHECK_INTERVAL``) after telling it
to stop, and only then terminates it. A worker's own exit runs its cleanup (multiprocessing
finalizers, a spawned interpreter's teardown, which with torch imported takes about a second on a
loaded 2-CPU machine); a worker terminated before it is done loses that cleanup. shmloader gave all
workers together 1 s, so the slower of two spawned workers was killed with SIGTERM at every close.
"""

from __future__ import annotations

import multiprocessing.util
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import shmloader


class SlowExit:
    """A worker_init_fn registering a cleanup that takes ``seconds`` and then leaves a marker file."""

    def __init__(self, directory: Path, seconds: float) -> None:
        self.directory, self.seconds = directory, seconds

    def __call__(self, worker_id: int) -> None:
        multiprocessing.util.Finalize(None, self.cleanup, args=(worker_id,), exitpriority=10)

    def cleanup(self, worker_id: int) -> None:
        time.sleep(self.seconds)  # the worker's own work on its way out, not a synchronisation
        (self.directory / f"worker{worker_id}.done").touch()


@pytest.mark.timeout(60)
def test_close_lets_workers_finish_a_cleanup_of_a_second_and_a_half(tmp_path: Path) -> None:
    loader: shmloader.DataLoader[Any] = shmloader.DataLoader(
        np.arange(32.0).reshape(16, 2), batch_size=2, num_workers=2, multiprocessing_context="fork",
        worker_init_fn=SlowExit(tmp_path, 1.5))
    assert len(list(loader)) == 8  # the epoch's iterator closed at its end
    loader.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["worker0.done", "worker1.done"]
