"""Map-style and iterable datasets, and their combinators, behaving as torch.utils.data's.

Owns: ``Dataset``, ``IterableDataset``, ``ArrayDataset`` (alias ``TensorDataset``),
``StackDataset``, ``ConcatDataset``, ``ChainDataset``, ``Subset``, ``random_split`` and
``is_iterable_dataset``. Runs wherever the user builds a dataset and in workers that index it.

Promises: torch's semantics, errors and messages (ConcatDataset's negative indices and bisection,
random_split's fraction rounding and round-robin remainder); torch's own datasets are accepted
wherever ours are — ``isinstance(torch_iterable_dataset, IterableDataset)`` and
``isinstance(torch_dataset, Dataset)`` are True (checked through ``sys.modules``, never by
importing torch); with a ``torch.Generator`` (or None while torch is imported) ``random_split``
makes exactly torch's splits. Importing this module does not import torch.
"""

from __future__ import annotations

import bisect
import itertools
import math
import sys
import warnings
from abc import ABCMeta
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, Generic, TypeVar, cast

from shmloader import _generators

__all__ = [
    "Dataset",
    "IterableDataset",
    "ArrayDataset",
    "TensorDataset",
    "StackDataset",
    "ConcatDataset",
    "ChainDataset",
    "Subset",
    "random_split",
    "is_iterable_dataset",
]

T_co = TypeVar("T_co", covariant=True)


def _torch_data_class(name: str) -> type | None:
    """torch.utils.data.<name> if torch's data package is already imported, else None."""
    module = sys.modules.get("torch.utils.data")
    cls = getattr(module, name, None)
    return cls if isinstance(cls, type) else None


class TorchTwinMeta(ABCMeta):
    """Metaclass that makes a base class also claim instances of its torch twin.

    A class whose own ``__dict__`` names ``_torch_twin`` (e.g. ``"IterableDataset"``) registers
    torch.utils.data's class of that name as a virtual subclass (``ABCMeta.register``) at the
    first isinstance/issubclass check after torch is imported. Registering, rather than answering
    ad hoc, keeps ABCMeta's caches right. Subclasses do not inherit the claim: a torch
    IterableDataset is not a ChainDataset.
    """

    def _register_torch_twin(cls) -> None:
        twin_name = cls.__dict__.get("_torch_twin")
        if twin_name is None or cls.__dict__.get("_torch_twin_registered"):
            return
        twin = _torch_data_class(twin_name)
        if twin is not None:
            # Flag first: register() itself asks issubclass, which would come back here.
            type.__setattr__(cls, "_torch_twin_registered", True)
            cls.register(twin)

    def __instancecheck__(cls, instance: Any) -> bool:
        cls._register_torch_twin()
        return super().__instancecheck__(instance)

    def __subclasscheck__(cls, subclass: type) -> bool:
        cls._register_torch_twin()
        return super().__subclasscheck__(subclass)


class Dataset(Generic[T_co], metaclass=TorchTwinMeta):
    """A map from keys to samples: subclasses implement ``__getitem__`` (and usually ``__len__``).

    May also implement ``__getitems__(indices) -> list`` to fetch a whole batch at once; the
    loader calls it when present, as torch's does. ``a + b`` is ``ConcatDataset([a, b])``.
    """

    _torch_twin = "Dataset"

    def __getitem__(self, index: Any) -> T_co:
        raise NotImplementedError("Subclasses of Dataset should implement __getitem__.")

    def __add__(self, other: Dataset[T_co]) -> ConcatDataset[T_co]:
        return ConcatDataset([self, other])

    # No default __len__, as in torch: list(x) and friends fall back to __iter__ when it is absent.


class IterableDataset(Dataset[T_co], Iterable[T_co]):
    """A stream of samples: subclasses implement ``__iter__``.

    With workers, each worker iterates its own copy and shards itself through
    ``get_worker_info()``. ``a + b`` is ``ChainDataset([a, b])``.
    """

    _torch_twin = "IterableDataset"

    def __add__(self, other: Dataset[T_co]) -> ChainDataset:  # type: ignore[override]
        return ChainDataset([self, other])


def is_iterable_dataset(obj: object) -> bool:
    """True for instances of our IterableDataset and of torch.utils.data.IterableDataset."""
    return isinstance(obj, IterableDataset)


