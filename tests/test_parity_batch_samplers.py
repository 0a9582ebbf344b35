"""torch parity of unusual samplers and batch samplers, side by side with torch's ``DataLoader``:
indices of numpy and 0-dim tensor types, keys of a dict-like dataset, a ``__len__`` that is
missing or wrong, batch samplers that yield empty lists, tuples, ndarrays or generators. The
batches (and ``len(loader)``, or its error's type) must be torch's; the index each ``__getitem__``
receives keeps its type. A generator of indices, which torch's workers cannot receive (its queue's
feeder thread fails to pickle it and the loader waits for ever), reaches ours as a list.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
from parity_helpers import assert_same_outcome, assert_same_structure

torch = pytest.importorskip("torch")
from torch.utils import data as tdata  # noqa: E402

import shmloader.torch as st  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")


class Seen(tdata.Dataset):
    """Each sample is its index and the name of the index's type."""

    def __len__(self) -> int:
        return 10

    def __getitem__(self, i: Any) -> dict[str, Any]:
        return {"i": np.int64(int(i)), "type": type(i).__name__}


class Keyed(tdata.Dataset):
    """A dict-like dataset: its keys are strings and tuples."""

    rows = {"a": 1, "b": 2, ("x", 1): 3, ("y", 2): 4}

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, key: Any) -> dict[str, Any]:
        return {"v": self.rows[key], "key": str(key)}


class Items:
    """An iterable of what ``make()`` gives, with ``length`` as its ``__len__`` (None: it has none)."""

    def __init__(self, make: Callable[[], list[Any]], length: int | None = None) -> None:
        self.make = make
        self.length = length

    def __iter__(self) -> Iterator[Any]:
        return iter(self.make())

    def __len__(self) -> int:
        if self.length is None:
            raise TypeError("object of type 'Items' has no len()")
        return self.length


SAMPLERS: dict[str, Callable[[], Any]] = {
    "numpy_ints": lambda: [np.int64(3), np.int32(1), np.uint8(2)],
    "tensor_0dim": lambda: [torch.tensor(3), torch.tensor(1)],
    "no_len": lambda: Items(lambda: [1, 2, 3]),
    "len_too_small": lambda: Items(lambda: [1, 2, 3, 4, 5], 2),
    "len_too_large": lambda: Items(lambda: [1, 2, 3], 9),
}

BATCH_SAMPLERS: dict[str, Callable[[], Any]] = {
    "empty_lists": lambda: [[], [1, 2], []],
    "tuples": lambda: [(1, 2), (3,)],
    "ndarrays": lambda: [np.array([1, 2]), np.array([], dtype=np.int64)],
    "numpy_and_tensor_indices": lambda: [[np.int64(1), np.int32(2)], [torch.tensor(3)]],
    "no_len": lambda: Items(lambda: [[1, 2], [3]]),
    "len_too_small": lambda: Items(lambda: [[1, 2], [3], [4]], 1),
    "len_too_large": lambda: Items(lambda: [[1, 2]], 4),
}


def _same(dataset: Any, **kwargs: Any) -> None:
    """Batches and ``len(loader)`` (or its error's type) as torch's."""
    assert_same_outcome(dataset, **kwargs)
    lengths: list[int | type[TypeError]] = []
    for cls in (tdata.DataLoader, st.DataLoader):
        try:
            lengths.append(len(cls(dataset, **kwargs)))
        except TypeError as error:
            lengths.append(type(error))
    assert lengths[1] == lengths[0]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("batch_size", [None, 2])
@pytest.mark.parametrize("name", sorted(SAMPLERS))
def test_a_samplers_indices(name: str, batch_size: int | None, num_workers: int) -> None:
    _same(Seen(), sampler=SAMPLERS[name](), batch_size=batch_size, num_workers=num_workers)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("name", sorted(BATCH_SAMPLERS))
def test_a_batch_samplers_batches(name: str, num_workers: int) -> None:
    _same(Seen(), batch_sampler=BATCH_SAMPLERS[name](), num_workers=num_workers)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("batch_size", [None, 2])
def test_a_dict_like_datasets_keys(batch_size: int | None, num_workers: int) -> None:
    _same(Keyed(), sampler=["a", ("x", 1), "b", ("y", 2)], batch_size=batch_size, num_workers=num_workers)


def _generators() -> list[Iterator[int]]:
    return [(j for j in (2 * i, 2 * i + 1)) for i in range(3)]


@pytest.mark.timeout(60)
def test_a_batch_of_a_generator_without_workers_as_torch() -> None:
    _same(Seen(), batch_sampler=Items(_generators))


@pytest.mark.timeout(60)
def test_a_batch_of_a_generator_reaches_a_worker_as_a_list() -> None:
    loader = st.DataLoader(Seen(), batch_sampler=Items(_generators), num_workers=2)
    try:
        ours = list(loader)
    finally:
        loader.close()
    theirs = list(tdata.DataLoader(Seen(), batch_sampler=[[0, 1], [2, 3], [4, 5]]))
    assert_same_structure(ours, theirs)


def _two_epochs(loader: Any) -> list[Any]:
    """Each epoch's batches (as lists), or the type of the error that ended it."""
    epochs: list[Any] = []
    try:
        for _ in range(2):
            try:
                epochs.append([batch["i"].tolist() for batch in loader])
            except Exception as error:  # noqa: BLE001  (the outcome compared is the error's type)
                epochs.append(type(error))
    finally:
        if hasattr(loader, "close"):
            loader.close()
    return epochs


@pytest.mark.timeout(60)
def test_a_one_pass_iterator_given_again_is_read_once_as_without_workers() -> None:
    """The main process reads a batch that is an iterator once (to send it as a list): the same
    object given again in the next epoch is empty, as torch's loader without workers finds it
    (torch's workers get a pickled copy of a list's iterator instead, the original never read)."""
    batches: Any = [iter([1, 2, 3])]  # torch's stubs ask for lists of indices
    theirs = _two_epochs(tdata.DataLoader(Seen(), batch_sampler=batches))
    ours = _two_epochs(st.DataLoader(Seen(), batch_sampler=[iter([1, 2, 3])], num_workers=2))
    assert theirs == [[[1, 2, 3]], IndexError]
    assert ours == theirs
