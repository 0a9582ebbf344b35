"""``shmloader.torch.DataLoader``: a real ``torch.utils.data.DataLoader`` whose batches come from shmloader.

Owns the torch flavour's class and its re-instantiation contract. Runs in the main process (a
forked worker inherits the object but never iterates it). Promises:

- ``isinstance(loader, torch.utils.data.DataLoader)`` is True, so frameworks that look for torch's
  class (Lightning, accelerate, ...) treat it as one: Lightning injects its ``DistributedSampler``
  and prediction index tracker, and does not ``iter()`` it to probe it.
- ``__init__``'s signature is torch's, plus shmloader's options as keyword-only extras; batches are
  exactly what torch's loader yields (``shmloader.collate.torch_default_collate``).
- The attributes torch's class and its integrations read exist with torch's meaning:
  ``dataset, batch_size, drop_last, sampler, batch_sampler, num_workers, collate_fn, pin_memory,
  timeout, worker_init_fn, multiprocessing_context, generator, prefetch_factor,
  persistent_workers, pin_memory_device, in_order``, ``_dataset_kind``, ``_iterator``,
  ``_IterableDataset_len_called``, ``_DataLoader__initialized`` (the same name-mangled flags as
  torch's, since both classes are called ``DataLoader``), ``_index_sampler``, ``_auto_collation``,
  ``_get_iterator`` and ``check_worker_number_rationality``.
- Re-instantiation: every ``__init__`` argument can be read back from the same-named attribute
  (shmloader's extras as they were passed: ``None`` leaves them to ``SHMLOADER_*``/defaults), so
  ``type(loader)(**kwargs read from attributes, sampler=new)`` — what Lightning does — builds a
  shmloader loader with the same options. :func:`init_kwargs` does that reading for any torch
  DataLoader (accelerate's wrapper included: see :mod:`shmloader.torch.accelerate`).
- Default samplers are torch's own classes (``RandomSampler``, ``SequentialSampler``,
  ``BatchSampler``), and the default ``collate_fn`` is torch's own ``default_collate`` (or
  ``default_convert`` without batching), as frameworks test for them (Lightning decides ``shuffle`` of its
  DistributedSampler by ``isinstance(sampler, RandomSampler)``). An int seed or numpy Generator
  as ``generator`` (a shmloader extension torch's samplers do not accept) keeps shmloader's
  RandomSampler, which draws the same structure with numpy.
- Dropping the persistent iterator (``loader._iterator = None``, as Lightning does when a loop
  ends) closes it, where torch's would be shut down by ``_shutdown_workers``.

See docs/frameworks.md.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Iterable
from typing import Any, TypeVar

import torch
from torch.utils.data import BatchSampler as _TorchBatchSampler
from torch.utils.data import DataLoader as _TorchDataLoader
from torch.utils.data import RandomSampler as _TorchRandomSampler
from torch.utils.data import SequentialSampler as _TorchSequentialSampler
from torch.utils.data import default_collate as _torch_default_collate
from torch.utils.data import default_convert as _torch_default_convert
from torch.utils.data.dataloader import _DatasetKind, _InfiniteConstantSampler

from shmloader.engine.iterator import BaseIter
from shmloader.engine.plan import Plan
from shmloader.loader import DataLoader as _ShmDataLoader
from shmloader.samplers import RandomSampler as _ShmRandomSampler
from shmloader.torch import datapipes

__all__ = ["DataLoader", "EXTRA_OPTIONS", "TORCH_OPTIONS", "init_kwargs"]

# torch's own __init__ parameters, in order (dataset first), and the keyword-only ones shmloader adds.
TORCH_OPTIONS: tuple[str, ...] = tuple(p for p in inspect.signature(_TorchDataLoader.__init__).parameters
                                       if p != "self")
EXTRA_OPTIONS: dict[str, Any] = {
    name: p.default for name, p in inspect.signature(_ShmDataLoader.__init__).parameters.items()
    if name != "self" and name not in TORCH_OPTIONS
}
# What fixes the index order; init_kwargs reads these back as torch's __init__ would need them.
_SAMPLING = ("batch_size", "shuffle", "sampler", "batch_sampler", "drop_last")
# Options that only mean something with workers: without workers, torch refuses the first three and
# its single-process iterator fails on a timeout. init_kwargs gives them torch's defaults then.
_WORKER_ONLY: dict[str, Any] = {
    name: p.default for name, p in inspect.signature(_TorchDataLoader.__init__).parameters.items()
    if name in ("prefetch_factor", "persistent_workers", "multiprocessing_context", "timeout")
}
T_co = TypeVar("T_co", covariant=True)


# ignore[misc]: the bases type __iter__/_get_iterator by their own iterator classes (ours wins in the MRO).
# Generic in the batch type, as both bases are: ``DataLoader[T]`` works as torch's does.
class DataLoader(_ShmDataLoader[T_co], _TorchDataLoader[T_co]):  # type: ignore[misc]
    """torch's ``DataLoader`` (a subclass of it) whose batches come from shmloader's workers and slot ring.

    Takes torch's arguments and, keyword-only, shmloader's (docs/config.md). Batches are torch
    tensors exactly as torch's ``default_collate`` makes them; with ``num_workers > 0`` they are
    views of shared-memory slots. See the module docstring for what frameworks may rely on.
    """

    _to_torch = True
    # shmloader's options, kept as attributes by __init__ (re-instantiation reads them): declared so
    # that a type checker knows them, typed as __init__ takes them (tests/test_torch_extras_typed.py)
    slot_bytes: int | None
    max_slots: int | None
    shm_dir: str | None
    sweep: bool | None
    on_worker_death: str | None
    max_restarts: int | None
    max_task_attempts: int | None
    task_seeding: bool | None
    dispatch: str | None
    task_timeout_s: float | None
    collate_threads: int | None
    log_level: str | None
    plugins: Iterable[Any] | None

    @functools.wraps(_ShmDataLoader.__init__)  # type: ignore[misc]  # torch's signature + extras, for inspect
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        # Defined here (not inherited) so that Lightning's _replace_dunder_methods, which wraps the
        # __init__ of torch's DataLoader subclasses that define one, records our arguments too.
        super().__init__(*args, **kwargs)
        self._dataset_kind = _DatasetKind.Iterable if self._is_iterable else _DatasetKind.Map
        for name, default in EXTRA_OPTIONS.items():  # the extras as passed, for re-instantiation
            object.__setattr__(self, name, self._explicit.get(name, default))

    def _adopt_dataset(self, dataset: Any, shuffle: bool | None) -> tuple[Any, bool | None]:
        return datapipes.adopt(dataset, shuffle)

    def _plan(self) -> Plan:
        return datapipes.epoch_plan(self, super()._plan())  # a DataPipe is seeded and sharded each epoch

    def _get_iterator(self) -> BaseIter:  # type: ignore[override]  # torch annotates its own iterator class
        it = super()._get_iterator()
        datapipes.iterator_made(self)
        return it

    def _default_sampler(self, dataset: Any, shuffle: bool, generator: Any) -> Any:
        if self._is_iterable:
            return _InfiniteConstantSampler()
        if not shuffle:
            return _TorchSequentialSampler(dataset)
        if generator is None or isinstance(generator, torch.Generator):
            return _TorchRandomSampler(dataset, generator=generator)
        return _ShmRandomSampler(dataset, generator=generator)  # int seed / numpy Generator

    def _default_batch_sampler(self, sampler: Any, batch_size: int, drop_last: bool) -> Any:
        return _TorchBatchSampler(sampler, batch_size, drop_last)

    def _default_collate_fn(self) -> Any:
        # torch's own function objects, so `loader.collate_fn is default_collate` holds as with torch's
        # loader; the loader recognises them (_collate_plan) and still collates into the slot.
        return _torch_default_collate if self._auto_collation else _torch_default_convert

    @property  # type: ignore[override]  # torch annotates its own iterator class; ours is shmloader's
    def _iterator(self) -> BaseIter | None:
        """The persistent iterator (``persistent_workers=True``), as torch's ``_iterator``."""
        return self.__dict__.get("_persistent_iterator")

    @_iterator.setter
    def _iterator(self, iterator: BaseIter | None) -> None:
        old = self.__dict__.get("_persistent_iterator")
        self.__dict__["_persistent_iterator"] = iterator
        creator = self.__dict__.get("_creator")
        if (old is not None and old is not iterator and not getattr(old, "closed", False)
                and creator is not None and creator.here):
            old.close()  # torch's is shut down by whoever drops it (Lightning: _shutdown_workers)


