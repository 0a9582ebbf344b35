"""shmloader's errors cross a process boundary and take one message string, as torch's RuntimeErrors do.

torch's loader raises plain RuntimeErrors, which pickle and which ``type(err)(message)`` rebuilds.
Ours carry their facts (worker, pid, exit code, ...) as keyword-only arguments; before, that made
``pickle.loads`` of one fail with a TypeError, so a loader's error raised in a child process
(multiprocessing, concurrent.futures, torch's own test harness) reached the parent as an unrelated
TypeError, and ``raise type(err)(f"{err} ...") from err`` (adding context) raised a TypeError
instead. Found by torch's test_dataloader.py (test_segfault, test_timeout) run against the torch
flavour.
"""

from __future__ import annotations

import multiprocessing
import os
import pickle
import signal
import threading
from typing import Any

import pytest

from shmloader import DataLoader, errors, get_worker_info

# Each error as the engine makes it: its message and its facts.
MADE: list[errors.LoaderError | ValueError] = [
    errors.WorkerDied("w died", worker_id=1, pid=42, exitcode=-9, tasks={3: [6, 7]}),
    errors.RestartBudgetExceeded("gave up", worker_id=0, pid=None, exitcode=3),
    errors.PoisonTask("poison", task=4, indices=[8, 9], attempts=3, deaths=["signal SIGKILL (9)"]),
    errors.WorkerTimeout("DataLoader timed out after 1 seconds", timeout_s=1.0, tasks={0: [0]}, worker_id=0, pid=7),
    errors.WorkerHung("hung", timeout_s=2.0, worker_id=1, pid=8),
    errors.ShmSpaceError("no room", needed_bytes=10, free_bytes=1, directory="/dev/shm"),
    errors.SegmentCollision("taken", directory="/dev/shm", name="shml_x", attempts=5),
    errors.PluginError("bad hook", plugin="p", hook="on_batch"),
    errors.RingExhausted("full"),
    errors.ConfigError("bad value", name="SHMLOADER_X", value="y"),
    errors.StateError("mismatch", saved=1, current=2),
]


def _facts(err: BaseException) -> tuple[Any, ...]:
    return type(err), err.args, str(err), vars(err)


@pytest.mark.parametrize("err", MADE, ids=lambda e: type(e).__name__)
def test_error_pickles_with_its_facts(err: BaseException) -> None:
    assert _facts(pickle.loads(pickle.dumps(err))) == _facts(err)


@pytest.mark.parametrize("err", MADE, ids=lambda e: type(e).__name__)
def test_error_is_built_from_one_message(err: BaseException) -> None:
    again = type(err)(f"{err} (while loading epoch 3)")  # what code that adds context does
    assert isinstance(again, type(err)) and str(again) == f"{err} (while loading epoch 3)"


class _DiesAt1:
    def __len__(self) -> int:
        return 4

    def __getitem__(self, i: int) -> int:
        if i == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        return i


def _load_and_report(conn: Any) -> None:
    import shmloader.torch as st

    loader = st.DataLoader(_DiesAt1(), batch_size=1, num_workers=1, on_worker_death="raise")
    try:
        list(loader)
    except Exception as err:  # sent to the parent as torch's test harness sends it
        conn.send(err)
    else:
        conn.send(None)
    finally:
        loader.close()


@pytest.mark.timeout(90)
def test_worker_death_reaches_the_parent_process() -> None:
    pytest.importorskip("torch")
    ctx = multiprocessing.get_context("fork")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_load_and_report, args=(child,))
    proc.start()
    try:
        assert parent.poll(60), "the child reported nothing"
        err = parent.recv()
    finally:
        proc.join(30)
    assert isinstance(err, errors.WorkerDied), err
    assert err.signal == signal.SIGKILL and err.worker_id == 0 and err.pid is not None
    assert f"pid {err.pid}" in str(err)


class _Sleeps:
    def __len__(self) -> int:
        return 4

    def __getitem__(self, i: int) -> int:
        if get_worker_info() is not None:
            threading.Event().wait(30)  # far past the timeout: the loader stops this worker first
        return i


@pytest.mark.timeout(90)
def test_timeout_message_is_torchs_for_whole_seconds() -> None:
    # torch: f"DataLoader timed out after {self._timeout} seconds"; `timeout=1` reads "1 seconds",
    # which torch's own test matches with r"timed out after \d+ seconds" (ours read "1.0 seconds")
    loader: DataLoader[Any] = DataLoader(_Sleeps(), batch_size=2, num_workers=1, timeout=1)
    with pytest.raises(errors.WorkerTimeout) as info:
        next(iter(loader))
    loader.close()
    assert str(info.value).startswith("DataLoader timed out after 1 seconds. ")
    assert info.value.timeout_s == 1.0
