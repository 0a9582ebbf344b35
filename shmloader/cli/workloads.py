"""The benchmark's workloads: synthetic datasets, and the consumer side of the training loop.

Owns the three workloads of ``python -m shmloader bench`` (*tiny*, *image*, *big*), the one
dataset type both loaders read, what the consumer does with a batch (touch it on the CPU, or move
it to a GPU), and the host-to-device copy measurement of ``--device`` mode. Runs in the benchmark's main process and, pickled, in loader
workers (fork, spawn or forkserver), which is why :class:`CachedSampleDataset` lives at module
level and rebuilds its cache after unpickling instead of shipping it.

Promises: ``dataset[i]`` returns cached numpy arrays, so fetching a sample costs almost nothing and
what the benchmark measures is collation and transport; :func:`touch_batch` reads every 4 KiB page
of every array in a batch, whether the batch holds numpy arrays or torch tensors (CPU or CUDA).
Importing this module does not import torch; the device helpers import it when called.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np

from shmloader.cli.records import Bandwidth
from shmloader.gpu.batch_tree import iter_leaves

__all__ = [
    "Field",
    "Workload",
    "WORKLOADS",
    "CachedSampleDataset",
    "iter_arrays",
    "touch_batch",
    "deliver",
    "measure_h2d",
]

PAGE_BYTES = 4096
_H2D_TARGET_BYTES = 1 << 30  # copied per source buffer in the bandwidth table
_DISTINCT_SAMPLES = 8  # cached samples a dataset cycles through; enough to defeat trivial reuse


@dataclass(frozen=True, slots=True)
class Field:
    """One element of a sample: an array of ``shape`` and ``dtype`` (``()`` is a numpy scalar)."""

    shape: tuple[int, ...]
    dtype: str

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * np.dtype(self.dtype).itemsize


@dataclass(frozen=True, slots=True)
class Workload:
    """A named benchmark case: what one sample holds, the batch size, the default batch count."""

    name: str
    fields: tuple[Field, ...]
    batch_size: int
    default_batches: int
    description: str

    @property
    def sample_bytes(self) -> int:
        return sum(field.nbytes for field in self.fields)

    @property
    def batch_bytes(self) -> int:
        return self.sample_bytes * self.batch_size

    def dataset(self, num_batches: int) -> CachedSampleDataset:
        """A dataset exactly ``num_batches`` full batches long."""
        return CachedSampleDataset(self.fields, num_batches * self.batch_size)


# Default batch counts keep a default run (3 workloads x workers 0,2 x 2 loaders) under a minute
# on 2 cores; see docs/performance.md.
WORKLOADS: dict[str, Workload] = {
    w.name: w
    for w in (
        Workload(
            "tiny",
            (Field((16,), "float32"), Field((), "int64")),
            batch_size=64,
            default_batches=3000,
            description="float32[16] + int64 label",
        ),
        Workload(
            "image",
            (Field((224, 224, 3), "uint8"), Field((), "int64")),
            batch_size=64,
            default_batches=400,
            description="uint8[224,224,3] + int64 label",
        ),
        Workload(
            "big",
            (Field((1024, 1024), "float32"),),
            batch_size=16,
            default_batches=80,
            description="float32[1024,1024]",
        ),
    )
}


class CachedSampleDataset:
    """A map-style dataset of ``length`` samples that returns a few cached numpy samples in turn.

    A sample is a tuple with one entry per field (a lone field is returned bare). The cache is
    built on first use in each process and is never pickled, so spawned workers receive only the
    field list.
    """

    def __init__(self, fields: tuple[Field, ...], length: int) -> None:
        if length < 0:
            raise ValueError(f"length must be non-negative, got {length}")
        self.fields = fields
        self.length = length
        self._cache: list[Any] | None = None

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> Any:
        if not 0 <= index < self.length:
            raise IndexError(f"index {index} out of range for a dataset of {self.length}")
        if self._cache is None:
            self._cache = [self._make_sample(k) for k in range(_DISTINCT_SAMPLES)]
        return self._cache[index % _DISTINCT_SAMPLES]

    def __getstate__(self) -> dict[str, Any]:
        return {"fields": self.fields, "length": self.length}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.fields = state["fields"]
        self.length = state["length"]
        self._cache = None

    def _make_sample(self, k: int) -> Any:
        values = tuple(_make_value(field, k) for field in self.fields)
        return values[0] if len(values) == 1 else values


def _make_value(field: Field, k: int) -> Any:
    dtype = np.dtype(field.dtype)
    if field.shape == ():
        return dtype.type(k)
    count = int(np.prod(field.shape, dtype=np.int64))
    # A cheap, non-constant fill: the values matter only in that pages are really written.
    values = (np.arange(count, dtype=np.int64) + k) % 251
    return values.astype(dtype).reshape(field.shape)


def iter_arrays(batch: Any) -> Iterator[Any]:
    """Yield every array or tensor inside a batch (nested tuples, lists and mappings)."""
    return (leaf for leaf in iter_leaves(batch) if isinstance(leaf, np.ndarray) or hasattr(leaf, "data_ptr"))


def touch_batch(batch: Any) -> float:
    """Read every page of every array in ``batch``; return a checksum so the work is real.

    CUDA tensors are reduced on their device (asynchronously: the caller synchronises).
    """
    total = 0.0
    for array in iter_arrays(batch):
        if getattr(array, "is_cuda", False):
            array.sum()
            continue
        total += _touch_pages(_as_numpy(array))
    return total


def _as_numpy(array: Any) -> np.ndarray:
    if isinstance(array, np.ndarray):
        return array
    return array.detach().numpy()  # a CPU torch tensor: a view, no copy


def _touch_pages(array: np.ndarray) -> float:
    if array.size == 0:
        return 0.0
    if not array.flags.c_contiguous:
        array = np.ascontiguousarray(array)  # the copy reads every page itself
    flat = array.reshape(-1).view(np.uint8)
    # One byte per page from the start, plus the last byte, whose page the stride can miss.
    return float(flat[::PAGE_BYTES].sum(dtype=np.uint64)) + float(flat[-1])


# --- device mode: what a GPU training loop does with a batch ----------------------------------


def deliver(name: str, loader: Any, device: str) -> Iterable[Any]:
    """What the training loop iterates: the loader itself, or its batches on ``device``.

    shmloader's batches go through its device prefetcher ``shmloader.to_device`` when it exists;
    torch's are moved per batch with ``.to(device, non_blocking=True)``, as its docs advise.
    """
    if device == "cpu":
        return loader
    if name == "shmloader":
        import shmloader

        to_device = getattr(shmloader, "to_device", None)
        if to_device is not None:
            return to_device(loader, device)
    return _move_each(loader, device)


def _move_each(loader: Iterable[Any], device: str) -> Iterator[Any]:
    for batch in loader:
        yield _to_device(batch, device)


def _to_device(batch: Any, device: str) -> Any:
    import torch

    if isinstance(batch, dict):
        return {key: _to_device(value, device) for key, value in batch.items()}
    if isinstance(batch, (tuple, list)):
        return type(batch)(_to_device(value, device) for value in batch)
    if isinstance(batch, np.ndarray):
        batch = torch.from_numpy(batch)
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    return batch


def measure_h2d(workload: Workload, device: str, use_shmloader: bool) -> list[Bandwidth]:
    """Copy the workload's largest batch array to ``device`` from each kind of host buffer."""
    import torch

    field = max(workload.fields, key=lambda f: f.nbytes)
    shape = (workload.batch_size, *field.shape)
    dtype = torch.from_numpy(np.empty(0, dtype=field.dtype)).dtype
    rows = []
    if use_shmloader:
        with _shmloader_pinned_batch(workload) as slot_view:
            rows.append(_time_copies(workload.name, "shmloader slot (pin_memory=True)",
                                     slot_view, device))  # fmt: skip
            del slot_view  # before the loader closes
    pinned = torch.empty(shape, dtype=dtype, pin_memory=True)
    rows.append(_time_copies(workload.name, "torch.empty(pin_memory=True)", pinned, device))
    pageable = torch.empty(shape, dtype=dtype)
    rows.append(_time_copies(workload.name, "pageable torch.empty", pageable, device))
    return rows


