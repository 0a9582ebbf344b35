"""How ``to_device`` rebuilds a nested batch (``gpu.backends.map_batch``), against torch's own
``pin_memory``, which rebuilds the batches of ``DataLoader(pin_memory=True)``.

A mutable mapping or sequence is copied (``copy.copy``) and its values replaced, so a
``defaultdict`` keeps its ``default_factory`` and a container subclass its attributes (a
tokenizer's batch, for instance, keeps its encodings); other containers are rebuilt with their own
type when it accepts that, else as a dict or list.
"""

from __future__ import annotations

from collections import OrderedDict, UserDict, UserList, defaultdict
from collections.abc import Mapping, MutableMapping, Sequence
from types import MappingProxyType
from typing import Any

import numpy as np
import pytest

import shmloader
from shmloader.gpu.batch_tree import iter_leaves, map_batch
from shmloader.gpu.fake import FakeBackend


class Tagged(dict):  # type: ignore[type-arg]
    """A dict subclass with state of its own, as a tokenizer's batch has."""

    def __init__(self, *args: Any, tag: str = "", **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.tag = tag


class Encoded(UserDict):  # type: ignore[type-arg]
    def __init__(self, data: Any = None, encodings: Any = None) -> None:
        super().__init__(data)
        self.encodings = encodings


class Rows(UserList):  # type: ignore[type-arg]
    def __init__(self, data: Any = None, source: str = "") -> None:
        super().__init__(data)
        self.source = source


def _shape(batch: Any) -> Any:
    """The container types, their attributes and the leaves, to compare two rebuilt batches."""
    if isinstance(batch, (str, bytes, int)):
        return batch
    attrs = {k: v for k, v in vars(batch).items() if k not in ("data", "_data")} if hasattr(batch, "__dict__") else {}
    if isinstance(batch, defaultdict):
        attrs["default_factory"] = batch.default_factory
    if isinstance(batch, Mapping):
        return type(batch), attrs, [(k, _shape(v)) for k, v in batch.items()]
    return type(batch), attrs, [_shape(v) for v in batch]


def _batches() -> list[Any]:
    tagged = Tagged({"x": 1}, tag="t")
    rows = Rows([1, 2], source="s")
    return [
        defaultdict(list, {"x": 1, "y": [2, 3]}),
        tagged,
        Encoded({"ids": 4}, encodings=["e"]),
        MappingProxyType({"a": 5}),  # immutable: rebuilt from a dict
        OrderedDict(b=rows, a=(6, "s")),
    ]


@pytest.mark.parametrize("batch", _batches(), ids=lambda b: type(b).__name__)
def test_containers_are_rebuilt_as_torch_pin_memory_rebuilds_them(batch: Any) -> None:
    torch_utils = pytest.importorskip("torch.utils.data._utils.pin_memory")
    theirs = torch_utils.pin_memory(batch)  # no tensor leaf: no device needed
    seen: list[Any] = []

    def noted(leaf: Any) -> Any:
        seen.append(leaf)
        return leaf

    ours = map_batch(batch, noted)
    assert _shape(ours) == _shape(theirs)
    assert ours is not batch
    assert seen == list(iter_leaves(batch)) == _leaves(theirs)  # every leaf torch walks to


def _leaves(batch: Any) -> list[Any]:
    """What torch's pin_memory walks to: inside every mapping and sequence, but strings and bytes."""
    if isinstance(batch, (str, bytes)):
        return []
    if isinstance(batch, Mapping):
        return [x for v in batch.values() for x in _leaves(v)]
    if isinstance(batch, Sequence):
        return [x for v in batch for x in _leaves(v)]
    return [batch]


def test_to_device_keeps_a_defaultdict_and_a_subclass_s_attributes() -> None:
    data = np.arange(8, dtype=np.float32)
    batch = Tagged({"x": data, "rows": Rows([data], source="s")}, tag="t")
    (moved,) = list(shmloader.to_device([batch], "cpu", transfer=FakeBackend(auto_complete=True)))
    assert type(moved) is Tagged and moved.tag == "t"
    assert type(moved["rows"]) is Rows and moved["rows"].source == "s"
    assert not np.shares_memory(np.asarray(moved["x"]), data)  # the values were replaced, not kept
    assert batch["x"] is data  # the caller's batch is left as it was


class Store(MutableMapping):  # type: ignore[type-arg]
    """A mutable mapping whose copy.copy() shares its storage (no ``__copy__`` of its own)."""

    def __init__(self, data: Any) -> None:
        self._store = dict(data)

    def __getitem__(self, key: Any) -> Any:
        return self._store[key]

    def __setitem__(self, key: Any, value: Any) -> None:
        self._store[key] = value

    def __delitem__(self, key: Any) -> None:
        del self._store[key]

    def __iter__(self) -> Any:
        return iter(self._store)

    def __len__(self) -> int:
        return len(self._store)


def test_a_mapping_whose_copy_shares_storage_is_rebuilt_and_the_batch_kept() -> None:
    """torch would copy and update it, replacing the batch's own values: the slot views a device copy
    still reads would be dropped with them."""
    data = np.arange(4)
    batch = Store({"x": data})
    moved = map_batch(batch, lambda leaf: "moved")
    assert type(moved) is Store and moved["x"] == "moved"
    assert batch["x"] is data
