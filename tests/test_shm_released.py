"""Batches the user held and has let go of: the shm directory keeps only what the loader still needs.

What must hold: once the user drops batches it held (``kept = list(loader)``, a few batches kept in
a list mid-epoch), the ring keeps a segment for no more slots than its steady size
(``Ring.whole_slots``: the pipeline plus the batch in use) and one spare, beside the batches still
held, wherever in the ring the released slots sit, and whether or not an epoch ends; torch's
batches, each in shared memory of its own, are freed as they are dropped. Every batch stays intact.
"""

from __future__ import annotations

import gc
import os
from typing import Any

import numpy as np
import pytest

import shmloader
from shmloader.transport.preflight import ring_slots

SHM = "/dev/shm"
MIB = 1 << 20
STEADY = ring_slots(2, 2)  # num_workers=2, prefetch_factor=2


class Rows:
    """Sample ``i`` holds ``width`` float32 values, all equal to ``i`` (batches of 4: 1 MiB)."""

    def __init__(self, n: int, width: int = 1 << 16, torch_flavour: bool = False) -> None:
        self.n, self.width, self.torch_flavour = n, width, torch_flavour

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> Any:
        row = np.full(self.width, i, dtype=np.float32)
        if self.torch_flavour:
            import torch

            return torch.from_numpy(row)
        return row


def _segments() -> list[os.stat_result]:
    """This process's segments in /dev/shm."""
    prefix = f"shml_{os.getpid()}_"
    return [os.stat(os.path.join(SHM, n)) for n in os.listdir(SHM) if n.startswith(prefix)]


def _backed_bytes() -> int:
    return sum(s.st_blocks * 512 for s in _segments())


def _intact(batch: Any, k: int) -> bool:
    return all(float(batch[r][0]) == 4 * k + r and float(batch[r][-1]) == 4 * k + r for r in range(4))


def _bound(held: int) -> int:
    """Segments allowed: the steady ring, one spare free slot, and one per batch still held."""
    return STEADY + 1 + held


@pytest.mark.timeout(60)
@pytest.mark.parametrize("in_order", [True, False])
def test_batches_let_go_of_mid_epoch_give_their_segments_back_before_the_epoch_ends(in_order: bool) -> None:
    loader: shmloader.DataLoader[Any] = shmloader.DataLoader(Rows(4 * 80), batch_size=4, num_workers=2,
                                                             in_order=in_order)
    it = iter(loader)
    try:
        held = [next(it) for _ in range(40)]
        assert len(_segments()) >= 40
        del held
        gc.collect()
        later = [next(it) for _ in range(3)]  # the next batches reclaim the released slots
        assert len(later) == 3
        del later
        n = len(_segments())
        assert n <= _bound(0), f"{_backed_bytes() >> 20} MiB kept in {n} segments"
        assert _backed_bytes() <= _bound(0) * MIB
        seen = sorted(int(b[0][0]) // 4 for b in it)  # the rest of the epoch: fresh slots work as before
        assert len(seen) == 37 and len(set(seen)) == 37
    finally:
        del it
        loader.close()


@pytest.mark.timeout(60)
def test_a_batch_still_held_does_not_keep_the_released_slots_before_it() -> None:
    loader: shmloader.DataLoader[Any] = shmloader.DataLoader(Rows(4 * 40), batch_size=4, num_workers=2,
                                                             persistent_workers=True)
    try:
        kept = list(loader)
        last = kept[-1]  # the last batch's slot sits at the end of the ring: the rest sit before it
        del kept
        gc.collect()
        again = [_intact(b, k) for k, b in enumerate(loader)]  # the next epoch, each batch dropped
        assert all(again) and len(again) == 40
        assert len(_segments()) <= _bound(1)
        assert _backed_bytes() <= _bound(1) * MIB
        assert _intact(last, 39)
        del last
        gc.collect()
        assert all(_intact(b, k) for k, b in enumerate(loader))
        assert len(_segments()) <= _bound(0)
    finally:
        loader.close()


@pytest.mark.timeout(90)
def test_torch_batches_let_go_of_give_their_segments_back() -> None:
    pytest.importorskip("torch")
    loader: shmloader.DataLoader[Any] = shmloader.DataLoader(Rows(4 * 60, torch_flavour=True), batch_size=4,
                                                             num_workers=2, persistent_workers=True)
    try:
        it = iter(loader)
        held = [next(it) for _ in range(30)]
        assert all(_intact(b, k) for k, b in enumerate(held))
        del held
        gc.collect()
        rest = [_intact(b, 30 + k) for k, b in enumerate(it)]
        assert all(rest) and len(rest) == 30
        assert len(_segments()) <= _bound(0)
        del it, rest
        assert all(_intact(b, k) for k, b in enumerate(loader))  # the next epoch on the same workers
        assert len(_segments()) <= _bound(0)
    finally:
        loader.close()
