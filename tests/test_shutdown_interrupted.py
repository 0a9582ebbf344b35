"""A KeyboardInterrupt (a second Ctrl-C) that lands while the loader shuts its workers down still
stops and joins every worker (docs/design/shutdown-order.md: "Every process is joined").

``WorkerPool.shutdown`` takes the workers off its list before it joins them, so an interruption
during the join used to leave busy workers running, and no later ``close()`` knew of them.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import select

import numpy as np
import pytest

import shmloader

CTX = mp.get_context("fork")


class BusyAfterFirst(shmloader.Dataset):
    """Samples from 4 on: say so (``busy``), then wait for the pipe ``gate`` to be readable (at most
    30 s), as slow I/O. (Not an mp.Event: one whose waiters are killed cannot be set any more.)"""

    def __init__(self, busy, gate: int) -> None:  # noqa: ANN001 - an mp.Semaphore
        self.busy = busy
        self.gate = gate

    def __len__(self) -> int:
        return 64

    def __getitem__(self, i: int) -> np.ndarray:
        if i >= 4:
            self.busy.release()
            select.select([self.gate], [], [], 30)
        return np.full(8, i, np.float32)


@pytest.mark.timeout(60)
def test_a_ctrl_c_during_the_join_of_close_still_stops_every_worker(tmp_path):
    """(The shutdown does not depend on the start method; fork lets the dataset hold the semaphore.)"""
    busy = CTX.Semaphore(0)
    gate, opener = os.pipe()
    loader = shmloader.DataLoader(BusyAfterFirst(busy, gate), batch_size=2, num_workers=2, persistent_workers=True,
                                  shm_dir=str(tmp_path), multiprocessing_context="fork")
    try:
        it = iter(loader)
        next(it)
        assert busy.acquire(timeout=30) and busy.acquire(timeout=30)  # both workers are inside a slow sample
        processes = [w.process for w in it._pool.workers]
        join = processes[0].join

        def interrupted_join(timeout: float | None = None) -> None:
            processes[0].join = join  # once: the user's second Ctrl-C, during the polite join
            raise KeyboardInterrupt

        processes[0].join = interrupted_join
        with pytest.raises(KeyboardInterrupt):
            loader.close()
        assert [p.exitcode is not None for p in processes] == [True, True]  # stopped and joined
        assert list(tmp_path.iterdir()) == []
    finally:
        os.close(opener)  # the gate opens (EOF) for a worker still waiting
        loader.close()
        os.close(gate)
