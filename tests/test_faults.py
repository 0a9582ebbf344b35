"""The crash-case table: where a worker fails × how it fails → which error, worded how.

Every case runs under fork and spawn (worker start-up, i.e. unpickling the dataset, only exists
under spawn). *Where*: ``start`` (the dataset's unpickling in a spawned worker), ``init``
(``worker_init_fn``), ``getitem`` (the dataset's ``__getitem__``), ``collate`` (``collate_fn``),
``pickle`` (pickling the batch back to the main process), ``task`` (unpickling the task in the
worker). *How*: ``raise``, ``kill`` (SIGKILL), ``segv`` (a real SIGSEGV), ``exit`` (``os._exit(3)``),
``hang`` with ``timeout=``, ``hang`` with ``task_timeout_s``. The fault sits in the second task
(sample indices [2..3]) so that the first batch is delivered before the loader fails; a hang sits in
the first task, so the timeout does not also time the worker's start-up.

The leak guard of conftest.py checks after each case that no process and no segment remain.
"""

from __future__ import annotations

import errno
import multiprocessing
import os
import re
import time
from typing import Any

import fault_datasets as fd
from iter_helpers import mp_iter
import numpy as np
import pytest

from shmloader import (
    DataLoader,
    LoaderError,
    ShmSpaceError,
    WorkerDied,
    WorkerHung,
    WorkerTimeout,
)
from shmloader import config_fields
from shmloader.engine import faults
from shmloader.errors import describe_exit, format_indices
from shmloader.transport import shm_space

METHODS = [m for m in ("fork", "spawn") if m in multiprocessing.get_all_start_methods()]
WHERES = ("start", "init", "getitem", "collate", "pickle", "task")
HOWS = ("raise", "kill", "segv", "exit", "hang_timeout", "hang_task_timeout")
HANG_S = 0.5
# torch's words first (what logs and retry wrappers search for), then the signal's name and number
DEATHS = {"kill": r"is killed by signal: Killed \(SIGKILL, 9\)", "segv": r"is killed by signal: Segmentation fault \(SIGSEGV, 11\)",
          "exit": r"exited unexpectedly with exit code 3"}
EXITCODES = {"kill": -9, "segv": -11, "exit": 3}


def loader_kwargs(where: str, how: str) -> dict[str, Any]:
    """A loader of 8 samples in batches of 2 that faults at ``where`` with ``how``."""
    fault = how.split("_")[0]
    at = 0 if fault == "hang" else 2
    kw: dict[str, Any] = {"dataset": fd.FaultyDataset(8), "batch_size": 2}
    if where == "start":
        kw["dataset"] = fd.FaultyDataset(8, "unpickle", fault)
    elif where == "init":
        kw["worker_init_fn"] = fd.FaultyInit(fault)
    elif where == "getitem":
        kw["dataset"] = fd.FaultyDataset(8, "getitem", fault, at=at)
    elif where == "collate":
        kw["collate_fn"] = fd.FaultyCollate(fault, at=at)
    elif where == "pickle":
        kw["collate_fn"] = fd.UnpicklableCollate(fault)
    elif where == "task":
        kw["batch_sampler"] = fd.BadIndexSampler(8, at, fault)
        del kw["batch_size"]
    if how == "hang_timeout":
        kw["timeout"] = HANG_S
    elif how == "hang_task_timeout":
        kw["task_timeout_s"] = HANG_S
    return kw


def expected(where: str, how: str) -> tuple[type[BaseException], str]:
    """The error class and a regex its message must match."""
    starting = where in ("start", "init")
    task, idx = ("0", r"\[0\.\.1\]") if where == "pickle" or how.startswith("hang") else ("1", r"\[2\.\.3\]")
    if how == "raise":
        name, cls = ("TypeError", TypeError) if where == "pickle" else ("Boom", fd.Boom)
        facts = r"\(pid \d+\)\." if starting else rf"\(pid \d+, task {task}, sample indices {idx}\)\."
        return cls, rf"^Caught {name} in DataLoader worker process 0 {facts}\nOriginal Traceback"
    if how in DEATHS:
        held = ("while starting .*before it took a task" if starting else
                rf"while running task {task} \(sample indices {idx}\)")
        return WorkerDied, rf"^DataLoader worker \(pid \d+\) {DEATHS[how]}\. Worker 0 died {held}"
    if how == "hang_timeout":
        return WorkerTimeout, (rf"^DataLoader timed out after {HANG_S} seconds\. Outstanding: task 0: indices "
                               r"\[0\.\.1\].*held by worker 0 \(pid \d+\)")
    doing = (rf"more than {HANG_S} seconds on start-up .*before it could take" if starting else
             rf"more than task_timeout_s={HANG_S} seconds on")
    return WorkerHung, (rf"^DataLoader worker 0 \(pid \d+\) spent {doing} task 0 \(sample indices \[0\.\.1\]\) "
                        "and was killed with SIGKILL")


