"""Nothing left behind: every way a loader ends stops every worker and unlinks every segment.

Covered: ``close()``, the context manager, ``del``, breaking out of an epoch, an exception in the
caller's loop, persistent workers then ``close()``, KeyboardInterrupt while the main process waits,
interpreter exit with a live iterator, a SIGKILL of the main process (workers gone within about a
second, the resource tracker unlinks the segments), and the sweep of a dead owner's segments when a
loader starts. Each check is made right after the event (no waiting), except where another process
must act (the kernel, the resource tracker): there a bounded deadline is polled.
"""

from __future__ import annotations

import gc
import multiprocessing
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from typing import Any

import fault_datasets as fd
from iter_helpers import mp_iter
import psutil
import pytest
from process_helpers import shared_helper, until

from shmloader import DataLoader
from shmloader.engine.wait import WaitAndRecover

SHM_DIR = "/dev/shm"
TESTS_DIR = os.path.dirname(os.path.abspath(__file__))


def workers_of(pid: int | None = None) -> list[psutil.Process]:
    """Child processes of ``pid`` (default: this process), multiprocessing's helpers excepted."""
    found = []
    root = psutil.Process(pid)
    for p in root.children(recursive=True):
        try:
            if not shared_helper(p, " ".join(p.cmdline()), parent=root.pid):
                found.append(p)
        except (psutil.NoSuchProcess, psutil.ZombieProcess):
            found.append(p)  # already exited but not reaped: a zombie is a leak too
    return found


def segments_of(pid: int) -> list[str]:
    return sorted(n for n in os.listdir(SHM_DIR) if n.startswith(f"shml_{pid}_"))


def assert_clean() -> None:
    """No worker (nor zombie) and no segment of this process, checked now, without waiting."""
    assert workers_of() == []
    assert segments_of(os.getpid()) == []


def make_loader(**kw: Any) -> DataLoader:
    kw.setdefault("batch_size", 2)
    kw.setdefault("num_workers", 2)
    return DataLoader(fd.FaultyDataset(kw.pop("n", 16)), **kw)


@pytest.mark.timeout(30)
def test_close_mid_epoch() -> None:
    it = iter(make_loader())
    batch = next(it)
    assert len(workers_of()) == 2 and segments_of(os.getpid())
    it.close()
    assert_clean()
    assert batch[1, 0] == 10  # a batch the caller holds stays readable after close


@pytest.mark.timeout(30)
def test_context_manager_with_persistent_workers() -> None:
    with make_loader(persistent_workers=True) as loader:
        for _ in loader:
            break
        assert len(workers_of()) == 2
    assert_clean()


@pytest.mark.timeout(30)
def test_del_of_a_live_iterator() -> None:
    it = iter(make_loader())
    next(it)
    del it
    gc.collect()
    assert_clean()


@pytest.mark.timeout(30)
def test_break_out_of_an_epoch() -> None:
    loader = make_loader()
    for _ in loader:
        break
    assert_clean()  # the loop's iterator was the only reference: dropping it closed the loader


@pytest.mark.timeout(30)
def test_exception_in_the_callers_loop() -> None:
    with pytest.raises(ZeroDivisionError):
        for _ in make_loader():
            1 / 0
    assert_clean()


@pytest.mark.timeout(30)
def test_persistent_workers_then_close() -> None:
    loader = make_loader(persistent_workers=True)
    pids = None
    for _epoch in range(3):
        assert len(list(loader)) == 8
        now = sorted(p.pid for p in workers_of())
        assert pids is None or now == pids  # the same workers serve every epoch
        pids = now
    loader.close()
    assert_clean()


def ctrl_c_once_waiting(main: int) -> threading.Thread:
    """A thread that sends SIGINT to this process, as Ctrl-C would, once thread ``main`` waits for a
    batch (runs the engine's wait). A worker that sent it could not know: its SIGINT could land in
    ``iter()`` or in the test's own code before ``next()``, which pytest takes for the user's Ctrl-C."""

    def waiting() -> bool:
        frame = sys._current_frames().get(main)
        return frame is not None and frame.f_code is WaitAndRecover._wait.__code__

    def run() -> None:
        until(waiting, 20)  # past that, interrupt anyway: the test then fails on what it checks, not hangs
        os.kill(os.getpid(), signal.SIGINT)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


