"""The epoch book: a loader's bookkeeping of epochs, which is what resume reads and writes.

Owns, for one loader: how many epochs were started, the latest epoch's ``state.EpochRecord``, a
loaded ``state.Resume`` waiting for the next ``iter()``, and the base seed a persistent iterator
will reuse for its next epoch. The loader owns the book; iterators reach it only through their
plan; ``state.py`` reads and writes these fields and nothing else of the loader's bookkeeping.
Runs in the main process.

Promises: ``start`` makes an epoch's sampler iterator and base seed exactly as torch does (the
seed drawn from ``loader.generator`` right after the sampler iterator is made, or reused by a
persistent iterator) and snapshots what re-creates the epoch before any of it draws (before
``iter(sampler)``); a loaded resume is used by exactly one ``start`` that goes on to make its
iterator (``starting``: an iterator that fails to start gives it back). See docs/resume.md.
"""

from __future__ import annotations

import contextlib
import sys
import weakref
from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import Any

from shmloader import state as _state
from shmloader._generators import draw_base_seed
from shmloader.errors import LoaderError
from shmloader.state_objects import check_epochs
from shmloader.state_random import global_rng, snapshot, torch_bytes


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
        # read for its sampler, dataset and generator (the stream it draws from) only; weakly, since the
        # loader holds the book: no cycle keeps a dropped loader (and its persistent workers) alive
        self._loader_ref = weakref.ref(loader)
        self.epoch_count = 0
        self.record: _state.EpochRecord | None = None
        self.resume: _state.Resume | None = None
        self.reused_seed: int | None = None  # set while a persistent iterator will reuse its seed

    @property
    def _loader(self) -> Any:
        """The loader (alive whenever it starts an epoch; an iterator without persistent workers
        holds it, ``Plan.loader``); a LoaderError when a persistent iterator outlived it."""
        loader = self._loader_ref()
        if loader is None:
            raise LoaderError("the DataLoader this iterator came from is gone (a persistent iterator kept "
                              "after its loader was dropped): keep the loader to save or resume its state")
        return loader

    def start(self, index_sampler: Any, iterable: bool, reuse_seed: int | None = None,
              draw_at_iter: bool = True) -> EpochStart:
        """Begin an epoch: sampler iterator, base seed (drawn, resumed, or ``reuse_seed``), record.

        The generators are snapshotted before ``iter(index_sampler)``, which may draw (a sampler
        that makes its whole order there); a resume restores that snapshot and replays the same
        draws: ``iter()``, then the base seed's draw when the saved epoch drew one. The sampler's
        first item is taken here with ``draw_at_iter`` (torch's multi-process iterator; resuming a
        state saved without workers, under the global RNG its first ``next()`` drew under), else at
        the first ``next()`` (its single-process one; see ``FirstDraw``). After
        ``load_state_dict`` the saved base seed is used and delivered tasks are skipped: map-style
        ones are taken from the sampler but never fetched; an iterable dataset's are made and dropped.
        """
        if self.resume is not None and self.resume.state["in_progress"]:  # first: a refused start
            check_epochs(self._loader, self.resume.state["objects"])  # leaves the resume armed
        resume, self.resume = self.resume, None
        drew: tuple[Any, Any] | None = None  # a resumed first draw made at iter(): the RNG before and after
        with global_rng(None if resume is None else resume.torch_global):
            objects = _state.object_states(self._loader)
            random = snapshot(self._loader)
            sampler_iter = iter(index_sampler)
            used = _moved(random.torch_global)  # iter(sampler) drew from torch's global RNG
            base_seed, drawn = self._base_seed(resume, reuse_seed)
            first = None if resume is None or resume.torch_first is None else torch_bytes(resume.torch_first)
            record = _state.new_record(self._loader, self, base_seed, objects,
                                       replace(random, seed_drawn=drawn, torch_first=first, torch_used=used), resume)
            if not iterable and not draw_at_iter:
                sampler_iter = FirstDraw(sampler_iter, record, resume)
            elif not iterable:  # a state saved without workers keeps what its first next() drew under
                left = _torch_rng()
                with global_rng(first):
                    before = _torch_rng()
                    sampler_iter = _state.peeked(sampler_iter)
                    if _moved(before):  # the sampler's first item drew from it
                        record.random = replace(record.random, torch_used=True)
                drew = (left, _torch_rng()) if resume is not None and first is None else None
        if drew is not None:
            _advance_if_at(*drew)
        skip = record.delivered if resume is not None and not iterable else _state.TaskSet()
        fast_forward = resume.yielded if resume is not None and iterable else 0
        return EpochStart(sampler_iter, base_seed, record, skip, fast_forward)

    @contextlib.contextmanager
    def starting(self) -> Iterator[None]:
        """Around making an iterator, or a persistent one's next epoch. One that raises (a Ctrl-C
        while workers start, a worker that cannot start, an iterable dataset's ``__iter__``) started
        no epoch: the book is put back, so
        ``state_dict()`` is what it was and the next ``iter()`` starts the same epoch; a loaded
        resume it took is armed again, with the sampler, dataset and generator states it restored,
        since the failed start may have drawn from them. Without a resume, what it drew stays drawn
        (as in torch), and a state saved now starts from there, as the next ``iter()`` does."""
        saved = self.epoch_count, self.record, self.resume, self.reused_seed
        try:
            yield
        except BaseException:
            self.epoch_count, self.record, self.resume, self.reused_seed = saved
            if self.resume is not None:
                _state.restore_sources(self._loader, self.resume.state)
            raise

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


