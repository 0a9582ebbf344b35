"""An ``iter(loader)`` that raises (a Ctrl-C while workers start, a worker that cannot start, an
iterable dataset whose ``__iter__`` fails, no room for the ring) starts no epoch: a state loaded
by ``load_state_dict`` stays armed for the next ``iter()``, which resumes it, and without one the
loader's epoch count and ``state_dict()`` are what they were, so the retry and a resume from a
state saved after the failure agree (shmloader/epoch_book.py, docs/resume.md)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

import shmloader
from shmloader.engine import workers as workers_mod
from shmloader.engine.mp_iterator import MultiProcessIter


class FailsOnce:
    """Raises KeyboardInterrupt the first time it is called once ``armed``."""

    def __init__(self, real: Any) -> None:
        self.real, self.armed = real, False

    def __call__(self, *args: Any) -> Any:
        if self.armed:
            self.armed = False
            raise KeyboardInterrupt
        return self.real(*args)


class Stream(shmloader.IterableDataset):
    """Items 0..13; ``__iter__`` fails once after ``fail_next`` is set."""

    fail_next = False

    def __iter__(self) -> Iterator[int]:
        if Stream.fail_next:
            Stream.fail_next = False
            raise KeyboardInterrupt
        return iter(range(14))


def _loader(case: str) -> shmloader.DataLoader:
    if case == "stream":
        return shmloader.DataLoader(Stream(), batch_size=2)
    return shmloader.DataLoader(np.arange(14), batch_size=2, shuffle=True, generator=3, num_workers=1,
                                multiprocessing_context="fork", persistent_workers=case == "persistent")


def _arm(case: str, monkeypatch: pytest.MonkeyPatch) -> FailsOnce | None:
    """Make the next iter() of a ``case`` loader fail as it starts."""
    if case == "stream":
        Stream.fail_next = True
        return None
    if case == "persistent":  # the persistent iterator's next epoch, on the same workers
        begin = FailsOnce(MultiProcessIter._begin_epoch)
        monkeypatch.setattr(MultiProcessIter, "_begin_epoch", lambda self: begin(self))
        begin.armed = True
        return begin
    start_all = FailsOnce(workers_mod.WorkerPool.start_all)
    monkeypatch.setattr(workers_mod.WorkerPool, "start_all", lambda self: start_all(self))
    start_all.armed = True
    return start_all


def _batches(it: Any, limit: int | None = None) -> list[Any]:
    out = []
    for batch in it:
        out.append(np.asarray(batch).tolist())
        if len(out) == limit:
            break
    return out


@pytest.mark.timeout(60)
@pytest.mark.parametrize("case", ["workers", "stream"])
def test_a_failed_iter_after_load_state_dict_leaves_the_resume_armed(case: str, monkeypatch) -> None:
    with _loader(case) as reference:
        uninterrupted = _batches(reference)
    with _loader(case) as saving:
        before = _batches(iter(saving), 3)
        state = json.loads(json.dumps(saving.state_dict()))
    with _loader(case) as resumed:
        resumed.load_state_dict(state)
        _arm(case, monkeypatch)
        with pytest.raises(KeyboardInterrupt):
            iter(resumed)
        assert resumed.state_dict() == state
        assert before + _batches(resumed) == uninterrupted  # the retry resumes the loaded epoch


@pytest.mark.timeout(60)
@pytest.mark.parametrize("case", ["workers", "stream", "persistent"])
def test_a_failed_iter_starts_no_epoch(case: str, monkeypatch) -> None:
    with _loader(case) as loader:
        _batches(loader)
        state = loader.state_dict()
        _arm(case, monkeypatch)
        with pytest.raises(KeyboardInterrupt):
            iter(loader)
        after = json.loads(json.dumps(loader.state_dict()))
        assert after["epoch"] == state["epoch"] == 1 and not after["in_progress"]
        retried = _batches(loader)
    with _loader(case) as resumed:
        resumed.load_state_dict(after)
        assert _batches(resumed) == retried  # the state after the failure is the retry's start
