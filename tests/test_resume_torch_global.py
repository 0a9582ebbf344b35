"""A state saved where torch is imported loads where torch is not, unless torch made the order.

A state saved mid-epoch in a process that had torch imported always held torch's global RNG
state, and loading it where torch cannot be imported (not installed, or hidden with
``sys.modules["torch"] = None``) raised "saved while torch's random generators made the order"
even when only numpy generators, an int seed or a sampler's own ``state_dict`` made it. Now the
state records whether the epoch's order drew from torch's global RNG (``random.torch_global_used``):
only then is torch needed to load it, and the refusal says so. A state of the same version saved
before that was recorded loads where torch is available, as before, and is refused by name where
it is not.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from typing import Any

import pytest

import shmloader
from shmloader.state import StateError

torch = pytest.importorskip("torch")  # the states are saved where torch is imported

N = 12


class Offset(shmloader.Sampler):
    """Each pass starts ``offset`` further on; no generator, its own state_dict."""

    def __init__(self) -> None:
        self.offset = 0

    def __iter__(self) -> Iterator[int]:
        start, self.offset = self.offset, self.offset + 5
        return iter([(start + i) % N for i in range(N)])

    def __len__(self) -> int:
        return N

    def state_dict(self) -> dict[str, Any]:
        return {"offset": self.offset}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.offset = state["offset"]


def _int_seed(num_workers: int = 0) -> shmloader.DataLoader[Any]:
    return shmloader.DataLoader(shmloader.ArrayDataset(list(range(N))), batch_size=2, shuffle=True, generator=7,
                                num_workers=num_workers)


def _numpy_generator(num_workers: int = 0) -> shmloader.DataLoader[Any]:
    import numpy as np

    return shmloader.DataLoader(shmloader.ArrayDataset(list(range(N))), batch_size=2, shuffle=True,
                                generator=np.random.default_rng(3), num_workers=num_workers)


def _stateful_sampler(num_workers: int = 0) -> shmloader.DataLoader[Any]:
    return shmloader.DataLoader(shmloader.ArrayDataset(list(range(N))), batch_size=2, sampler=Offset(),
                                generator=5, num_workers=num_workers)


def _torch_global(num_workers: int = 0) -> shmloader.DataLoader[Any]:
    """generator=None with torch imported: the sampler's seed comes from torch's global RNG."""
    return shmloader.DataLoader(shmloader.ArrayDataset(list(range(N))), batch_size=2, shuffle=True,
                                num_workers=num_workers)


def _batches(loader: shmloader.DataLoader[Any]) -> list[list[int]]:
    return [b.tolist() for (b,) in loader]


def _saved_after_two(make: Any, num_workers: int = 0) -> tuple[dict[str, Any], list[list[int]]]:
    """A state saved two batches into an epoch (torch imported), and the batches that follow."""
    loader = make(num_workers)
    it = iter(loader)
    for _ in range(2):
        next(it)
    state = loader.state_dict()
    rest = [b.tolist() for (b,) in it]
    loader.close()
    return state, rest


def _resumes_with_torch_only(make: Any, state: dict[str, Any], rest: list[list[int]], monkeypatch: pytest.MonkeyPatch,
                             refusal: str) -> None:
    """``state`` resumes ``rest`` where torch is imported; with torch hidden it is refused (``refusal``)."""
    resumed = make()
    resumed.load_state_dict(state)
    assert _batches(resumed) == rest
    monkeypatch.setitem(sys.modules, "torch", None)
    with pytest.raises(StateError, match=refusal):
        make().load_state_dict(state)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("make", [_int_seed, _numpy_generator, _stateful_sampler])
@pytest.mark.parametrize("num_workers", [0, 2])
def test_an_order_torch_did_not_make_loads_where_torch_is_hidden(make: Any, num_workers: int,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    state, rest = _saved_after_two(make, num_workers)
    assert state["random"]["torch_global"] is not None  # torch was imported: its RNG is still kept
    assert state["random"]["torch_global_used"] is False
    monkeypatch.setitem(sys.modules, "torch", None)
    resumed = make()
    resumed.load_state_dict(state)  # raised "saved while torch's random generators made the order"
    assert _batches(resumed) == rest


@pytest.mark.timeout(60)
@pytest.mark.parametrize("num_workers", [0, 2])
def test_an_order_drawn_from_torchs_global_rng_is_refused_where_torch_is_hidden(
        num_workers: int, monkeypatch: pytest.MonkeyPatch) -> None:
    state, rest = _saved_after_two(_torch_global, num_workers)
    assert state["random"]["torch_global_used"] is True
    _resumes_with_torch_only(_torch_global, state, rest, monkeypatch,
                             r"this epoch's order was drawn from torch's global RNG.*torch cannot be imported here")


@pytest.mark.timeout(60)
def test_a_state_that_does_not_say_whether_torch_made_the_order(monkeypatch: pytest.MonkeyPatch) -> None:
    """Saved before ``torch_global_used`` was recorded: it loads where torch is, as it did, and
    where torch is not it is refused, saying what it lacks (it cannot tell)."""
    state, rest = _saved_after_two(_int_seed)
    del state["random"]["torch_global_used"]
    _resumes_with_torch_only(_int_seed, state, rest, monkeypatch, r"does not say whether this epoch's order was "
                             r"drawn from torch's global RNG.*torch cannot be imported here")


@pytest.mark.timeout(60)
def test_torch_global_used_must_be_true_or_false() -> None:
    state, _ = _saved_after_two(_int_seed)
    state["random"]["torch_global_used"] = "no"
    with pytest.raises(StateError, match="random.torch_global_used must be true or false"):
        _int_seed().load_state_dict(state)
