"""A Ctrl-C (``KeyboardInterrupt``) or ``SystemExit`` raised while ``num_workers=0`` fetches or
collates a batch is not that batch's error: the batch was never handed out, so a state saved then
has it undelivered, and a resume fetches it. A caller that catches the interrupt and goes on
iterating gets that batch from the next ``next()``, as torch's multi-process iterator hands it
over once its worker is done: every batch is delivered exactly once, the epoch is the
uninterrupted one, and a state saved later has no gap where the interrupted batch was
(shmloader/engine/iterator.py, docs/resume.md "An interrupted batch").
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest

import shmloader
from shmloader.collate import default_collate

N, BATCH = 14, 2  # 7 tasks per epoch
TRIP = 7  # the sample that is interrupted once: the second of its batch (a stream has taken the first)
INTERRUPTS = [KeyboardInterrupt, SystemExit]


class Tripwire:
    """Raises ``kind`` the first time it is stepped on at ``TRIP``, never again."""

    def __init__(self, kind: type[BaseException] | None) -> None:
        self.kind = kind

    def step(self, at: int) -> None:
        if self.kind is not None and at == TRIP:
            kind, self.kind = self.kind, None
            raise kind()


def _sample(i: int) -> np.ndarray:
    """Sample i: [i, a draw from numpy's global RNG] (a random augmentation)."""
    return np.array([i, np.random.randint(1 << 30)], dtype=np.int64)


class Samples(shmloader.Dataset):
    """Sample i is ``_sample(i)``; fetching sample ``TRIP`` is interrupted once."""

    def __init__(self, trip: Tripwire) -> None:
        self.trip = trip

    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int) -> np.ndarray:
        self.trip.step(i)
        return _sample(i)


class Stream(shmloader.IterableDataset):
    """Items 0..N-1 from an iterator (not a generator: an interrupt does not end it) that is
    interrupted once, before it yields item ``TRIP``: mid-batch, after item ``TRIP - 1``."""

    def __init__(self, trip: Tripwire) -> None:
        self.trip = trip

    def __iter__(self) -> Iterator[np.ndarray]:
        return _Items(self.trip)


class _Items:
    def __init__(self, trip: Tripwire) -> None:
        self.trip, self.next_item = trip, 0

    def __iter__(self) -> _Items:
        return self

    def __next__(self) -> np.ndarray:
        if self.next_item == N:
            raise StopIteration
        self.trip.step(self.next_item)
        self.next_item += 1
        return _sample(self.next_item - 1)


class TrippingCollate:
    """default_collate, interrupted once, collating the batch that holds sample ``TRIP``."""

    def __init__(self, trip: Tripwire) -> None:
        self.trip = trip

    def __call__(self, samples: list[Any]) -> Any:
        for sample in samples:
            self.trip.step(int(sample[0]))
        return default_collate(samples)


def _loader(where: str, kind: type[BaseException] | None) -> shmloader.DataLoader:
    """Per-task seeding: an uninterrupted epoch's augmentation is the same run after run."""
    trip = Tripwire(kind)
    quiet = Tripwire(None)
    dataset: Samples | Stream
    collate_fn: Callable[[Any], Any]
    if where == "collate":
        dataset, collate_fn = Samples(quiet), TrippingCollate(trip)
    elif where == "stream":
        dataset, collate_fn = Stream(trip), default_collate
    elif where == "stream_collate":
        dataset, collate_fn = Stream(quiet), TrippingCollate(trip)
    else:
        return shmloader.DataLoader(Samples(trip), batch_size=BATCH, shuffle=where == "shuffled", generator=7,
                                    task_seeding=True)
    return shmloader.DataLoader(dataset, batch_size=BATCH, collate_fn=collate_fn, generator=7, task_seeding=True)


def _run(source: Any, kind: type[BaseException], save_at: int) -> tuple[list[Any], list[dict]]:
    """Iterate ``source`` (a loader or ``to_device`` of one), catching ``kind`` and going on;
    returns the batches and its states saved right after the interrupt and after ``save_at`` batches."""
    batches: list[Any] = []
    states: list[dict] = []
    it = iter(source)
    while True:
        try:
            batch = next(it)
        except StopIteration:
            return batches, states
        except kind:
            states.append(json.loads(json.dumps(source.state_dict())))
            continue
        batches.append(np.asarray(batch).tolist())
        if len(batches) == save_at:
            states.append(json.loads(json.dumps(source.state_dict())))


