"""A ``worker_init_fn`` that raises (an ``Exception``): raised once, where that worker's first task
is due, and the worker lives on, as torch's does.

torch's worker (torch/utils/data/_utils/worker.py, ``_worker_loop``) catches the exception of
``init_fn(worker_id)``, answers its first index with it, and keeps serving: with
``persistent_workers=True`` it is not started again, so ``worker_init_fn`` does not run again and
the next epochs load every batch. Before, shmloader stopped the iterator at that error
(``LoaderError`` at the next ``next()``) and its next ``iter()`` started fresh workers, whose
``worker_init_fn`` ran, and raised, again: every epoch failed.

Where the two differ, on purpose: the failed worker's other tasks of that first epoch are loaded
(torch's fail with ``UnboundLocalError``, its fetcher never having been made), and with an
iterable dataset that worker's share of that epoch ends at the error (torch's answers every later
task with ``UnboundLocalError``, so that epoch never ends).
"""

from __future__ import annotations

import multiprocessing
from typing import Any

import pytest

import start_datasets as sd
from shmloader import DataLoader

METHODS = [m for m in ("fork", "spawn") if m in multiprocessing.get_all_start_methods()]
CAUGHT = r"^Caught ValueError in DataLoader worker process 0 \(pid \d+\)\.\nOriginal Traceback"


def outcomes(loader: Any, steps: int = 8) -> list[Any]:
    """One epoch, step by step: each batch as a list, each error as its type's name; "end" at the end."""
    it, seen = iter(loader), []
    for _ in range(steps):
        try:
            seen.append(next(it).tolist())
        except StopIteration:
            seen.append("end")
            break
        except Exception as error:  # noqa: BLE001  (the point is which error came where)
            seen.append(type(error).__name__)
    return seen


@pytest.mark.timeout(90)
@pytest.mark.parametrize("method", METHODS)
def test_persistent_workers_raise_it_once_and_do_not_run_it_again(method: str, tmp_path: Any) -> None:
    calls = str(tmp_path / "calls")
    loader: DataLoader[Any] = DataLoader(list(range(8)), batch_size=2, num_workers=2, persistent_workers=True,
                                         worker_init_fn=sd.InitCountedRaisesIn(0, calls),
                                         multiprocessing_context=method)
    try:
        it = iter(loader)
        with pytest.raises(ValueError, match=CAUGHT) as info:
            next(it)  # task 0, worker 0's first
        assert "init of worker 0 failed" in str(info.value)
        assert [b.tolist() for b in it] == [[2, 3], [4, 5], [6, 7]]  # the worker lives on
        for _epoch in range(2):
            assert outcomes(loader) == [[0, 1], [2, 3], [4, 5], [6, 7], "end"]
        assert sd.init_calls(calls) == [0, 1]  # once per worker, as torch's
    finally:
        loader.close()


@pytest.mark.timeout(90)
def test_without_persistent_workers_each_epoch_runs_it_again_as_torch(tmp_path: Any) -> None:
    calls = str(tmp_path / "calls")
    loader: DataLoader[Any] = DataLoader(list(range(8)), batch_size=2, num_workers=2,
                                         worker_init_fn=sd.InitCountedRaisesIn(0, calls))
    for _epoch in range(2):
        assert outcomes(loader) == ["ValueError", [2, 3], [4, 5], [6, 7], "end"]
    assert sd.init_calls(calls) == [0, 0, 1, 1]


@pytest.mark.timeout(90)
def test_an_iterable_datasets_failed_worker_ends_its_share_then_lives_on(tmp_path: Any) -> None:
    calls = str(tmp_path / "calls")
    loader: DataLoader[Any] = DataLoader(sd.ShardedRange(8), batch_size=2, num_workers=2, persistent_workers=True,
                                         worker_init_fn=sd.InitCountedRaisesIn(0, calls))
    try:
        assert outcomes(loader) == ["ValueError", [1, 3], [5, 7], "end"]
        assert outcomes(loader) == [[0, 2], [1, 3], [4, 6], [5, 7], "end"]
        assert sd.init_calls(calls) == [0, 1]
    finally:
        loader.close()


@pytest.mark.timeout(120)
def test_torch_flavour_matches_torch_from_the_second_epoch(tmp_path: Any) -> None:
    """Side by side with torch's loader: the error at the same batch of the first epoch, the batches
    of worker 1 there, and every batch of the next epochs; ``worker_init_fn`` run once per worker."""
    torch_data = pytest.importorskip("torch.utils.data")
    import shmloader.torch as st

    seen = {}
    for name, cls in (("torch", torch_data.DataLoader), ("ours", st.DataLoader)):
        calls = str(tmp_path / f"calls-{name}")
        loader = cls(list(range(8)), batch_size=2, num_workers=2, persistent_workers=True,
                     worker_init_fn=sd.InitCountedRaisesIn(0, calls), multiprocessing_context=METHODS[0])
        try:
            seen[name] = [outcomes(loader) for _ in range(3)], sd.init_calls(calls)
        finally:
            if name == "ours":
                loader.close()
            else:
                loader._iterator._shutdown_workers()
            del loader
    (theirs, their_calls), (ours, our_calls) = seen["torch"], seen["ours"]
    assert theirs[0] == ["ValueError", [2, 3], "UnboundLocalError", [6, 7], "end"]  # torch's first epoch
    assert ours[0] == ["ValueError", [2, 3], [4, 5], [6, 7], "end"]  # worker 0 runs on without its init
    assert ours[1:] == theirs[1:] == [[[0, 1], [2, 3], [4, 5], [6, 7], "end"]] * 2
    assert our_calls == their_calls == [0, 1]
