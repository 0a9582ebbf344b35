"""A worker whose ``worker_init_fn`` raises (in one worker of two): its failure is raised where its
first task is due, after every batch before it, as torch raises it; never in place of a batch
another worker made before it.

The order is made deterministic in the first test: worker 1's init fails at once, and worker 0
fetches sample 0 only once the main process has read worker 1's failure (a gate file, created by
a wrapper of the main process's reply handler; ``task_timeout_s`` makes the main process wait on
every worker's replies, not only on the due batch's worker). The failure then always arrives
first; batch 0 must still be handed out before it. Before, the failure was raised as it was read,
and batch 0 was lost.
"""

from __future__ import annotations

import multiprocessing
from typing import Any

import numpy as np
import pytest

import start_datasets as sd
from shmloader import DataLoader
from shmloader.engine.wait import WaitAndRecover
from shmloader.transport.messages import Failed

METHODS = [m for m in ("fork", "spawn") if m in multiprocessing.get_all_start_methods()]
CAUGHT = r"^Caught ValueError in DataLoader worker process 1 \(pid \d+\)\.\nOriginal Traceback"


def open_gate_on_failure(monkeypatch: pytest.MonkeyPatch, gate: str) -> None:
    """Create ``gate`` as the main process reads a worker's ``Failed`` reply."""
    original = WaitAndRecover._process

    def process(self: Any, w: Any, msg: Any) -> None:
        if isinstance(msg, Failed):
            open(gate, "w").close()
        original(self, w, msg)

    monkeypatch.setattr(WaitAndRecover, "_process", process)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("policy", ["raise", "restart"])
@pytest.mark.parametrize("method", METHODS)
def test_start_failure_raised_where_its_first_task_is_due(method: str, policy: str, tmp_path: Any,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    gate = str(tmp_path / "gate")
    open_gate_on_failure(monkeypatch, gate)
    loader: DataLoader[Any] = DataLoader(sd.GatedFirst(8, gate), batch_size=2, num_workers=2,
                                         worker_init_fn=sd.InitRaisesIn(1), multiprocessing_context=method,
                                         on_worker_death=policy, max_task_attempts=1, task_timeout_s=60)
    check_order(iter(loader))


def check_order(it: Any) -> None:
    """Batch 0, then worker 1's failure at batch 1, then the other batches: worker 1 runs on without
    its init, as torch's does (tests/test_worker_init_fails.py)."""
    first = np.asarray(next(it))
    assert first[:, 0].tolist() == [0, 10]  # worker 0's batch
    with pytest.raises(ValueError, match=CAUGHT) as info:
        next(it)  # task 1: worker 1's first task
    assert "init of worker 1 failed" in str(info.value)
    assert [np.asarray(b)[:, 0].tolist() for b in it] == [[40, 50], [60, 70]]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("persistent", [False, True])
def test_start_failure_in_order_by_default(persistent: bool, tmp_path: Any) -> None:
    """The default wait (on the due batch's worker only) gives the same order."""
    loader: DataLoader[Any] = DataLoader(sd.GatedFirst(8, str(tmp_path / "open")), batch_size=2, num_workers=2,
                                         worker_init_fn=sd.InitRaisesIn(1), persistent_workers=persistent)
    open(str(tmp_path / "open"), "w").close()
    check_order(iter(loader))


@pytest.mark.timeout(60)
def test_torch_raises_it_at_the_same_batch() -> None:
    """The order the test above asks for is torch's: batch 0, then worker 1's failure at batch 1."""
    torch_data = pytest.importorskip("torch.utils.data")
    loader = torch_data.DataLoader(list(range(8)), batch_size=2, num_workers=2, worker_init_fn=sd.InitRaisesIn(1),
                                   multiprocessing_context=METHODS[0])
    it = iter(loader)
    assert next(it).tolist() == [0, 1]
    with pytest.raises(ValueError, match=r"^Caught ValueError in DataLoader worker process 1\."):
        next(it)
    del it  # its workers are shut down here
