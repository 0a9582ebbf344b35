"""``timeout=`` while workers start, and under spawn; what the next epoch gets.

A worker whose start-up (``worker_init_fn``, unpickling the dataset) takes longer than
``timeout=`` makes the first ``next()`` time out, as torch's does (its workers start in
``iter()``, its first ``next()`` waits ``timeout`` seconds): the same error type, the same
words. With persistent workers they are kept, and once started they serve the epoch and the next.
"""

from __future__ import annotations

from typing import Any

import pytest
import timeout_datasets as td
from process_helpers import until, workers_left

from shmloader import DataLoader, WorkerTimeout

TIMEOUT_S = 0.5
MAP_ORDER = [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9], [10, 11]]


def _indices(batches: Any) -> list[list[int]]:
    return [indices.tolist() for indices, _pid in batches]


@pytest.mark.timeout(60)
def test_a_start_up_slower_than_timeout_times_out_the_first_batch_as_in_torch(tmp_path):
    torch = pytest.importorskip("torch")
    root = tmp_path / "torch"
    root.mkdir()
    gate = td.Gate(str(root), once=True)
    theirs = torch.utils.data.DataLoader(td.SlowAt(gate), batch_size=2, num_workers=2, timeout=TIMEOUT_S,
                                         worker_init_fn=td.InitGate(gate), multiprocessing_context="fork")
    with pytest.raises(RuntimeError, match=rf"^DataLoader timed out after {TIMEOUT_S} seconds") as info:
        next(iter(theirs))
    td.release(str(root))
    del info, theirs  # torch's iterator stops its workers when dropped
    assert until(lambda: workers_left() == [], 20)
    gate = td.Gate(str(tmp_path), once=True)
    with DataLoader(td.SlowAt(gate), batch_size=2, num_workers=2, timeout=TIMEOUT_S, multiprocessing_context="fork",
                    worker_init_fn=td.InitGate(gate)) as loader:
        with pytest.raises(WorkerTimeout, match=rf"^DataLoader timed out after {TIMEOUT_S} seconds\. Outstanding: "
                                                r"task 0: indices \[0\.\.1\]"):
            next(iter(loader))
        assert _indices(loader) == MAP_ORDER  # new workers, whose start-up is quick


@pytest.mark.timeout(60)
def test_persistent_workers_slow_to_start_are_kept_and_serve_the_next_epoch(tmp_path):
    gate = td.Gate(str(tmp_path), once=False)  # every worker is slow to start, once
    with DataLoader(td.SlowAt(gate, at=-1), batch_size=2, num_workers=2, timeout=TIMEOUT_S, persistent_workers=True,
                    multiprocessing_context="fork", worker_init_fn=td.InitGate(gate)) as loader:
        with pytest.raises(WorkerTimeout, match="persistent workers were kept"):
            next(iter(loader))
        assert until(lambda: len(td.blocked(str(tmp_path))) == 2, 20)
        slow = td.release(str(tmp_path))
        batches = list(loader)
        assert _indices(batches) == MAP_ORDER
        assert {int(p) for _i, pids in batches for p in pids} == set(slow)  # the workers that started slowly


@pytest.mark.timeout(120)
@pytest.mark.parametrize("persistent", [False, True])
def test_under_spawn_the_epoch_after_a_timeout_is_whole(tmp_path, persistent):
    gate = td.Gate(str(tmp_path), once=True)
    with DataLoader(td.SlowAt(gate), batch_size=2, num_workers=2, timeout=2.0, persistent_workers=persistent,
                    multiprocessing_context="spawn", worker_init_fn=td.Announce(str(tmp_path))) as loader:
        it = iter(loader)
        assert until(lambda: td.started(str(tmp_path)) == 2, 60)  # timeout= bounds batches, not interpreter starts
        assert _indices([next(it), next(it)]) == MAP_ORDER[:2]
        with pytest.raises(WorkerTimeout):
            next(it)
        td.release(str(tmp_path))
        if persistent:  # kept: started already
            assert _indices(loader) == MAP_ORDER
        else:
            it = iter(loader)
            assert until(lambda: td.started(str(tmp_path)) == 4, 60)
            assert _indices(it) == MAP_ORDER
