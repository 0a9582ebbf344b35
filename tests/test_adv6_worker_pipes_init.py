"""A ``worker_init_fn`` that takes the worker's descriptors before its first task.

The defect: the worker read which pipes its descriptors name (``PipeWatch``) only as it began to
serve tasks, after ``worker_init_fn``. One that closed them and opened files onto their numbers
had those files taken for the pipes: the worker's ``Ready`` went into the user's file and the
worker exited with code 0 saying nothing; one that put a file onto the nudge pipe's number had a
byte written into that file at every ``TooSmall``. The identities are now read as the worker
starts, before any user code (its dataset's unpickling included).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import adv6_datasets as ds
import numpy as np
import pytest

from shmloader import DataLoader, WorkerDied
from shmloader.engine.workers import WorkerPool
from shmloader.worker.pipes import LOST_PIPE_EXIT


@pytest.mark.timeout(60)
def test_a_worker_init_fn_that_takes_the_pipes_is_named(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    loader: DataLoader[Any] = DataLoader(ds.Outgrows(8, ()), batch_size=2, num_workers=2, timeout=30,
                                         worker_init_fn=ds.TakesDescriptorsAtInit(str(tmp_path)))
    try:
        with pytest.raises(WorkerDied) as info:
            list(loader)
    finally:
        loader.close()
    assert f"exit code {LOST_PIPE_EXIT}" in str(info.value), str(info.value)
    err = capfd.readouterr().err
    assert f"(pid {info.value.pid}): descriptor" in err, err
    assert {f.name: f.stat().st_size for f in tmp_path.iterdir() if f.stat().st_size} == {}


@pytest.mark.timeout(60)
def test_a_worker_init_fn_that_takes_the_nudge_pipe_gets_no_byte(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    init = WorkerPool.__init__

    def noting_the_nudge_fd(self: WorkerPool, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        monkeypatch.setattr(ds, "NUDGE_FD", self._nudge_w.fileno())  # inherited by the forked workers

    monkeypatch.setattr(WorkerPool, "__init__", noting_the_nudge_fd)
    loader: DataLoader[Any] = DataLoader(ds.Outgrows(6, (1, 4)), batch_size=1, num_workers=2,
                                         multiprocessing_context="fork", worker_init_fn=ds.TakesNudgeAtInit(str(tmp_path)))
    batches = list(loader)
    assert [float(b[0, 0]) for b in batches] == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]
    assert [b.shape[1] for b in batches] == [4, ds.BIG, 4, 4, ds.BIG, 4]
    assert sorted(f.name for f in tmp_path.iterdir()) == ["w0", "w1"]
    assert {f.name: f.stat().st_size for f in tmp_path.iterdir()} == {"w0": 0, "w1": 0}  # no nudge written there
    assert np.all(batches[1] == 1.0)
