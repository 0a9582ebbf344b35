"""What an iterator does after a fault it raised: it says so, never ends the epoch quietly.

A fault (a worker's death, a hang, no shared memory, a Ctrl-C) shuts the iterator's workers down:
the batches it had not handed out are gone. A caller that catches the error and keeps calling
``next()`` (a loop that skips a bad batch, as the engine allows for a dataset's own errors) used to
get ``StopIteration`` there: the epoch ended early and quietly, the rest of its batches lost. Such a
``next()`` now raises ``LoaderError`` naming the fault, as ``next()`` after ``close()`` raises
``LoaderClosed``; ``iter(loader)`` starts afresh (``iter()`` on the device prefetcher, for its user).
"""

from __future__ import annotations

from typing import Any

import fault_datasets as fd
import pytest

from shmloader import DataLoader, LoaderError, WorkerDied, to_device
from shmloader.errors import LoaderClosed


def _loader(**kw: Any) -> DataLoader:
    return DataLoader(fd.FaultyDataset(16, "getitem", "kill", at=5), batch_size=2, num_workers=2,
                      multiprocessing_context="fork", **kw)


def _next_after_the_fault(it: Any, start_over: str = "iter(loader)") -> None:
    """Read up to the worker's death (batches before it arrive), then call next() once more: the
    error names ``start_over``, the call that starts a new epoch."""
    with pytest.raises(WorkerDied):
        for _ in range(8):
            next(it)
    with pytest.raises(LoaderError, match=r"stopped at an earlier error \(WorkerDied: DataLoader worker "
                                          r"\(pid \d+\) (is killed by signal|exited unexpectedly)") as info:
        next(it)
    assert not isinstance(info.value, LoaderClosed)
    assert str(info.value).endswith(f"Start a new epoch with {start_over}."), str(info.value)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("persistent", [False, True])
def test_next_after_a_fault_raises_instead_of_ending_the_epoch_quietly(persistent: bool) -> None:
    loader = _loader(persistent_workers=persistent)
    with loader:
        it = iter(loader)
        _next_after_the_fault(it)
        with pytest.raises(LoaderError, match="stopped at an earlier error"):  # again: it stays so
            next(it)


@pytest.mark.timeout(30)
def test_a_device_prefetcher_after_a_fault_raises_too() -> None:
    pytest.importorskip("torch")  # to_device makes tensors of the numpy batches
    with _loader() as loader:
        _next_after_the_fault(iter(to_device(loader, "cpu")), "iter() on the to_device() prefetcher")

