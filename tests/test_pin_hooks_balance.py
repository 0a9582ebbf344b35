"""A pinned ring's register/unregister hooks balance exactly through a loader's whole life.

The ring grows while batches are held, gives back surplus slots once they are dropped, renews an
outlier's large slots smaller, compacts at a persistent loader's next epoch, and closes with
batches dropped whose fences are still pending. Through all of it, with the fake backend: every
segment registered is unregistered exactly once, while still mapped (the fake raises otherwise),
and ``close()`` unpins a segment only once the fences of the batches dropped from it completed.
"""

from __future__ import annotations

import gc
from typing import Any

import numpy as np
import pytest
from iter_helpers import mp_iter

import shmloader
from shmloader.gpu.fake import FakeBackend
from shmloader.transport.segment import Segment

BIG, SMALL = 1 << 18, 64  # float32 elements of an outlier sample and of the others
N = 128


class Sizes:
    """Samples 0-3 are large (an outlier batch), the rest small."""

    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int) -> np.ndarray:
        return np.full(BIG if i < 4 else SMALL, i, dtype=np.float32)


def watch_unregisters(fake: FakeBackend, monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """For each unregistration: whether every fence recorded so far had completed."""
    seen: list[bool] = []
    unregister = fake.unregister_segment

    def watched(segment: Segment) -> None:
        seen.append(all(f.done for f in fake.fences))
        unregister(segment)

    monkeypatch.setattr(fake, "unregister_segment", watched)
    return seen


@pytest.mark.timeout(90)
def test_hooks_balance_through_growth_renewal_compaction_and_close(fake: FakeBackend,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    seen = watch_unregisters(fake, monkeypatch)
    dl: shmloader.DataLoader = shmloader.DataLoader(Sizes(), batch_size=4, num_workers=2, pin_memory=True, persistent_workers=True,
                              prefetch_factor=1, slot_bytes=1 << 16)
    try:
        held = list(dl)  # every batch held: the ring grows
        assert [int(b[0, 0]) for b in held] == list(range(0, N, 4))
        ring = mp_iter(dl._iterator)._ring
        grown = len(ring.slots)
        del held
        gc.collect()
        outlier = max(s.size_bytes for s in ring.slots)
        for k, batch in enumerate(dl):  # the next epoch compacts; the outlier's slots are renewed smaller
            assert int(batch[0, 0]) == 4 * k
            if k == N // 4 - 2:
                assert min(s.size_bytes for s in ring.slots) < outlier
        assert len(ring.slots) < grown
        fake.fences_done = False
        kept = []
        for k, batch in enumerate(dl):  # stopped mid-epoch, its dropped batches' fences pending
            kept.append(batch)
            if k == 5:
                break
        del kept, batch
        gc.collect()
        assert any(not f.done for f in fake.fences)
    finally:
        dl.close()
    gc.collect()
    assert fake.registered == {}, "segments left registered"
    assert fake.count("register") == fake.count("unregister") == ring.created_total
    assert all(c.mapped for c in fake.calls if c.kind == "unregister")
    assert seen and all(seen), "a segment unpinned while a fence was pending"
