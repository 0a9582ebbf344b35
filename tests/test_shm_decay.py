"""Slots follow the recent batches down as well as up (``engine/slot_size.py``).

What must hold: after one outlier batch, once a few ring-lengths of small batches have passed, the
ring's segments are back near the size the small batches need (torch's batches each use shared
memory of their own size, so after an outlier torch holds nothing more), within the epoch and in a
persistent loader's later epochs; batch sizes that vary within a band (2x here) renew no segment
once the ring has grown to fit them; every batch stays intact.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

import shmloader
from shmloader.transport.preflight import ring_slots

SHM = "/dev/shm"
MIB = 1 << 20
STEADY = ring_slots(2, 2)  # num_workers=2, prefetch_factor=2
SMALL = 64  # float32 values: a 256-byte batch
OUTLIER = 4 << 20  # float32 values: a 16 MiB batch, in a 20 MiB slot


class Sized:
    """Sample ``i`` is ``sizes[i]`` float32 values, all equal to ``i``."""

    def __init__(self, sizes: list[int]) -> None:
        self.sizes = sizes

    def __len__(self) -> int:
        return len(self.sizes)

    def __getitem__(self, i: int) -> np.ndarray:
        return np.full(self.sizes[i], i, dtype=np.float32)


class OutlierFirstEpoch:
    """Indices ``0 .. n-1`` each epoch; the first epoch also visits ``n`` (the outlier) after ``at``."""

    def __init__(self, n: int, at: int) -> None:
        self.n, self.at, self.epochs = n, at, 0

    def __len__(self) -> int:
        return self.n

    def __iter__(self) -> Iterator[int]:
        order = list(range(self.n))
        if self.epochs == 0:
            order.insert(self.at, self.n)
        self.epochs += 1
        return iter(order)


def _backed_bytes() -> int:
    """The bytes this process's segments hold in /dev/shm."""
    prefix = f"shml_{os.getpid()}_"
    return sum(os.stat(os.path.join(SHM, n)).st_blocks * 512 for n in os.listdir(SHM) if n.startswith(prefix))


def _intact(batch: Any, i: int, size: int) -> bool:
    return batch.shape == (1, size) and float(batch[0, 0]) == i and float(batch[0, -1]) == i


def _small_ring_bound() -> int:
    """What a ring of small batches may hold: its steady size and a spare, at the first slot size."""
    return (STEADY + 1) * MIB


@pytest.mark.timeout(90)
def test_one_outlier_batch_does_not_keep_large_slots_for_the_rest_of_the_epoch() -> None:
    sizes = [SMALL] * 160
    sizes[10] = OUTLIER
    loader: shmloader.DataLoader[Any] = shmloader.DataLoader(Sized(sizes), batch_size=1, num_workers=2)
    it = iter(loader)
    try:
        for i in range(140):
            assert _intact(next(it), i, sizes[i])
        held = _backed_bytes()
        assert held <= _small_ring_bound(), f"{held / MIB:.1f} MiB kept 130 batches after the outlier"
        assert all(_intact(b, 140 + k, SMALL) for k, b in enumerate(it))
    finally:
        del it
        loader.close()


@pytest.mark.timeout(90)
def test_a_persistent_loader_gives_the_outliers_slots_back_in_later_epochs() -> None:
    n = 40
    loader: shmloader.DataLoader[Any] = shmloader.DataLoader(Sized([SMALL] * n + [OUTLIER]), batch_size=1,
                                                             num_workers=2, sampler=OutlierFirstEpoch(n, 5),
                                                             persistent_workers=True)
    try:
        first = [int(b[0, 0]) for b in loader]
        assert first == list(range(5)) + [n] + list(range(5, n))
        for _ in range(2):
            assert all(_intact(b, i, SMALL) for i, b in enumerate(loader))
        it = iter(loader)
        assert all(_intact(next(it), i, SMALL) for i in range(10))
        held = _backed_bytes()
        assert held <= _small_ring_bound(), f"{held / MIB:.1f} MiB kept two epochs after the outlier"
        del it
    finally:
        loader.close()


@pytest.mark.timeout(120)
def test_sizes_varying_within_a_band_renew_no_segment_once_grown() -> None:
    low = 3 << 18  # float32 values: 3 MiB; the batches vary between 3 and 6 MiB
    sizes = [low + (low * ((7 * i) % 11)) // 10 for i in range(200)]
    loader: shmloader.DataLoader[Any] = shmloader.DataLoader(Sized(sizes), batch_size=1, num_workers=2)
    it = iter(loader)
    try:
        counts = []
        for i, b in enumerate(it):  # each batch held until the next one comes, throughout
            assert _intact(b, i, sizes[i])
            counts.append(it._ring.created_total)  # type: ignore[attr-defined]
        assert len(counts) == 200
        grown = counts[30]  # every size of the band has come by
        assert counts[-1] == grown, f"{counts[-1] - grown} segments renewed in the last 170 batches"
    finally:
        del it
        loader.close()