def init_kwargs(loader: _TorchDataLoader, **overrides: Any) -> dict[str, Any]:
    """Keyword arguments that rebuild ``loader`` (any torch DataLoader), read from its attributes.

    torch's options come back as torch's ``__init__`` needs them: a given ``batch_sampler`` alone
    (torch then reports ``batch_size=None``), otherwise ``sampler``, ``batch_size`` and
    ``drop_last`` (no sampler for an IterableDataset). shmloader's extras that were passed are
    included when ``loader`` is a ``shmloader.torch.DataLoader``. ``overrides`` replace any of them;
    an option ``DataLoader`` does not take raises TypeError naming it. When the resulting
    ``num_workers`` is 0, the worker-only options not overridden (``prefetch_factor``,
    ``persistent_workers``, ``multiprocessing_context``, ``timeout``) take torch's defaults, so
    ``init_kwargs(loader, num_workers=0)`` rebuilds a loader with workers as one without.
    """
    kwargs: dict[str, Any] = {"dataset": loader.dataset}
    kwargs.update(_sampling_kwargs(loader))
    for name in TORCH_OPTIONS:
        if name not in kwargs and name not in _SAMPLING:
            kwargs[name] = getattr(loader, name)
    if isinstance(loader, DataLoader):  # the extras that were passed (None: not passed, left to SHMLOADER_*)
        kwargs.update({name: value for name in EXTRA_OPTIONS if (value := getattr(loader, name)) is not None})
    unknown = sorted(set(overrides) - set(TORCH_OPTIONS) - set(EXTRA_OPTIONS))
    if unknown:
        raise TypeError(f"init_kwargs() got options DataLoader does not take: {', '.join(unknown)}")
    kwargs.update(overrides)
    if kwargs.get("num_workers", 0) == 0:  # what torch refuses (or cannot iterate) without workers
        kwargs.update({name: default for name, default in _WORKER_ONLY.items() if name not in overrides})
    return kwargs


def _sampling_kwargs(loader: _TorchDataLoader) -> dict[str, Any]:
    if isinstance(loader.dataset, torch.utils.data.IterableDataset) or _is_iterable_kind(loader):
        return {"batch_size": loader.batch_size, "drop_last": loader.drop_last}
    if loader.batch_size is None and loader.batch_sampler is not None:
        return {"batch_sampler": loader.batch_sampler}
    return {"sampler": loader.sampler, "batch_size": loader.batch_size, "drop_last": loader.drop_last}


def _is_iterable_kind(loader: Any) -> bool:
    return getattr(loader, "_dataset_kind", None) == _DatasetKind.Iterable

