"""``num_workers=0`` with ``pin_memory=True`` pins a numpy batch by a copy, as torch pins tensors
(also after an epoch with workers chose a pin backend for the slots).

With workers a numpy batch views its slot, which the pin backend registered: it is pinned. Without
workers the batch is the collate's own memory, and torch's ``pin_memory`` (the copy torch's
single-process loader makes) passes numpy arrays through: they reached the caller unpinned, so a
``non_blocking`` copy of them to the device was a synchronous one, and nothing said so. Here the
accelerator is faked (this machine's torch has none): the pinned allocator is replaced by one that
records what it was asked for; tests/test_gpu.py checks ``is_pinned()`` on a real device.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np
import pytest

pytest.importorskip("torch")

import shmloader  # noqa: E402
from shmloader.gpu import pinning  # noqa: E402


class Pair(NamedTuple):
    x: np.ndarray
    y: np.ndarray


class Rows(shmloader.Dataset):
    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int) -> Any:
        return {"pair": Pair(np.full((3, 2), i, dtype=np.float32), np.array(i, dtype=np.int16)),
                "name": f"row{i}", "empty": np.zeros((0, 4), dtype=np.float64)}


class PinnedHost:
    """Stands in for the pinned allocator: a fresh uint8 buffer per call, each one recorded."""

    def __init__(self) -> None:
        self.buffers: list[np.ndarray] = []

    def __call__(self, nbytes: int) -> np.ndarray:
        buffer = np.empty(nbytes, dtype=np.uint8)
        self.buffers.append(buffer)
        return buffer


def _faked(monkeypatch: pytest.MonkeyPatch, accelerator: bool) -> PinnedHost:
    host = PinnedHost()
    monkeypatch.setattr(pinning, "accelerator_available", lambda: accelerator)
    monkeypatch.setattr(pinning, "pinned_host", host)
    return host


def _inside(array: np.ndarray, buffers: list[np.ndarray]) -> bool:
    base = array
    while base.base is not None:
        base = base.base
    return any(base is b for b in buffers)


@pytest.mark.timeout(60)
def test_a_numpy_batch_is_copied_into_pinned_memory_whole(monkeypatch: pytest.MonkeyPatch) -> None:
    host = _faked(monkeypatch, accelerator=True)
    loader: shmloader.DataLoader[Any] = shmloader.DataLoader(Rows(), batch_size=4, pin_memory=True)
    batches = list(loader)
    assert len(batches) == 2
    for k, batch in enumerate(batches):
        pair = batch["pair"]
        assert isinstance(pair, Pair) and batch["name"] == [f"row{i}" for i in range(4 * k, 4 * k + 4)]
        np.testing.assert_array_equal(pair.x, np.repeat(np.arange(4 * k, 4 * k + 4), 6).reshape(4, 3, 2))
        np.testing.assert_array_equal(pair.y, np.arange(4 * k, 4 * k + 4, dtype=np.int16))
        assert pair.x.dtype == np.float32 and pair.y.dtype == np.int16 and batch["empty"].shape == (4, 0, 4)
        for array in (pair.x, pair.y, batch["empty"]):
            assert _inside(array, host.buffers), "a numpy array of the batch was left in unpinned memory"
    assert [b.nbytes for b in host.buffers[:3]] == [4 * 3 * 2 * 4, 4 * 2, 0]


@pytest.mark.timeout(60)
def test_without_an_accelerator_nothing_is_copied(monkeypatch: pytest.MonkeyPatch) -> None:
    host = _faked(monkeypatch, accelerator=False)
    loader: shmloader.DataLoader[Any] = shmloader.DataLoader(Rows(), batch_size=4, pin_memory=True)
    with pytest.warns(UserWarning, match="no accelerator"):
        assert len(list(loader)) == 2
    assert host.buffers == []


@pytest.mark.timeout(60)
def test_after_an_epoch_with_workers_batches_without_them_are_still_copied(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch lets ``num_workers`` change between epochs: a backend chosen for the ring's slots must
    not be handed a batch in no slot (its ``finish`` treats it as registered, so it stayed unpinned)."""
    from shmloader.gpu.fake import FakeBackend

    fake = FakeBackend()
    monkeypatch.setenv(pinning.ENV_BACKEND, "fake")
    monkeypatch.setattr(pinning, "make_backend", lambda name: fake)
    host = _faked(monkeypatch, accelerator=True)
    data = np.arange(16 * 4, dtype=np.float32).reshape(16, 4)
    dl: shmloader.DataLoader = shmloader.DataLoader(shmloader.ArrayDataset(data), batch_size=4, num_workers=1,
                                                    pin_memory=True)
    try:
        assert len(list(dl)) == 4 and fake.finished == 4 and not host.buffers  # in slots: the backend's
        dl.num_workers = 0
        batches = [x for (x,) in dl]
    finally:
        dl.close()
    assert fake.finished == 4, "a batch in no slot was handed to the pin backend as if pinned"
    assert len(batches) == 4 and all(_inside(x, host.buffers) for x in batches)
    np.testing.assert_array_equal(np.concatenate(batches), data)