CASES = [
    pytest.param(method, where, how, id=f"{method}-{where}-{how}")
    for method in METHODS for where in WHERES for how in HOWS
    if not (where == "start" and method != "spawn")  # only a spawned worker unpickles its dataset
]


@pytest.mark.timeout(30)
@pytest.mark.parametrize("method,where,how", CASES)
def test_crash_case(method: str, where: str, how: str, monkeypatch: pytest.MonkeyPatch) -> None:
    if where in ("start", "init"):  # a hang in start-up: give start-up the task deadline, not 30 s
        monkeypatch.setattr(faults, "START_TIMEOUT_FLOOR_S", 0.0)
    cls, pattern = expected(where, how)
    loader: DataLoader[Any] = DataLoader(num_workers=1, multiprocessing_context=method, **loader_kwargs(where, how))
    got: list[Any] = []
    started = time.monotonic()  # then the last batch's arrival: a fault after it is timed from there,
    with pytest.raises(cls) as info:  # not from a (spawned, on a loaded machine slow) worker's start
        for batch in loader:
            got.append(np.asarray(batch["x"] if isinstance(batch, dict) else batch).copy())
            started = time.monotonic()
    elapsed = time.monotonic() - started
    assert re.search(pattern, str(info.value), re.S), str(info.value)
    if where in ("getitem", "collate", "task") and not how.startswith("hang"):
        assert [g[:, 0].tolist() for g in got] == [[0, 10]]  # the batch before the fault arrived, intact
    if how.startswith("hang"):
        assert HANG_S <= elapsed < HANG_S + 10
    else:
        assert elapsed < 10  # a death is noticed through its sentinel, not by a poll interval
    check_attributes(info.value, where, how)


def check_attributes(exc: BaseException, where: str, how: str) -> None:
    if how in DEATHS:
        assert isinstance(exc, RuntimeError) and isinstance(exc, LoaderError)
        assert isinstance(exc, WorkerDied)
        assert exc.worker_id == 0 and isinstance(exc.pid, int)
        assert exc.exitcode == EXITCODES[how]
        assert exc.signal == (-EXITCODES[how] if EXITCODES[how] < 0 else None)
        if where not in ("start", "init", "pickle"):
            assert exc.tasks[1] == [2, 3]
    elif how.startswith("hang"):
        assert isinstance(exc, WorkerTimeout) and isinstance(exc, RuntimeError)
        assert exc.tasks[0] == [0, 1]
        if how == "hang_task_timeout":
            assert exc.worker_id == 0 and isinstance(exc.pid, int)


# -- promptness, measured ---------------------------------------------------------------------


@pytest.mark.timeout(30)
@pytest.mark.parametrize("method", METHODS)
def test_death_is_reported_within_a_second(method: str, tmp_path: Any) -> None:
    stamp = str(tmp_path / "died_at")
    loader: DataLoader[Any] = DataLoader(fd.StampAndDie(stamp), batch_size=2, num_workers=2,
                                         multiprocessing_context=method)
    with pytest.raises(WorkerDied, match=r"SIGKILL, 9\)\. Worker 0 died while running task 4 \(sample indices \[8\.\.9\]\)"):
        for _ in loader:
            pass
    latency_s = time.time() - float(open(stamp).read())
    assert latency_s < 1.0, latency_s


# -- the policy module's pure parts ---------------------------------------------------------


