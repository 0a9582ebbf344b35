"""Python ints that do not fit int64 are refused by the numpy flavour as torch refuses them.

torch's ``default_collate`` makes a batch of Python ints with ``torch.tensor(batch)`` and raises
``ValueError: Overflow when unpacking long long`` when one is outside int64. The numpy flavour
promises an int64 array for a batch of ints; numpy alone would make a uint64 array
(``[2**63, 2**63]``), a float64 array that rounds the values (``[2**63 + 1, 1]``), or an object
array (``[2**70, 1]``). Found by tests/test_fuzz_torch_diff.py.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from parity_helpers import ListDataset

import shmloader

OUT_OF_RANGE = [
    [2**63 + 1, 1],
    [1, 2**63],
    [2**63, 2**63],
    [True, 2**63],
    [-(2**63) - 1, 0],
    [2**70, 1],
]


@pytest.mark.parametrize("batch", OUT_OF_RANGE, ids=str)
def test_ints_outside_int64_raise_torchs_value_error(batch: list[int]) -> None:
    with pytest.raises(ValueError, match=r"^Overflow when unpacking long long \(at batch\['n'\]"):
        shmloader.default_collate([{"n": value} for value in batch])


def test_the_bounds_of_int64_collate_to_int64() -> None:
    out = shmloader.default_collate([2**63 - 1, -(2**63), True])
    assert out.dtype == np.int64 and out.tolist() == [2**63 - 1, -(2**63), 1]


def test_torch_raises_the_same_type() -> None:
    torch = pytest.importorskip("torch")
    for batch in OUT_OF_RANGE:
        with pytest.raises(ValueError, match="Overflow when unpacking long long"):
            torch.utils.data.default_collate(batch)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("num_workers", [0, 1])
def test_the_loader_raises_it(num_workers: int) -> None:
    loader: shmloader.DataLoader[Any]
    with shmloader.DataLoader(ListDataset([1, 2**63 + 1]), batch_size=2, num_workers=num_workers) as loader:
        with pytest.raises(ValueError, match="Overflow when unpacking long long"):
            next(iter(loader))


@pytest.mark.parametrize("batch", [[np.int64(1), 2**63], [np.int8(1), 2**63], [np.uint8(1), -(2**63) - 1]], ids=str)
def test_a_numpy_integer_first_with_a_python_int_outside_int64_raises_as_torch(batch: list) -> None:
    """torch makes such a batch with ``torch.as_tensor``: the same ValueError. numpy alone rounded
    the values into a float64 array, or made an object array."""
    with pytest.raises(ValueError, match=r"^Overflow when unpacking long long \(at batch"):
        shmloader.default_collate(batch)


def test_a_numpy_integer_first_with_python_ints_inside_int64_stays_exact() -> None:
    out = shmloader.default_collate([np.int64(1), 2**62])
    assert out.dtype == np.int64 and out.tolist() == [1, 2**62]
