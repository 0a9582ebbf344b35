"""Fetching samples for one task, exactly as torch's fetchers do, minus the collate step.

Runs in a worker (or in the main process with ``num_workers=0``). Owns, for an iterable dataset,
the dataset iterator and whether it has ended. Promises torch's semantics: map-style datasets use
``__getitems__`` when they define it; an iterable dataset's partial last batch is kept unless
``drop_last``; once the iterator has ended every later fetch raises ``StopIteration``. A batch
cut short by ``KeyboardInterrupt``/``SystemExit`` (only possible with ``num_workers=0``: workers
ignore SIGINT) keeps its samples for the next fetch.
"""

from __future__ import annotations

from typing import Any


class MapFetcher:
    def __init__(self, dataset: Any, auto_collation: bool) -> None:
        self.dataset = dataset
        self.auto_collation = auto_collation

    def fetch(self, indices: Any) -> Any:
        """``indices`` is the batch of indices (auto-collation) or one index."""
        if not self.auto_collation:
            return self.dataset[indices]
        getitems = getattr(self.dataset, "__getitems__", None)
        if getitems:
            return getitems(indices)
        return [self.dataset[i] for i in indices]


class IterableFetcher:
    def __init__(self, dataset: Any, auto_collation: bool, batch_size: int | None, drop_last: bool,
                 start: bool = True) -> None:
        self.dataset = dataset
        self.auto_collation = auto_collation
        self.batch_size = batch_size
        self.drop_last = drop_last
        self.iterator: Any = None
        self.ended = True  # until reset() has the dataset's iterator
        self._partial: list[Any] = []
        if start:
            self.reset()

    def reset(self) -> None:
        self.iterator = iter(self.dataset)
        self.ended = False
        self._partial = []

    def fetch(self, _indices: Any = None) -> Any:
        if self.ended:
            raise StopIteration
        if not self.auto_collation:
            try:
                return next(self.iterator)
            except StopIteration:
                # ended for good, as torch's worker ends at its first one (``iteration_end``): an
                # iterator asked again may yield more, and the tasks already sent would deliver it
                self.ended = True
                raise
        assert self.batch_size is not None
        data, self._partial = self._partial, []
        try:
            while len(data) < self.batch_size:
                try:
                    data.append(next(self.iterator))
                except StopIteration:
                    self.ended = True
                    break
        except (KeyboardInterrupt, SystemExit):
            # num_workers=0: the samples taken are gone from the iterator; the next fetch (the
            # interrupted batch's, made again) goes on from them. A dataset's error drops them, as torch's.
            self._partial = data
            raise
        if not data or (self.drop_last and len(data) < self.batch_size):
            raise StopIteration
        return data
