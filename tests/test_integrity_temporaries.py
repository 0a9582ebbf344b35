"""An object that pickles through an array or tensor it makes on the fly (``__getstate__`` that
returns a fresh one) arrives with its own values: the codec's "held again" record (``("=", n)``)
is keyed by object id, and an id is only unique while its object lives."""

from __future__ import annotations

import ctypes
import mmap
from typing import Any

import numpy as np
import pytest

import shmloader
from shmloader.transport import codec
from shmloader.transport.alloc import SlotAllocator


class Fresh:
    """Pickles as a new float64 array of its values each time (bare state, not memoized by pickle)."""

    def __init__(self, values: Any) -> None:
        self.values = values

    def __getstate__(self) -> np.ndarray:
        return np.array(self.values, dtype=np.float64)

    def __setstate__(self, state: np.ndarray) -> None:
        self.values = state


class FreshTensor(Fresh):
    def __getstate__(self) -> Any:
        import torch

        return torch.tensor(self.values, dtype=torch.float64)


def _round_trip(batch: Any, size_bytes: int = 1 << 16) -> Any:
    m = mmap.mmap(-1, size_bytes)
    payload, _ = codec.encode(batch, SlotAllocator(m, size_bytes))
    buf = (ctypes.c_char * size_bytes).from_buffer(m)
    return codec.decode(payload, buf, size_bytes)[0]


@pytest.mark.parametrize("kind", [Fresh, FreshTensor])
def test_arrays_made_while_pickling_are_not_taken_for_one_another(kind: type) -> None:
    """Each ``Fresh`` arrived with the first one's values: its temporary array was freed once
    pickled, the next one took its id, and the codec described it as the same object again."""
    if kind is FreshTensor:
        pytest.importorskip("torch")
    got = _round_trip([kind([1.0, 2.0]), kind([3.0, 4.0]), kind([5.0, 6.0])])
    assert [list(map(float, g.values)) for g in got] == [[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]]


def test_measure_counts_every_array_made_while_pickling() -> None:
    """``measure`` (the slot size a retry asks for) counted a temporary array once for all."""
    batch = [Fresh(np.zeros(1000)) for _ in range(4)]
    assert codec.measure(batch) >= 4 * 8000


class Samples:
    def __len__(self) -> int:
        return 4

    def __getitem__(self, i: int) -> Fresh:
        return Fresh([float(i), float(i) + 0.5])


def keep(samples: list[Fresh]) -> list[Fresh]:
    return samples


@pytest.mark.timeout(60)
@pytest.mark.parametrize("num_workers", [0, 1, 2])
def test_a_batch_of_such_objects_through_workers(num_workers: int) -> None:
    loader: shmloader.DataLoader[Any] = shmloader.DataLoader(Samples(), batch_size=4, num_workers=num_workers,
                                                             collate_fn=keep)
    (batch,) = list(loader)
    assert [list(map(float, s.values)) for s in batch] == [[i, i + 0.5] for i in range(4)]
