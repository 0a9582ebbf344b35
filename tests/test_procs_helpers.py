"""A worker that forks a helper process of its own: its death is still seen at once.

The defect: multiprocessing's sentinel for a fork or spawn worker is a pipe whose write end the
worker holds for its life, and it reads as closed only when every process holding that end has
exited. A helper the worker forked (``worker_init_fn`` or the dataset starting a background
process with a bare fork, as some C libraries do) inherits it, so while the helper lived a dead
worker looked alive: the main process waited for its batch until the helper exited (forever for
a helper that never does; here 20 s for one that lived 20 s), and every join at shutdown waited
out its full timeout. The main process now watches each worker's exit through a pidfd, which the
worker's children cannot hold (``shmloader/engine/exits.py``).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import numpy as np
import procs_datasets as pd
import pytest

from shmloader import DataLoader, WorkerDied

METHODS = ["fork", "spawn", "forkserver"]
NOTICED_S = 15.0  # well under the helper's life (procs_datasets.HELPER_LIFE_S)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("method", METHODS)
def test_a_worker_death_is_raised_while_a_helper_it_forked_lives(method: str, tmp_path: Path) -> None:
    loader: DataLoader[Any] = DataLoader(pd.DiesAt(9), batch_size=2, num_workers=2,
                                         worker_init_fn=pd.StartsHelper(str(tmp_path)), multiprocessing_context=method)
    started = time.monotonic()
    try:
        with pytest.raises(WorkerDied, match=r"worker \(pid \d+\) is killed by signal: Killed \(SIGKILL, 9\)\. Worker \d died"):
            list(loader)
        elapsed = time.monotonic() - started
    finally:
        loader.close()
        pd.end_noted(str(tmp_path), "helper")
    assert pd.noted_pids(str(tmp_path), "helper")  # the worker that died had started its helper (the other may not have)
    assert elapsed < NOTICED_S, f"the death was noticed only after {elapsed:.1f} s"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("method", METHODS)
def test_a_worker_with_a_helper_is_restarted_and_every_batch_comes_once(method: str, tmp_path: Path) -> None:
    helpers = tmp_path / "helpers"
    helpers.mkdir()
    loader: DataLoader[Any] = DataLoader(pd.DiesAt(9, once_dir=str(tmp_path)), batch_size=2, num_workers=2,
                                         worker_init_fn=pd.StartsHelper(str(helpers)), multiprocessing_context=method,
                                         on_worker_death="restart")
    started = time.monotonic()
    try:
        batches = [b.tolist() for b in loader]
        elapsed = time.monotonic() - started
    finally:
        loader.close()
        pd.end_noted(str(helpers), "helper")
    assert batches == [np.full((2, 4), [[i], [i + 1]]).tolist() for i in range(0, pd.N, 2)]
    assert len(pd.noted_pids(str(helpers), "helper")) == 3  # two workers and the one that replaced the dead one
    assert elapsed < NOTICED_S, f"the epoch took {elapsed:.1f} s"
