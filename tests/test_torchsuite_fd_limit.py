"""Out of file descriptors because the caller holds many batches: torch raises a RuntimeError there
("Too many open files ... increase the limit using `ulimit -n` ... set_sharing_strategy"), and code
written for torch catches RuntimeError. Ours was a plain OSError, which such code does not catch.
It is now ``TooManyOpenFiles``: an OSError with the errno (EMFILE or ENFILE) and a LoaderError (a
RuntimeError), naming the limit, how to raise it, and why torch's sharing-strategy advice does not
apply. torch's test_dataloader.py ``test_fd_limit_exceeded``, in our words."""

from __future__ import annotations

import errno
import subprocess
import sys
from pathlib import Path

import pytest

from shmloader.errors import LoaderError, TooManyOpenFiles

REPO = Path(__file__).resolve().parent.parent

SCRIPT = """
import resource
import numpy as np
import shmloader

class Random(shmloader.IterableDataset):
    def __iter__(self):
        for _ in range(200):
            yield np.random.randn(2, 2)

kept = []
resource.setrlimit(resource.RLIMIT_NOFILE, (100, 100))
try:
    for batch in shmloader.DataLoader(Random(), multiprocessing_context="fork", num_workers=1):
        kept.append(batch)
except RuntimeError as e:
    assert isinstance(e, OSError) and e.errno == {errno}, repr(e)
    assert "ulimit -n" in str(e) and "set_sharing_strategy" in str(e), str(e)
    print("caught", type(e).__name__)
else:
    raise SystemExit("no error: all %d batches held" % len(kept))
"""


@pytest.mark.timeout(120)
def test_holding_batches_past_the_descriptor_limit_is_a_runtime_error_as_in_torch() -> None:
    run = subprocess.run([sys.executable, "-c", SCRIPT.format(errno=errno.EMFILE)], cwd=REPO, capture_output=True,
                         text=True, timeout=110)
    assert run.returncode == 0 and "caught TooManyOpenFiles" in run.stdout, run.stdout + run.stderr


def test_the_error_is_an_os_error_and_a_loader_error_that_pickles() -> None:
    import pickle

    error = TooManyOpenFiles(errno.EMFILE, "cannot create a shared-memory segment in /dev/shm: too many open files")
    assert isinstance(error, OSError) and isinstance(error, LoaderError) and isinstance(error, RuntimeError)
    back = pickle.loads(pickle.dumps(error))
    assert type(back) is TooManyOpenFiles and back.errno == errno.EMFILE and str(back) == str(error)
