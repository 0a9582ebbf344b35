"""``DataLoader``: torch's signature and checks, wired to shmloader's engine.

Owns the loader's options (resolved once through ``config``: explicit argument > ``SHMLOADER_*``
environment variable > default), the default samplers, the choice of collation, and — with
``persistent_workers`` — the one multi-process iterator whose workers and ring outlive an epoch.
Runs in the main process. Promises torch's behaviour: the same validations, error types and
messages, ``len()`` rules, immutability of ``batch_size, batch_sampler, sampler, drop_last, dataset,
persistent_workers`` after construction, and a fresh sampler iteration each epoch. A loader pickles
and deep-copies as torch's does (what a copy carries: loader_copy.py); the call's explicit
arguments are recorded by loader_call.py.

``shmloader.DataLoader`` is numpy-native (numpy in, numpy out; tensors in, tensors out).
``shmloader.torch.DataLoader`` (shmloader/torch/loader.py) subclasses this class and torch's
DataLoader, sets ``_to_torch = True`` (it returns exactly what torch's ``default_collate`` returns)
and overrides ``_default_sampler``/``_default_batch_sampler`` to make torch's own samplers.
"""

from __future__ import annotations

import math
import functools
import multiprocessing
from collections.abc import Callable, Iterable
from multiprocessing.context import BaseContext
from typing import Any, Generic, TypeVar

from shmloader import collate as _collate
from shmloader import loader_checks as checks
from shmloader import loader_copy
from shmloader import loader_services as services
from shmloader._generators import RandomSource, seed_stream
from shmloader.config import DEFAULT, resolve_config
from shmloader.config_fields import FIELDS
from shmloader.datasets import is_iterable_dataset
from shmloader.engine.iterator import BaseIter, SingleProcessIter
from shmloader.engine import live
from shmloader.engine.live import LiveIterators
from shmloader.engine.plan import Plan
from shmloader.engine.start_limits import limits_named
from shmloader.epoch_book import EpochBook
from shmloader.events import Events
from shmloader.gpu import pinning
from shmloader.loader_call import records_explicit
from shmloader.log import apply_log_level
from shmloader.owner import ProcessOwner
from shmloader.plugins import build_plugin_manager
from shmloader.samplers import BatchSampler, RandomSampler, Sampler, SequentialSampler
from shmloader.warning_origin import TORCH_LOADER_MODULE, warn

T_co = TypeVar("T_co", covariant=True)

_CONFIG_OPTIONS = frozenset(f.name for f in FIELDS)  # the loader arguments an SHMLOADER_* variable can set
_IMMUTABLE = ("batch_size", "batch_sampler", "sampler", "drop_last", "dataset", "persistent_workers")


class _InfiniteConstantSampler(Sampler):
    """Analogous to ``itertools.repeat(None, None)``: the sampler of an IterableDataset."""

    def __iter__(self):  # type: ignore[no-untyped-def]
        while True:
            yield None


