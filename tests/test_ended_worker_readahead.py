"""How far the other workers read ahead once an IterableDataset's share has ended, beside torch.

torch 2.13 caps the tasks outstanding IN TOTAL at ``prefetch_factor * num_workers``
(``_try_put_index``), not per worker (with ``in_order=False`` a worker takes at most that total
divided among the workers not ended). The task that finds a worker's end is replaced by one for
another worker; a task dealt to a worker after its end is never answered (its worker skips it),
and stays counted until the epoch ends. So once worker 0 of two has ended, worker 1 holds
``prefetch_factor * 2 - (tasks dealt to worker 0 after its end)`` tasks: 3 here, where ours held
``prefetch_factor``, 2. The ring needs no more slots: the total stays within
``prefetch_factor * num_workers``.

Worker 0's end is held at a gate (``GatedEnd``) until batch 1 is out, so exactly one task (4) is
dealt to it after its end on both sides, whatever the timing. Ungated, that number follows timing:
torch reads the end only when it waits for a batch (after handing out batch 0 and dealing task 4
to worker 0), we read it with batch 0's reply, in the same read, and often deal worker 0 nothing
more: worker 1 then holds 4.
"""

from __future__ import annotations

import multiprocessing
from typing import Any

import pytest

import ended_datasets as ed
from iter_helpers import mp_iter
from shmloader import DataLoader
from shmloader.transport.preflight import ring_slots

N = 40
SHORT = 2  # worker 0's share: samples 0 and 2, one batch; worker 1's: 1, 3, ... 39
PREFETCH = 2
BATCHES = 8  # handed out, of worker 1's ten


def _gate() -> tuple[Any, Any]:
    ctx = multiprocessing.get_context("fork")
    return ctx.Event(), ctx.Event()


def _ahead(it: Any, at_end: Any, gate: Any, ahead_of_1: Any) -> list[int]:
    """Hand out ``BATCHES`` batches of ``it``, worker 0's end let through after the second; after
    each from then on, ``ahead_of_1()``: the tasks worker 1 was sent that are not handed out yet."""
    assert ed.firsts(next(it)) == [0, 2]
    assert at_end.wait(30), "worker 0 never reached the end of its share"
    assert ed.firsts(next(it)) == [1, 3]  # task 4 went to worker 0, its end not yet read: on both sides
    gate.set()
    seen = []
    for _ in range(BATCHES - 2):
        next(it)
        seen.append(ahead_of_1())
    return seen


@pytest.mark.timeout(60)
def test_torch_reads_further_ahead_with_the_workers_left() -> None:
    torch_data: Any = pytest.importorskip("torch.utils.data")
    at_end, gate = _gate()
    loader = torch_data.DataLoader(ed.torch_uneven(N, SHORT, lambda: ed.gated_end(at_end, gate)), batch_size=2,
                                   num_workers=2, prefetch_factor=PREFETCH, multiprocessing_context="fork")
    it = iter(loader)
    assert _ahead(it, at_end, gate, lambda: it._workers_num_tasks[1]) == [3] * (BATCHES - 2)
    it._shutdown_workers()


@pytest.mark.timeout(60)
def test_ours_reads_as_far_ahead_and_needs_no_more_slots() -> None:
    at_end, gate = _gate()
    loader: DataLoader[Any] = DataLoader(ed.GatedEnd(N, SHORT, at_end, gate), batch_size=2, num_workers=2,
                                         prefetch_factor=PREFETCH, multiprocessing_context="fork")
    it = mp_iter(iter(loader))
    handed = [1]  # worker 1's batches out: batch 1, then one per later batch (worker 0 has no other)
    in_pipeline: list[int] = []

    def ahead_of_1() -> int:
        in_pipeline.append(it._ledger.in_epoch(it._epoch) + len(it._reorder))
        handed[0] += 1
        return it._dispatcher.dealt[1] - handed[0]

    assert _ahead(it, at_end, gate, ahead_of_1) == [3] * (BATCHES - 2)  # was [2] * 6: prefetch_factor
    assert max(in_pipeline) <= PREFETCH * 2  # the ring's slots: as many as before
    assert len(it._ring.slots) <= ring_slots(2, PREFETCH)
    it.close()
