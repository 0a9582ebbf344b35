"""One iterator, several threads: ``close()`` from another thread, and ``next()`` from two at once.

A watchdog thread that closes the loader while the training thread waits in ``next()`` used to
tear the workers, pipes and ring down under that ``next()``: it then waited forever in ``poll``
on pipes that no longer existed (nothing would ever wake it), or failed deep inside with a
``ZeroDivisionError`` (no workers left to deal a task to). Now the thread inside ``next()`` owns
the iterator until it returns: ``close()`` from another thread wakes it and waits for it to stop,
and ``next()`` then raises ``LoaderClosed``. Also here: ``close()`` from a signal handler on the
thread inside ``next()``, and a ``loader.close()`` that cannot stop one of its iterators in time.
Each test bounds every wait; the threads are daemons, so a regression fails here instead of
keeping the session alive.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from typing import Any

import fault_datasets as fd
from iter_helpers import mp_iter
from plugin_fixtures import CloseOnBatch
import numpy as np
from process_helpers import workers_left
import pytest

from shmloader import DataLoader
from shmloader.errors import LoaderClosed, LoaderError
from shmloader.hookspecs import hookimpl

DEADLINE_S = 20.0


def _in_wait(thread: threading.Thread) -> bool:
    """Whether ``thread`` is inside the iterator's wait for workers (the poll)."""
    frame = sys._current_frames().get(thread.ident or -1)
    while frame is not None:
        if frame.f_code.co_name == "_wait" and "engine" in frame.f_code.co_filename:
            return True
        frame = frame.f_back
    return False


def _until(condition: Any, what: str) -> None:
    """Poll ``condition`` (bounded): for a state another thread reaches, not a sleep in its place."""
    deadline = time.monotonic() + DEADLINE_S
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(0.002)


def _consume(it: Any, out: dict[str, Any]) -> None:
    try:
        out["batches"] = [np.asarray(b).tolist() for b in it]
    except BaseException as exc:  # recorded for the test thread to assert on
        out["error"] = exc


def _started(dataset: Any, **kw: Any) -> tuple[DataLoader, Any]:
    """A loader of ``dataset`` (batches of 2, 2 workers) and its iterator, workers started."""
    loader: DataLoader[Any] = DataLoader(dataset, batch_size=2, num_workers=2, **kw)
    return loader, iter(loader)


def _assert_refused(it: Any) -> None:
    with pytest.raises(LoaderClosed):
        next(it)


def _no_children() -> bool:
    return not workers_left(zombies=True)


def _close_under_next(it: Any, ready: Any, what: str, close: Any) -> dict[str, Any]:
    """Run ``it`` to its end in a consumer thread, ``close`` from this one once ``ready()``; return
    what the consumer got, after asserting that it returned and left no worker behind."""
    out: dict[str, Any] = {}
    consumer = threading.Thread(target=_consume, args=(it, out), daemon=True, name="consumer")
    consumer.start()
    _until(lambda: ready(consumer), what)
    close()
    assert _no_children(), "close() returned with workers still running"
    consumer.join(DEADLINE_S)
    assert not consumer.is_alive(), "next() in the other thread never returned after close()"
    assert isinstance(out.get("error"), LoaderClosed), f"next() ended with {out!r}, not LoaderClosed"
    return out


@pytest.mark.timeout(60)
@pytest.mark.parametrize("closer", ["loader", "iterator"])
def test_close_from_another_thread_stops_a_next_that_waits_for_workers(closer: str) -> None:
    # sample 2 hangs in its worker: the second next() waits in poll with nothing to wake it
    loader, it = _started(fd.FaultyDataset(8, where="getitem", how="hang", at=2))
    assert np.asarray(next(it)).tolist() == [fd.sample(0).tolist(), fd.sample(1).tolist()]
    out = _close_under_next(it, _in_wait, "the consumer to wait in next()", (loader if closer == "loader" else it).close)
    assert out.get("batches") is None
    _assert_refused(it)


@pytest.mark.timeout(60)
def test_close_from_another_thread_while_batches_flow() -> None:
    """Whatever the consumer was doing when close() came, it gets whole batches, then LoaderClosed."""
    loader, it = _started(fd.FaultyDataset(4000))
    _close_under_next(it, lambda _t: it._num_yielded >= 20, "twenty batches", loader.close)


