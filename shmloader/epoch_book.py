"""The epoch book: a loader's bookkeeping of epochs, which is what resume reads and writes.

Owns, for one loader: how many epochs were started, the latest epoch's ``state.EpochRecord``, a
loaded ``state.Resume`` waiting for the next ``iter()``, and the base seed a persistent iterator
will reuse for its next epoch. The loader owns the book; iterators reach it only through their
plan; ``state.py`` reads and writes these fields and nothing else of the loader's bookkeeping.
Runs in the main process.

Promises: ``start`` makes an epoch's sampler iterator and base seed exactly as torch does (the
seed drawn from ``loader.generator`` right after the sampler iterator is made, or reused by a
persistent iterator) and snapshots what re-creates the epoch before any of it draws (before
``iter(sampler)``); a loaded resume is used by exactly one ``start``. See docs/resume.md.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import Any

from shmloader import state as _state
from shmloader._generators import draw_base_seed
from shmloader.state_random import global_rng, snapshot


@dataclass(frozen=True)
class EpochStart:
    """What an iterator begins an epoch with."""

    sampler_iter: Iterator[Any]
    base_seed: int
    record: _state.EpochRecord
    skip: _state.TaskSet  # map-style resume: task numbers delivered before the save
    fast_forward: int  # iterable resume: batches to make again and drop


class EpochBook:
    """Epochs started, the latest record, a pending resume, the seed a persistent iterator reuses."""

    def __init__(self, loader: Any) -> None:
        self._loader = loader  # read for its sampler, dataset and generator (the stream it draws from) only
        self.epoch_count = 0
        self.record: _state.EpochRecord | None = None
        self.resume: _state.Resume | None = None
        self.reused_seed: int | None = None  # set while a persistent iterator will reuse its seed

    def start(self, index_sampler: Any, iterable: bool, reuse_seed: int | None = None) -> EpochStart:
        """Begin an epoch: sampler iterator, base seed (drawn, resumed, or ``reuse_seed``), record.

        The generators are snapshotted before ``iter(index_sampler)``, which may draw (a sampler
        that makes its whole order there); a resume restores that snapshot and replays the same
        draws: ``iter()``, then the base seed's draw when the saved epoch drew one. After
        ``load_state_dict`` the saved base seed is used and delivered tasks are skipped: map-style
        ones are taken from the sampler but never fetched; an iterable dataset's are made and dropped.
        """
        resume, self.resume = self.resume, None
        with global_rng(None if resume is None else resume.torch_global):
            objects = _state.object_states(self._loader)
            random = snapshot(self._loader)
            sampler_iter = iter(index_sampler)
            base_seed, drawn = self._base_seed(resume, reuse_seed)
            record = _state.new_record(self._loader, self, base_seed, objects, replace(random, seed_drawn=drawn),
                                       resume)
            if not iterable:
                sampler_iter = _state.peeked(sampler_iter)
        skip = record.delivered if resume is not None and not iterable else _state.TaskSet()
        fast_forward = resume.yielded if resume is not None and iterable else 0
        return EpochStart(sampler_iter, base_seed, record, skip, fast_forward)

    def _base_seed(self, resume: _state.Resume | None, reuse_seed: int | None) -> tuple[int, bool]:
        """The epoch's base seed, and whether it was drawn from ``loader.generator`` (torch's draw)."""
        if resume is not None:
            if resume.seed_drawn:  # the generators go on from where the saved epoch's draw left them
                draw_base_seed(self._loader._generator_source)
            return resume.base_seed, resume.seed_drawn
        if reuse_seed is not None:
            return reuse_seed, False
        return draw_base_seed(self._loader._generator_source), True

    def save(self, record: _state.EpochRecord | None = None) -> dict[str, Any]:
        """The loader's state as of ``record`` (default: the latest epoch, or the next one's start)."""
        return _state.loader_state(self._loader, record)
