"""The restart policy: ``on_worker_death='restart'`` replaces dead workers and re-sends their tasks.

Workers are killed mid-epoch from inside ``__getitem__`` on the first attempt only (a marker file
created with ``O_EXCL`` says a fault already fired), so every retry succeeds. The tests check that
every batch is delivered exactly once, in order and with the right content; that per-task seeding
makes a retried batch bit-identical to an undisturbed run; that a task killing every worker that
runs it becomes a ``PoisonTask``; that ``max_restarts`` bounds a crash loop; that an
IterableDataset refuses to restart; and that ``task_timeout_s`` kills a hung worker and retries its
task.
"""

from __future__ import annotations

import multiprocessing
import os
import re
import signal
import subprocess
import sys
import time
from typing import Any

import fault_datasets as fd
from iter_helpers import mp_iter
import numpy as np
import psutil
import pytest

from shmloader import DataLoader, PoisonTask, RestartBudgetExceeded, WorkerDied

METHODS = [m for m in ("fork", "spawn") if m in multiprocessing.get_all_start_methods()]
N = 40
BATCH = 4


def expected_batches(n: int = N, batch: int = BATCH) -> list[np.ndarray]:
    return [np.stack([fd.sample(i) for i in range(s, min(s + batch, n))]) for s in range(0, n, batch)]


def assert_exactly_once_in_order(got: list[np.ndarray], n: int = N) -> None:
    want = expected_batches(n)
    assert len(got) == len(want)
    for k, (g, w) in enumerate(zip(got, want)):
        assert np.array_equal(g, w), f"batch {k}: {g[:, 0]} != {w[:, 0]}"


@pytest.mark.timeout(60)
@pytest.mark.parametrize("method", METHODS)
def test_every_batch_once_in_order_despite_kills(method: str, tmp_path: Any) -> None:
    plan = {3: "kill", 9: "segv", 10: "exit", 22: "kill", 23: "kill", 37: "segv"}
    loader: DataLoader[Any] = DataLoader(fd.PlannedFaults(N, str(tmp_path), plan), batch_size=BATCH, num_workers=2,
                                         multiprocessing_context=method, on_worker_death="restart")
    got = [b.copy() for b in loader]
    assert_exactly_once_in_order(got)
    stats = loader.stats()
    assert stats["worker_deaths"] == stats["worker_restarts"] == len(plan)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(f"plan{i}" for i in plan)


@pytest.mark.timeout(60)
def test_out_of_order_delivery_is_still_exactly_once(tmp_path: Any) -> None:
    plan = {1: "kill", 14: "kill", 30: "exit"}
    loader: DataLoader[Any] = DataLoader(fd.PlannedFaults(N, str(tmp_path), plan), batch_size=BATCH, num_workers=2,
                                         in_order=False, on_worker_death="restart")
    got = sorted((b.copy() for b in loader), key=lambda b: int(b[0, 0]))
    assert_exactly_once_in_order(got)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("method", METHODS)
def test_a_batch_samplers_own_batches_are_re_sent_and_named_after_deaths(method: str, tmp_path: Any) -> None:
    """The batch sampler's batches reach the engine as they are (ranges, tuples here): a dead
    worker's task is re-sent as it was, and a poison task's indices are still plain numbers."""
    batches = [range(s, s + BATCH) for s in range(0, N, BATCH)]
    loader: DataLoader[Any] = DataLoader(fd.PlannedFaults(N, str(tmp_path), {3: "kill", 22: "exit"}),
                                         batch_sampler=batches, num_workers=2, multiprocessing_context=method,
                                         on_worker_death="restart")
    assert_exactly_once_in_order([b.copy() for b in loader])
    assert loader.stats()["worker_restarts"] == 2
    loader = DataLoader(fd.FaultyDataset(20, "getitem", "kill", at=5), batch_sampler=[(0, 1), (4, 5)],
                        num_workers=1, multiprocessing_context=method, on_worker_death="restart",
                        max_task_attempts=2)
    with pytest.raises(PoisonTask, match=r"task 1 \(sample indices \[4\.\.5\]\)") as info:
        list(loader)
    assert (info.value.indices, info.value.tasks) == ([4, 5], {1: [4, 5]})


