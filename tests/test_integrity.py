"""What a worker delivers is what the same collate gives in the main process: layout (strides,
memory order), values and object identity, for arrays and tensors a ``collate_fn`` or a collate
rule returns, in the slot or not. Each case compares ``num_workers=0`` with a worker, bit for bit."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import shmloader
from shmloader.collate import register_collate_rule, unregister_collate_rule


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


# --------------------------------------------------------------- what a collate rule returns

class Item:
    """A sample type that only a registered collate rule knows."""

    def __init__(self, v: int) -> None:
        self.v = v


class Items(Indices):
    def __getitem__(self, i: int) -> Item:
        return Item(i)


def _in_slot_values(batch: list[Item], ctx: Any, dtype: Any = np.int64) -> np.ndarray:
    out = ctx.alloc((len(batch),), np.dtype(dtype))
    out[:] = [item.v for item in batch]
    return out


def repeated_rule(batch: list[Item], ctx: Any) -> list[np.ndarray]:
    out = _in_slot_values(batch, ctx)
    return [out, out, out[::-1]]


@pytest.fixture
def rule(request: pytest.FixtureRequest) -> Any:
    register_collate_rule(Item, request.param)
    yield request.param
    unregister_collate_rule(Item)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("rule", [repeated_rule], indirect=True)
def test_an_in_slot_array_held_twice_arrives_as_one_object(rule: Any) -> None:
    """A list of in-slot arrays (the flat descriptor) that holds one array twice arrived as two
    objects; pickle, the in-process batch and torch's workers give one."""
    ref, got = _both(None, Items())
    for r, g in zip(ref, got):
        assert r[0] is r[1] and g[0] is g[1] and g[0] is not g[2]
        for a, b in zip(r, g):
            _assert_same_array(a, b)