@pytest.mark.timeout(60)
def test_close_from_a_hook_inside_next_takes_effect_when_that_next_returns() -> None:
    plugin = CloseOnBatch()
    plugin.loader, it = _started(fd.FaultyDataset(16), plugins=[plugin])
    assert np.asarray(next(it)).tolist()[0] == fd.sample(0).tolist()
    batch = next(it)  # the hook closes the loader while this next() runs: its batch still comes
    assert np.asarray(batch).tolist()[0] == fd.sample(2).tolist()
    assert _no_children()
    _assert_refused(it)


@pytest.mark.timeout(60)
def test_next_from_two_threads_at_once_delivers_each_batch_once() -> None:
    loader, it = _started(fd.FaultyDataset(2000))
    outs: list[dict[str, Any]] = [{}, {}]
    threads = [threading.Thread(target=_consume, args=(it, out), daemon=True) for out in outs]
    for t in threads:
        t.start()
    for t in threads:
        t.join(DEADLINE_S)
    assert not any(t.is_alive() for t in threads)
    assert [o.get("error") for o in outs] == [None, None]
    firsts = sorted(b[0][0] for o in outs for b in o["batches"])
    assert firsts == [10 * i for i in range(0, 2000, 2)]  # every batch once, none lost or doubled
    loader.close()


@pytest.mark.timeout(60)
def test_next_from_inside_a_hook_of_the_same_iterator_is_refused() -> None:
    class Reenter:
        it: Any = None

        @hookimpl
        def shmloader_batch_ready(self, task: int) -> None:
            if task == 0:
                next(self.it)

    plugin = Reenter()
    loader, plugin.it = _started(fd.FaultyDataset(16), plugins=[plugin])
    it = plugin.it
    next(it)  # the hook's error is raised at the next next(), after the batch in hand (docs/plugins.md)
    with pytest.raises(LoaderError, match="inside"):
        next(it)
    loader.close()