def test_describe_exit_names_signals_and_codes() -> None:
    assert describe_exit(-9) == "signal SIGKILL (9)"
    assert describe_exit(-11) == "signal SIGSEGV (11)"
    assert describe_exit(3) == "exit code 3"
    assert describe_exit(None).startswith("no exit code")
    assert format_indices([0, 1, 2, 5, 7, 8]) == "[0..2, 5, 7..8]"


def test_error_facts_take_any_batch_a_batch_sampler_yields() -> None:
    """A batch of indices reaches the engine as the batch sampler made it (an ndarray, a range, a
    tuple, a tensor): messages show its numbers, and the errors' attributes hold plain lists."""
    assert format_indices(np.array([5, 6, 7, 9])) == "[5..7, 9]"
    assert format_indices(range(3, 6)) == format_indices((3, 4, 5)) == "[3..5]"
    assert format_indices(np.array([[0, 1], [2, 3]])) == "[[0, 1], [2, 3]]"  # not indices: shown as they are
    poison = faults.poison(3, np.array([6, 7]), 3, ["a", "b", "c"])
    assert "sample indices [6..7]" in str(poison) and poison.indices == [6, 7] and poison.tasks == {3: [6, 7]}
    hung = faults.hung(0, 1, 2, np.array([4, 5]), 0.5)
    assert "sample indices [4..5]" in str(hung) and hung.tasks == {2: [4, 5]}
    died = faults.died(2, 1234, -9, {5: np.array([10, 11]), 6: range(12, 14)}, "/dev/shm")
    assert "sample indices [10..11]" in str(died) and died.tasks == {5: [10, 11], 6: [12, 13]}


def test_error_facts_show_a_tensor_batchs_numbers() -> None:
    torch = pytest.importorskip("torch")
    assert format_indices(torch.tensor([5, 6, 7, 9])) == "[5..7, 9]"
    assert format_indices([torch.tensor(4)]) == "[4]"  # one sampled index (batch_size=None)
    assert faults.poison(1, torch.tensor([2, 3]), 3, []).indices == [2, 3]