class FirstDraw:
    """A ``num_workers=0`` epoch's sampler iterator: its first ``next()`` is where torch's
    single-process iterator makes the sampler's first draw (a RandomSampler's seed, drawn from
    torch's global RNG when it has no generator), and that draw sees what the saved epoch's saw.

    Saving: when something drew from torch's global RNG between the epoch's start and that
    ``next()`` (a model's init, the caller's own draws), its state then joins the record's snapshot
    (``torch_first``). Resuming: that ``next()`` runs with the saved state — or, when nothing drew
    in between, with the state the replayed start left — and the caller's is put back after it.
    Later items are read with ``next()`` only, as ``state.peeked`` reads them.
    """

    def __init__(self, it: Iterator[Any], record: _state.EpochRecord, resume: _state.Resume | None) -> None:
        torch = sys.modules.get("torch")
        self._it, self._record, self._resuming, self._pending = it, record, resume is not None, True
        # torch's global RNG as this start leaves it (None: torch was not imported when it began)
        self._left = None if torch is None or record.random.torch_global is None else torch.get_rng_state()

    def __iter__(self) -> FirstDraw:
        return self

    def __next__(self) -> Any:
        if self._pending:
            self._pending = False
            if self._left is not None:
                return self._first()
        return next(self._it)

    def _first(self) -> Any:
        torch, left = sys.modules["torch"], self._left
        self._left = None
        saved = self._record.random.torch_first
        if self._resuming:
            with global_rng(left if saved is None else saved):
                item = self._drawn_first(torch.get_rng_state())
                after = torch.get_rng_state()
            if saved is None:
                _advance_if_at(left, after)
            return item
        now = torch.get_rng_state()
        if not torch.equal(now, left):
            self._record.random = replace(self._record.random, torch_first=now)
        return self._drawn_first(now)

    def _drawn_first(self, before: Any) -> Any:
        """The sampler's first item; the record notes when it drew from torch's global RNG."""
        item = next(self._it)
        if _moved(before):
            self._record.random = replace(self._record.random, torch_used=True)
        return item


def _torch_rng() -> Any:
    """torch's global RNG state now; None when torch is not imported."""
    torch = sys.modules.get("torch")
    return None if torch is None else torch.get_rng_state()


def _moved(before: Any) -> bool:
    """Whether torch's global RNG is no longer at ``before`` (None: torch was not imported then)."""
    torch = sys.modules.get("torch")
    return torch is not None and before is not None and not torch.equal(torch.get_rng_state(), before)


def _advance_if_at(before: Any, after: Any) -> None:
    """A resumed epoch made its sampler's first draw, from ``before`` to ``after``, under a borrowed
    global RNG. When the caller's global RNG is at ``before``, the saved epoch had that draw still
    to come (saved between ``iter()`` and its first ``next()``, without workers) and the caller has
    restored its RNG from a checkpoint taken with the state: uninterrupted, the draw would have
    advanced it, so it is advanced to ``after``, and later epochs draw what they would have. Any
    other caller RNG (a checkpoint taken after the draw, or none restored) is left as it is."""
    torch = sys.modules.get("torch")
    if torch is not None and before is not None and torch.equal(torch.get_rng_state(), before):
        torch.set_rng_state(after)
