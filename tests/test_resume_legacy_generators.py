"""A sampler whose ``generator`` attribute is a generator the state cannot hold is refused by name.

The state snapshots the ``generator`` attribute of every sampler and batch sampler when it is a
``numpy.random.Generator`` or a ``torch.Generator`` (docs/resume.md, "Re-creating the epoch's
order"). A custom sampler without ``state_dict`` whose ``generator`` is a legacy
``numpy.random.RandomState`` or a ``random.Random`` was saved without it: a resumed epoch drew
another order from a fresh one, and its delivered tasks were other batches (samples lost and
repeated, without a word). Now ``state_dict()`` inside such an epoch raises ``StateError`` naming
the sampler and the generator's type, as for any order that cannot be re-created.
"""

from __future__ import annotations

import random
import sys
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
from resume_helpers import second_epoch_and_saved

import shmloader
from shmloader.errors import StateError

N = 23
DATA = np.arange(float(N))


class Shuffled(shmloader.Sampler):
    """Each pass a permutation drawn from ``generator`` (RandomState, random.Random or numpy Generator)."""

    def __init__(self, generator: Any) -> None:
        self.generator = generator

    def __iter__(self) -> Iterator[int]:
        if isinstance(self.generator, random.Random):
            order = list(range(N))
            self.generator.shuffle(order)
            return iter(order)
        return iter(self.generator.permutation(N).tolist())

    def __len__(self) -> int:
        return N


class WithState(Shuffled):
    """The same, saved through its own state_dict (the generator's state)."""

    def state_dict(self) -> dict[str, Any]:
        name, key, pos, has_gauss, gauss = self.generator.get_state()
        return {"state": [name, key.tolist(), pos, has_gauss, gauss]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        name, key, pos, has_gauss, gauss = state["state"]
        self.generator.set_state((name, np.array(key, dtype=np.uint32), pos, has_gauss, gauss))


def _in_second_epoch(loader: shmloader.DataLoader) -> shmloader.DataLoader:
    """``loader`` one epoch and two batches in (a fresh generator would not be where this one is)."""
    list(loader)
    it = iter(loader)
    next(it), next(it)
    return loader


GENERATORS = {"RandomState": lambda: np.random.RandomState(3), "Random": lambda: random.Random(3)}


@pytest.mark.parametrize("kind", sorted(GENERATORS))
def test_a_samplers_generator_the_state_cannot_hold_is_named(kind: str) -> None:
    loader = _in_second_epoch(shmloader.DataLoader(DATA, batch_size=3, sampler=Shuffled(GENERATORS[kind]())))
    with pytest.raises(StateError, match=f"the sampler \\(Shuffled\\) draws its order from its generator "
                                         f"attribute, a {kind}"):
        loader.state_dict()


def test_a_batch_samplers_sampler_is_checked_too() -> None:
    batches = shmloader.BatchSampler(Shuffled(np.random.RandomState(3)), 3, drop_last=False)
    loader = _in_second_epoch(shmloader.DataLoader(DATA, batch_sampler=batches))
    with pytest.raises(StateError, match=r"the batch_sampler.sampler \(Shuffled\) draws its order"):
        loader.state_dict()


@pytest.mark.parametrize("sampler", [lambda: WithState(np.random.RandomState(3)),  # saved by the sampler itself
                                     lambda: Shuffled(np.random.default_rng(3))])  # a generator the state holds
def test_a_generator_that_is_saved_resumes(sampler: Callable[[], shmloader.Sampler]) -> None:
    def make() -> shmloader.DataLoader:
        return shmloader.DataLoader(DATA, batch_size=3, sampler=sampler())

    second, before, state = second_epoch_and_saved(make, 2)
    resumed = make()
    resumed.load_state_dict(state)
    assert before + [b.tolist() for b in resumed] == second


class EpochKeyed(shmloader.Sampler):
    """``set_epoch`` and an integer ``epoch`` (saved as its epoch) but no state_dict; with
    ``generator=None`` and torch hidden, its order comes from fresh OS entropy."""

    def __init__(self) -> None:
        self.generator, self.epoch = None, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self) -> Iterator[int]:
        return iter(np.random.default_rng().permutation(N).tolist())

    def __len__(self) -> int:
        return N


def test_an_epoch_keyed_sampler_drawing_fresh_entropy_is_still_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "torch", None)  # torch hidden: generator=None is OS entropy
    loader: shmloader.DataLoader[Any] = shmloader.DataLoader(DATA, batch_size=3, sampler=EpochKeyed())
    it = iter(loader)
    next(it)
    with pytest.raises(StateError, match="EpochKeyed with generator=None draws its order from fresh OS entropy"):
        loader.state_dict()
