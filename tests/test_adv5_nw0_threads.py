"""``num_workers=0`` and other threads: ``next()`` from two threads, ``close()`` from another thread
during a ``next()``, and ``next()`` from inside the iterator's own ``next()`` through the dataset.

The multi-process iterator promised these (tests/test_close_threads.py); the in-process one did not:

- two threads' ``next()`` at once both made the task in hand and handed its batch out twice;
- a ``close()`` from another thread while ``next()`` was inside the dataset tore the collate helpers
  and buffers down under it; that ``next()`` then handed its batch out, started the helpers again
  and left them (and a batch buffer) to a closed iterator.

Now the thread inside ``next()`` owns the iterator until it returns, as with workers: ``next()`` from
two threads run one after the other, each batch once; ``close()`` from another thread waits for that
``next()``, which raises ``LoaderClosed`` (its batch not handed out, nor counted), and nothing of the
epoch lives when ``close()`` returns.
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import pytest
from process_helpers import until

import shmloader
from shmloader.collate import threads
from shmloader.errors import LoaderClosed, LoaderError

DEADLINE_S = 20.0
SHAPE = (32, 32)


class Squares:
    """float32 samples of ``SHAPE`` filled with their index; ``block`` makes one index wait on ``go``."""

    def __init__(self, length: int, block: int | None = None) -> None:
        self.length = length
        self.block = block
        self.inside = threading.Event()
        self.go = threading.Event()

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> np.ndarray:
        if index == self.block:
            self.inside.set()
            self.go.wait(DEADLINE_S)
        return np.full(SHAPE, index, np.float32)


def _helpers() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("shmloader-collate")]


@pytest.mark.timeout(60)
def test_next_from_two_threads_at_once_hands_each_batch_out_once() -> None:
    it = iter(shmloader.DataLoader(Squares(2000), batch_size=2))
    outs: list[list[int]] = [[], []]
    errors: list[BaseException] = []

    def consume(out: list[int]) -> None:
        try:
            out.extend(int(batch[0, 0, 0]) for batch in it)
        except BaseException as exc:  # noqa: BLE001  (reported below)
            errors.append(exc)

    consumers = [threading.Thread(target=consume, args=(out,), daemon=True) for out in outs]
    for t in consumers:
        t.start()
    for t in consumers:
        t.join(DEADLINE_S)
    assert not any(t.is_alive() for t in consumers) and errors == []
    assert sorted(outs[0] + outs[1]) == list(range(0, 2000, 2))  # every batch once, none lost or doubled


@pytest.mark.timeout(60)
def test_close_from_another_thread_during_next_stops_it_and_leaves_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(threads, "SPLIT_MIN_BYTES", 1)  # every stack split over the helpers
    dataset = Squares(12, block=6)
    loader: shmloader.DataLoader[Any] = shmloader.DataLoader(dataset, batch_size=4, collate_threads=2)
    it = iter(loader)
    assert float(next(it)[0, 0, 0]) == 0.0 and _helpers()  # a helper serves the epoch
    closed: list[BaseException | None] = []

    def closer() -> None:
        dataset.inside.wait(DEADLINE_S)
        try:
            loader.close()
            closed.append(None)
        except BaseException as exc:  # noqa: BLE001  (reported below)
            closed.append(exc)

    def release() -> None:  # once close() asked the next() to stop, let the dataset return
        until(lambda: it._guard.stop_requested, DEADLINE_S)  # type: ignore[attr-defined]
        dataset.go.set()

    helpers = [threading.Thread(target=f, daemon=True) for f in (closer, release)]
    for t in helpers:
        t.start()
    with pytest.raises(LoaderClosed):
        next(it)
    for t in helpers:
        t.join(DEADLINE_S)
    assert closed == [None]
    assert _helpers() == [] and len(it._pool) == 0  # type: ignore[attr-defined]
    with pytest.raises(LoaderClosed):
        next(it)
    assert [float(b[0, 0, 0]) for b in loader] == [0.0, 4.0, 8.0]  # a new epoch starts afresh


@pytest.mark.timeout(60)
def test_a_dataset_calling_next_on_its_own_iterator_is_refused_naming_it() -> None:
    class Reenter:
        it: Any = None

        def __len__(self) -> int:
            return 4

        def __getitem__(self, index: int) -> int:
            return next(self.it) if index == 1 else index

    dataset = Reenter()
    dataset.it = iter(shmloader.DataLoader(dataset, batch_size=None))
    assert next(dataset.it) == 0
    with pytest.raises(LoaderError, match="own next()") as info:
        next(dataset.it)
    assert "the dataset" in str(info.value)
    assert [int(x) for x in dataset.it] == [2, 3]  # the refused batch's error was its own: the epoch goes on


@pytest.mark.timeout(60)
def test_close_giving_up_on_a_blocked_next_names_what_can_block_it_without_workers(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Without workers the ``next()`` that does not return is most likely inside the dataset (or the
    sampler, or collate_fn): ``close()``'s error must say so, not guess a plugin hook alone."""
    from shmloader.engine import stepguard

    monkeypatch.setattr(stepguard, "CLOSE_WAIT_S", 0.2)
    dataset = Squares(8, block=0)
    loader: shmloader.DataLoader[Any] = shmloader.DataLoader(dataset, batch_size=2)
    it = iter(loader)
    got: list[Any] = []
    stepper = threading.Thread(target=lambda: got.append(_next_or_error(it)), daemon=True)
    stepper.start()
    try:
        assert dataset.inside.wait(DEADLINE_S)
        with pytest.raises(LoaderError, match="did not return") as info:
            it.close()  # type: ignore[attr-defined]
        assert "the dataset" in str(info.value) and "num_workers=0" in str(info.value)
    finally:
        dataset.go.set()
        stepper.join(DEADLINE_S)
    assert not stepper.is_alive() and isinstance(got[0], LoaderClosed)  # it closed itself as it returned


def _next_or_error(it: Any) -> Any:
    try:
        return next(it)
    except BaseException as exc:  # noqa: BLE001  (the test reads it)
        return exc
