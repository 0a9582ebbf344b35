"""A process forked by other code while another thread of the parent held a loader's registry of
live iterators (``LiveIterators``: taken for a moment by ``iter(loader)`` and ``loader.close()``)
could never ``iter()`` or ``close()`` that loader: its copy of the lock stayed held by a thread
that does not exist in the child, so the child hung for good. torch's DataLoader has no such lock:
its loader works in the child. The registry now gives a forked child a lock of its own.
"""

from __future__ import annotations

import os
import select
import signal
import threading
import traceback
from typing import Any

import numpy as np
import pytest

import shmloader

CHILD_S = 30.0


def _hold(lock: Any, held: threading.Event, release: threading.Event) -> None:
    with lock:
        held.set()
        release.wait(CHILD_S)


def _exit_code(pid: int) -> int | None:
    """The child's exit code, or None (and the child killed) if it did not end within CHILD_S."""
    fd = os.pidfd_open(pid)
    try:
        ended, _, _ = select.select([fd], [], [], CHILD_S)
    finally:
        os.close(fd)
    if not ended:
        os.kill(pid, signal.SIGKILL)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status) if ended else None


def _in_child(loader: Any) -> int:
    got = [b[0].tolist() for b in loader]
    loader.close()
    return 0 if got == [[0, 1], [2, 3], [4, 5], [6, 7]] else 2


@pytest.mark.timeout(90)
@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_child_forked_while_the_registry_is_locked_uses_the_loader(num_workers: int) -> None:
    context = {"multiprocessing_context": "fork"} if num_workers else {}
    loader: Any = shmloader.DataLoader(shmloader.ArrayDataset(np.arange(8)), batch_size=2, num_workers=num_workers,
                                       **context)
    held, release = threading.Event(), threading.Event()
    holder = threading.Thread(target=_hold, args=(loader._live._lock, held, release))
    holder.start()
    try:
        assert held.wait(CHILD_S)
        pid = os.fork()  # as other code forks: another thread holds the lock at this moment
        if pid == 0:  # pragma: no cover - the child
            code = 1
            try:
                code = _in_child(loader)
            except BaseException:
                traceback.print_exc()  # to the test's captured stderr
            finally:
                os._exit(code)
    finally:
        release.set()
        holder.join()
    assert _exit_code(pid) == 0, "the forked child could not iterate and close the loader"
    assert [b[0].tolist() for b in loader] == [[0, 1], [2, 3], [4, 5], [6, 7]]  # the parent's is intact
    loader.close()