class RefillingBatchSampler:
    """Yields one list, refilled in place for every batch (each batch right when yielded)."""

    def __len__(self) -> int:
        return N // BATCH

    def __iter__(self) -> Any:
        batch = [0] * BATCH
        for start in range(0, N - N % BATCH, BATCH):
            batch[:] = range(start, start + BATCH)
            yield batch


@pytest.mark.timeout(60)
def test_a_dead_workers_task_is_re_sent_with_its_own_indices_not_a_refilled_list(tmp_path: Any) -> None:
    """A task keeps a copy of its list of indices: a batch sampler that refills one list has moved
    on by the time a dead worker's task is sent again."""
    loader: DataLoader[Any] = DataLoader(fd.PlannedFaults(N, str(tmp_path), {3: "kill"}),
                                         batch_sampler=RefillingBatchSampler(), num_workers=2,
                                         multiprocessing_context="fork", on_worker_death="restart")
    assert_exactly_once_in_order([b.copy() for b in loader])
    assert loader.stats()["worker_restarts"] == 1


@pytest.mark.timeout(60)
def test_persistent_workers_restart_then_next_epoch(tmp_path: Any) -> None:
    loader: DataLoader[Any] = DataLoader(fd.PlannedFaults(N, str(tmp_path), {5: "kill", 6: "kill"}), batch_size=BATCH,
                                         num_workers=2, persistent_workers=True, on_worker_death="restart",
                                         max_restarts=2)
    with loader:
        for _epoch in range(3):  # the budget is per epoch; the faults fire in the first only
            assert_exactly_once_in_order([b.copy() for b in loader])
    assert loader.stats()["worker_restarts"] == 2


@pytest.mark.timeout(60)
@pytest.mark.parametrize("method", METHODS)
def test_task_seeding_makes_a_retried_batch_bit_identical(method: str, tmp_path: Any) -> None:
    def run(num_workers: int, once_dir: str | None, kill_at: tuple[int, ...]) -> list[np.ndarray]:
        loader: DataLoader[Any] = DataLoader(fd.RandomDataset(N, once_dir, kill_at), batch_size=BATCH,
                                             num_workers=num_workers, multiprocessing_context=method,
                                             on_worker_death="restart", task_seeding=True, generator=7)
        return [b.copy() for b in loader]

    disturbed = run(2, str(tmp_path), (3, 17, 18, 31))
    undisturbed = run(2, None, ())
    one_worker = run(1, None, ())
    assert len(disturbed) == len(undisturbed) == N // BATCH
    assert all(np.array_equal(a, b) for a, b in zip(disturbed, undisturbed))
    assert all(np.array_equal(a, b) for a, b in zip(one_worker, undisturbed))  # not tied to the worker
    assert not np.array_equal(undisturbed[0], undisturbed[1])  # the samples really are random


@pytest.mark.timeout(60)
@pytest.mark.parametrize("method", METHODS)
def test_poison_task_is_named_after_max_task_attempts(method: str) -> None:
    loader: DataLoader[Any] = DataLoader(fd.FaultyDataset(20, "getitem", "kill", at=5), batch_size=2, num_workers=2,
                                         multiprocessing_context=method, on_worker_death="restart", max_task_attempts=2)
    with pytest.raises(PoisonTask) as info:
        for _ in loader:
            pass
    exc = info.value
    assert (exc.task, exc.indices, exc.attempts) == (2, [4, 5], 2)
    assert exc.tasks == {2: [4, 5]}
    assert re.match(r"task 2 \(sample indices \[4\.\.5\]\) killed its worker on each of 2 attempts and is not "
                    r"retried again: worker \d \(pid \d+\) died with signal SIGKILL \(9\); worker \d \(pid \d+\) "
                    r"died with signal SIGKILL \(9\)\.", str(exc)), str(exc)
    assert isinstance(exc, RuntimeError)


