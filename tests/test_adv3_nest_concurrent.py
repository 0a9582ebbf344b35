"""Loaders used side by side and across threads: no batch lost or twice, no hang, nothing left.

Two loaders zipped in one thread while a worker of one is SIGKILLed (it raises or restarts; the
other never notices); two threads each iterating their own loader, both closed at once by two
more threads (and one loader closed by two threads at once); a loader made in one thread and
iterated and closed in another; a persistent loader whose iterator a thread drops while it waits
inside ``next()`` and another thread starts the next epoch.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from typing import Any

import numpy as np
import pytest
from iter_helpers import mp_iter
from process_helpers import workers_left

import shmloader
from shmloader.errors import LoaderClosed, WorkerDied

DEADLINE_S = 20.0
IDS = np.arange(200, dtype=np.int64)


def _loader(**kwargs: Any) -> shmloader.DataLoader[Any]:
    return shmloader.DataLoader(shmloader.ArrayDataset(IDS), batch_size=4, num_workers=2, **kwargs)


def _values(batch: Any) -> list[int]:
    (x,) = batch
    return np.asarray(x).ravel().tolist()


def _join(threads: list[threading.Thread]) -> None:
    for t in threads:
        t.join(DEADLINE_S)
    assert not [t.name for t in threads if t.is_alive()], "a thread did not finish"


@pytest.mark.timeout(60)
@pytest.mark.parametrize("policy", ["raise", "restart"])
def test_zip_of_two_loaders_while_a_worker_of_one_is_killed(policy: str) -> None:
    a, b = _loader(on_worker_death=policy), _loader(on_worker_death=policy)
    ia, ib = mp_iter(iter(a)), iter(b)
    got_a: list[int] = []
    got_b: list[int] = []
    try:
        for k, (x, y) in enumerate(zip(ia, ib)):
            got_a += _values(x)
            got_b += _values(y)
            if k == 5:
                os.kill(ia._pool.workers[0].pid, signal.SIGKILL)
    except WorkerDied as exc:
        assert policy == "raise"
        assert "SIGKILL" in str(exc) and "on_worker_death='restart'" in str(exc)
    else:
        assert policy == "restart"
        assert got_a == IDS.tolist()  # each batch once, in order, the dead worker's re-run
    got_b += [v for y in ib for v in _values(y)]  # the other loader goes on to its end
    assert got_b == IDS.tolist()
    assert got_a == IDS.tolist()[:len(got_a)]
    a.close()
    b.close()
    assert workers_left(zombies=True) == []


@pytest.mark.timeout(90)
@pytest.mark.parametrize("persistent", [False, True])
def test_two_threads_iterating_their_own_loaders_both_closed_at_once(persistent: bool) -> None:
    for _ in range(3):
        loaders = [_loader(persistent_workers=persistent) for _ in range(2)]
        outs: list[dict[str, Any]] = [{}, {}]
        first = [threading.Event(), threading.Event()]

        def consume(i: int) -> None:
            got: list[int] = []
            try:
                for batch in loaders[i]:
                    got += _values(batch)
                    first[i].set()
            except BaseException as exc:  # recorded for the test thread
                outs[i]["error"] = exc
            outs[i]["got"] = got

        consumers = [threading.Thread(target=consume, args=(i,), daemon=True) for i in range(2)]
        for t in consumers:
            t.start()
        assert all(e.wait(DEADLINE_S) for e in first)
        barrier = threading.Barrier(2)

        def close(i: int) -> None:
            barrier.wait()
            loaders[i].close()

        closers = [threading.Thread(target=close, args=(i,), daemon=True) for i in range(2)]
        for t in closers:
            t.start()
        _join(closers + consumers)
        for out in outs:
            assert out["got"] == IDS.tolist()[:len(out["got"])]  # a prefix: nothing lost or twice
            assert isinstance(out.get("error", LoaderClosed("ended first")), LoaderClosed), out
        assert workers_left(zombies=True) == []


class _Cycling:
    """A sampler over ``IDS`` that starts again at its end while ``endless``: an epoch the consumer
    cannot finish before the closers come, however the threads are scheduled."""

    endless = True

    def __len__(self) -> int:
        return len(IDS)

    def __iter__(self):  # noqa: ANN204
        while True:
            yield from range(len(IDS))
            if not self.endless:
                return


@pytest.mark.timeout(60)
def test_one_loader_closed_by_two_threads_at_once_while_a_third_iterates() -> None:
    sampler = _Cycling()
    loader = _loader(persistent_workers=True, sampler=sampler)
    out: dict[str, Any] = {}
    first = threading.Event()

    def consume() -> None:
        try:
            for batch in loader:
                first.set()
        except BaseException as exc:
            out["error"] = exc

    consumer = threading.Thread(target=consume, daemon=True)
    consumer.start()
    assert first.wait(DEADLINE_S)
    barrier = threading.Barrier(2)
    errors: list[BaseException] = []

    def close() -> None:
        barrier.wait()
        try:
            loader.close()
        except BaseException as exc:
            errors.append(exc)

    closers = [threading.Thread(target=close, daemon=True) for _ in range(2)]
    for t in closers:
        t.start()
    _join(closers + [consumer])
    assert errors == []
    assert isinstance(out.get("error"), LoaderClosed), out
    assert workers_left(zombies=True) == []
    sampler.endless = False
    assert [v for b in loader for v in _values(b)] == IDS.tolist()  # iter() after close() starts afresh
    loader.close()


@pytest.mark.timeout(60)
def test_a_loader_made_in_one_thread_is_iterated_and_closed_in_another() -> None:
    box: dict[str, Any] = {}
    maker = threading.Thread(target=lambda: box.update(loader=_loader(persistent_workers=True)))
    maker.start()
    _join([maker])

    def use() -> None:
        loader = box["loader"]
        box["epochs"] = [[v for b in loader for v in _values(b)] for _ in range(2)]
        loader.close()

    user = threading.Thread(target=use, daemon=True)
    user.start()
    _join([user])
    assert box["epochs"] == [IDS.tolist()] * 2
    assert workers_left(zombies=True) == []


class SlowFirst(shmloader.Dataset):
    """``np.int64(i)``; sample 0 takes 0.3 s, so the first batch of every epoch is waited for."""

    def __len__(self) -> int:
        return 200

    def __getitem__(self, i: int) -> Any:
        if i == 0:
            time.sleep(0.3)  # the sample's own cost, not synchronisation
        return np.int64(i)


@pytest.mark.timeout(90)
@pytest.mark.parametrize("epochs_before", [0, 1])
def test_an_iterator_dropped_in_a_thread_while_another_starts_the_next_epoch(epochs_before: int) -> None:
    loader: shmloader.DataLoader[Any] = shmloader.DataLoader(SlowFirst(), batch_size=4, num_workers=2,
                                                             persistent_workers=True)
    for _ in range(epochs_before):
        list(loader)
    res: dict[str, Any] = {}
    made = threading.Event()

    def abandon() -> None:
        it = iter(loader)
        made.set()
        res["abandoned"] = np.asarray(next(it)).tolist()  # inside next() when the other thread's iter() comes
        del it

    def fresh() -> None:
        res["fresh"] = [v for b in loader for v in np.asarray(b).ravel().tolist()]

    first = threading.Thread(target=abandon, daemon=True)
    first.start()
    assert made.wait(DEADLINE_S)
    guard = mp_iter(loader._iterator)._guard
    deadline = time.monotonic() + DEADLINE_S
    while guard.owner != first.ident:  # the step lock's holder: the first thread, inside next()
        assert time.monotonic() < deadline, "the first thread never entered next()"
        time.sleep(0.001)
    second = threading.Thread(target=fresh, daemon=True)
    second.start()
    _join([first, second])
    assert res["abandoned"] == [0, 1, 2, 3]  # the old epoch's batch: the reset waited for that next()
    assert res["fresh"] == list(range(200))  # the new epoch whole, once each
    loader.close()
    assert workers_left(zombies=True) == []
