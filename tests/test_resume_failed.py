"""A batch whose error was raised in its place (its dataset or collate failed, the caller went on,
as torch allows) has been handed out: an uninterrupted epoch does not fetch it again, so a resume
does not either, and the saved state stays a few ranges (shmloader/engine/iterator.py).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from test_resume import quiet

import shmloader

N, BATCH = 23, 3  # 8 tasks per epoch
BAD = 1  # the sample that fails: in the first batch of an unshuffled epoch


class FailsAt(shmloader.Dataset):
    """Sample i is [i, a per-task-seeded draw]; sample ``BAD`` raises KeyError."""

    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int) -> np.ndarray:
        if i == BAD:
            raise KeyError(f"bad sample {i}")
        return np.array([i, np.random.randint(1 << 30)], dtype=np.int64)


class FlakyStream(shmloader.IterableDataset):
    """Items [i, draw], sharded across workers; item ``BAD`` raises KeyError and the stream goes on."""

    def __iter__(self) -> Iterator[np.ndarray]:
        info = shmloader.get_worker_info()
        first, step = (0, 1) if info is None else (info.id, info.num_workers)
        return _Flaky(iter(range(first, N, step)))


class _Flaky:
    def __init__(self, items: Iterator[int]) -> None:
        self.items = items

    def __iter__(self) -> _Flaky:
        return self

    def __next__(self) -> np.ndarray:
        i = next(self.items)
        if i == BAD:
            raise KeyError(f"bad item {i}")
        return np.array([i, np.random.randint(1 << 30)], dtype=np.int64)


def _loader(workers: int, iterable: bool = False) -> shmloader.DataLoader:
    extra = {"multiprocessing_context": "fork"} if workers else {}
    dataset = FlakyStream() if iterable else FailsAt()
    return shmloader.DataLoader(dataset, batch_size=BATCH, num_workers=workers, generator=7, task_seeding=True,
                                **extra)


def handed_out(it: Any, limit: int | None = None) -> list[Any]:
    """Batches as lists, and "error" for each batch whose KeyError was raised in its place."""
    out: list[Any] = []
    while limit is None or len(out) < limit:
        try:
            out.append(np.asarray(next(it)).tolist())
        except StopIteration:
            break
        except KeyError:
            out.append("error")
    return out


def _save_and_resume(workers: tuple[int, int], k: int, iterable: bool) -> tuple[list[Any], dict[str, Any], list[Any]]:
    with quiet():
        loader = _loader(workers[0], iterable)
        it = iter(loader)
        before = handed_out(it, k)
        state = json.loads(json.dumps(loader.state_dict()))
        loader.close()
        del it
        resumed = _loader(workers[1], iterable)
        resumed.load_state_dict(state)
        after = handed_out(iter(resumed))
        resumed.close()
    return before, state, after


@pytest.mark.timeout(120)
@pytest.mark.parametrize("workers", [(0, 2), (2, 0)])
def test_a_failed_batch_counts_as_delivered_and_is_not_fetched_again(workers: tuple[int, int]) -> None:
    with quiet():
        reference = handed_out(iter(_loader(0)))
    assert reference[0] == "error" and len(reference) == -(-N // BATCH)
    before, state, after = _save_and_resume(workers, 3, iterable=False)
    assert before == reference[:3]
    assert state["delivered"] == [[0, 3]] and state["yielded"] == 3  # compact: the failure is not a hole
    assert after == reference[3:]  # neither fetched nor raised again


@pytest.mark.timeout(60)
def test_the_delivered_set_stays_compact_after_a_failure() -> None:
    loader = _loader(0)
    it = iter(loader)
    assert handed_out(it)[0] == "error"
    record = loader._book.record
    assert record is not None
    assert record.delivered.to_ranges() == [[0, -(-N // BATCH)]] and not record.delivered.above


@pytest.mark.timeout(120)
@pytest.mark.parametrize("workers", [0, 2])
def test_an_iterable_datasets_failed_batch_is_fast_forwarded_over(workers: int) -> None:
    with quiet():
        loader = _loader(workers, iterable=True)
        reference = handed_out(iter(loader))
        loader.close()
    failed = reference.index("error")
    before, state, after = _save_and_resume((workers, workers), failed + 2, iterable=True)
    assert before == reference[:failed + 2] and state["yielded"] == failed + 2
    assert after == reference[failed + 2:]  # made again and dropped, the failure too: not raised again


class FailsAtSample(FailsAt):
    def __init__(self, bad: int) -> None:
        self.bad = bad

    def __getitem__(self, i: int) -> np.ndarray:
        if i == self.bad:
            raise KeyError(f"bad sample {i}")
        return np.array([i, np.random.randint(1 << 30)], dtype=np.int64)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("bad", [BAD, 7], ids=["first-batch", "read-ahead"])
def test_a_failed_batch_through_to_device_counts_as_delivered(workers: int, bad: int) -> None:
    """``to_device``'s state_dict() (what docs/resume.md says to save) right after a batch's error
    was raised: that batch is delivered, whether its read failed with nothing before it (the first
    batch) or while the batch before it was in the caller's hands (read ahead, raised later)."""
    pytest.importorskip("torch")

    def loader() -> shmloader.DataLoader:
        extra = {"multiprocessing_context": "fork"} if workers else {}
        return shmloader.DataLoader(FailsAtSample(bad), batch_size=BATCH, num_workers=workers, generator=7,
                                    task_seeding=True, **extra)

    with quiet():
        reference = handed_out(iter(loader()))
        failed = reference.index("error")
        source = loader()
        moved = shmloader.to_device(source, "cpu")
        it = iter(moved)
        before = handed_out(it, failed + 1)
        state = json.loads(json.dumps(moved.state_dict()))
        del it
        source.close()
        resumed = loader()
        resumed.load_state_dict(state)
        after = handed_out(iter(resumed))
        resumed.close()
    assert before == reference[:failed + 1]
    assert state["delivered"] == [[0, failed + 1]] and state["yielded"] == failed + 1
    assert after == reference[failed + 1:]
