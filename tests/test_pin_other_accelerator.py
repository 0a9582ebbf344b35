"""``pin_memory=True`` with workers on an accelerator that no pin backend registers slots for.

torch pins on its current accelerator, whatever it is (``torch.accelerator``: CUDA, XPU, MPS, ...):
its pin thread copies each batch into that accelerator's pinned memory. The built-in backends
register slots only for CUDA (torch or cupy); on another accelerator no backend is chosen. Then
shmloader pins as torch does, by a copy, and says nothing: "no accelerator is found" would be false.
With an explicit ``SHMLOADER_PIN_BACKEND=none`` the user asked for no pinning: nothing is copied.
The accelerator is faked (this machine's torch has none; tests/test_gpu.py runs on a device)."""

from __future__ import annotations

import warnings
from typing import Any

import numpy as np
import pytest
from test_nw0_pin_numpy import Rows, _faked, _inside

import shmloader


@pytest.mark.timeout(60)
@pytest.mark.parametrize("persistent", [False, True])
def test_with_workers_another_accelerator_gets_batches_pinned_by_a_copy(monkeypatch: pytest.MonkeyPatch,
                                                                        persistent: bool) -> None:
    host = _faked(monkeypatch, accelerator=True)  # torch sees an accelerator, no backend sees CUDA
    loader: shmloader.DataLoader[Any] = shmloader.DataLoader(Rows(), batch_size=4, pin_memory=True, num_workers=2,
                                                             persistent_workers=persistent)  # fmt: skip
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # not torch's "no accelerator is found"
            for _ in range(2):
                batches = list(loader)
                assert [b["pair"].y.tolist() for b in batches] == [[0, 1, 2, 3], [4, 5, 6, 7]]
                for batch in batches:
                    for array in (batch["pair"].x, batch["pair"].y, batch["empty"]):
                        assert _inside(array, host.buffers), "a batch of the loader was left unpinned"
    finally:
        loader.close()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("backend", ["none", "mlock"])
def test_an_explicitly_named_backend_copies_nothing(monkeypatch: pytest.MonkeyPatch, backend: str) -> None:
    host = _faked(monkeypatch, accelerator=True)
    monkeypatch.setenv("SHMLOADER_PIN_BACKEND", backend)
    loader: shmloader.DataLoader[Any] = shmloader.DataLoader(Rows(), batch_size=4, pin_memory=True, num_workers=2)
    batches: list[Any] = list(loader)
    assert len(batches) == 2 and host.buffers == []
    np.testing.assert_array_equal(batches[1]["pair"].y, np.arange(4, 8, dtype=np.int16))
