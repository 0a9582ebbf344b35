"""Samplers under adversity, numpy flavour (no torch needed): a sampler that raises while a
persistent iterator starts its next epoch.

Each test is one that failed before its fix.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

import shmloader
from ownership_datasets import Indices as Indexed


class RaisesInPass:
    """``range(n)`` each pass, but pass ``bad_pass`` (counted from 1) raises before index ``at``."""

    def __init__(self, n: int, bad_pass: int, at: int) -> None:
        self.n, self.bad_pass, self.at, self.passes = n, bad_pass, at, 0

    def __iter__(self) -> Iterator[int]:
        self.passes += 1
        for i in range(self.n):
            if self.passes == self.bad_pass and i == self.at:
                raise KeyError(f"sampler broke at index {i}")
            yield i

    def __len__(self) -> int:
        return self.n


def _firsts(loader: shmloader.DataLoader) -> list[int]:
    return [int(b[0][0]) for b in loader]


@pytest.mark.timeout(60)
def test_a_sampler_raising_as_a_persistent_epoch_starts_leaves_the_next_epoch_whole() -> None:
    # epoch 2's sampler raises while iter() sends its first tasks (index 7: the 4th batch of 2):
    # tasks 0-2 of that aborted epoch were already with the workers
    sampler = RaisesInPass(12, bad_pass=2, at=7)
    loader: shmloader.DataLoader[Any] = shmloader.DataLoader(Indexed(12), batch_size=2, sampler=sampler,
                                                             num_workers=2, persistent_workers=True)
    with loader:
        assert _firsts(loader) == [0, 2, 4, 6, 8, 10]
        with pytest.raises(KeyError, match="sampler broke at index 7"):
            _firsts(loader)
        # the failed start took the workers (and their base seed) with it: the next iter() draws one
        assert loader.state_dict()["base_seed"] is None
        assert _firsts(loader) == [0, 2, 4, 6, 8, 10]  # was: ValueError "task 0 already has an outcome"
        assert _firsts(loader) == [0, 2, 4, 6, 8, 10]
