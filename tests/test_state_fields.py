"""A corrupt saved state is refused by ``load_state_dict`` with a StateError naming the field.

Before, only the format, version, keys, configuration and the last delivered task were checked: a
bad ``base_seed`` loaded and surfaced at the first ``next()`` as a crash "in DataLoader worker
process 0" (as if the user's dataset had failed), and other bad fields raised AttributeError,
TypeError, KeyError or RuntimeError from inside ``state.py``, some only at ``iter()``.
"""

from __future__ import annotations

import copy
import json
from typing import Any, Callable

import numpy as np
import pytest

import shmloader
from shmloader.errors import StateError
from shmloader.samplers import RandomSampler

torch = pytest.importorskip("torch")  # the states below hold a torch generator and torch's global RNG

DATA = np.arange(46.0).reshape(23, 2)


def _loader(num_workers: int = 0) -> shmloader.DataLoader:
    return shmloader.DataLoader(DATA, batch_size=3, shuffle=True, num_workers=num_workers,
                                generator=torch.Generator().manual_seed(1))


def _saved_after_two_batches(loader: shmloader.DataLoader) -> dict[str, Any]:
    it = iter(loader)
    next(it), next(it)
    state = json.loads(json.dumps(loader.state_dict()))
    loader.close()
    return state


@pytest.fixture(scope="module")
def good() -> dict[str, Any]:
    return _saved_after_two_batches(_loader())


def _set(path: list[Any], value: Any) -> Callable[[dict], None]:
    def change(state: dict) -> None:
        obj = state
        for key in path[:-1]:
            obj = obj[key]
        obj[path[-1]] = value
    return change


CASES: dict[str, tuple[Callable[[dict], None], str]] = {
    "base_seed none mid-epoch": (_set(["base_seed"], None), "base_seed must be an integer in"),
    "base_seed a string": (_set(["base_seed"], "x"), "base_seed must be"),
    "base_seed past 2**64": (_set(["base_seed"], 1 << 64), "base_seed must be"),
    "epoch a string": (_set(["epoch"], "3"), "epoch must be an integer >= 0"),
    "yielded negative": (_set(["yielded"], -1), "yielded must be an integer >= 0"),
    "in_progress a string": (_set(["in_progress"], "false"), "in_progress must be true or false"),
    "config a list": (_set(["config"], []), "config must be a mapping"),
    "delivered an int": (_set(["delivered"], 5), "delivered must be a list"),
    "random without sources": (_set(["random"], {}), "random must be a mapping"),
    "objects a list": (_set(["objects"], []), "objects must be a mapping"),
    "torch generator truncated": (lambda s: s["random"]["sources"][0].__setitem__("state", "AAAA"),
                                  "is not a torch generator state torch can set"),
    "torch global not base64": (_set(["random", "torch_global"], "%%%"), "is not a base64 torch generator"),
    "torch first-batch state not base64": (_set(["random", "torch_global_first_batch"], "%%%"),
                                           "random.torch_global_first_batch is not a base64 torch generator"),
    "delivered holds an int": (_set(["delivered"], [5]), "the state's delivered must be sorted, disjoint"),
    "delivered range of one": (_set(["delivered"], [[0]]), "the state's delivered must be sorted, disjoint"),
    "delivered range of strings": (_set(["delivered"], [["a", "b"]]), "the state's delivered must be sorted"),
    "delivered range negative": (_set(["delivered"], [[-2, 1]]), "the state's delivered must be sorted"),
    "base_seed_drawn a string": (_set(["random", "base_seed_drawn"], "yes"), "random.base_seed_drawn must be true"),
    # an epoch's start has nothing delivered: loaded, such tasks were skipped in the next epoch
    "delivered while not in progress": (_set(["in_progress"], False), "delivered must be empty when in_progress"),
    # an iterable dataset's resume makes this many batches again and drops them: past the epoch, all of it
    "yielded past the delivered tasks": (_set(["yielded"], 50), r"yielded \(50\) cannot exceed the 2 delivered"),
    "version true": (_set(["version"], True), "state version True cannot be loaded"),
}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("case", sorted(CASES))
def test_a_corrupt_field_is_refused_by_name(good: dict[str, Any], case: str) -> None:
    change, message = CASES[case]
    state = copy.deepcopy(good)
    change(state)
    loader = _loader(num_workers=2)
    try:
        with pytest.raises(StateError, match=message):
            loader.load_state_dict(state)
    finally:
        loader.close()


@pytest.mark.timeout(60)
def test_a_sound_state_still_resumes(good: dict[str, Any]) -> None:
    full = _loader()
    want = [b.tolist() for b in full][2:]
    full.close()
    loader = _loader(num_workers=2)
    try:
        loader.load_state_dict(copy.deepcopy(good))
        assert [b.tolist() for b in loader] == want
    finally:
        loader.close()


def _numpy_loader() -> shmloader.DataLoader:
    return shmloader.DataLoader(DATA, batch_size=3, shuffle=True, generator=7)  # numpy streams


def _state_of(stream: object) -> Any:
    """The bit generator state of a numpy stream (what an int seed becomes)."""
    assert isinstance(stream, np.random.Generator)
    return stream.bit_generator.state


@pytest.fixture(scope="module")
def good_numpy() -> dict[str, Any]:
    state = _saved_after_two_batches(_numpy_loader())
    assert [entry["kind"] for entry in state["random"]["sources"]] == ["numpy", "numpy"]
    return state


def _pcg(key: str, value: Any) -> Callable[[dict], None]:
    return lambda s: s["random"]["sources"][0]["state"]["state"].__setitem__(key, value)