@pytest.mark.timeout(30)
def test_keyboard_interrupt_while_waiting() -> None:
    loader: DataLoader[Any] = DataLoader(fd.HangsAt(8, at=0), batch_size=2, num_workers=1)
    it = iter(loader)
    ctrl_c = ctrl_c_once_waiting(threading.get_ident())
    with pytest.raises(KeyboardInterrupt):
        next(it)  # the main process waits for the first batch when the interrupt comes
    ctrl_c.join()
    assert mp_iter(it).closed  # the iterator closed itself on the way out, before the caller dropped it
    assert_clean()


class NotesSigterm:
    """A trainer's SIGTERM handler (a framework's, checkpointing on preemption): it notes every
    process it runs in, as a file named after the pid."""

    def __init__(self, directory: str) -> None:
        self.directory = directory

    def __call__(self, signum: int, frame: Any) -> None:
        open(os.path.join(self.directory, str(os.getpid())), "w").close()


@pytest.mark.timeout(30)
def test_the_trainers_sigterm_handler_never_runs_in_a_worker_stopped_at_shutdown(tmp_path: Any) -> None:
    """A forked worker inherited the trainer's SIGTERM handler: the SIGTERM that stops a busy
    worker at shutdown ran the trainer's code in the worker (a framework's handler signals the
    job's other processes), and the worker, still alive, held the shutdown up until SIGKILL."""
    notes, hung = tmp_path / "notes", tmp_path / "hung"
    notes.mkdir()
    hung.mkdir()
    previous = signal.signal(signal.SIGTERM, NotesSigterm(str(notes)))
    try:
        loader: DataLoader[Any] = DataLoader(fd.HangsAt(16, at=4, note_dir=str(hung)), batch_size=2, num_workers=1,
                                             multiprocessing_context="fork")
        it = mp_iter(iter(loader))
        next(it), next(it)
        # the worker hangs on task 2 (sample 4): only a signal stops it (else it could still see the stop flag)
        assert until(lambda: os.path.exists(hung / "hung"), 20)
        handles = list(it._pool.workers)
        loader.close()
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert os.listdir(notes) == []
    assert [h.process.exitcode for h in handles] == [-signal.SIGTERM]
    assert_clean()


@pytest.mark.timeout(30)
def test_broken_loader_can_iterate_again() -> None:
    loader: DataLoader[Any] = DataLoader(fd.FaultyDataset(8, "getitem", "kill", at=2), batch_size=2, num_workers=1,
                                         persistent_workers=True)
    with pytest.raises(RuntimeError, match=r"DataLoader worker \(pid \d+\) is killed by signal: Killed"):
        list(loader)
    assert_clean()
    with pytest.raises(RuntimeError, match=r"DataLoader worker \(pid \d+\) is killed by signal: Killed"):  # a fresh start, not a stale state
        list(loader)
    loader.close()
    assert_clean()


# -- the main process ends -----------------------------------------------------------------

SCRIPT = textwrap.dedent("""
    import multiprocessing, os, sys, time
    sys.path.insert(0, {tests!r})
    import fault_datasets as fd
    from shmloader import DataLoader

    if __name__ == "__main__":
        loader = DataLoader(fd.FaultyDataset(64), batch_size=2, num_workers=2, multiprocessing_context={method!r})
        it = iter(loader)
        batch = next(it)
        pids = [p.pid for p in multiprocessing.active_children()]
        print(" ".join(map(str, pids)), flush=True)
        if {wait!r}:
            time.sleep(3600)  # the test SIGKILLs this process here
""")


def run_script(method: str, wait: bool) -> subprocess.Popen:
    code = SCRIPT.format(tests=TESTS_DIR, method=method, wait=wait)
    return subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def gone_within(pids: list[int], deadline_s: float) -> float:
    """Seconds until every pid is gone (exited; a zombie counts), or fail after ``deadline_s``."""
    start = time.monotonic()
    while True:
        alive = [p for p in pids if psutil.pid_exists(p) and _status(p) != psutil.STATUS_ZOMBIE]
        elapsed = time.monotonic() - start
        if not alive:
            return elapsed
        assert elapsed < deadline_s, f"still alive after {deadline_s} s: {alive}"
        time.sleep(0.02)  # polling another process's exit, with a bound: not synchronisation


