"""Workers outlive the thread that started them, and a process forked from the trainer leaves them alone.

Two defects, each with its reproducer here:

- ``PR_SET_PDEATHSIG`` is tied to the *thread* that forked the worker, not to its process
  (prctl(2)). A worker started from a thread other than the main one — a persistent loader's first
  epoch run in a thread, ``iter(loader)`` in a thread, a restart made by ``next()`` in a thread —
  was SIGKILLed when that thread ended. Such a worker now relies on its poll of the main process,
  which still ends it when the main process dies (a SIGKILL of the trainer is checked here).
- A child forked from the trainer (plain ``os.fork()``, a library's) that exits normally runs
  multiprocessing's exit handler over the ``_children`` it inherited, which listed our workers:
  it SIGTERMed the parent's live workers. The child now inherits none of our workers there, and
  everything else in it (another library's processes, the parent's own bookkeeping) is as it was.

Scenarios that fork or die on purpose run in a fresh interpreter.
"""

from __future__ import annotations

import json
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
    loader: DataLoader[Any] = DataLoader(Full(), batch_size=2, num_workers=2, persistent_workers=True,
                                         multiprocessing_context=method)
    try:
        assert in_thread(lambda: firsts(loader)) == FIRSTS
        assert_workers_outlive_their_thread()
        assert firsts(loader) == FIRSTS  # the second epoch, on the same workers, in the main thread
    finally:
        loader.close()


@pytest.mark.timeout(60)
def test_an_iterator_made_in_a_thread_is_consumed_in_the_main_thread() -> None:
    loader: DataLoader[Any] = DataLoader(Full(), batch_size=2, num_workers=2, multiprocessing_context="fork")
    try:
        it = in_thread(lambda: iter(loader))
        assert_workers_outlive_their_thread()
        assert firsts(it) == FIRSTS
    finally:
        loader.close()


@pytest.mark.timeout(60)
def test_a_worker_restarted_from_a_thread_survives_it(tmp_path: Any) -> None:
    plan = {5: "kill"}  # the worker fetching sample 5 dies; next() in the thread replaces it
    loader: DataLoader[Any] = DataLoader(fd.PlannedFaults(N, str(tmp_path), plan), batch_size=2, num_workers=2,
                                         persistent_workers=True, on_worker_death="restart",
                                         multiprocessing_context="fork")
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


# -- defect B: a child forked from the trainer exits ----------------------------------------------

FORK_CHILD_SCRIPT = textwrap.dedent("""
    import json, multiprocessing, os, sys, time
    sys.path.insert(0, {tests!r})
    from test_worker_threads_fork import Full
    from shmloader import DataLoader

    def idle():
        time.sleep(3600)

    if __name__ == "__main__":
        other = multiprocessing.get_context("fork").Process(target=idle, daemon=True)  # not ours
        other.start()
        loader = DataLoader(Full(), batch_size=2, num_workers=2, multiprocessing_context={method!r})
        it = iter(loader)
        got = [int(next(it)[0, 0])]
        ours = [p for p in multiprocessing.active_children() if p is not other]
        pid = os.fork()
        if pid == 0:  # a library's child: it exits normally, so atexit handlers run
            kids = multiprocessing.process._children
            print("CHILD", json.dumps({{"kept_other": other in kids, "ours": sum(p in kids for p in ours)}}),
                  flush=True)
            kids.discard(other)  # its owner's business, not ours: keep its SIGTERM out of this test
            sys.exit(0)
        _, status = os.waitpid(pid, 0)
        tracked = sum(p in multiprocessing.process._children for p in ours)
        try:
            got += [int(b[0, 0]) for b in it]
        except Exception as e:
            got = type(e).__name__ + ": " + str(e).splitlines()[0]
        loader.close()
        other.kill()
        other.join()
        print("PARENT", json.dumps({{"got": got, "child_status": status, "tracked": tracked}}), flush=True)
""")


def _reports(stdout: str) -> dict[str, Any]:
    return {line.split(" ", 1)[0]: json.loads(line.split(" ", 1)[1]) for line in stdout.splitlines()
            if line.startswith(("CHILD ", "PARENT "))}


@pytest.mark.timeout(90)
@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_a_forked_child_that_exits_leaves_the_parent_workers_alone(method: str) -> None:
    code = FORK_CHILD_SCRIPT.format(tests=TESTS_DIR, method=method)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=80)
    reports = _reports(out.stdout)
    assert reports.get("PARENT", {}).get("got") == FIRSTS, (out.stdout, out.stderr[-3000:])
    assert reports["PARENT"]["child_status"] == 0, out.stderr[-3000:]  # no failed join in the child
    assert reports["PARENT"]["tracked"] == 2  # the parent still tracks both its workers
    assert reports["CHILD"] == {"kept_other": True, "ours": 0}  # only our workers left the child's list
    assert "can only join a child process" not in out.stderr, out.stderr[-3000:]
