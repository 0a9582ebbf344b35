"""What a timeout tells a user who drives the loader through the device prefetcher.

``to_device(loader, device)`` calls ``next()`` and ``iter(loader)`` itself: its user calls
``next()`` on the prefetcher's iterator and starts an epoch with ``iter()`` on the prefetcher.
The errors that say what to do after a ``timeout=`` used to name ``next()`` and ``iter(loader)``
whoever drove the loader: followed through the prefetcher, ``iter(loader)`` gives host batches,
not device ones. They name the prefetcher's calls now, and the loader's own when it is iterated
directly again. The fake backend stands in for the device (CPU only); the slow sample is a gate the
test opens (timeout_datasets.py), nothing sleeps to wait.
"""

from __future__ import annotations

from typing import Any

import pytest
import timeout_datasets as td
from iter_helpers import mp_iter
from process_helpers import workers_left

import shmloader
from shmloader import DataLoader, LoaderError, WorkerTimeout
from shmloader.gpu.fake import FakeBackend

TIMEOUT_S = 1.0
MAP_ORDER = [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9], [10, 11]]
PREFETCHER_NEXT = "next() on the to_device() iterator"
PREFETCHER_EPOCH = "iter() on the to_device() prefetcher"


def _on_device(loader: DataLoader) -> Any:
    fake = FakeBackend()
    fake.auto_complete = True
    return shmloader.to_device(loader, "cpu", transfer=fake)


def _loader(dataset: Any, persistent: bool) -> DataLoader:
    return DataLoader(dataset, batch_size=2, num_workers=2, timeout=TIMEOUT_S, persistent_workers=persistent,
                      multiprocessing_context="fork")


def _indices(batches: Any) -> list[list[int]]:
    return [indices.tolist() for indices, _ in batches]


@pytest.mark.timeout(60)
def test_a_kept_timeout_through_the_prefetcher_names_the_prefetchers_calls(tmp_path: Any) -> None:
    gate = td.Gate(str(tmp_path), once=False)
    with _loader(td.SlowAt(gate, at=5), persistent=True) as loader:
        it = iter(_on_device(loader))
        got = _indices([next(it), next(it)])
        with pytest.raises(WorkerTimeout, match=r"^DataLoader timed out after") as info:
            next(it)
        text = str(info.value)
        assert f"{PREFETCHER_NEXT} waits for this batch again, and {PREFETCHER_EPOCH} starts the next epoch" \
            in text, text
        assert "iter(loader)" not in text, text
        td.release(str(tmp_path))
        assert got + _indices(it) == MAP_ORDER  # the advice holds: next() on it goes on with the epoch
        assert _indices(iter(_on_device(loader))) == MAP_ORDER
        direct = mp_iter(iter(loader))  # the loader iterated directly: its own calls again
        assert direct.caller.next == "next()" and direct.caller.epoch == "iter(loader)"
        assert _indices(direct) == MAP_ORDER
    assert workers_left() == []


@pytest.mark.timeout(60)
def test_after_a_timeout_through_the_prefetcher_the_next_call_says_to_start_over_on_it(tmp_path: Any) -> None:
    gate = td.Gate(str(tmp_path), once=True)  # slow once: new workers are not
    with _loader(td.SlowAt(gate, at=5), persistent=False) as loader:
        moved = _on_device(loader)
        it = iter(moved)
        next(it), next(it)
        with pytest.raises(WorkerTimeout):
            next(it)
        with pytest.raises(LoaderError, match=r"stopped at an earlier error \(WorkerTimeout") as info:
            next(it)
        assert str(info.value).endswith(f"Start a new epoch with {PREFETCHER_EPOCH}."), str(info.value)
        td.release(str(tmp_path))
        assert _indices(iter(moved)) == MAP_ORDER  # the advice holds
    assert workers_left() == []
