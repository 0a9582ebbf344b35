"""A slot growth refused for lack of shared memory is raised when its task is due, not before.

The refusal breaks the loader, but it belongs to one task: every batch due before that task is
still handed out, as it would be had its worker been slower than the refusal. Raised as soon as it
was met, it dropped the batches of earlier tasks still in flight, whether the refusal came at the
pre-flight check (``WaitAndRecover._regrow``) or while the segment was being reserved
(``WaitAndRecover._grow``). Here task 0's worker waits until the refusal has been met before it
loads its sample, so batch 0 is still in flight when task 1's growth is refused. The wait is made
to read every worker's replies (``_head_only`` off): asleep, it would read only task 0's worker,
and task 1's reply would wait in its pipe until batch 0 came.
"""

from __future__ import annotations

import multiprocessing
from typing import Any

import numpy as np
import pytest
from iter_helpers import mp_iter
from shm_full import full_past_the_first_part

import shmloader
from shmloader.errors import ShmSpaceError
from shmloader.transport import shm_space

BIG = 1 << 19  # float64s: a 4 MiB sample, four times the first slot


class _WaitsAtZero(shmloader.Dataset):
    """Sample 0 comes once ``go`` is set; sample 1 outgrows the first slot; the rest are small."""

    def __init__(self, go: Any) -> None:
        self.go = go

    def __len__(self) -> int:
        return 6

    def __getitem__(self, i: int) -> np.ndarray:
        if i == 0 and not self.go.wait(30):
            raise TimeoutError("the test never set go")
        return np.full(BIG if i == 1 else 4, float(i))


def _loader(go: Any) -> shmloader.DataLoader[Any]:
    return shmloader.DataLoader(_WaitsAtZero(go), batch_size=1, num_workers=2, prefetch_factor=2,
                                multiprocessing_context="fork")


def _iter(loader: shmloader.DataLoader[Any]) -> Any:
    it = iter(loader)
    mp_iter(it)._head_only = False  # wake for task 1's reply while task 0 is due
    return it


def _check_batch_zero_then_refusal(it: Any) -> None:
    first = next(it)
    assert first.tolist() == [[0.0] * 4]  # task 0's batch, in flight when task 1's growth was refused
    with pytest.raises(ShmSpaceError):
        next(it)  # task 1's turn
    assert mp_iter(it).closed and multiprocessing.active_children() == []


@pytest.mark.timeout(60)
def test_a_growth_refused_at_the_preflight_waits_for_the_batches_due_before_it(monkeypatch):
    monkeypatch.setattr(shm_space, "shm_free_bytes", lambda d: 12 << 20)  # 1 MiB slots fit, 4 MiB ones not
    go = multiprocessing.get_context("fork").Event()
    loader = _loader(go)
    it = _iter(loader)
    real_regrow = mp_iter(it)._regrow

    def regrow_then_go(*args: Any) -> None:
        real_regrow(*args)
        go.set()  # the refusal was met: only now does task 0's worker load its sample

    mp_iter(it)._regrow = regrow_then_go  # type: ignore[method-assign]
    try:
        _check_batch_zero_then_refusal(it)
    finally:
        loader.close()


@pytest.mark.timeout(60)
def test_a_growth_refused_while_reserving_waits_for_the_batches_due_before_it(monkeypatch):
    go = multiprocessing.get_context("fork").Event()
    full_past_the_first_part(monkeypatch, on_refusal=go.set)
    loader = _loader(go)
    try:
        _check_batch_zero_then_refusal(_iter(loader))
    finally:
        loader.close()


@pytest.mark.timeout(30)
def test_a_growth_refused_while_reserving_the_last_task_is_raised_not_waited_for(monkeypatch):
    """The refusal met in ``_grow`` is due at once when it is the only task left: the step loop
    hands it out instead of sleeping in a wait that no worker will end (the loader hung there)."""
    full_past_the_first_part(monkeypatch)
    loader = shmloader.DataLoader(_OneBig(), batch_size=None, num_workers=1, multiprocessing_context="fork")
    it = iter(loader)
    try:
        with pytest.raises(ShmSpaceError, match="No space left on device"):
            next(it)
        assert mp_iter(it).closed and multiprocessing.active_children() == []
    finally:
        loader.close()


class _OneBig(shmloader.Dataset):
    """One sample, four times the first slot: one task, whose slot must grow."""

    def __len__(self) -> int:
        return 1

    def __getitem__(self, i: int) -> np.ndarray:
        return np.full(BIG, float(i))
