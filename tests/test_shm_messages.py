"""A full shm directory: the error says what filled it and what to change.

What must hold: when the ring cannot grow because the user holds batches, the ShmSpaceError says
so (how many slots, how many held) and names the remedy for it (drop or copy the batches kept,
``max_slots`` to stop sooner); when the directory has bytes left but no inodes (a tmpfs mounted
with a small ``nr_inodes``), the error says that, instead of "needs N bytes, has more than N free".
"""

from __future__ import annotations

import errno
import gc
import os
from typing import Any

import numpy as np
import pytest
from ring_helpers import leased

import shmloader
from shmloader.errors import ShmSpaceError
from shmloader.transport import segment, shm_space
from shmloader.transport.ring import Ring

SHM = "/dev/shm"
MIB = 1 << 20


def _full(fd: int, offset: int, length: int) -> None:
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def test_a_ring_that_cannot_grow_for_held_batches_says_so(monkeypatch: Any) -> None:
    ring = Ring(SHM)
    try:
        bufs = []
        for task in range(3):
            slot = ring.grow(MIB, (0, task))
            ring.fill(slot, (0, task))
            bufs.append(ring.lease(slot, (0, task)))
        monkeypatch.setattr(segment.os, "posix_fallocate", _full)
        with pytest.raises(ShmSpaceError) as caught:
            ring.grow(MIB, (0, 3))
        text = str(caught.value)
        assert "3 slots" in text and "3 of them held by batches" in text, text
        assert "max_slots" in text and SHM in text and str(MIB) in text, text
    finally:
        monkeypatch.undo()
        del bufs
        gc.collect()
        ring.close()


def test_a_directory_out_of_inodes_says_so_not_bytes(monkeypatch: Any) -> None:
    ring = Ring(SHM)
    monkeypatch.setattr(segment.os, "posix_fallocate", _full)
    monkeypatch.setattr(shm_space, "shm_free_files", lambda d: 0)
    try:
        with pytest.raises(ShmSpaceError) as caught:
            ring.grow(MIB, (0, 0))
        text = str(caught.value)
        assert "inode" in text and "nr_inodes" in text and "SHMLOADER_SHM_DIR" in text, text
    finally:
        monkeypatch.undo()
        ring.close()


class Small:
    def __len__(self) -> int:
        return 64

    def __getitem__(self, i: int) -> np.ndarray:
        return np.full(4, i)


@pytest.mark.timeout(60)
def test_list_of_a_loader_past_the_directory_names_the_held_batches(monkeypatch: Any) -> None:
    real = os.posix_fallocate
    calls = []

    def fills_up(fd: int, offset: int, length: int) -> None:  # room for 8 slots, then none
        calls.append(length)
        if len(calls) > 8:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real(fd, offset, length)

    monkeypatch.setattr(segment.os, "posix_fallocate", fills_up)
    loader: shmloader.DataLoader[Any] = shmloader.DataLoader(Small(), batch_size=2, num_workers=2,
                                                             multiprocessing_context="fork")
    held = []
    try:
        with pytest.raises(ShmSpaceError) as caught:
            for batch in loader:
                held.append(batch)
        assert "held by batches" in str(caught.value) and len(held) >= 3, str(caught.value)
        assert all((b[:, 0] == [2 * k, 2 * k + 1]).all() for k, b in enumerate(held))
    finally:
        del held
        loader.close()