NUMPY_CASES: dict[str, Callable[[dict], None]] = {
    "pcg state negative": _pcg("state", -1),
    "pcg state past 128 bits": _pcg("state", 1 << 200),
    "pcg increment a string": _pcg("inc", "x"),
    "pcg state null": _pcg("state", None),
    "state a list": lambda s: s["random"]["sources"][0].__setitem__("state", [1, 2]),
    "state empty": lambda s: s["random"]["sources"][0].__setitem__("state", {}),
    "bit generator unknown": lambda s: s["random"]["sources"][0]["state"].__setitem__("bit_generator", "Nope"),
}


@pytest.mark.parametrize("case", sorted(NUMPY_CASES))
def test_a_corrupt_numpy_generator_state_is_refused_by_name(good_numpy: dict[str, Any], case: str) -> None:
    state = copy.deepcopy(good_numpy)
    NUMPY_CASES[case](state)
    loader = _numpy_loader()
    before = _state_of(loader._generator_source)
    with pytest.raises(StateError, match=r"the state's random.sources \(generator\) is not a numpy generator state"):
        loader.load_state_dict(state)
    assert _state_of(loader._generator_source) == before


class Scaled(shmloader.Dataset):
    """A dataset with a state of its own; ``refuse`` makes its load_state_dict raise."""

    def __init__(self, refuse: bool = False) -> None:
        self.scale, self.refuse = 1, refuse

    def __len__(self) -> int:
        return len(DATA)

    def __getitem__(self, i: int) -> np.ndarray:
        return DATA[i] * self.scale

    def state_dict(self) -> dict[str, int]:
        return {"scale": self.scale}

    def load_state_dict(self, state: dict[str, int]) -> None:
        if self.refuse:
            raise ValueError("Scaled refuses this state")
        self.scale = state["scale"]


class Offset(shmloader.Sampler):
    """A sampler with a state of its own."""

    def __init__(self) -> None:
        self.offset = 0

    def __iter__(self):  # type: ignore[no-untyped-def]
        return iter([(self.offset + i) % len(DATA) for i in range(len(DATA))])

    def __len__(self) -> int:
        return len(DATA)

    def state_dict(self) -> dict[str, int]:
        return {"offset": self.offset}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.offset = state["offset"]


def _scaled_state(generator: Any) -> dict[str, Any]:
    """A mid-epoch state of a loader whose dataset has scale 5 and whose generator is ``generator``."""
    loader: shmloader.DataLoader[Any] = shmloader.DataLoader(Scaled(), batch_size=3, shuffle=True, generator=generator)
    loader.dataset.scale = 5
    return _saved_after_two_batches(loader)


@pytest.mark.parametrize("saved_generator, message", [
    (lambda: np.random.Generator(np.random.MT19937(3)), r"random.sources \(generator\).*MT19937.*PCG64"),
    (lambda: torch.Generator().manual_seed(3), "the state holds a torch generator at generator"),
])
def test_a_state_whose_generators_do_not_fit_this_loader_restores_nothing(saved_generator: Any, message: str) -> None:
    state = _scaled_state(saved_generator())
    # PCG64 streams
    target: shmloader.DataLoader[Any] = shmloader.DataLoader(Scaled(), batch_size=3, shuffle=True, generator=7)
    sampler = target.sampler
    assert isinstance(sampler, RandomSampler)  # shuffle=True
    streams = [_state_of(target._generator_source), _state_of(sampler._source)]
    with pytest.raises(StateError, match=message):
        target.load_state_dict(state)
    assert target.dataset.scale == 1  # the dataset's load_state_dict was not called
    assert [_state_of(target._generator_source), _state_of(sampler._source)] == streams


@pytest.mark.parametrize("generator", [lambda: torch.Generator().manual_seed(3), lambda: 7])
def test_a_generator_the_state_holds_nothing_for_is_refused(generator: Callable[[], Any]) -> None:
    # saved with generator=None: the order came from torch's global RNG, which the state holds; a
    # loader with a generator draws its order from that instead, so the delivered tasks would be
    # other batches (loaded before: 5 of 23 samples lost, 5 repeated, without a word)
    saving: shmloader.DataLoader[Any] = shmloader.DataLoader(DATA, batch_size=3, shuffle=True)
    state = _saved_after_two_batches(saving)
    assert state["random"]["sources"] == []
    with pytest.raises(StateError, match="this loader has a (torch|numpy) generator at generator, but the state "
                                         "holds no generator state there"):
        shmloader.DataLoader(DATA, batch_size=3, shuffle=True, generator=generator()).load_state_dict(state)


def test_an_object_that_refuses_its_state_leaves_the_others_as_they_were() -> None:
    saving: shmloader.DataLoader[Any] = shmloader.DataLoader(Scaled(), batch_size=3, sampler=Offset(), generator=7)
    assert isinstance(saving.sampler, Offset)
    saving.sampler.offset, saving.dataset.scale = 4, 5
    state = _saved_after_two_batches(saving)
    target: shmloader.DataLoader[Any] = shmloader.DataLoader(Scaled(refuse=True), batch_size=3, sampler=Offset(),
                                                             generator=7)
    stream = _state_of(target._generator_source)
    with pytest.raises(ValueError, match="Scaled refuses this state"):
        target.load_state_dict(state)
    assert isinstance(target.sampler, Offset)
    assert target.sampler.offset == 0  # loaded before the dataset refused, then put back
    assert _state_of(target._generator_source) == stream and target._book.resume is None
