"""Per-type caches keep a bounded number of types alive, however many sample types go by.

The collate rule found for each sample type, the role of each container type in a batch walked by
``to_device``, are cached by type so that the next batch skips the lookup. A cache that keeps every
type it ever saw keeps each type alive for the life of the process: a dataset that makes its
sample class at run time (a ``namedtuple`` per dataset, per config, per epoch) grew the main
process by a class, its methods and its namespace per type, for ever (torch's ``default_collate``
keeps nothing between calls). These tests let a few hundred fresh types go by and count how many
are still alive: at most a cache's bound, never all of them.
"""

from __future__ import annotations

import collections
import gc
import weakref
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

import shmloader
from shmloader import DataLoader, Dataset
from shmloader.caches import CACHE_LIMIT

_TYPES = 3 * CACHE_LIMIT  # fresh sample types gone by: all alive if a cache keeps every one
_namedtuple: Any = collections.namedtuple  # called with names made at run time, as the datasets here do


class FreshTypes(Dataset):
    """Sample ``i`` is a namedtuple of a class made for its batch (``i // 2``), noted in ``made``."""

    def __init__(self, batches: int) -> None:
        self.batches = batches
        self.made: list[weakref.ref[type]] = []
        self._current: Any = None

    def __len__(self) -> int:
        return 2 * self.batches

    def __getitem__(self, i: int) -> Any:
        if i % 2 == 0:
            self._current = _namedtuple(f"Sample{i // 2}", ["x", "y"])
            self.made.append(weakref.ref(self._current))
        assert self._current is not None
        return self._current(np.full(3, i, dtype=np.float32), i)


def _alive(made: list[weakref.ref[type]]) -> int:
    gc.collect()
    return sum(ref() is not None for ref in made)


@pytest.mark.parametrize("torch_flavour", [False, True])
def test_collating_fresh_sample_types_keeps_a_bounded_number_alive(torch_flavour: bool) -> None:
    loader_class: Any = DataLoader
    if torch_flavour:
        pytest.importorskip("torch")
        import shmloader.torch

        loader_class = shmloader.torch.DataLoader
    dataset = FreshTypes(_TYPES)
    with loader_class(dataset, batch_size=2, num_workers=0) as loader:
        for batch in loader:
            assert int(batch.y[1]) == int(batch.y[0]) + 1
        del batch
    assert len(dataset.made) == _TYPES
    assert _alive(dataset.made) <= CACHE_LIMIT + 2, "the collate rule cache keeps every sample type"


def _batches(made: list[weakref.ref[type]]) -> Iterator[Any]:
    """Batches each of a container class made for it."""
    for k in range(_TYPES):
        kind = _namedtuple(f"Batch{k}", ["x"])
        made.append(weakref.ref(kind))
        yield kind(np.full(4, k, dtype=np.float32))
        del kind


def test_moving_batches_of_fresh_container_types_keeps_a_bounded_number_alive() -> None:
    from shmloader.gpu.fake import FakeBackend

    made: list[weakref.ref[type]] = []
    moved = shmloader.to_device(_batches(made), "cpu", transfer=FakeBackend(auto_complete=True))
    seen = 0
    for batch in moved:
        assert float(np.asarray(batch.x)[0]) == seen
        seen += 1
    del batch, moved
    assert seen == _TYPES
    assert _alive(made) <= CACHE_LIMIT + 2, "the batch walk's role cache keeps every container type"