@pytest.mark.timeout(60)
def test_a_worker_that_cannot_start_is_reported_after_two_attempts_not_restarted_forever() -> None:
    loader: DataLoader[Any] = DataLoader(fd.FaultyDataset(20), worker_init_fn=fd.FaultyInit("exit"), batch_size=2,
                                         num_workers=2, on_worker_death="restart", max_restarts=16)
    with pytest.raises(WorkerDied) as info:
        next(iter(loader))
    exc = info.value
    assert type(exc) is WorkerDied and exc.exitcode == 3  # not RestartBudgetExceeded after 16 replays
    # each worker is started at most twice (one of them may fail twice before the other's death is seen)
    assert 1 <= loader.stats()["worker_restarts"] <= 2
    assert re.search(r"exit code 3\. Worker \d died while starting .* before it took a task.*, on each of 2 attempts in a row\.",
                     str(exc)), str(exc)
    assert "on_worker_death='restart'" not in str(exc)  # a restart starts it the same way again


SCRIPT_WITHOUT_MAIN_GUARD = """
import numpy as np, shmloader
loader = shmloader.DataLoader(shmloader.ArrayDataset(np.arange(8.0)), batch_size=2, num_workers=2,
                              multiprocessing_context="spawn", on_worker_death="restart")
try:
    print(sum(1 for _ in loader))
except shmloader.WorkerDied as exc:
    print("ERROR", type(exc).__name__, exc)
"""


@pytest.mark.timeout(120)
def test_a_spawn_script_without_the_main_guard_is_told_about_the_guard(tmp_path: Any) -> None:
    script = tmp_path / "no_guard.py"
    script.write_text(SCRIPT_WITHOUT_MAIN_GUARD)
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=100, cwd=tmp_path)
    out = done.stdout
    assert "ERROR WorkerDied " in out, (out, done.stderr[-2000:])  # not RestartBudgetExceeded
    assert "if __name__ == \"__main__\":" in out and "docs.python.org" in out
    assert "on_worker_death='restart'" not in out
    # each worker bootstraps at most twice: the traceback is not replayed max_restarts times
    assert done.stderr.count("An attempt has been made to start a new process") <= 4


@pytest.mark.timeout(60)
def test_max_restarts_bounds_deaths_spread_over_tasks(tmp_path: Any) -> None:
    plan = {i: "kill" for i in range(0, N, 3)}  # each task kills once: none is poison, but too many deaths
    loader: DataLoader[Any] = DataLoader(fd.PlannedFaults(N, str(tmp_path), plan), batch_size=BATCH, num_workers=2,
                                         on_worker_death="restart", max_restarts=4)
    got = []
    with pytest.raises(RestartBudgetExceeded, match=r"SIGKILL, 9\): worker \d, which died while running task \d+ .*max_restarts=4"):
        for b in loader:
            got.append(b.copy())
    assert loader.stats()["worker_restarts"] == 4
    assert_exactly_once_in_order(got, n=len(got) * BATCH)  # what did arrive was right


@pytest.mark.timeout(60)
@pytest.mark.parametrize("method", METHODS)
def test_iterable_dataset_cannot_restart(method: str) -> None:
    loader: DataLoader[Any] = DataLoader(fd.KillingStream(20, at=7), batch_size=2, num_workers=2,
                                         multiprocessing_context=method, on_worker_death="restart")
    with pytest.raises(WorkerDied) as info:
        for _ in loader:
            pass
    exc = info.value
    assert not isinstance(exc, RestartBudgetExceeded)
    assert exc.worker_id == 1 and exc.signal == 9
    assert "(iterable dataset: no sample indices)" in str(exc)
    assert "cannot be restarted, even with on_worker_death='restart'" in str(exc)


def _until_exited(pid: int, deadline_s: float = 10.0) -> None:
    """Poll (bounded) until child ``pid`` has exited, without reaping it: another process's exit, not
    a sleep standing in for synchronisation."""
    deadline = time.monotonic() + deadline_s
    while psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
        assert time.monotonic() < deadline, f"worker {pid} still alive {deadline_s} s after SIGKILL"
        time.sleep(0.001)


