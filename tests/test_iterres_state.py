"""A foreign or malformed saved state is refused by ``load_state_dict`` with a ``StateError`` that
names the field, before anything is restored (docs/resume.md, "What is refused")."""

from __future__ import annotations

import copy
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
