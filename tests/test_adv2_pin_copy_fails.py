"""With workers, the pinning copy of a batch (``pin_memory=True`` on an accelerator no backend
registers slots for) that fails: the batch counts as handed out only once the caller has it.

The batch used to be counted delivered (and reported to observers) before the copy: an interrupt
in the copy broke the iterator with the batch in no one's hands, and a state saved then (as
docs/resume.md says to) counted it, so the resumed epoch skipped it. A copy's own error stopped
the iterator, where without workers it is raised in the batch's place and the epoch goes on.
The accelerator is faked, as in tests/test_pin_other_accelerator.py.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pytest

import shmloader
from fault_datasets import FaultyDataset
from shmloader.gpu import pinning

N, BATCH, TRIP = 12, 2, 3  # the copy of the fourth batch handed out fails, once


def trips_once(kind: type[BaseException], tripped: list[int]) -> Any:
    """A ``pin_copy`` that raises ``kind`` for the TRIP-th batch (from 0) it copies, then copies on."""
    calls: list[Any] = []

    def pin_copy(batch: Any) -> Any:
        calls.append(batch)
        if len(calls) == TRIP + 1:
            tripped.append(TRIP)
            raise kind("the pinned copy failed")
        return batch
    return pin_copy


def loader(workers: int) -> shmloader.DataLoader[Any]:
    kw: dict[str, Any] = {"num_workers": workers}
    if workers:
        kw["multiprocessing_context"] = "fork"
    dl: shmloader.DataLoader[Any] = shmloader.DataLoader(FaultyDataset(N), batch_size=BATCH, shuffle=True,
                                                         generator=3, **kw)
    dl.pin_memory = True
    return dl


def firsts(batches: list[Any]) -> list[int]:
    return [int(np.asarray(b)[0, 0]) for b in batches]


@pytest.fixture
def faked(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    monkeypatch.setattr(pinning, "accelerator_available", lambda: True)
    monkeypatch.setattr(pinning, "warn_if_unpinned", lambda loader: None)
    monkeypatch.setattr(pinning, "pin_copy", lambda batch: batch)  # the copy itself is not under test
    return monkeypatch


@pytest.mark.timeout(60)
@pytest.mark.parametrize("workers", [0, 2])
def test_an_interrupt_in_the_copy_leaves_the_batch_undelivered(faked: pytest.MonkeyPatch, workers: int) -> None:
    want = firsts(list(loader(workers)))
    tripped: list[int] = []
    faked.setattr(pinning, "pin_copy", trips_once(KeyboardInterrupt, tripped))
    first = loader(workers)
    got: list[Any] = []
    with pytest.raises(KeyboardInterrupt):
        for b in first:
            got.append(b)
    assert tripped
    state = json.loads(json.dumps(first.state_dict()))
    first.close()
    assert state["delivered"] == [[0, TRIP]] and state["yielded"] == TRIP
    resumed = loader(workers)
    resumed.load_state_dict(state)
    assert firsts(got) + firsts(list(resumed)) == want


@pytest.mark.timeout(60)
@pytest.mark.parametrize("workers", [0, 2])
def test_an_error_in_the_copy_is_raised_in_the_batchs_place_and_the_epoch_goes_on(faked: pytest.MonkeyPatch,
                                                                                   workers: int) -> None:
    want = firsts(list(loader(workers)))
    tripped: list[int] = []
    faked.setattr(pinning, "pin_copy", trips_once(MemoryError, tripped))
    dl = loader(workers)
    it = iter(dl)
    got: list[Any] = []
    while True:
        try:
            got.append(next(it))
        except MemoryError:
            assert len(got) == TRIP
            state = dl.state_dict()
            assert state["delivered"] == [[0, TRIP + 1]] and state["yielded"] == TRIP + 1
        except StopIteration:
            break
    assert tripped
    assert firsts(got) == want[:TRIP] + want[TRIP + 1:]
    dl.close()
