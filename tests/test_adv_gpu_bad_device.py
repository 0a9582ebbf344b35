"""``to_device`` with a device it cannot copy to: the error comes at ``iter()``, and the epoch it
had started on the loader (workers, slots) is stopped with it, not left running while the error
lives (a notebook keeps the last error; so does ``pytest.raises``).

The loader's iterator is made first (the loader picks its pin backend as it starts), then the
transfer's side stream for the device; a device that does not exist ("bogus"), CUDA on a machine
without it, or "cuda:1" with one device fails there. A persistent loader keeps its workers, as it
does between epochs; any other iterator the epoch made is closed.
"""

from __future__ import annotations

import multiprocessing
import os
from typing import Any

import numpy as np
import pytest

import shmloader
from shmloader.gpu.fake import FakeBackend


class NoSuchDevice(FakeBackend):
    """A transfer whose device cannot be reached (torch: "invalid device ordinal")."""

    def new_stream(self, device: str) -> str:
        raise RuntimeError(f"CUDA error: invalid device ordinal ({device})")


def ours() -> list[str]:
    """This process's segments in /dev/shm."""
    return sorted(name for name in os.listdir("/dev/shm") if name.startswith(f"shml_{os.getpid()}_"))


def make_loader(**kwargs: Any) -> shmloader.DataLoader:
    data = np.arange(64 * 8, dtype=np.float32).reshape(64, 8)
    return shmloader.DataLoader(shmloader.ArrayDataset(data), batch_size=8, num_workers=2, **kwargs)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("device", ["bogus", "cuda:1"])
def test_a_device_that_cannot_be_reached_stops_the_epoch_it_started(device: str) -> None:
    pytest.importorskip("torch")
    loader = make_loader()
    before = ours()
    transfer = NoSuchDevice() if device == "cuda:1" else None
    try:
        with pytest.raises(RuntimeError) as info:
            iter(shmloader.to_device(loader, device, transfer=transfer))
        # the error is still alive here (info holds it), and nothing of the epoch is
        assert multiprocessing.active_children() == [] and ours() == before, str(info.value)
        assert device in str(info.value)
    finally:
        loader.close()


@pytest.mark.timeout(60)
def test_cuda_without_cuda_stops_the_epoch_it_started() -> None:
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    loader = make_loader(pin_memory=True)
    before = ours()
    try:
        with pytest.warns(UserWarning, match="no accelerator"), pytest.raises(RuntimeError) as info:
            iter(shmloader.to_device(loader, "cuda"))  # torch's own error: no CUDA support
        assert multiprocessing.active_children() == [] and ours() == before, str(info.value)
    finally:
        loader.close()


@pytest.mark.timeout(60)
def test_a_persistent_loader_keeps_its_workers_and_goes_on_after_a_bad_device() -> None:
    pytest.importorskip("torch")  # to_device makes tensors of the numpy batches
    loader = make_loader(persistent_workers=True)
    try:
        with pytest.raises(RuntimeError):
            iter(shmloader.to_device(loader, "cuda:1", transfer=NoSuchDevice()))
        moved = shmloader.to_device(loader, "cpu")
        got = [x for (x,) in moved]
        assert len(got) == 8 and float(got[-1][-1, -1]) == 64 * 8 - 1
    finally:
        loader.close()