def test_died_message_facts_then_hints_then_remedy(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(shm_space, "shm_free_bytes", lambda d: 4096)
    exc = faults.died(2, 1234, -7, {5: [10, 11], 6: [12, 13]}, "/dev/shm")
    lines = str(exc).splitlines()
    assert lines[0] == ("DataLoader worker (pid 1234) is killed by signal: Bus error (SIGBUS, 7). Worker 2 died while "
                        "running task 5 (sample indices [10..11]); it also held task 6 (sample indices [12..13]).")
    assert lines[1].startswith("hint: SIGBUS often means /dev/shm ran out of space; it has 4096 bytes free")
    assert "on_worker_death='restart'" in lines[2]
    assert (exc.worker_id, exc.pid, exc.signal, exc.tasks) == (2, 1234, 7, {5: [10, 11], 6: [12, 13]})


def test_oom_hint_only_when_the_count_rose(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(faults, "_OOM_KILLS_AT_START", 1)
    monkeypatch.setattr(faults, "_cgroup_oom_kills", lambda: 1)
    assert faults.hints("/dev/shm", -9) == []
    monkeypatch.setattr(faults, "_cgroup_oom_kills", lambda: 3)
    assert faults.hints("/dev/shm", -9) == [
        "hint: the cgroup's oom_kill count rose from 1 to 3 while this process ran; the kernel's OOM killer "
        "may have killed the worker"]
    assert faults.hints("/dev/shm", 3) == []


def test_exit_code_0_hints_at_sys_exit() -> None:
    assert faults.hints("/dev/shm", 0) == [
        "hint: exit code 0 means the worker ended by itself without being asked to: sys.exit(), a "
        "SystemExit or os._exit(0) in the dataset, collate_fn or worker_init_fn?"]
    assert faults.hints("/dev/shm", 1) == []


@pytest.mark.timeout(60)
def test_sys_exit_in_getitem_is_a_death_that_says_so() -> None:
    loader: DataLoader[Any] = DataLoader(fd.FaultyDataset(8, "getitem", "sysexit", at=3), batch_size=2, num_workers=2)
    try:
        with pytest.raises(WorkerDied) as info:
            list(loader)
    finally:
        loader.close()
    assert "exited unexpectedly with exit code 0" in str(info.value) and "sample indices [2..3]" in str(info.value)
    assert "sys.exit()" in str(info.value)


def test_iterable_death_says_why_no_restart() -> None:
    exc = faults.died(0, 1, -9, {0: None}, "/dev/shm", iterable=True)
    assert "(iterable dataset: no sample indices)" in str(exc)
    assert "cannot be restarted" in str(exc)


def test_errors_are_runtime_errors() -> None:
    for cls in (WorkerDied, WorkerTimeout, WorkerHung):
        assert issubclass(cls, RuntimeError)
    exc = faults.poison(3, [6, 7], 3, ["a", "b", "c"])
    assert isinstance(exc, RuntimeError)
    assert re.match(r"task 3 \(sample indices \[6\.\.7\]\) killed its worker on each of 3 attempts", str(exc))


# -- /dev/shm pre-flight and shm_dir --------------------------------------------------------


def test_preflight_names_bytes_needed_free_and_remedies(monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> None:
    from shmloader.transport.preflight import check_ring_fits
    from shmloader.transport.ring import Ring

    monkeypatch.setattr(shm_space, "shm_free_bytes", lambda d: 3 << 20)
    ring = Ring(str(tmp_path))
    check_ring_fits(ring, 1 << 20, 3, num_workers=1, prefetch_factor=1)  # exactly fits
    with pytest.raises(ShmSpaceError) as info:
        check_ring_fits(ring, 1 << 20, 6, num_workers=2, prefetch_factor=2)
    exc = info.value
    assert (exc.needed_bytes, exc.free_bytes, exc.directory) == (6 << 20, 3 << 20, str(tmp_path))
    assert str(exc).startswith(f"the slot ring (6 slots of 1048576 bytes: num_workers=2 x prefetch_factor=2 + 2 "
                               f"held by the consumer) needs 6291456 more bytes but {tmp_path} has only 3145728 "
                               "bytes free. Remedies:")
    for remedy in ("--shm-size", "fewer workers", "prefetch_factor", "SHMLOADER_SHM_DIR"):
        assert remedy in str(exc)
    assert isinstance(exc, RuntimeError)


def test_enospc_at_creation_becomes_shm_space_error(tmp_path: Any) -> None:
    from shmloader.transport.shm_space import explain_enospc

    with pytest.raises(ShmSpaceError, match=r"a new shared-memory segment of 4096 bytes \(No space left on "
                                            r"device\) needs 4096 more bytes but .* bytes free"):
        with explain_enospc(str(tmp_path), 4096):
            raise OSError(errno.ENOSPC, "No space left on device")
    with pytest.raises(PermissionError, match=r"cannot create a shared-memory segment in .* \(denied\): "
                                              r"that directory is set by SHMLOADER_SHM_DIR or shm_dir="):
        with explain_enospc(str(tmp_path), 4096):  # a directory no segment can be made in: same type, named
            raise PermissionError(errno.EACCES, "denied")
    with pytest.raises(OSError, match=r"^\[Errno 5\] I/O$"):  # anything else: unchanged
        with explain_enospc(str(tmp_path), 4096):
            raise OSError(errno.EIO, "I/O")


@pytest.mark.timeout(60)
def test_a_shm_dir_where_no_segment_can_be_made_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    # Refused when the loader is built (test_adv_input_shm_dir_probe.py); this is the later line of
    # defence, for a directory that stops taking files after the loader was built.
    monkeypatch.setattr(config_fields, "probe_dir", lambda path: None)
    monkeypatch.setenv("SHMLOADER_SHM_DIR", "/proc")  # exists, takes no files
    loader: DataLoader[Any] = DataLoader(np.arange(16.0).reshape(8, 2), batch_size=2, num_workers=2)
    try:
        with pytest.raises(OSError, match=r"cannot create a shared-memory segment in /proc .*SHMLOADER_SHM_DIR"):
            next(iter(loader))
    finally:
        loader.close()


@pytest.mark.timeout(30)
def test_loader_preflight_with_slot_bytes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(shm_space, "shm_free_bytes", lambda d: 1 << 20)
    loader: DataLoader[Any] = DataLoader(fd.FaultyDataset(8), batch_size=2, num_workers=2, slot_bytes=1 << 20)
    with pytest.raises(ShmSpaceError, match=r"the slot ring \(6 slots of 1048576 bytes.*only 1048576 bytes free"):
        iter(loader)
    assert multiprocessing.active_children() == []  # it failed before starting any worker


@pytest.mark.timeout(30)
def test_loader_turns_enospc_into_shm_space_error(monkeypatch: pytest.MonkeyPatch) -> None:
    def full(fd_: int, offset: int, length: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", full)  # the main process is the only one that creates
    loader: DataLoader[Any] = DataLoader(fd.FaultyDataset(8), batch_size=2, num_workers=1,
                                         multiprocessing_context="fork")
    try:
        with pytest.raises(ShmSpaceError, match="No space left on device"):
            next(iter(loader))  # iter() sends the first tasks, as torch's does: their slots are made there
        assert not multiprocessing.active_children()  # the error left the loader shut, not half-running
    finally:
        loader.close()


@pytest.mark.timeout(30)
@pytest.mark.parametrize("method", METHODS)
def test_shm_dir_places_untracked_segments_and_unlinks_them(method: str, tmp_path: Any,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    from shmloader.transport import segment

    registered: list[str] = []
    monkeypatch.setattr(segment, "_register", registered.append)
    monkeypatch.setenv("SHMLOADER_SHM_DIR", str(tmp_path))
    loader: DataLoader[Any] = DataLoader(fd.FaultyDataset(16), batch_size=2, num_workers=2,
                                         multiprocessing_context=method)
    it = iter(loader)
    first = next(it)
    inside = sorted(os.listdir(tmp_path))
    assert inside and all(n.startswith(f"shml_{os.getpid()}_") for n in inside)
    assert not [n for n in os.listdir("/dev/shm") if n.startswith(f"shml_{os.getpid()}_")]
    rest = [b[:, 0].tolist() for b in it]
    assert [first[:, 0].tolist()] + rest == [[20 * k, 20 * k + 10] for k in range(8)]
    assert os.listdir(tmp_path) == []  # unlinked at the end of the epoch
    assert registered == []  # a file-backed segment is not the resource tracker's to unlink


@pytest.mark.timeout(30)
def test_growth_past_the_budget_breaks_the_loader_cleanly(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(shm_space, "shm_free_bytes", lambda d: 6 << 20)  # the first 1 MiB slots fit, 4 MiB ones not
    it = iter(DataLoader(fd.GrowingDataset(16, at=8, floats=1 << 19), batch_size=2, num_workers=1))
    got = []
    with pytest.raises(ShmSpaceError, match=r"the slot ring \(4 slots of \d+ bytes.*bytes free\. Remedies"):
        for batch in it:
            got.append(int(batch[0, 0]))
    assert got == [0, 2, 4, 6]  # every batch before the growth, intact
    assert mp_iter(it).closed and multiprocessing.active_children() == []  # shut at once, not at garbage collection


@pytest.mark.parametrize("method", [m for m in ("spawn", "forkserver") if m in multiprocessing.get_all_start_methods()])
@pytest.mark.parametrize("argument", ["dataset", "collate_fn", "worker_init_fn"])
def test_what_a_spawned_worker_cannot_receive_is_named(method: str, argument: str) -> None:
    """Under spawn and forkserver the dataset, collate_fn and worker_init_fn are pickled for the
    workers; one that does not pickle used to be pickle's bare ``TypeError: cannot pickle
    '_thread.lock' object``, naming none of them. Its type is kept."""
    kw: dict[str, Any] = {"dataset": fd.FaultyDataset(8), argument: fd.HoldsALock()}
    loader: DataLoader[Any] = DataLoader(batch_size=2, num_workers=1, multiprocessing_context=method, **kw)
    with pytest.raises(TypeError) as info:
        iter(loader)
    assert str(info.value).startswith(f"the {argument} (HoldsALock) cannot be pickled, as the {method!r} start "
                                      "method needs to send it to each worker: TypeError: cannot pickle "
                                      "'_thread.lock' object.")
    assert "multiprocessing_context='fork'" in str(info.value)
    assert isinstance(info.value.__cause__, TypeError)
    assert multiprocessing.active_children() == []
