"""An observer that raises never costs a batch, a worker or a cleanup (docs/plugins.md).

Every event an observer hears is told after the loader has done what the event reports: a dead
worker's successor has its predecessor's tasks before ``worker_restarted`` is heard, and an error
from that (or any worker event) is raised at the next ``next()``, as ``batch_ready``'s is. Every
observer sees every batch, the built-in stats included, whichever of them raises. An error from
the epoch's last batch that no ``next()`` came to raise is logged when the next epoch starts, not
raised into it. And timeouts longer than ``poll()`` can wait (24.8 days) are waited in parts.
"""

from __future__ import annotations

import logging
import os

import numpy as np
import pytest

import shmloader
from shmloader.errors import PluginError

DATA = np.arange(12.0).reshape(6, 2)


def _drain(it) -> tuple[list, int]:  # noqa: ANN001 - an iterator of the loader
    """Every batch of the epoch, going on past observer errors; (batches, observer errors)."""
    got, errors = [], 0
    while True:
        try:
            got.append(next(it).ravel().tolist())
        except PluginError:
            errors += 1
        except StopIteration:
            return got, errors


class KillOnce(shmloader.Dataset):
    """Sample 9 kills its worker the first time (a flag file says whether it did)."""

    def __init__(self, flag: str) -> None:
        self.flag = flag

    def __len__(self) -> int:
        return 24

    def __getitem__(self, i: int) -> np.ndarray:
        if i == 9 and os.path.exists(self.flag):
            os.unlink(self.flag)
            os._exit(3)
        return np.array([i])


class RaiseOnRestart:
    def shmloader_worker_restarted(self, worker_id: int) -> None:
        raise KeyError("observer bug")


@pytest.mark.timeout(60)
def test_an_observer_failing_on_a_restart_costs_no_batch(tmp_path):
    flag = tmp_path / "kill"
    flag.touch()
    loader = shmloader.DataLoader(KillOnce(str(flag)), batch_size=3, num_workers=2, on_worker_death="restart",
                                  plugins=[RaiseOnRestart()], timeout=30)
    try:
        got, errors = _drain(iter(loader))
    finally:
        loader.close()
    assert not flag.exists() and errors == 1  # the worker died once; its successor got its tasks
    assert got == [[3 * k, 3 * k + 1, 3 * k + 2] for k in range(8)]


class RaiseOnStart:
    def shmloader_worker_started(self, worker_id: int) -> None:
        raise KeyError("observer bug")


@pytest.mark.timeout(60)
def test_an_observer_failing_on_a_start_is_raised_at_the_first_next_and_close_stops_the_workers():
    loader = shmloader.DataLoader(DATA, batch_size=2, num_workers=2, multiprocessing_context="fork",
                                  plugins=[RaiseOnStart()])
    try:
        it = iter(loader)  # the workers run: the iterator holds them, so close() stops them
        with pytest.raises(PluginError, match="shmloader_worker_started"):
            next(it)
        got, errors = _drain(it)
    finally:
        loader.close()  # the leak guard checks that no worker is left
    assert errors == 0 and got == DATA.reshape(3, 4).tolist()


class FailOnTask:
    def __init__(self, task: int, times: int = 1) -> None:
        self.task = task
        self.times = times

    def shmloader_batch_ready(self, task: int) -> None:
        if task == self.task and self.times:
            self.times -= 1
            raise ValueError("observer bug")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("num_workers", [0, 2])
def test_every_observer_sees_every_batch_whichever_raises(num_workers):
    loader = shmloader.DataLoader(DATA, batch_size=2, num_workers=num_workers, plugins=[FailOnTask(1)])
    try:
        got, errors = _drain(iter(loader))
        assert len(got) == 3 and errors == 1
        assert loader.stats()["batches"] == 3  # the built-in stats, called after the failing observer
    finally:
        loader.close()


@pytest.mark.timeout(60)
def test_an_error_from_the_last_batch_that_no_next_raised_is_logged_not_raised_into_the_next_epoch(caplog):
    loader = shmloader.DataLoader(DATA, batch_size=2, num_workers=2, persistent_workers=True,
                                  plugins=[FailOnTask(2)])
    try:
        it = iter(loader)
        assert len([next(it) for _ in range(3)]) == 3  # the whole epoch; the observer failed on the last
        with caplog.at_level(logging.WARNING, logger="shmloader"):
            second = [b.tolist() for b in loader]  # a new epoch on the same iterator
        assert len(second) == 3
        assert "an observer failed after the last batch of the epoch" in caplog.text
    finally:
        loader.close()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("setting", [{"SHMLOADER_TIMEOUT": "3000000"}, {"SHMLOADER_TASK_TIMEOUT_S": "3000000"},
                                     {"task_timeout_s": 3e6}, {"timeout": 3e6}])
def test_a_timeout_longer_than_poll_can_wait_is_waited_in_parts(monkeypatch, setting):
    kwargs = {}
    for key, value in setting.items():
        if key.startswith("SHMLOADER_"):
            monkeypatch.setenv(key, value)
        else:
            kwargs[key] = value
    loader = shmloader.DataLoader(DATA, batch_size=2, num_workers=2, **kwargs)
    try:
        assert [b.tolist() for b in loader] == DATA.reshape(3, 2, 2).tolist()  # it raised OverflowError
    finally:
        loader.close()