@contextmanager
def _shmloader_pinned_batch(workload: Workload) -> Iterator[Any]:
    """The largest array of one shmloader batch, as a tensor viewing its (pinned) slot.

    The loader stays open while the view is used: closing it may unregister the slot.
    """
    import torch

    import shmloader

    loader_class: Any = getattr(shmloader, "DataLoader")
    # one worker, so the batch really lives in a (pinned) slot; the iterator is kept open meanwhile
    loader = loader_class(workload.dataset(workload.batch_size), batch_size=workload.batch_size,
                          pin_memory=True, num_workers=1, persistent_workers=True)
    try:
        it = iter(loader)
        batch = next(it)
        array = max(iter_arrays(batch), key=lambda a: a.nbytes)
        yield torch.from_numpy(array) if isinstance(array, np.ndarray) else array
    finally:
        batch = array = it = None
        close = getattr(loader, "close", None)
        if callable(close):
            close()
        del loader
        gc.collect()


def _time_copies(workload: str, source: str, src: Any, device: str) -> Bandwidth:
    import torch

    dst = torch.empty_like(src, device=device)
    nbytes = src.nelement() * src.element_size()
    copies = max(5, min(200, _H2D_TARGET_BYTES // max(1, nbytes)))
    dst.copy_(src, non_blocking=True)  # first copy: allocations and lazy CUDA set-up
    torch.cuda.synchronize(device)
    start = time.perf_counter()
    for _ in range(copies):
        dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize(device)
    seconds = time.perf_counter() - start
    return Bandwidth(workload, source, bool(src.is_pinned()), nbytes, copies, seconds)
