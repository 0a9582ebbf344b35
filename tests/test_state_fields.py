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

torch = pytest.importorskip("torch")  # the states below hold a torch generator and torch's global RNG

DATA = np.arange(46.0).reshape(23, 2)


def _loader(num_workers: int = 0) -> shmloader.DataLoader:
    return shmloader.DataLoader(DATA, batch_size=3, shuffle=True, num_workers=num_workers,
                                generator=torch.Generator().manual_seed(1))


@pytest.fixture(scope="module")
def good() -> dict[str, Any]:
    loader = _loader()
    it = iter(loader)
    next(it), next(it)
    state = json.loads(json.dumps(loader.state_dict()))
    loader.close()
    return state


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
    "base_seed_drawn a string": (_set(["random", "base_seed_drawn"], "yes"), "random.base_seed_drawn must be true"),
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
