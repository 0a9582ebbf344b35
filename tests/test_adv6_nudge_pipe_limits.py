"""Out of descriptors as a pool is made: the pool's own nudge pipe, made before any worker's pipes,
is refused with the same named error as a worker's pipe.

The defect: ``WorkerPool`` made its nudge pipe in its constructor, outside ``start_all``'s
rewording of a limit, so at the open-file limit ``iter(loader)`` raised a bare
``OSError: [Errno 24] Too many open files`` where it named worker 0, ``num_workers`` and
``RLIMIT_NOFILE`` before the nudge pipe existed.
"""

from __future__ import annotations

import errno
import gc
import os
from multiprocessing.context import BaseContext
from typing import Any

import adv6_datasets as ds
import pytest
from process_helpers import workers_left

from shmloader import DataLoader


def _refused(self: BaseContext, duplex: bool = True) -> Any:
    raise OSError(errno.EMFILE, os.strerror(errno.EMFILE))


@pytest.mark.timeout(60)
def test_no_descriptor_for_the_nudge_pipe_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    loader: DataLoader[Any] = DataLoader(ds.Outgrows(8, ()), batch_size=2, num_workers=2,
                                         multiprocessing_context="fork")
    gc.collect()
    before = len(os.listdir("/proc/self/fd"))
    monkeypatch.setattr(BaseContext, "Pipe", _refused)  # every pipe: the first one asked for fails
    with pytest.raises(OSError) as info:
        iter(loader)
    monkeypatch.undo()
    loader.close()
    gc.collect()
    assert info.value.errno == errno.EMFILE
    text = str(info.value)
    assert "worker 0 of num_workers=2" in text and "RLIMIT_NOFILE" in text, text
    assert workers_left() == [] and len(os.listdir("/proc/self/fd")) == before
