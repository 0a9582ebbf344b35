"""torch parity of an iterable dataset loaded with ``in_order=False``: a worker that is slow to
give its first batch does not stall the others, side by side with torch's ``DataLoader``.

torch's ``_try_put_index`` deals an iterable dataset's tasks round-robin over the workers whose
share has not ended and, with ``in_order=False``, passes over a worker that already holds its
share of the pipeline (``prefetch_factor`` tasks while every worker has data). So with two
workers and worker 0 stuck on its first sample, worker 1's next tasks go to worker 1 and its
whole share reaches the caller first. (Before, the loader dealt the next task to worker 0 in
turn, waited for room there, and the caller waited with it.)
"""

from __future__ import annotations

import multiprocessing
from collections.abc import Iterator
from typing import Any

import pytest

torch = pytest.importorskip("torch")
from torch.utils import data as tdata  # noqa: E402

import shmloader.torch as st  # noqa: E402

FORK = multiprocessing.get_context("fork")
GATE_WAIT_S = 60.0
LOADER_TIMEOUT_S = 30.0


class Gated(tdata.IterableDataset):
    """``range(12)`` sharded over the workers; worker 0 waits for ``gate`` (a semaphore: releasing it
    never blocks, even when the waiter was killed) before its first sample."""

    def __init__(self, gate: Any) -> None:
        self.gate = gate

    def __iter__(self) -> Iterator[int]:
        info = tdata.get_worker_info()
        assert info is not None
        if info.id == 0 and not self.gate.acquire(timeout=GATE_WAIT_S):
            raise TimeoutError("the gate of worker 0 was never opened")
        yield from range(info.id, 12, info.num_workers)


def _run(loader_class: type) -> tuple[list[list[int]], list[list[int]]]:
    """The first three batches while worker 0 is stuck, then the rest once it may go on."""
    gate = FORK.Semaphore(0)
    loader = loader_class(Gated(gate), batch_size=2, num_workers=2, in_order=False,
                          multiprocessing_context="fork", timeout=LOADER_TIMEOUT_S)
    it = iter(loader)
    try:
        first = [next(it).tolist() for _ in range(3)]
        gate.release()
        rest = [batch.tolist() for batch in it]
    finally:
        gate.release()
        if hasattr(loader, "close"):
            loader.close()
        else:
            it._shutdown_workers()
    return first, rest


@pytest.mark.timeout(180)
def test_a_stuck_worker_does_not_stall_the_others_as_in_torch() -> None:
    theirs = _run(tdata.DataLoader)
    assert theirs == ([[1, 3], [5, 7], [9, 11]], [[0, 2], [4, 6], [8, 10]])  # what torch 2.13 gives
    assert _run(st.DataLoader) == theirs
