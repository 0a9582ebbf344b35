"""Iterators the loader hands out: the shared base and the single-process one.

Owns one epoch's position in the sampler, the base seed (drawn as torch draws it, right after the
sampler iterator is made, from ``loader.generator``), and torch's warning when an IterableDataset
yields more batches than ``len(loader)`` promised. The multi-process iterator
(``mp_iterator.MultiProcessIter``) builds on the same base.
"""

from __future__ import annotations

import enum
import warnings
from typing import Any

from ._generators import draw_base_seed
from .worker_main import make_fetcher, run_collate


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
        self._sampler_iter = iter(self._index_sampler)
        self._base_seed = draw_base_seed(loader.generator)
        self._num_yielded = 0
        self._len_called = loader._IterableDataset_len_called
        self._state = IterState.RUNNING

    def __iter__(self) -> BaseIter:
        return self

    def __len__(self) -> int:
        return len(self._index_sampler)

    def _reset(self, loader: Any) -> None:
        self._sampler_iter = iter(self._index_sampler)
        self._num_yielded = 0
        self._len_called = loader._IterableDataset_len_called

    def __next__(self) -> Any:
        data = self._next_data()
        self._num_yielded += 1
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
        index = next(self._sampler_iter)  # StopIteration ends the epoch
        spec = self._spec
        data = self._fetcher.fetch(index)  # an iterable dataset may end here too
        batch = run_collate(spec.collate_kind, spec.collate_fn, spec.to_torch, spec.collate_rules, data,
                            _heap_alloc)
        return self._loader._finish_batch(batch)


def _heap_alloc(shape: tuple[int, ...], dtype: Any) -> Any:
    import numpy as np

    return np.empty(shape, dtype=dtype)
