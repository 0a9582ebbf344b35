"""Samplers: the order in which the main process asks for sample indices, as torch's samplers do.

Owns ``Sampler``, ``SequentialSampler``, ``RandomSampler``, ``SubsetRandomSampler``,
``WeightedRandomSampler``, ``BatchSampler`` and ``DistributedSampler``. Runs in the main process:
indices are made there and sent to workers as tasks.

Promises: torch's arguments, validation, error types and messages; Python ints out. With a
``torch.Generator`` — or ``generator=None`` while torch is imported, where torch uses its global
RNG — every sampler yields exactly torch's sequence for the same generator state, because it runs
the very torch ops torch runs (see :mod:`shmloader._generators`). With an int seed or a
``numpy.random.Generator`` the same structure is drawn with numpy. ``isinstance(torch_sampler,
Sampler)`` is True once torch is imported. Importing this module does not import torch.
"""

from __future__ import annotations

import importlib.util
import itertools
import math
import os
import sys
from collections.abc import Iterable, Iterator, Mapping, Sequence, Sized
from typing import Any, Generic, TypeVar

import numpy as np

from shmloader import _generators
from shmloader.datasets import TorchTwinMeta
from shmloader.state_objects import check_epoch_state

__all__ = [
    "Sampler",
    "SequentialSampler",
    "RandomSampler",
    "SubsetRandomSampler",
    "WeightedRandomSampler",
    "BatchSampler",
    "DistributedSampler",
]

T_co = TypeVar("T_co", covariant=True)


def check_positive_int(name: str, value: object) -> None:
    """torch's check of a count (``batch_size``, ``num_samples``): an int, not a bool, above 0;
    else its ValueError, word for word."""
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{name} should be a positive integer value, but got {name}={value}")


class Sampler(Generic[T_co], metaclass=TorchTwinMeta):
    """Base class: subclasses implement ``__iter__`` (indices or lists of indices), usually ``__len__``."""

    _torch_twin = "Sampler"

    def __iter__(self) -> Iterator[T_co]:
        raise NotImplementedError

    # No default __len__, as in torch: list(x) and friends fall back to __iter__ when it is absent.


class _GeneratorMixin:
    """Keeps ``generator`` as the user gave it, and the stream to draw from (int seed resolved once)."""

    _generator: Any
    _source: Any

    @property
    def generator(self) -> Any:
        return self._generator

    @generator.setter
    def generator(self, value: Any) -> None:
        self._source = _generators.resolve_generator(value)
        self._generator = value


class SequentialSampler(Sampler[int]):
    """``0, 1, ..., len(data_source) - 1``."""

    def __init__(self, data_source: Sized) -> None:
        self.data_source = data_source

    def __iter__(self) -> Iterator[int]:
        return iter(range(len(self.data_source)))

    def __len__(self) -> int:
        return len(self.data_source)


