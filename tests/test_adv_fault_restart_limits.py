"""A dead worker's replacement refused by a process limit (out of descriptors as it starts).

Under ``on_worker_death='restart'`` the successor of a SIGKILLed worker is started with the loader
running; when its pipes cannot be opened (``RLIMIT_NOFILE`` reached: other files the trainer opened
meanwhile), the caller got a bare ``OSError: [Errno 24] Too many open files``, naming neither the
worker, nor the limit, nor the death it was recovering from, where the same refusal at the
loader's start names all of them. Now the restart's error is worded as a start's (same type and
errno): the worker, ``num_workers``, the dead predecessor's pid, the limit and its value, the
remedy; and nothing of the loader is left behind.
"""

from __future__ import annotations

import errno
import os
import resource
import signal
from typing import Any

import pytest

from adv_fault_datasets import Gate, StopsAt, epoch_error
from shmloader import DataLoader
from shmloader.engine.workers import WorkerPool
from test_adv2_exactly_once import firsts


@pytest.mark.timeout(30)
@pytest.mark.parametrize("persistent", [False, True])
def test_a_restart_refused_at_the_descriptor_limit_names_the_worker_the_death_and_the_limit(
        tmp_path: Any, monkeypatch: pytest.MonkeyPatch, persistent: bool) -> None:
    gate = Gate()
    killed: list[int] = []
    start = WorkerPool._start
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)

    def at_the_limit(self: WorkerPool, worker_id: int) -> Any:
        if not killed:
            return start(self, worker_id)
        resource.setrlimit(resource.RLIMIT_NOFILE, (len(os.listdir("/proc/self/fd")), hard))  # not one more
        try:
            return start(self, worker_id)
        finally:
            resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))

    def kill(pid: int) -> None:
        killed.append(pid)
        os.kill(pid, signal.SIGKILL)

    monkeypatch.setattr(WorkerPool, "_start", at_the_limit)
    loader: DataLoader[Any] = DataLoader(StopsAt(12, 5, gate, str(tmp_path)), batch_size=2, num_workers=2,
                                         on_worker_death="restart", persistent_workers=persistent)
    err = epoch_error(loader, gate, kill, OSError)
    assert isinstance(err, OSError)
    message = str(err)
    assert err.errno == errno.EMFILE
    assert "worker 0 of num_workers=2" in message, message
    assert f"pid {killed[0]}" in message, message
    assert "RLIMIT_NOFILE" in message and "ulimit -n" in message, message
    monkeypatch.setattr(WorkerPool, "_start", start)
    assert sorted(firsts(loader)) == list(range(12))  # iter(loader) starts afresh
