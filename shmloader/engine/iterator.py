"""Iterators the loader hands out: the shared base and the single-process one.

Owns one epoch's position in the sampler, the base seed (drawn as torch draws it, right after the
sampler iterator is made, from ``loader.generator``), and torch's warning when an IterableDataset
yields more batches than ``len(loader)`` promised; and the epoch's ``state.EpochRecord`` (the
delivered task numbers and what re-creates the epoch), which ``state_dict()`` saves and which a
loaded state resumes: delivered tasks are skipped (map-style) or fast-forwarded (iterable). See
docs/resume.md. With per-task seeding, ``num_workers=0`` seeds each task as a worker would (the
caller's RNG states are put back). The multi-process iterator
(``mp_iterator.MultiProcessIter``) builds on the same base.
"""

from __future__ import annotations

import contextlib
import enum
import random
import sys
import time
import warnings
from collections.abc import Iterator
from typing import Any

from shmloader import state as _state
from shmloader._generators import draw_base_seed
from shmloader.errors import PluginError
from shmloader.worker.main import make_fetcher, run_collate
from shmloader.worker_info import generate_state, task_seed


class IterState(enum.Enum):
    RUNNING = "running"
    EXHAUSTED = "exhausted"
    BROKEN = "broken"
    CLOSED = "closed"


class BaseIter:
    """What single- and multi-process iteration share (torch's ``_BaseDataLoaderIter``)."""

    def __init__(self, loader: Any) -> None:
        self._loader = loader
        self._dataset = loader.dataset
        self._iterable = loader._is_iterable
        self._auto_collation = loader._auto_collation
        self._num_workers = loader.num_workers
        self._index_sampler = loader._index_sampler
        self._base_seed = 0
        self._start_epoch(loader, draw_seed=True)
        self._len_called = loader._IterableDataset_len_called
        self._state = IterState.RUNNING

    def __iter__(self) -> BaseIter:
        return self

    def __len__(self) -> int:
        return len(self._index_sampler)

    def _reset(self, loader: Any) -> None:
        self._start_epoch(loader, draw_seed=False)  # persistent workers keep their base seed, as torch's
        self._len_called = loader._IterableDataset_len_called

    def _start_epoch(self, loader: Any, draw_seed: bool) -> None:
        """Make the sampler iterator and base seed, and the record that can resume this epoch (issue 8).

        After ``load_state_dict`` the saved base seed is used and delivered tasks are skipped: map-style
        ones are taken from the sampler but never fetched; an iterable dataset's are made and dropped.
        """
        resume = _state.take_resume(loader)
        with _state.global_rng(resume):
            objects = _state.object_states(loader)
            self._sampler_iter = iter(self._index_sampler)
            if resume is not None:
                self._base_seed = resume.base_seed
            elif draw_seed:
                self._base_seed = draw_base_seed(loader.generator)
            self._record = _state.new_record(loader, self._base_seed, objects, resume)
            if not self._iterable:
                self._sampler_iter = _state.peeked(self._sampler_iter)
        self._next_task = 0
        self._skip = self._record.delivered if resume is not None and not self._iterable else _state.TaskSet()
        self._fast_forward = resume.yielded if resume is not None and self._iterable else 0
        self._num_yielded = self._record.yielded

    def state_dict(self) -> dict[str, Any]:
        """This epoch's state (plain, JSON-serialisable); load it with ``loader.load_state_dict``."""
        return _state.loader_state(self._loader, self._record)

    _observer_error: BaseException | None = None

    def _report_batch(self, *event: Any) -> None:
        """Tell the observers a batch is out. An observer's error is raised at the next ``next()``,
        so the batch in hand still reaches the caller: none is lost or skipped (docs/plugins.md)."""
        try:
            self._loader._events.batch_ready(*event)
        except PluginError as exc:
            self._observer_error = exc

    def __next__(self) -> Any:
        if self._observer_error is not None:
            exc, self._observer_error = self._observer_error, None
            raise exc
        try:
            while self._fast_forward:  # resume of an iterable dataset: drop what was delivered before
                self._next_data()
                self._fast_forward -= 1
            data = self._next_data()
        except StopIteration:
            self._record.finished = True
            raise
        self._num_yielded += 1
        self._record.yielded = self._num_yielded
        if self._iterable and self._len_called is not None and self._num_yielded > self._len_called:
            msg = (f"Length of IterableDataset {self._dataset} was reported to be {self._len_called}"
                   f"(when accessing len(dataloader)), but {self._num_yielded} samples have been fetched. ")
            if self._num_workers > 0:
                msg += ("For multiprocessing data-loading, this could be caused by not properly configuring "
                        "the IterableDataset replica at each worker. Please see "
                        "https://pytorch.org/docs/stable/data.html#torch.utils.data.IterableDataset for examples.")
            warnings.warn(msg, stacklevel=2)
        return data

    def _next_data(self) -> Any:
        raise NotImplementedError

    def __getstate__(self) -> None:
        raise NotImplementedError(f"{type(self).__name__} cannot be pickled")

    def close(self) -> None:
        self._state = IterState.CLOSED


class SingleProcessIter(BaseIter):
    """``num_workers=0``: fetch and collate in the calling thread, into ordinary memory."""

    def __init__(self, loader: Any) -> None:
        super().__init__(loader)
        self._spec = loader._worker_spec(self._base_seed)
        self._fetcher = make_fetcher(self._spec)

    def _next_data(self) -> Any:
        try:
            return self._fetch_next()
        except StopIteration:
            if self._state is IterState.RUNNING:
                self._state = IterState.EXHAUSTED
                self._loader._events.epoch_end()
            raise

    def _fetch_next(self) -> Any:
        if self._state is not IterState.RUNNING:
            raise StopIteration
        while self._next_task in self._skip:  # resume: delivered before the save
            next(self._sampler_iter)
            self._next_task += 1
        index = next(self._sampler_iter)  # StopIteration ends the epoch
        task, spec = self._next_task, self._spec
        self._next_task += 1
        seed = task_seed(self._base_seed, self._record.epoch, task) if self._loader._config.task_seeding else None
        t0 = time.perf_counter()
        with _seeded(seed):
            data = self._fetcher.fetch(index)  # an iterable dataset may end here too
            t1 = time.perf_counter()
            batch = run_collate(spec.collate_kind, spec.collate_fn, spec.to_torch, spec.collate_rules, data,
                                _heap_alloc)
        t2 = time.perf_counter()
        self._record.delivered.add(task)
        # worker id -1: the main process itself; all of fetch + collate is time the consumer waited
        self._report_batch(task, -1, 0, t1 - t0, t2 - t1, t2 - t0)
        return self._loader._finish_batch(batch)


@contextlib.contextmanager
def _seeded(seed: int | None) -> Iterator[None]:
    """Per-task seeding in the main process: seed as ``worker_info.seed_task`` does, then put back the
    caller's random, numpy and torch CPU RNG states (torch.manual_seed would also reseed CUDA's)."""
    if seed is None:
        yield
        return
    import numpy as np

    torch = sys.modules.get("torch")
    saved = random.getstate(), np.random.get_state(), None if torch is None else torch.get_rng_state()
    random.seed(seed)
    np.random.seed(generate_state(seed, 0))
    if torch is not None:
        torch.default_generator.manual_seed(seed)
    try:
        yield
    finally:
        random.setstate(saved[0])
        np.random.set_state(saved[1])
        if torch is not None:
            torch.set_rng_state(saved[2])


def _heap_alloc(shape: tuple[int, ...], dtype: Any) -> Any:
    import numpy as np

    return np.empty(shape, dtype=dtype)