def _status(pid: int) -> str:
    try:
        return psutil.Process(pid).status()
    except psutil.NoSuchProcess:
        return psutil.STATUS_DEAD


@pytest.mark.timeout(60)
@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_interpreter_exit_with_a_live_iterator(method: str) -> None:
    proc = run_script(method, wait=False)
    out, err = proc.communicate(timeout=45)
    assert proc.returncode == 0, err
    pids = [int(p) for p in out.split()]
    assert len(pids) == 2
    assert gone_within(pids, 1.0) < 1.0
    assert segments_of(proc.pid) == []
    assert "leaked" not in err and "Traceback" not in err, err


@pytest.mark.timeout(60)
@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_sigkill_of_the_main_process(method: str) -> None:
    proc = run_script(method, wait=True)
    try:
        line = proc.stdout.readline()  # type: ignore[union-attr]
        pids = [int(p) for p in line.split()]
        assert len(pids) == 2, proc.stderr.read() if not line else line  # type: ignore[union-attr]
        assert segments_of(proc.pid)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
        assert gone_within(pids, 1.5) < 1.0  # PR_SET_PDEATHSIG: at once, not at the next poll
        _poll_until(lambda: segments_of(proc.pid) == [], 10.0)  # the resource tracker unlinks them
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.communicate(timeout=10)


def _poll_until(condition: Any, deadline_s: float) -> None:
    start = time.monotonic()
    while not condition():
        assert time.monotonic() - start < deadline_s, f"not true within {deadline_s} s"
        time.sleep(0.05)  # another process acts; a bounded poll of its result


# -- segments of dead owners are swept --------------------------------------------------------


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


@pytest.mark.timeout(30)
def test_stale_segments_of_a_dead_owner_are_swept_at_start() -> None:
    dead = _dead_pid()
    stale = os.path.join(SHM_DIR, f"shml_{dead}_abcdef_0")
    live = os.path.join(SHM_DIR, "shml_1_abcdef_0")  # pid 1 is always alive: never swept
    for path in (stale, live):
        with open(path, "wb") as f:
            f.write(b"\0" * 4096)
    try:
        loader = make_loader(num_workers=1)
        assert len(list(loader)) == 8
        assert not os.path.exists(stale)
        assert os.path.exists(live)
    finally:
        for path in (stale, live):
            if os.path.exists(path):
                os.unlink(path)


class _Unkillable:
    """A worker process that no signal ends (uninterruptible sleep in the kernel: a hung network
    file system read): ``join`` returns at its timeout, ``exitcode`` stays None. An unbounded join
    would wait for ever: it fails the test instead."""

    pid = None  # nothing real is signalled
    exitcode = None

    def __init__(self) -> None:
        self.joins: list[float | None] = []

    def terminate(self) -> None:
        pass

    def kill(self) -> None:
        pass

    def join(self, timeout: float | None = None) -> None:
        self.joins.append(timeout)
        assert timeout is not None, "an unbounded join of a worker that does not exit hangs close() for ever"


@pytest.mark.timeout(30)
def test_a_worker_that_survives_sigkill_does_not_hang_the_shutdown(caplog: pytest.LogCaptureFixture) -> None:
    from shmloader.engine import reaping, workers

    tasks_r, tasks_w = multiprocessing.Pipe(duplex=False)
    results_r, results_w = multiprocessing.Pipe(duplex=False)
    proc = _Unkillable()
    handle = workers.WorkerHandle(0, proc, tasks_w, results_r, task_reader=tasks_r)
    with caplog.at_level("WARNING", logger="shmloader"):
        reaping.reap(handle)
    assert proc.joins and all(t is not None for t in proc.joins)
    assert "did not exit" in caplog.text and "SIGKILL" in caplog.text
    assert tasks_w.closed and results_r.closed and tasks_r.closed
    results_w.close()
