"""Samplers under adversity, numpy flavour (no torch needed): a sampler that raises while a
persistent iterator starts its next epoch, and the epoch of a ``DistributedSampler`` saved and
resumed wherever it sits (as the loader's sampler or inside its batch sampler).

Each test is one that failed before its fix; torch-side parity of the same areas is in
tests/test_adv_samplers_torch.py.
"""

from __future__ import annotations

import json
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


def _distributed(epoch: int | None) -> shmloader.DistributedSampler:
    sampler = shmloader.DistributedSampler(Indexed(23), num_replicas=2, rank=1, shuffle=True, seed=3)
    if epoch is not None:
        sampler.set_epoch(epoch)
    return sampler


@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.timeout(60)
def test_a_distributed_sampler_inside_a_batch_sampler_resumes_its_epoch(num_workers: int) -> None:
    def make(epoch: int | None) -> shmloader.DataLoader:
        batches = shmloader.BatchSampler(_distributed(epoch), 2, drop_last=False)
        return shmloader.DataLoader(Indexed(23), batch_sampler=batches, num_workers=num_workers)

    uninterrupted = [b.tolist() for b in make(5)]
    saving = make(5)
    it = iter(saving)
    before = [next(it).tolist() for _ in range(2)]
    state = json.loads(json.dumps(saving.state_dict()))
    saving.close()
    resumed = make(None)  # a fresh sampler at epoch 0: the state must say epoch 5
    resumed.load_state_dict(state)
    batches: Any = resumed.batch_sampler
    assert batches.sampler.epoch == 5
    assert before + [b.tolist() for b in resumed] == uninterrupted  # was: batches of epoch 0, some twice


def test_a_batch_samplers_distributed_sampler_refuses_another_ranks_state() -> None:
    def make(rank: int) -> shmloader.DataLoader:
        sampler = shmloader.DistributedSampler(Indexed(23), num_replicas=2, rank=rank, seed=3)
        return shmloader.DataLoader(Indexed(23), batch_sampler=shmloader.BatchSampler(sampler, 2, False))

    saving = make(0)
    next(iter(saving))
    with pytest.raises(shmloader.state.StateError, match="rank saved 0, this sampler 1"):
        make(1).load_state_dict(saving.state_dict())