class BlocksOnFirstBatch:
    """An observer whose hook blocks (a progress bar writing to a stalled pipe) on each iterator's
    first batch until ``release`` is set; ``inside`` has one entry per hook that blocks now."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.inside: list[int] = []  # list.append is atomic: the hooks run in two threads

    @hookimpl
    def shmloader_batch_ready(self, task: int) -> None:
        if task == 0:
            self.inside.append(task)
            self.release.wait(DEADLINE_S)


@pytest.mark.timeout(60)
def test_a_close_that_cannot_stop_one_iterator_still_stops_every_other(monkeypatch: pytest.MonkeyPatch) -> None:
    """``loader.close()`` gave up at the first iterator whose ``next()`` did not return in time
    (``LoaderError``) and never asked the loader's other iterators to stop: they ran on, their
    workers with them. Now each is asked, then the first error is raised."""
    from shmloader.engine import stepguard

    monkeypatch.setattr(stepguard, "CLOSE_WAIT_S", 0.2)
    plugin = BlocksOnFirstBatch()
    loader: DataLoader[Any] = DataLoader(fd.FaultyDataset(16), batch_size=2, num_workers=1, plugins=[plugin])
    its = [iter(loader), iter(loader)]
    threads = [threading.Thread(target=next, args=(it,), daemon=True) for it in its]
    for t in threads:
        t.start()
    _until(lambda: len(plugin.inside) == 2, "both iterators inside a blocking hook")
    with pytest.raises(LoaderError, match="did not return within 0.2 s"):
        loader.close()
    plugin.release.set()
    for t in threads:
        t.join(DEADLINE_S)
    assert not any(t.is_alive() for t in threads)
    assert [mp_iter(it).closed for it in its] == [True, True]  # each closed itself as its next() returned
    assert _no_children()


@pytest.mark.timeout(60)
def test_close_from_a_signal_handler_while_next_waits_on_a_hung_worker() -> None:
    """A SIGTERM handler (preemption) that calls ``loader.close()`` runs on the thread inside
    ``next()``: close() could only leave a request there, and the poll, resumed after the handler,
    waited on for a batch that a hung worker never sent. Now the request also wakes the poll:
    that ``next()`` raises ``LoaderClosed`` at once."""
    loader, it = _started(fd.FaultyDataset(16, "getitem", "hang", at=0))
    main = threading.current_thread()
    rescued: list[bool] = []

    def signal_main_thread() -> None:
        _until(lambda: _in_wait(main), "next() waiting for the hung worker")
        os.kill(os.getpid(), signal.SIGUSR1)
        deadline = time.monotonic() + 5.0  # bounded: a regression fails below instead of hanging
        while _in_wait(main) and time.monotonic() < deadline:
            time.sleep(0.01)
        if _in_wait(main):
            rescued.append(True)
            it.close()  # from this thread, which wakes the poll: the test ends, and fails

    previous = signal.signal(signal.SIGUSR1, lambda signum, frame: loader.close())
    helper = threading.Thread(target=signal_main_thread, daemon=True)
    try:
        helper.start()
        _assert_refused(it)
    finally:
        signal.signal(signal.SIGUSR1, previous)
        helper.join(DEADLINE_S)
    assert rescued == [], "next() went on waiting after close() in a signal handler"
    assert _no_children()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("persistent", [True, False])
def test_close_while_iter_starts_the_iterator_stops_what_it_started(monkeypatch: pytest.MonkeyPatch,
                                                                    persistent: bool) -> None:
    """``loader.close()`` from another thread while ``iter(loader)`` was building its iterator
    missed it (it joined the loader's iterators only once built): close() returned with its
    workers running, a persistent loader kept it, and its ``next()`` gave batches. Now close()
    waits for the build to end and stops it; its ``next()`` raises ``LoaderClosed``."""
    from shmloader.engine.workers import WorkerPool

    started, release = threading.Event(), threading.Event()
    original = WorkerPool.start_all

    def start_all_then_block(pool: WorkerPool) -> None:
        original(pool)
        started.set()
        release.wait(DEADLINE_S)

    monkeypatch.setattr(WorkerPool, "start_all", start_all_then_block)
    loader: DataLoader[Any] = DataLoader(fd.FaultyDataset(16), batch_size=2, num_workers=2,
                                         persistent_workers=persistent)
    out: dict[str, Any] = {}
    builder = threading.Thread(target=lambda: out.update(it=iter(loader)), daemon=True)
    builder.start()
    assert started.wait(DEADLINE_S)
    # the build goes on once close() has asked it to stop (or at once, where close() does not wait)
    asked = lambda: _close_asked(builder) or release.is_set()  # noqa: E731

    def release_once_asked() -> None:
        _until(asked, "close() to ask")
        release.set()

    releaser = threading.Thread(target=release_once_asked, daemon=True)
    releaser.start()
    loader.close()
    release.set()
    assert _no_children(), "close() returned with the workers of the iterator being built running"
    builder.join(DEADLINE_S)
    assert not builder.is_alive()
    _assert_refused(out["it"])
    assert loader._iterator is None
    monkeypatch.setattr(WorkerPool, "start_all", original)
    assert np.asarray(next(iter(loader))).tolist()[0] == fd.sample(0).tolist()  # usable again
    loader.close()
    assert _no_children()


def _close_asked(builder: threading.Thread) -> bool:
    """Whether a close() has asked the iterator ``builder`` is building to stop: it then waits for
    the build, or (before the fix) has already returned."""
    frame = sys._current_frames().get(builder.ident or -1)
    while frame is not None:
        it = frame.f_locals.get("self")
        guard = getattr(it, "_guard", None)
        if guard is not None:
            return bool(guard.stop_requested)
        frame = frame.f_back
    return False


@pytest.mark.timeout(60)
@pytest.mark.parametrize("num_workers", [0, 2])
def test_close_before_iter_admits_its_iterator_refuses_it(monkeypatch: pytest.MonkeyPatch, num_workers: int) -> None:
    """A close() that comes after ``iter(loader)`` began but before its iterator joined the
    loader's (where close() cannot find it) makes that ``iter()`` raise, having started nothing."""
    from shmloader.engine.live import LiveIterators

    loader: DataLoader[Any] = DataLoader(fd.FaultyDataset(16), batch_size=2, num_workers=num_workers,
                                         persistent_workers=num_workers > 0)
    original = LiveIterators.admit

    def close_first(live: LiveIterators, it: Any, ticket: int) -> None:
        monkeypatch.setattr(LiveIterators, "admit", original)
        loader.close()  # as a close() from another thread would, just before the admission
        original(live, it, ticket)

    monkeypatch.setattr(LiveIterators, "admit", close_first)
    with pytest.raises(LoaderClosed, match="while iter"):
        iter(loader)
    assert _no_children() and loader._iterator is None
    assert np.asarray(next(iter(loader))).tolist()[0] == fd.sample(0).tolist()  # usable again
    loader.close()
