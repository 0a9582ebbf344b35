"""What a worker delivers is what the same collate gives in the main process: layout (strides,
memory order), values and object identity, for arrays and tensors a ``collate_fn`` or a collate
rule returns, in the slot or not. Each case compares ``num_workers=0`` with a worker, bit for bit."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import shmloader


class Indices:
    """A map-style dataset of its indices."""

    def __len__(self) -> int:
        return 4

    def __getitem__(self, i: int) -> int:
        return i


def _both(collate_fn: Any, dataset: Any = None) -> tuple[list[Any], list[Any]]:
    """The batches of ``num_workers=0`` and of one worker, for the same collate."""
    dataset = Indices() if dataset is None else dataset
    return tuple(list(shmloader.DataLoader(dataset, batch_size=2, num_workers=n, collate_fn=collate_fn))
                 for n in (0, 1))  # type: ignore[return-value]


def _assert_same_array(a: np.ndarray, b: np.ndarray) -> None:
    assert (type(a), a.dtype, a.shape, a.strides) == (type(b), b.dtype, b.shape, b.strides)
    assert a.tobytes(order="A") == b.tobytes(order="A")


# ------------------------------------------------------------------ numpy arrays a collate_fn makes

def fortran_batch(indices: list[int]) -> list[np.ndarray]:
    x = np.arange(24, dtype=np.float64).reshape(4, 6) + sum(indices)
    return [np.asfortranarray(x), x.T, x]


@pytest.mark.timeout(60)
def test_fortran_ordered_arrays_keep_their_order() -> None:
    """A Fortran-ordered array from a collate_fn arrived C-ordered (strides (48, 8) for (8, 32));
    pickle, and so torch's workers, keep the order."""
    ref, got = _both(fortran_batch)
    for r, g in zip(ref, got):
        for a, b in zip(r, g):
            _assert_same_array(a, b)
        assert g[0].flags.f_contiguous and g[1].flags.f_contiguous