def _first_dim(array: Any) -> int:
    shape = getattr(array, "shape", None)
    if shape is None or len(shape) == 0:
        raise ValueError(
            f"ArrayDataset needs arrays with at least one dimension, got {type(array).__name__}"
            + ("" if shape is None else f" of shape {tuple(shape)}")
        )
    return int(shape[0])


class ArrayDataset(Dataset[tuple]):
    """Rows of numpy arrays or torch tensors that share their first dimension (torch's TensorDataset).

    ``dataset[i]`` is ``tuple(array[i] for array in arrays)``. Other sequences are converted with
    ``numpy.asarray``.
    """

    arrays: tuple

    def __init__(self, *arrays: Any) -> None:
        if not arrays:
            raise ValueError("ArrayDataset needs at least one array")
        arrays = tuple(a if hasattr(a, "shape") else _as_numpy(a) for a in arrays)
        first = _first_dim(arrays[0])
        if any(_first_dim(a) != first for a in arrays):
            raise AssertionError("Size mismatch between tensors")
        self.arrays = arrays

    @property
    def tensors(self) -> tuple:
        """torch's name for :attr:`arrays`."""
        return self.arrays

    def __getitem__(self, index: Any) -> tuple:
        return tuple(array[index] for array in self.arrays)

    def __len__(self) -> int:
        return _first_dim(self.arrays[0])


def _as_numpy(value: Any) -> Any:
    import numpy as np

    return np.asarray(value)


#: torch's name for :class:`ArrayDataset`.
TensorDataset = ArrayDataset


class StackDataset(Dataset[Any]):
    """Zips datasets of equal length: ``StackDataset(a, b)[i] == (a[i], b[i])``, or a dict with kwargs."""

    datasets: tuple | dict

    def __init__(self, *args: Dataset, **kwargs: Dataset) -> None:
        if args and kwargs:
            raise ValueError(
                "Supported either ``tuple``- (via ``args``) or"
                "``dict``- (via ``kwargs``) like input/output, but both types are given."
            )
        if not args and not kwargs:
            raise ValueError("At least one dataset should be passed")
        parts = list(args) if args else list(kwargs.values())
        self._length = len(parts[0])  # type: ignore[arg-type]
        if any(self._length != len(d) for d in parts):  # type: ignore[arg-type]
            raise ValueError("Size mismatch between datasets")
        self.datasets = args if args else kwargs

    def __getitem__(self, index: Any) -> Any:
        if isinstance(self.datasets, dict):
            return {k: d[index] for k, d in self.datasets.items()}
        return tuple(d[index] for d in self.datasets)

    def __getitems__(self, indices: list) -> list:
        if isinstance(self.datasets, dict):
            columns = {k: _fetch_many(d, indices) for k, d in self.datasets.items()}
            return [{k: col[j] for k, col in columns.items()} for j in range(len(indices))]
        cols = [_fetch_many(d, indices) for d in self.datasets]
        return [tuple(col[j] for col in cols) for j in range(len(indices))]

    def __len__(self) -> int:
        return self._length


def _fetch_many(dataset: Any, indices: list) -> list:
    """dataset.__getitems__(indices) when it has one (length checked, as torch), else one by one."""
    getitems = getattr(dataset, "__getitems__", None)
    if not callable(getitems):
        return [dataset[i] for i in indices]
    items = getitems(indices)
    if len(items) != len(indices):
        raise ValueError(
            "Nested dataset's output size mismatch."
            f" Expected {len(indices)}, got {len(items)}"
        )
    return items


class ConcatDataset(Dataset[T_co]):
    """Datasets one after another; ``cumulative_sizes[k]`` is the total length of datasets 0..k."""

    datasets: list
    cumulative_sizes: list[int]

    @staticmethod
    def cumsum(sequence: Iterable[Any]) -> list[int]:
        return list(itertools.accumulate(len(e) for e in sequence))

    def __init__(self, datasets: Iterable[Dataset]) -> None:
        super().__init__()
        self.datasets = list(datasets)
        if len(self.datasets) == 0:
            raise AssertionError("datasets should not be an empty iterable")
        for d in self.datasets:
            if isinstance(d, IterableDataset):
                raise AssertionError("ConcatDataset does not support IterableDataset")
        self.cumulative_sizes = self.cumsum(self.datasets)

    def __len__(self) -> int:
        return self.cumulative_sizes[-1]

    def __getitem__(self, idx: int) -> T_co:
        if idx < 0:
            if -idx > len(self):
                raise ValueError("absolute value of index should not exceed dataset length")
            idx = len(self) + idx
        dataset_idx = bisect.bisect_right(self.cumulative_sizes, idx)
        sample_idx = idx if dataset_idx == 0 else idx - self.cumulative_sizes[dataset_idx - 1]
        return self.datasets[dataset_idx][sample_idx]


