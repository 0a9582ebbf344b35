"""Workers outlive the thread that started them.

``PR_SET_PDEATHSIG`` is tied to the *thread* that forked the worker, not to its process
(prctl(2)). A worker started from a thread other than the main one — a persistent loader's first
epoch run in a thread, ``iter(loader)`` in a thread, a restart made by ``next()`` in a thread — was
SIGKILLed when that thread ended. Such a worker now relies on its poll of the main process, which
still ends it when the main process dies (a SIGKILL of the trainer is checked here).

Scenarios that fork or die on purpose run in a fresh interpreter.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import subprocess
import sys
import textwrap
import threading
from typing import Any, Callable

import fault_datasets as fd
import numpy as np
import psutil
import pytest

from shmloader import DataLoader
from shmloader.worker.main import PARENT_CHECK_S

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
N = 16
FIRSTS = list(range(0, N, 2))  # each batch's first sample, for batch_size=2


class Full:
    """Sample ``i`` is four copies of ``i``."""

    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int) -> np.ndarray:
        return np.full(4, i)


def firsts(batches: Any) -> list[int]:
    return [int(b[0, 0]) for b in batches]


def in_thread(fn: Callable[[], Any]) -> Any:
    """``fn()`` run in a new thread that has ended when this returns; its result or its error."""
    box: dict[str, Any] = {}

    def body() -> None:
        try:
            box["value"] = fn()
        except BaseException as e:  # re-raised in the caller
            box["error"] = e

    t = threading.Thread(target=body)
    t.start()
    t.join()
    if "error" in box:
        raise box["error"]
    return box["value"]


def assert_workers_outlive_their_thread() -> None:
    """Every worker is still alive a second after the thread that started it ended (the kernel's
    SIGKILL, when it came, came at once)."""
    workers = [psutil.Process(p.pid) for p in multiprocessing.active_children()]
    assert workers
    gone, _ = psutil.wait_procs(workers, timeout=1.0)
    assert gone == [], f"workers died with the thread that started them: {gone}"


# -- defect A: PR_SET_PDEATHSIG and the starting thread -----------------------------------------


@pytest.mark.timeout(60)
@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_persistent_workers_survive_the_thread_that_started_them(method: str) -> None:
    loader = DataLoader(Full(), batch_size=2, num_workers=2, persistent_workers=True,
                        multiprocessing_context=method)
    try:
        assert in_thread(lambda: firsts(loader)) == FIRSTS
        assert_workers_outlive_their_thread()
        assert firsts(loader) == FIRSTS  # the second epoch, on the same workers, in the main thread
    finally:
        loader.close()


@pytest.mark.timeout(60)
def test_an_iterator_made_in_a_thread_is_consumed_in_the_main_thread() -> None:
    loader = DataLoader(Full(), batch_size=2, num_workers=2, multiprocessing_context="fork")
    try:
        it = in_thread(lambda: iter(loader))
        assert_workers_outlive_their_thread()
        assert firsts(it) == FIRSTS
    finally:
        loader.close()


@pytest.mark.timeout(60)
def test_a_worker_restarted_from_a_thread_survives_it(tmp_path: Any) -> None:
    plan = {5: "kill"}  # the worker fetching sample 5 dies; next() in the thread replaces it
    loader = DataLoader(fd.PlannedFaults(N, str(tmp_path), plan), batch_size=2, num_workers=2,
                        persistent_workers=True, on_worker_death="restart", multiprocessing_context="fork")
    try:
        assert in_thread(lambda: firsts(loader)) == [fd.sample(i)[0] for i in FIRSTS]
        assert loader.stats()["worker_restarts"] == 1
        assert_workers_outlive_their_thread()
        assert firsts(loader) == [fd.sample(i)[0] for i in FIRSTS]
    finally:
        loader.close()


ORPHAN_SCRIPT = textwrap.dedent("""
    import multiprocessing, sys, threading, time
    sys.path.insert(0, {tests!r})
    from test_worker_threads_fork import Full
    from shmloader import DataLoader

    if __name__ == "__main__":
        loader = DataLoader(Full(), batch_size=2, num_workers=2, multiprocessing_context={method!r})
        box = {{}}
        t = threading.Thread(target=lambda: next(box.setdefault("it", iter(loader))))
        t.start()
        t.join()
        print(" ".join(str(p.pid) for p in multiprocessing.active_children()), flush=True)
        time.sleep(3600)  # the test SIGKILLs this process here
""")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_workers_started_from_a_thread_exit_when_the_main_process_dies(method: str) -> None:
    code = ORPHAN_SCRIPT.format(tests=TESTS_DIR, method=method)
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()  # type: ignore[union-attr]
        workers = [psutil.Process(int(p)) for p in line.split()]
        assert len(workers) == 2, proc.stderr.read() if not line else line  # type: ignore[union-attr]
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
        # no PR_SET_PDEATHSIG for them: their poll of the main process ends them
        _, alive = psutil.wait_procs(workers, timeout=PARENT_CHECK_S + 2.5)
        assert alive == [], f"workers outlived the main process: {alive}"
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.communicate(timeout=10)
