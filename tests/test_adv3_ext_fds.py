"""A dataset that closes descriptors it did not open, or opens files onto their numbers.

The defect: the worker took its closed pipe for the main process's end and exited with code 0,
saying nothing (torch's worker at least prints the ``OSError``), and where the dataset had opened
files onto the pipes' numbers, the worker wrote its reply into the dataset's own file. The worker
now checks its pipes before each reply and whenever a read fails or it has waited a while: it
names itself, its pid and the descriptor on stderr and exits with its own code, which the main
process's ``WorkerDied`` explains.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import adv3_ext_datasets as ds
import pytest

from shmloader import DataLoader, WorkerDied
from shmloader.worker.pipes import LOST_PIPE_EXIT


@pytest.mark.timeout(60)
@pytest.mark.parametrize("reopen", [False, True])
def test_a_dataset_that_takes_the_workers_pipes_is_named(tmp_path: Path, reopen: bool,
                                                           capfd: pytest.CaptureFixture[str]) -> None:
    files = tmp_path / "files"
    files.mkdir()
    loader: DataLoader[Any] = DataLoader(ds.TakesDescriptors(5, str(files) if reopen else None), batch_size=2,
                                         num_workers=2)
    try:
        with pytest.raises(WorkerDied) as info:
            list(loader)
    finally:
        loader.close()
    message = str(info.value)
    assert f"exit code {LOST_PIPE_EXIT}" in message and "sample indices [4..5]" in message, message
    assert "pipe to the main process" in message and "did not open" in message, message
    err = capfd.readouterr().err
    assert f"DataLoader worker 0 (pid {info.value.pid})" in err and "descriptor" in err, err
    assert all(os.path.getsize(f) == 0 for f in files.iterdir())  # no reply written into the dataset's files