class ChainDataset(IterableDataset):
    """IterableDatasets one after another, chained lazily; each must be an IterableDataset."""

    def __init__(self, datasets: Iterable[Dataset]) -> None:
        super().__init__()
        self.datasets = datasets

    def __iter__(self) -> Iterator[Any]:
        for d in self.datasets:
            if not isinstance(d, IterableDataset):
                raise AssertionError("ChainDataset only supports IterableDataset")
            yield from d

    def __len__(self) -> int:
        total = 0
        for d in self.datasets:
            if not isinstance(d, IterableDataset):
                raise AssertionError("ChainDataset only supports IterableDataset")
            total += len(d)  # type: ignore[arg-type]
        return total


class Subset(Dataset[T_co]):
    """The samples of ``dataset`` at ``indices``; batches go through the parent's ``__getitems__``.

    As in torch, a subclass that overrides ``__getitem__`` must also override ``__getitems__``.
    """

    dataset: Any
    indices: Sequence[int]

    def __init__(self, dataset: Any, indices: Sequence[int]) -> None:
        self.dataset = dataset
        self.indices = indices
        cls = type(self)
        if cls.__getitem__ is not Subset.__getitem__ and cls.__getitems__ is Subset.__getitems__:
            raise NotImplementedError(
                f"{cls.__name__} overrides __getitem__ but not __getitems__. "
                "When subclassing Subset and overriding __getitem__, you must also override "
                "__getitems__ to ensure DataLoader works correctly with your custom logic. "
                "A simple implementation:\n\n"
                "def __getitems__(self, indices):\n"
                "    return [self.__getitem__(idx) for idx in indices]"
            )

    def __getitem__(self, idx: Any) -> T_co:
        if isinstance(idx, list):
            return self.dataset[[self.indices[i] for i in idx]]
        return self.dataset[self.indices[idx]]

    def __getitems__(self, indices: list[int]) -> list[T_co]:
        getitems = getattr(self.dataset, "__getitems__", None)
        if callable(getitems):
            return getitems([self.indices[idx] for idx in indices])
        return [self.dataset[self.indices[idx]] for idx in indices]

    def __len__(self) -> int:
        return len(self.indices)


def _lengths_from_fractions(fractions: Sequence[float], total: int) -> list[int]:
    """floor(total * f) per split, then the remainder one by one round-robin; warn on empty splits."""
    lengths: list[int] = []
    for i, frac in enumerate(fractions):
        if frac < 0 or frac > 1:
            raise ValueError(f"Fraction at index {i} is not between 0 and 1")
        lengths.append(math.floor(total * frac))
    for i in range(total - sum(lengths)):
        lengths[i % len(lengths)] += 1
    for i, length in enumerate(lengths):
        if length == 0:
            warnings.warn(
                f"Length of split at index {i} is 0. This might result in an empty dataset.",
                stacklevel=3,
            )
    return lengths


def random_split(
    dataset: Any,
    lengths: Sequence[int | float],
    generator: _generators.RandomSource = None,
) -> list[Subset]:
    """Split ``dataset`` into non-overlapping random Subsets of the given lengths or fractions.

    Fractions that sum to 1 become ``floor(frac * len(dataset))`` each, the remainder added one at
    a time round-robin, as torch does. ``generator=None`` means torch's default generator when
    torch is imported (torch's own default), else fresh numpy entropy.
    """
    if math.isclose(sum(lengths), 1) and sum(lengths) <= 1:
        lengths = _lengths_from_fractions(lengths, len(dataset))
    if sum(lengths) != len(dataset):
        raise ValueError("Sum of input lengths does not equal the length of the input dataset!")
    sizes = cast("list[int]", list(lengths))
    indices = _generators.randperm(sum(sizes), generator)
    return [
        Subset(dataset, indices[offset - size : offset])
        for offset, size in zip(itertools.accumulate(sizes), sizes)
    ]