class DataLoader(Generic[T_co]):
    """Combines a dataset and a sampler and iterates over batches, as torch's DataLoader does.

    With ``num_workers > 0`` the workers collate each batch straight into a reusable shared-memory
    slot and the batches you receive are views of it; a slot is reused once you drop the batch.
    Options beyond torch's (keyword-only) are listed in docs/config.md, each also settable by an
    ``SHMLOADER_*`` environment variable.
    """

    _to_torch = False
    _explicit: dict[str, Any]  # set by _records_explicit before __init__ runs
    _generator_source: RandomSource  # set with ``generator`` (__setattr__): an int seed as its stream
    __initialized = False

    @records_explicit
    def __init__(
        self,
        dataset: Any,
        batch_size: int | None = 1,
        shuffle: bool | None = None,
        sampler: Sampler | Iterable | None = None,
        batch_sampler: Sampler | Iterable | None = None,
        num_workers: int = 0,
        collate_fn: Callable[[Any], Any] | None = None,
        pin_memory: bool = False,
        drop_last: bool = False,
        timeout: float = 0,
        worker_init_fn: Callable[[int], None] | None = None,
        multiprocessing_context: str | BaseContext | None = None,
        generator: Any = None,
        *,
        prefetch_factor: int | None = None,
        persistent_workers: bool = False,
        pin_memory_device: str = "",
        in_order: bool = True,
        slot_bytes: int | None = None,
        max_slots: int | None = None,
        shm_dir: str | None = None,
        sweep: bool | None = None,
        on_worker_death: str | None = None,
        max_restarts: int | None = None,
        max_task_attempts: int | None = None,
        task_seeding: bool | None = None,
        dispatch: str | None = None,
        task_timeout_s: float | None = None,
        collate_threads: int | None = None,
        log_level: str | None = None,
        plugins: Iterable[Any] | None = None,
    ) -> None:
        explicit = {k: v for k, v in self._explicit.items() if k in _CONFIG_OPTIONS}
        cfg = resolve_config(explicit)
        if cfg.provenance["log_level"] != DEFAULT:  # unset: the application's logging decides
            apply_log_level(cfg.log_level)
        num_workers, timeout, prefetch_factor = cfg.num_workers, cfg.timeout, cfg.prefetch_factor
        persistent_workers = cfg.persistent_workers
        num_workers = checks.check_counts(num_workers, timeout, prefetch_factor, persistent_workers)
        if num_workers > 0 and prefetch_factor is None:
            prefetch_factor = 2
        checks.check_max_slots(cfg.max_slots, num_workers, prefetch_factor, cfg.provenance["max_slots"])
        self._config = cfg
        self.num_workers = num_workers
        self.prefetch_factor = prefetch_factor
        self.pin_memory = cfg.pin_memory
        self.pin_memory_device = pin_memory_device
        self.timeout = timeout
        self.worker_init_fn = worker_init_fn
        self.multiprocessing_context = cfg.multiprocessing_context
        self.in_order = cfg.in_order
        self.dataset, shuffle = self._adopt_dataset(dataset, shuffle)
        self._is_iterable = is_iterable_dataset(dataset)
        batch_size, shuffle, drop_last = checks.check_sampling(self._is_iterable, batch_size, shuffle, sampler,
                                                               batch_sampler, drop_last)
        if batch_sampler is not None:
            batch_size, drop_last = None, False
        if sampler is None:
            sampler = self._default_sampler(dataset, shuffle, generator)
        if batch_size is not None and batch_sampler is None:
            batch_sampler = self._default_batch_sampler(sampler, batch_size, drop_last)
        self.batch_size = batch_size
        self.drop_last = drop_last
        self.sampler = sampler
        self.batch_sampler = batch_sampler
        self.generator = generator
        self.collate_fn = collate_fn if collate_fn is not None else self._default_collate_fn()
        self.persistent_workers = persistent_workers
        self._user_plugins = checks.plugin_list(plugins)  # a pickled or copied loader carries these (loader_copy.py)
        if self._explicit.get("plugins") is not None:
            self._explicit["plugins"] = self._user_plugins  # read back as given, even from a one-pass iterable
        self._start_machinery()
        self._IterableDataset_len_called: int | None = None
        self.__initialized = True
        self.check_worker_number_rationality()

    def _start_machinery(self) -> None:
        """What each loader object makes for itself, at construction and when unpickled or copied."""
        self._plugins = build_plugin_manager(self._user_plugins)
        self._events = Events(self._plugins)
        self._pin = pinning.PinState()  # the one pin backend, chosen with the first ring
        self._book = EpochBook(self)  # epochs, the latest record, a loaded resume (state.py's)
        self._iterator: BaseIter | None = None  # the persistent iterator
        self._live = LiveIterators()  # every iterator close() must stop, those being built included
        self._creator = ProcessOwner()

    def __getstate__(self) -> dict[str, Any]:
        """What a pickle or copy carries: the loader, never its iterators, workers or plugin manager."""
        return loader_copy.carried_state(self)

    def __setstate__(self, state: dict[str, Any]) -> None:
        loader_copy.restore(self, state)

    def __copy__(self) -> DataLoader[T_co]:
        """``copy.copy``: allowed with a persistent iterator, as torch allows it; the copy makes its own."""
        clone = type(self).__new__(type(self))
        clone.__setstate__(loader_copy.carried_state(self, shallow=True))
        return clone

    def _adopt_dataset(self, dataset: Any, shuffle: bool | None) -> tuple[Any, bool | None]:
        """The dataset kept and the ``shuffle`` checked (the torch flavour wraps DataPipes as torch)."""
        return dataset, shuffle

    # -- default samplers: shmloader's here; the torch flavour makes torch's own -----------------
    def _default_sampler(self, dataset: Any, shuffle: bool, generator: Any) -> Sampler | Iterable:
        """The sampler made when none is given (torch's rule: infinite / random / sequential)."""
        if self._is_iterable:
            return _InfiniteConstantSampler()
        if shuffle:
            return RandomSampler(dataset, generator=generator)
        return SequentialSampler(dataset)

    def _default_batch_sampler(self, sampler: Any, batch_size: int, drop_last: bool) -> Sampler | Iterable:
        """The batch sampler made when ``batch_size`` is given and ``batch_sampler`` is not."""
        return BatchSampler(sampler, batch_size, drop_last)

    # -- validation (torch's order, types and messages) -----------------------------------------
    @property
    def multiprocessing_context(self) -> BaseContext | None:
        return self.__multiprocessing_context

    @multiprocessing_context.setter
    def multiprocessing_context(self, context: str | BaseContext | None) -> None:
        self.__multiprocessing_context = checks.resolve_context(context, self.num_workers)

    def check_worker_number_rationality(self) -> None:
        """torch's warning when more workers are asked for than this process may use CPUs."""
        checks.warn_worker_number(self.num_workers, self._warning_module)

    @property
    def _warning_module(self) -> str | None:
        """The module the torch flavour's warnings in torch's words name (shmloader/warning_origin.py)."""
        return TORCH_LOADER_MODULE if self._to_torch else None

    def __setattr__(self, attr: str, value: Any) -> None:
        if self.__initialized and attr in _IMMUTABLE:
            raise ValueError(f"{attr} attribute should not be set after {type(self).__name__} is initialized")
        super().__setattr__(attr, value)
        if attr == "generator":  # the stream base seeds are drawn from: an int seed is seeded once, here
            super().__setattr__("_generator_source", seed_stream(value))

    # -- iteration -----------------------------------------------------------------------------
    @property
    def _auto_collation(self) -> bool:
        return self.batch_sampler is not None

    @property
    def _index_sampler(self) -> Any:
        return self.batch_sampler if self._auto_collation else self.sampler

    def __iter__(self) -> BaseIter:
        if self.num_workers > 0:
            live.refuse_if_exiting()  # a thread left to the exit, after its hook: no worker nothing would stop
        if self.persistent_workers and self.num_workers > 0:
            it = self._iterator
            if it is None or getattr(it, "closed", False):
                it = self._iterator = self._get_iterator()
                if getattr(it, "closed", False):  # a close() in another thread stopped it as it was built
                    self._iterator = None  # after the close's own reset: the loader keeps no closed one
            else:
                try:
                    with self._book.starting():  # a next epoch that fails to start starts no epoch either
                        it._reset(self._plan())
                except BaseException:
                    if getattr(it, "closed", False):  # closed as it failed: the next iter() draws a new seed
                        self._book.reused_seed = None
                    raise
            return it
        return self._get_iterator()

    def _get_iterator(self) -> BaseIter:
        """A new iterator, admitted to ``_live`` before it starts anything (engine/live.py)."""
        ticket = self._live.ticket()  # a close() from here on stops what this call starts, or refuses it
        pinning.check_requested(self)  # a bad SHMLOADER_PIN_BACKEND raises with workers or without
        if self.num_workers > 0:  # torch's order: this check, then its iterator's pin warnings
            self.check_worker_number_rationality()
        self._warn_pinning()
        with self._book.starting():  # an iterator that fails to start starts no epoch
            if self.num_workers == 0:
                it: BaseIter = SingleProcessIter(self._plan())
                self._live.admit(it, ticket)  # it started nothing: a refused one is just dropped
            else:
                with limits_named(self.num_workers):  # a bare "Too many open files": which limit, what to do
                    from shmloader.engine.mp_iterator import MultiProcessIter

                    it = MultiProcessIter(self._plan(), functools.partial(self._live.admit, ticket=ticket))
        return it

    def __len__(self) -> int:
        if self._is_iterable:
            length = self._IterableDataset_len_called = len(self.dataset)
            if self.batch_size is not None:
                length = length // self.batch_size if self.drop_last else math.ceil(length / self.batch_size)
            return length
        return len(self._index_sampler)

    def close(self) -> None:
        """Stop everything this loader started: every worker of every iterator it handed out
        (persistent or not) and every segment of their rings. Batches you hold stay valid; a
        ``next()`` on any of those iterators raises ``LoaderClosed``; ``iter(loader)`` starts
        afresh. An ``iter(loader)`` under way in another thread is stopped too: this waits for its
        build, then closes it; or that ``iter()`` raises ``LoaderClosed``, having started nothing.
        A no-op in a process that inherited the loader (a forked worker). If one iterator cannot be
        closed now (``LoaderError``: its ``next()`` or build in another thread did not end in
        time), the others are closed all the same, then that error is raised."""
        if not self._creator.here:
            return
        try:
            self._live.close_all()  # every one, whatever one raises; then its error
        finally:
            self._iterator = None

    def __enter__(self) -> DataLoader[T_co]:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def state_dict(self) -> dict[str, Any]:
        """Where iteration stands, as plain JSON-serialisable data (see docs/resume.md).

        Mid-epoch: the epoch, base seed, what re-creates the epoch's order and which tasks were
        delivered. Between epochs (or before the first): the start of the next epoch.
        """
        from shmloader import state

        return state.loader_state(self)

    def load_state_dict(self, state: Any) -> None:
        """Restore a ``state_dict()``: the next ``iter(self)`` resumes its epoch where it stood.

        Raises ``shmloader.state.StateError`` (both sides printed) for a state of another version or
        configuration (dataset length, batch size, drop_last, sampler type, ...).
        """
        from shmloader import state as _state

        _state.load(self, state)

    def stats(self) -> dict[str, Any]:
        """Timings and counters: per-worker fetch/collate time, consumer wait, bytes, bottleneck."""
        return self._events.stats.summary()

    @property
    def _pinner(self) -> pinning.PinBackend | None:
        """The loader's pin backend (None until chosen, or when none pins); the device prefetcher
        copies through it."""
        return self._pin.backend

    # -- engine wiring: the plan is all an iterator sees of the loader --------------------------
    def _plan(self) -> Plan:
        """One iterator's frozen view of this loader (engine/plan.py); raises for a ``prefetch_factor``,
        ``timeout`` or ``worker_init_fn`` (perhaps set since construction) this iteration cannot use,
        and for workers in a process that may not have children (a worker of another loader)."""
        cfg = self._config
        prefetch_factor = checks.check_prefetch_at_iter(self.prefetch_factor, self.num_workers)
        timeout_s = checks.check_timeout_at_iter(self.timeout, self.num_workers)
        checks.check_worker_init_fn(self.worker_init_fn, self.num_workers)
        checks.check_may_start_workers(self.num_workers)  # not from a worker: before anything starts
        return Plan(
            config=cfg, dataset=self.dataset, num_workers=self.num_workers,
            prefetch_factor=prefetch_factor, timeout_s=timeout_s, in_order=self.in_order,
            persistent=self.persistent_workers, iterable=self._is_iterable, auto_collation=self._auto_collation,
            index_sampler=self._index_sampler, len_called=self._IterableDataset_len_called, events=self._events,
            book=self._book, context=self._mp_context, worker_spec=services.spec_maker(self),
            make_ring=services.ring_maker(self), preflight=services.preflight(self.num_workers, self.prefetch_factor),
            finish=services.finisher(self), warning_module=self._warning_module,
            loader=None if self.persistent_workers and self.num_workers else self,
        )

    def _default_collate_fn(self) -> Callable[[Any], Any]:
        if self._auto_collation:
            return _collate.torch_default_collate if self._to_torch else _collate.default_collate
        return _collate.torch_default_convert if self._to_torch else _collate.default_convert

    @property
    def _mp_context(self) -> BaseContext:
        return self.multiprocessing_context or multiprocessing.get_context()

    def _warn_pinning(self) -> None:
        if self.pin_memory and self.pin_memory_device:  # named by _get_iterator's frame, as torch's by its iterator's
            warn("pin_memory_device is deprecated, the current accelerator will be used as the device,"
                 f"ignore pin_memory_device='{self.pin_memory_device}'.", stacklevel=2,
                 torch_module=self._warning_module)
        pinning.warn_if_unpinned(self)  # torch's "no accelerator" warning, at each iterator as torch's
