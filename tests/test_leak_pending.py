"""An iterator dropped while it keeps an error for later lets go of its workers at once.

Some errors are kept on the iterator and raised later, so that what came before them is handed
out first: an observer's error (raised at the next ``next()``), a sampler's error met while the
pipeline was refilled, a refused slot growth (raised at the next wait), the loader's error for the
batch ``to_device`` read ahead. (A refused growth is kept only while batches read in the same wait
are handed out: the unit tests of ``keep`` at the end stand for it.) A kept error's traceback holds the frames it passed through, and
those frames hold the iterator: when the caller stops before that error is raised (``break``
after the last batch it wanted), iterator, workers and segments were left to the cyclic collector.
As in ``test_leak_cycles.py``, the collector is off while the iterator is dropped.
"""

from __future__ import annotations

import contextlib
import weakref
from typing import Any

from iter_helpers import mp_iter
import numpy as np
import pytest
from process_helpers import workers_left
from test_leak_cycles import FailingSampler, FailsAt, FailsOnTask1, Rows, no_cyclic_gc

import shmloader
from shmloader import DataLoader
from shmloader.gpu.prefetch_epoch import Epoch
from shmloader.kept import NOTE, keep


@pytest.mark.timeout(60)
@pytest.mark.parametrize("num_workers", [0, 2])
def test_an_iterator_dropped_with_an_observer_s_error_kept_is_freed_at_once(num_workers: int) -> None:
    loader: DataLoader[Any] = DataLoader(Rows(), batch_size=4, num_workers=num_workers, plugins=[FailsOnTask1()])
    with no_cyclic_gc():
        it = iter(loader)
        next(it), next(it)  # batch 1's report failed: its error waits for the next next()
        assert it._observer_error is not None
        gone = weakref.ref(it)
        del it
        assert gone() is None, "the iterator outlived its last reference (a reference cycle)"
        assert workers_left() == []


@pytest.mark.timeout(60)
def test_an_iterator_dropped_with_a_refill_error_kept_is_freed_at_once() -> None:
    loader: DataLoader[Any] = DataLoader(Rows(), batch_sampler=FailingSampler(bad=5), num_workers=2)
    with no_cyclic_gc():
        it = mp_iter(iter(loader))
        got = []
        while it._refill_error is None:
            got.append(int(next(it)[0, 0]))
        assert got == list(range(0, 2 * len(got), 2))
        gone = weakref.ref(it)
        del it
        assert gone() is None, "the iterator outlived its last reference (a reference cycle)"
        assert workers_left() == []


@pytest.mark.timeout(60)
def test_to_device_dropped_with_a_read_ahead_error_kept_is_freed_at_once() -> None:
    from shmloader.gpu.fake import FakeBackend

    with contextlib.suppress(ImportError):  # the fake's copy imports torch; its first import keeps a frame
        import torch  # noqa: F401
    loader: DataLoader[Any] = DataLoader(FailsAt(16, bad=5), batch_size=4, num_workers=2)
    moved = shmloader.to_device(loader, "cpu", transfer=FakeBackend(auto_complete=True))
    with no_cyclic_gc():
        epoch = iter(moved)
        assert isinstance(epoch, Epoch)
        first = next(epoch)  # batch 1 (index 5) failed while read ahead: its error waits
        np.testing.assert_array_equal(np.asarray(first), np.repeat(np.arange(4), 4).reshape(4, 4))
        assert epoch.error is not None
        gone = weakref.ref(epoch)
        del epoch, first
        assert gone() is None, "the prefetcher's epoch outlived its last reference (a reference cycle)"
        assert workers_left() == []


@pytest.mark.timeout(60)
def test_to_device_left_early_stops_its_epoch_s_workers_and_still_saves_its_state() -> None:
    """The prefetcher keeps a mark of where the loader's epoch stood, for ``state_dict()``; the
    mark held the loader's iterator (its ``state_of``), so after a ``break`` the epoch's workers
    and slots lived on until the next epoch began, where torch's loop lets go of them."""
    from shmloader.gpu.fake import FakeBackend

    loader: DataLoader[Any] = DataLoader(Rows(), batch_size=4, num_workers=2)
    moved = shmloader.to_device(loader, "cpu", transfer=FakeBackend(auto_complete=True))
    with no_cyclic_gc():
        for _batch in moved:
            break
        del _batch
        assert workers_left() == []
    state = moved.state_dict()
    resumed: DataLoader[Any] = DataLoader(Rows(), batch_size=4, num_workers=2)
    resumed.load_state_dict(state)
    assert [int(b[0, 0]) for b in resumed] == [4, 8, 12]


def fail() -> None:
    raise ValueError("deep")


def notes(error: BaseException) -> list[str]:
    """``error.__notes__``, which typeshed knows from Python 3.11 on (``keep`` sets it on 3.10 too)."""
    return error.__notes__  # type: ignore[attr-defined]


class Holder:
    """Keeps the error its method met, as the iterators do: the method's frame holds the holder."""

    error: BaseException | None = None

    def call(self) -> None:
        try:
            fail()
        except ValueError as exc:
            self.error = keep(exc)


def test_keep_lets_the_keeper_go_and_keeps_where_the_error_was_met_as_text() -> None:
    holder = Holder()
    with no_cyclic_gc():
        holder.call()
        error = holder.error
        gone = weakref.ref(holder)
        del holder
        assert gone() is None, "the kept error's traceback held its keeper"
    assert isinstance(error, ValueError) and error.args == ("deep",)
    assert error.__traceback__ is None
    (note,) = notes(error)
    assert note.startswith(NOTE)
    assert f"line {fail.__code__.co_firstlineno + 1}, in fail" in note
    assert 'raise ValueError("deep")' in note


def test_a_kept_error_s_chain_keeps_its_types_and_messages() -> None:
    def chained() -> None:
        try:
            fail()
        except ValueError as exc:
            raise RuntimeError("wrapped") from exc

    try:
        chained()
    except RuntimeError as exc:
        kept = keep(exc)
    cause = kept.__cause__
    assert isinstance(cause, ValueError) and cause.args == ("deep",)
    assert kept.__traceback__ is None and cause.__traceback__ is None
    assert "in chained" in notes(kept)[0] and "in fail" in notes(cause)[0]
    with pytest.raises(RuntimeError, match="wrapped") as raised:
        raise kept
    assert raised.value.__cause__ is cause


def test_keep_twice_adds_no_second_note() -> None:
    try:
        fail()
    except ValueError as exc:
        kept = keep(keep(exc))
    assert len(notes(kept)) == 1