def _interrupted_batch(batches: list[Any]) -> int:
    """The position of the batch that holds sample ``TRIP``."""
    return next(k for k, batch in enumerate(batches) if any(row[0] == TRIP for row in batch))


def _resumed(where: str, state: dict) -> list[Any]:
    loader = _loader(where, None)
    loader.load_state_dict(state)
    return [np.asarray(b).tolist() for b in loader]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("where", ["sequential", "shuffled", "collate", "stream", "stream_collate"])
@pytest.mark.parametrize("kind", INTERRUPTS, ids=lambda k: k.__name__)
def test_an_interrupted_batch_comes_from_the_next_next_and_the_state_has_no_gap(
        where: str, kind: type[BaseException]) -> None:
    uninterrupted = [np.asarray(b).tolist() for b in _loader(where, None)]
    done = _interrupted_batch(uninterrupted)  # handed out before the interrupted one
    save_at = done + 2  # two batches past the interrupted one
    batches, (at_interrupt, later) = _run(_loader(where, kind), kind, save_at)
    assert batches == uninterrupted  # nothing lost, nothing twice, each with its own augmentation
    assert at_interrupt["yielded"] == done
    if not where.startswith("stream"):
        assert at_interrupt["delivered"] == ([[0, done]] if done else [])
    assert _resumed(where, at_interrupt) == uninterrupted[done:]  # the user never got it: a resume makes it
    assert later["yielded"] == save_at
    if not where.startswith("stream"):
        assert later["delivered"] == [[0, save_at]]  # one range: no gap left where the interrupt was
    assert _resumed(where, later) == uninterrupted[save_at:]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", INTERRUPTS, ids=lambda k: k.__name__)
def test_an_interrupt_while_to_device_reads_ahead_loses_no_batch(kind: type[BaseException]) -> None:
    """``to_device`` reads batch k+1 while handing out batch k: an interrupt in that read comes
    before batch k reaches the caller, so batch k is neither lost (the next ``next()`` returns it)
    nor counted in ``moved.state_dict()`` (a resume from the state saved then makes it)."""
    from shmloader.gpu.fake import FakeBackend

    uninterrupted = [np.asarray(b).tolist() for b in _loader("sequential", None)]
    done = _interrupted_batch(uninterrupted) - 1  # received before the interrupt
    moved = shmloader.to_device(_loader("sequential", kind), "cpu", transfer=FakeBackend(auto_complete=True))
    batches, (at_interrupt, later) = _run(moved, kind, done + 2)
    assert batches == uninterrupted
    assert at_interrupt["delivered"] == [[0, done]] and at_interrupt["yielded"] == done
    assert _resumed("sequential", at_interrupt) == uninterrupted[done:]
    assert later["delivered"] == [[0, done + 2]]
    assert _resumed("sequential", later) == uninterrupted[done + 2:]


@pytest.mark.timeout(60)
def test_an_interrupt_while_the_batch_is_pinned_loses_no_batch(monkeypatch: pytest.MonkeyPatch) -> None:
    """``pin_memory=True`` without workers copies each batch into pinned memory (where an
    accelerator is): the last step before the caller gets it, so an interrupt there leaves the
    batch undelivered and the next ``next()`` makes it again."""
    from shmloader.gpu import pinning

    trip = Tripwire(KeyboardInterrupt)
    pinned: list[Any] = []

    def pin_copy(batch: Any) -> Any:
        trip.step(int(np.asarray(batch)[-1, 0]))  # the batch that ends with sample TRIP
        pinned.append(batch)
        return batch

    monkeypatch.setattr(pinning, "accelerator_available", lambda: True)
    monkeypatch.setattr(pinning, "warn_if_unpinned", lambda loader: None)
    monkeypatch.setattr(pinning, "pin_copy", pin_copy)
    uninterrupted = [np.asarray(b).tolist() for b in _loader("sequential", None)]
    loader = _loader("sequential", None)
    loader.pin_memory = True
    batches, (at_interrupt, later) = _run(loader, KeyboardInterrupt, _interrupted_batch(uninterrupted) + 2)
    assert batches == uninterrupted and len(pinned) == len(uninterrupted)
    assert at_interrupt["delivered"] == [[0, _interrupted_batch(uninterrupted)]]
    assert later["delivered"] == [[0, _interrupted_batch(uninterrupted) + 2]]
