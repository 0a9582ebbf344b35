"""A loader iterated with workers, then with ``num_workers=0``, still pins its batches.

torch lets ``num_workers`` change between epochs. With workers, the pin backend chosen for the ring
marks slot-backed batches pinned (``finish``: their pages are registered). Without workers a batch
is the collate's own memory, in no slot: it must be pinned by a copy, as a loader that never had
workers pins it, not passed to the backend as if a registered slot held it (it reached the caller
unpinned, so a ``non_blocking`` copy of it was a synchronous one). The accelerator and the pinned
allocator are faked here; tests/test_gpu.py checks ``is_pinned()`` on a real device.
"""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("torch")

import shmloader  # noqa: E402
from shmloader.gpu import pinning  # noqa: E402
from shmloader.gpu.fake import FakeBackend  # noqa: E402


def _inside(array: np.ndarray, buffers: list[np.ndarray]) -> bool:
    base = array
    while base.base is not None:
        base = base.base
    return any(base is buffer for buffer in buffers)


@pytest.mark.timeout(60)
def test_batches_without_workers_are_pinned_by_a_copy_after_an_epoch_with_workers(
        fake: FakeBackend, monkeypatch: pytest.MonkeyPatch) -> None:
    buffers: list[np.ndarray] = []

    def pinned_host(nbytes: int) -> np.ndarray:
        buffers.append(np.empty(nbytes, dtype=np.uint8))
        return buffers[-1]

    monkeypatch.setattr(pinning, "accelerator_available", lambda: True)
    monkeypatch.setattr(pinning, "pinned_host", pinned_host)
    data = np.arange(16 * 4, dtype=np.float32).reshape(16, 4)
    dl = shmloader.DataLoader(shmloader.ArrayDataset(data), batch_size=4, num_workers=1, pin_memory=True)
    try:
        assert len(list(dl)) == 4 and fake.finished == 4 and not buffers  # slots: the backend's
        dl.num_workers = 0
        batches = [x for (x,) in dl]
    finally:
        dl.close()
    assert fake.finished == 4, "a batch in no slot was handed to the pin backend as if pinned"
    assert len(batches) == 4 and all(_inside(x, buffers) for x in batches)
    np.testing.assert_array_equal(np.concatenate(batches), data)