@pytest.mark.timeout(60)
def test_an_iterable_worker_whose_share_had_ended_is_replaced_not_fatal() -> None:
    """A worker of an IterableDataset that had reported the end of its share holds no position in
    the stream: its death loses nothing, yet it ended the epoch with WorkerDied under the restart
    policy. A persistent one is replaced (and takes no task until the next epoch, which it serves);
    every batch arrives once. (Without persistent workers it is let go, not replaced:
    tests/test_ended_worker_death.py.)"""
    loader: DataLoader[Any] = DataLoader(fd.UnevenStream(80, short=2), batch_size=2, num_workers=2,
                                         multiprocessing_context="fork", on_worker_death="restart",
                                         persistent_workers=True)
    expected = sorted([0, 2, *range(1, 80, 2)])
    with loader:
        it = mp_iter(iter(loader))
        firsts, killed = [], None
        for batch in it:
            firsts += (batch[:, 0] // 10).tolist()
            w0 = it._pool.workers[0]
            if killed is None and w0.exhausted and not w0.outstanding:  # its share has ended, and it knows
                killed = w0.pid
                os.kill(killed, signal.SIGKILL)
                _until_exited(killed)  # so a wait for one of worker 1's later batches sees it
        assert killed is not None
        assert sorted(firsts) == expected  # each sample once
        assert loader.stats()["worker_restarts"] == 1
        assert sorted(x for b in loader for x in (b[:, 0] // 10).tolist()) == expected  # its successor's share


@pytest.mark.timeout(60)
@pytest.mark.parametrize("method", METHODS)
def test_hung_worker_is_killed_and_its_task_retried(method: str, tmp_path: Any) -> None:
    deadline_s = 0.5
    loader: DataLoader[Any] = DataLoader(fd.PlannedFaults(N, str(tmp_path), {13: "hang"}), batch_size=BATCH,
                                         num_workers=2, multiprocessing_context=method, on_worker_death="restart",
                                         task_timeout_s=deadline_s)
    started = time.monotonic()
    got = [b.copy() for b in loader]
    assert time.monotonic() - started >= deadline_s  # the hang was waited out, not skipped
    assert_exactly_once_in_order(got)
    assert loader.stats()["worker_restarts"] == 1


@pytest.mark.timeout(60)
def test_restart_is_configurable_from_the_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> None:
    monkeypatch.setenv("SHMLOADER_ON_WORKER_DEATH", "restart")
    loader: DataLoader[Any] = DataLoader(fd.PlannedFaults(N, str(tmp_path), {6: "kill"}), batch_size=BATCH,
                                         num_workers=1)
    assert_exactly_once_in_order([b.copy() for b in loader])


class GatedFirst:
    """Sample 0 waits for a byte on ``gate`` (a pipe's read end, inherited through fork): its
    task is late past any deadline until the main process lets it finish."""

    def __init__(self, gate: int) -> None:
        self.gate = gate

    def __len__(self) -> int:
        return 4

    def __getitem__(self, i: int) -> np.ndarray:
        if i == 0:
            os.read(self.gate, 1)
        return fd.sample(i)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("policy", ["raise", "restart"])
def test_a_reply_that_arrives_as_the_deadline_passes_is_used_not_killed(monkeypatch: pytest.MonkeyPatch,
                                                                          policy: str) -> None:
    """The wait for a late task timed out, then its batch arrived before the deadline was acted
    on: ``_kill_hung`` killed the worker without reading it, so the batch was thrown away and the
    task re-run as an attempt (or, without restarts, ``WorkerHung`` raised for a batch at hand).
    Now the reply is read first, and the worker killed only if it still holds a late task."""
    from shmloader.engine.wait import WaitAndRecover

    gate_r, gate_w = os.pipe()
    original = WaitAndRecover._on_quiet
    released: list[int] = []

    def reply_lands_first(self: Any, started: float) -> None:
        w = self._pool.workers[0]
        late = w.outstanding and time.monotonic() >= w.head_since + self._policy.deadline_s(w.ready)
        if late and not released:
            released.append(w.pid)
            os.write(gate_w, b"x")
            assert w.results.poll(20.0), "the late batch never came"  # in the pipe before the check
        original(self, started)

    monkeypatch.setattr(WaitAndRecover, "_on_quiet", reply_lands_first)
    try:
        loader: DataLoader[Any] = DataLoader(GatedFirst(gate_r), batch_size=1, num_workers=1,
                                             multiprocessing_context="fork", on_worker_death=policy, task_timeout_s=0.2)
        got = [b.copy() for b in loader]
    finally:
        os.close(gate_r)
        os.close(gate_w)
    assert released, "the wait never timed out on the late task"
    assert [g.tolist() for g in got] == [[fd.sample(i).tolist()] for i in range(4)]
    assert loader.stats()["worker_restarts"] == 0
