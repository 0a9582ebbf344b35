"""Samplers and worker info under adversity, against torch: torch's ``DistributedSampler`` (which has
no ``state_dict``) resumed at its epoch, and ``WorkerInfo`` with torch's fields.

Each test is one that failed before its fix; the numpy-flavour ones are in tests/test_adv_samplers.py.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import pytest

torch = pytest.importorskip("torch")
from torch.utils.data import Dataset, DistributedSampler  # noqa: E402
from torch.utils.data._utils import worker as torch_worker  # noqa: E402

import shmloader  # noqa: E402
from shmloader.state import StateError  # noqa: E402
from shmloader.torch import DataLoader  # noqa: E402


class Indexed(Dataset):
    def __len__(self) -> int:
        return 23

    def __getitem__(self, i: int) -> int:
        return i


def _loader(epoch: int | None, num_workers: int, rank: int = 1) -> DataLoader:
    sampler: Any = DistributedSampler(Indexed(), num_replicas=2, rank=rank, shuffle=True, seed=3)
    if epoch is not None:
        sampler.set_epoch(epoch)
    return DataLoader(Indexed(), batch_size=2, sampler=sampler, num_workers=num_workers)


@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.timeout(60)
def test_torchs_distributed_sampler_resumes_at_its_epoch(num_workers: int) -> None:
    uninterrupted = [b.tolist() for b in _loader(5, num_workers)]
    saving = _loader(5, num_workers)
    it = iter(saving)
    before = [next(it).tolist() for _ in range(2)]
    state = json.loads(json.dumps(saving.state_dict()))
    saving.close()
    resumed = _loader(None, num_workers)  # a fresh sampler at epoch 0: the state must say epoch 5
    resumed.load_state_dict(state)
    sampler: Any = resumed.sampler
    assert sampler.epoch == 5
    assert before + [b.tolist() for b in resumed] == uninterrupted  # was: epoch 0's batches, some twice


def test_torchs_distributed_sampler_refuses_another_ranks_state_by_name() -> None:
    saving = _loader(5, 0, rank=0)
    next(iter(saving))
    other = _loader(None, 0, rank=1)
    with pytest.raises(StateError, match="rank saved 0, this sampler 1"):
        other.load_state_dict(saving.state_dict())
    sampler: Any = other.sampler
    assert sampler.epoch == 0


def test_torchs_distributed_sampler_state_with_a_bad_epoch_is_refused_by_name() -> None:
    saving = _loader(5, 0)
    next(iter(saving))
    state = saving.state_dict()
    state["objects"]["sampler"]["epoch"] = -1
    with pytest.raises(StateError, match="epoch must be an integer >= 0; got -1"):
        _loader(None, 0).load_state_dict(state)


def test_worker_info_has_torchs_fields_and_repr() -> None:
    ours = shmloader.WorkerInfo(id=1, num_workers=2, seed=7, dataset="data")
    theirs = torch_worker.WorkerInfo(id=1, num_workers=2, seed=7, dataset="data")  # type: ignore[arg-type]
    assert [f.name for f in dataclasses.fields(ours)] == [f.name for f in dataclasses.fields(theirs)]
    assert repr(ours) == repr(theirs)
    with pytest.raises(dataclasses.FrozenInstanceError):
        ours.id = 3  # type: ignore[misc]
