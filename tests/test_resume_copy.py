"""A copied loader's ``state_dict()`` is the original's position when it was copied, however copied.

A pickled or deep-copied loader carries a copy of the epoch bookkeeping: its ``state_dict()`` is
where the original stood at the copy, and neither loader's iteration moves the other's. A
``copy.copy`` shared the original's in-progress epoch record itself, so its ``state_dict()``
followed the original's later batches (and its own iteration could not be told apart): a
checkpoint taken from the copy lost or repeated batches. Now ``copy.copy`` copies the record too.
torch's shallow copy shares the loader's attributes by reference, its iterator included
(``copy.copy(loader)._iterator is loader._iterator`` with persistent workers, torch 2.13); a
shmloader copy never shares an iterator (tests/test_loader_pickle.py), so it has no live epoch of
the original's to follow.
"""

from __future__ import annotations

import copy
import pickle
from collections.abc import Callable
from typing import Any

import pytest

import shmloader


def _round_trip(loader: Any) -> Any:
    return pickle.loads(pickle.dumps(loader))


COPIES: dict[str, Callable[[Any], Any]] = {"copy": copy.copy, "deepcopy": copy.deepcopy, "pickle": _round_trip}


def _loader(num_workers: int) -> shmloader.DataLoader[Any]:
    return shmloader.DataLoader(shmloader.ArrayDataset(list(range(12))), batch_size=2, shuffle=True, generator=7,
                                num_workers=num_workers)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("how", sorted(COPIES))
def test_a_copys_state_is_the_position_at_the_copy(how: str, num_workers: int) -> None:
    loader = _loader(num_workers)
    it = iter(loader)
    first = [next(it)[0].tolist() for _ in range(2)]
    at_copy = loader.state_dict()
    clone = COPIES[how](loader)
    try:
        rest = [b.tolist() for (b,) in it]  # the original goes on to the end of its epoch
        assert clone.state_dict() == at_copy  # a copy.copy followed the original: every task delivered
        assert loader.state_dict() != at_copy
        resumed = _loader(0)
        resumed.load_state_dict(clone.state_dict())
        assert [b.tolist() for (b,) in resumed] == rest
        assert len(first + rest) == 6
    finally:
        clone.close()
        loader.close()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("how", sorted(COPIES))
def test_iterating_a_copy_leaves_the_originals_state_alone(how: str) -> None:
    loader = _loader(0)
    it = iter(loader)
    next(it)
    at_copy = loader.state_dict()
    clone = COPIES[how](loader)
    clone_it = iter(clone)
    for _ in range(3):
        next(clone_it)
    assert loader.state_dict() == at_copy
    assert clone.state_dict()["epoch"] == at_copy["epoch"] + 1  # the copy began the next epoch of its own