class RandomSampler(_GeneratorMixin, Sampler[int]):
    """Shuffled indices (whole permutations, then a partial one), or ``num_samples`` draws with replacement.

    With ``generator=None`` each pass draws a fresh generator's seed from the global RNG, as torch
    does (see :func:`shmloader._generators.new_seed_for_sampler`).
    """

    def __init__(
        self,
        data_source: Sized,
        replacement: bool = False,
        num_samples: int | None = None,
        generator: _generators.RandomSource = None,
    ) -> None:
        self.data_source = data_source
        self.replacement = replacement
        self._num_samples = num_samples
        self.generator = generator
        if not isinstance(self.replacement, bool):
            raise TypeError(
                f"replacement should be a boolean value, but got replacement={self.replacement}"
            )
        if not isinstance(self.num_samples, int) or self.num_samples <= 0:
            raise ValueError(
                "num_samples should be a positive integer value, "
                f"but got num_samples={self.num_samples}"
            )

    @property
    def num_samples(self) -> int:
        # The dataset's size may change at runtime, as torch allows.
        if self._num_samples is None:
            return len(self.data_source)
        return self._num_samples

    def __iter__(self) -> Iterator[int]:
        n = len(self.data_source)
        source = _generators.new_seed_for_sampler(self._source)
        if self.replacement:
            # torch draws in chunks of 32 so that a partly consumed pass wastes little entropy.
            for _ in range(self.num_samples // 32):
                yield from _generators.randint(n, 32, source)
            yield from _generators.randint(n, self.num_samples % 32, source)
        else:
            for _ in range(self.num_samples // n):
                yield from _generators.randperm(n, source)
            yield from _generators.randperm(n, source)[: self.num_samples % n]

    def __len__(self) -> int:
        return self.num_samples


def _python_scalar(item: Any) -> Any:
    """numpy / torch integer scalars become Python ints; anything else is left as it is."""
    if isinstance(item, np.generic) or getattr(item, "ndim", None) == 0:
        return item.item()
    return item


class SubsetRandomSampler(_GeneratorMixin, Sampler[int]):
    """The given indices, in a random order (without replacement)."""

    def __init__(
        self, indices: Sequence[int], generator: _generators.RandomSource = None
    ) -> None:
        self.indices = indices
        self.generator = generator

    def __iter__(self) -> Iterator[int]:
        for i in _generators.randperm(len(self.indices), self._source):
            yield _python_scalar(self.indices[i])

    def __len__(self) -> int:
        return len(self.indices)


def _weights_array(weights: Any) -> np.ndarray:
    """Weights as a float64 numpy array (a torch tensor is detached and moved to the CPU first)."""
    if hasattr(weights, "detach") and hasattr(weights, "cpu"):
        weights = weights.detach().cpu().double().numpy()
    array = np.asarray(weights, dtype=np.float64)
    if array.ndim != 1:
        raise ValueError(
            "weights should be a 1d sequence but given "
            f"weights have shape {tuple(array.shape)}"
        )
    return array


class WeightedRandomSampler(_GeneratorMixin, Sampler[int]):
    """``num_samples`` indices of ``range(len(weights))`` drawn with probability proportional to weight.

    ``weights`` is kept as a float64 numpy array; editing it in place changes later passes.
    """

    weights: np.ndarray

    def __init__(
        self,
        weights: Sequence[float],
        num_samples: int,
        replacement: bool = True,
        generator: _generators.RandomSource = None,
    ) -> None:
        check_positive_int("num_samples", num_samples)
        if not isinstance(replacement, bool):
            raise ValueError(
                f"replacement should be a boolean value, but got replacement={replacement}"
            )
        self.weights = _weights_array(weights)
        self.num_samples = num_samples
        self.replacement = replacement
        self.generator = generator

    def __iter__(self) -> Iterator[int]:
        yield from _generators.multinomial(
            self.weights, self.num_samples, self.replacement, self._source
        )

    def __len__(self) -> int:
        return self.num_samples


class BatchSampler(Sampler[list[int]]):
    """Groups the indices of ``sampler`` (any iterable) into lists of ``batch_size``."""

    def __init__(
        self, sampler: Sampler[int] | Iterable[int], batch_size: int, drop_last: bool
    ) -> None:
        # No isinstance check on sampler: an object with only __getitem__ is iterable too.
        check_positive_int("batch_size", batch_size)
        if not isinstance(drop_last, bool):
            raise ValueError(f"drop_last should be a boolean value, but got drop_last={drop_last}")
        self.sampler = sampler
        self.batch_size = batch_size
        self.drop_last = drop_last

    def __iter__(self) -> Iterator[list[int]]:
        sampler_iter = iter(self.sampler)
        if self.drop_last:
            # zip over batch_size references to one iterator stops at the last full batch.
            for full in zip(*[sampler_iter] * self.batch_size):
                yield [*full]
            return
        batch = [*itertools.islice(sampler_iter, self.batch_size)]
        while batch:
            yield batch
            batch = [*itertools.islice(sampler_iter, self.batch_size)]

    def __len__(self) -> int:
        size = len(self.sampler)  # type: ignore[arg-type]
        if self.drop_last:
            return size // self.batch_size
        return (size + self.batch_size - 1) // self.batch_size


def _from_env(variable: str) -> int | None:
    """An int from the environment (torchrun sets RANK and WORLD_SIZE), None when unset."""
    raw = os.environ.get(variable)
    if raw is None or raw.strip() == "":
        return None
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"environment variable {variable} must be an int, got {raw!r}") from None


def _from_torch_distributed(what: str) -> int | None:
    """world size or rank from torch.distributed, if it is imported and initialised; else None."""
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return None
    return int(dist.get_world_size() if what == "world_size" else dist.get_rank())


def _resolve(value: int | None, variable: str, what: str) -> int:
    """``value``, else an initialised process group's (torch's only source: a stale RANK/WORLD_SIZE
    must not give another shard than torch's), else torchrun's environment variable."""
    found = value if value is not None else _from_torch_distributed(what)
    found = found if found is not None else _from_env(variable)
    if found is not None:
        return found
    raise RuntimeError(
        f"DistributedSampler could not find its {what}: pass num_replicas= and rank=, "
        "set the WORLD_SIZE and RANK environment variables (torchrun sets both), "
        "or initialise torch.distributed before building the sampler"
    )


def _shuffled(n: int, seed: int) -> list[int]:
    """randperm(n) from a generator seeded with ``seed``: torch's when torch is installed.

    Installed, not merely imported: every rank must draw the same permutation whatever each
    happened to import, and a distributed job has torch anyway.
    """
    if sys.modules.get("torch") is not None or importlib.util.find_spec("torch") is not None:
        import torch

        g = torch.Generator()
        g.manual_seed(seed)
        return torch.randperm(n, generator=g).tolist()
    return np.random.default_rng(seed).permutation(n).tolist()


class DistributedSampler(Sampler[int]):
    """This rank's share of the dataset: every ``num_replicas``-th index from ``rank``, as torch.

    ``num_replicas`` and ``rank`` default to an initialised torch.distributed (as torch's), else to
    the WORLD_SIZE and RANK environment variables (torchrun sets both). Without ``drop_last`` the index list is padded by repeating
    its head to a multiple of ``num_replicas``; with it the tail is dropped. Call
    :meth:`set_epoch` before each epoch: the shuffle is seeded with ``seed + epoch``.
    """

    def __init__(
        self,
        dataset: Sized,
        num_replicas: int | None = None,
        rank: int | None = None,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
    ) -> None:
        num_replicas = _resolve(num_replicas, "WORLD_SIZE", "world_size")
        rank = _resolve(rank, "RANK", "rank")
        if rank >= num_replicas or rank < 0:
            raise ValueError(
                f"Invalid rank {rank}, rank should be in the interval [0, {num_replicas - 1}]"
            )
        self.dataset = dataset
        self.num_replicas = num_replicas
        self.rank = rank
        self.epoch = 0
        self.drop_last = drop_last
        n = len(dataset)
        if self.drop_last and n % self.num_replicas != 0:
            # The largest share every rank can have without repeating an index.
            self.num_samples = math.ceil((n - self.num_replicas) / self.num_replicas)
        else:
            self.num_samples = math.ceil(n / self.num_replicas)
        self.total_size = self.num_samples * self.num_replicas
        self.shuffle = shuffle
        self.seed = seed

    def _all_indices(self) -> list[int]:
        """Every rank's indices, padded or cut to total_size."""
        n = len(self.dataset)
        indices = _shuffled(n, self.seed + self.epoch) if self.shuffle else list(range(n))
        if self.drop_last:
            return indices[: self.total_size]
        padding_size = self.total_size - len(indices)
        if padding_size <= len(indices):
            return indices + indices[:padding_size]
        return indices + (indices * math.ceil(padding_size / len(indices)))[:padding_size]

    def __iter__(self) -> Iterator[int]:
        indices = self._all_indices()
        if len(indices) != self.total_size:
            raise AssertionError(
                f"Number of indices ({len(indices)}) does not match total_size ({self.total_size})"
            )
        indices = indices[self.rank : self.total_size : self.num_replicas]
        if len(indices) != self.num_samples:
            raise AssertionError(
                f"Number of subsampled indices ({len(indices)}) does not match "
                f"num_samples ({self.num_samples})"
            )
        return iter(indices)

    def __len__(self) -> int:
        return self.num_samples

    def set_epoch(self, epoch: int) -> None:
        """Set the epoch: with shuffle=True each epoch gets its own order, the same on every rank."""
        self.epoch = epoch

    def state_dict(self) -> dict[str, int]:
        """What fixes this rank's next pass (saved by ``DataLoader.state_dict`` when an epoch starts)."""
        return {"epoch": self.epoch, "seed": self.seed, "num_replicas": self.num_replicas, "rank": self.rank}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore ``state_dict()``. A state of another rank, world size or seed, or a malformed one
        (not a mapping, a key missing, an epoch that is no integer >= 0), is refused with a
        ``StateError`` (a ValueError) naming the field, and the sampler is left as it was."""
        self.epoch = check_epoch_state("DistributedSampler", self.state_dict(), state)
