"""Without workers, a batch's error names its sample indices too (a note, its type and message kept).

The defect: with ``num_workers=0`` a dataset's or collate's error came out exactly as raised, naming
no sample (torch's does the same), while a worker's error names its task and sample indices. The
batch's error now carries a note (``__notes__``, printed by Python 3.11+ after the message) naming
the batch and its sample indices; its type, message and traceback are the dataset's own, as torch's.
"""

from __future__ import annotations

import sys
import traceback
from typing import Any

import numpy as np
import pytest

from shmloader import DataLoader
from shmloader.collate import CollateShapeError


class _Bad:
    """Sample 5 raises; sample 3 has another shape than the others."""

    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int) -> np.ndarray:
        if i == 5:
            raise ValueError("bad sample")
        return np.zeros(4 if i == 3 else 3)


def _error(sampler: list[int], batch_size: int | None = 2) -> BaseException:
    loader: DataLoader[Any] = DataLoader(_Bad(), batch_size=batch_size, sampler=sampler)
    with pytest.raises(Exception) as info:
        list(loader)
    return info.value


def test_a_getitem_error_names_the_batch_and_its_samples() -> None:
    error = _error([0, 1, 4, 5])
    assert type(error) is ValueError and str(error) == "bad sample"
    assert getattr(error, "__notes__", None) == [
        "while loading batch 1 (sample indices [4..5]) in the main process (num_workers=0)"]
    if sys.version_info >= (3, 11):
        assert "sample indices [4..5]" in "".join(traceback.format_exception(error))


def test_a_collate_error_names_the_samples_and_a_lone_sample_its_index() -> None:
    error = _error([2, 3])
    assert isinstance(error, CollateShapeError)
    assert getattr(error, "__notes__", None) == [
        "while loading batch 0 (sample indices [2..3]) in the main process (num_workers=0)"]
    error = _error([1, 5], batch_size=None)
    assert getattr(error, "__notes__", None) == [
        "while loading batch 1 (sample indices [5]) in the main process (num_workers=0)"]


class _BadStream:
    """An iterable dataset whose third sample raises."""

    def __iter__(self) -> Any:
        for i in range(6):
            if i == 2:
                raise ValueError("bad stream sample")
            yield np.zeros(3)


def test_an_iterable_datasets_error_names_the_batch() -> None:
    from shmloader.datasets import IterableDataset

    class Stream(_BadStream, IterableDataset):
        pass

    loader: DataLoader[Any] = DataLoader(Stream(), batch_size=2)
    with pytest.raises(ValueError, match="bad stream sample") as info:
        list(loader)
    assert getattr(info.value, "__notes__", None) == [
        "while loading batch 1 of the iterable dataset in the main process (num_workers=0)"]
