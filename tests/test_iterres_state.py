"""A foreign or malformed saved state is refused by ``load_state_dict`` with a ``StateError`` that
names the field, before anything is restored (docs/resume.md, "What is refused")."""

from __future__ import annotations

import copy
import json
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

import shmloader
from shmloader.errors import StateError

DATA = np.arange(20.0).reshape(10, 2)


def _loader() -> shmloader.DataLoader:
    return shmloader.DataLoader(DATA, batch_size=2, shuffle=True, generator=1)


@pytest.mark.parametrize("name", ["__class__", "_book", "_index_sampler", "generator", "foo"])
def test_objects_other_than_sampler_batch_sampler_dataset_are_refused_by_name(name: str) -> None:
    # "__class__" used to reach DataLoader.state_dict() unbound (a TypeError from inside state.py),
    # and any loader attribute with load_state_dict was handed the state's entry
    state: dict[str, Any] = copy.deepcopy(_loader().state_dict())
    state["objects"] = {name: {"offset": 1}}
    loader = _loader()
    before = loader.state_dict()
    with pytest.raises(StateError, match=rf"objects.*{name}"):
        loader.load_state_dict(state)
    assert loader.state_dict() == before


class UnknownLength(shmloader.IterableDataset):
    """Five samples, sharded by worker; its length is unknown, as some stream libraries say it."""

    def __iter__(self) -> Iterator[np.ndarray]:
        info = shmloader.get_worker_info()
        step, first = (1, 0) if info is None else (info.num_workers, info.id)
        return iter([np.array([i]) for i in range(first, 5, step)])

    def __len__(self) -> int:
        raise NotImplementedError("this stream does not know its length")


class UnknownBatches:
    """A batch sampler of pairs whose ``__len__`` says it does not know."""

    def __iter__(self) -> Iterator[list[int]]:
        return iter([[0, 1], [2, 3], [4]])

    def __len__(self) -> int:
        raise NotImplementedError


@pytest.mark.timeout(60)
@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("kind", ["iterable", "batch_sampler"])
def test_a_length_that_raises_not_implemented_does_not_stop_saving(kind: str, num_workers: int) -> None:
    # iteration never asks for it (as torch's), but state_dict() raised the NotImplementedError
    def make() -> shmloader.DataLoader:
        if kind == "iterable":
            return shmloader.DataLoader(UnknownLength(), batch_size=2, num_workers=num_workers)
        return shmloader.DataLoader(DATA[:5], batch_sampler=UnknownBatches(), num_workers=num_workers)

    full = [b.tolist() for b in make()]
    loader = make()
    it = iter(loader)
    before = [next(it).tolist()]
    state = json.loads(json.dumps(loader.state_dict()))
    assert state["config"]["dataset_len" if kind == "iterable" else "batches_per_epoch"] is None
    loader.close()
    resumed = make()
    resumed.load_state_dict(state)
    assert before + [b.tolist() for b in resumed] == full


@pytest.mark.timeout(60)
@pytest.mark.parametrize("num_workers", [0, 1])
def test_an_ended_iterator_saves_its_next_epoch_only_until_that_epoch_starts(num_workers: int) -> None:
    def make() -> shmloader.DataLoader:
        return shmloader.DataLoader(DATA, batch_size=4, shuffle=True, generator=3, num_workers=num_workers)

    uninterrupted = make()
    epochs = [[b.tolist() for b in uninterrupted] for _ in range(2)]
    loader = make()
    first = iter(loader)
    assert [b.tolist() for b in first] == epochs[0]
    state = json.loads(json.dumps(first.state_dict()))  # the start of epoch 1
    second = iter(loader)
    next(second)
    # it used to save the start of epoch 2 (the generators as epoch 1 left them): epoch 1 skipped
    with pytest.raises(StateError, match="epoch 0 has ended after a later epoch has started"):
        first.state_dict()
    loader.close()
    resumed = make()
    resumed.load_state_dict(state)
    assert [b.tolist() for b in resumed] == epochs[1]
