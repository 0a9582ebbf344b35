"""torch made unimportable with ``sys.modules['torch'] = None`` (the usual way to hide a package;
``import torch`` then raises ModuleNotFoundError): the numpy flavour must behave as where torch
is not installed at all, never try to import it and fail."""

from __future__ import annotations

import sys
import warnings
from typing import Any

import pytest

import shmloader
from shmloader.gpu import pinning
from shmloader.gpu.prefetch import device_name
from shmloader.state import StateError


@pytest.fixture
def hidden_torch(monkeypatch: pytest.MonkeyPatch):
    """torch unimportable for the test; the cached accelerator answer asked again, then restored."""
    monkeypatch.setitem(sys.modules, "torch", None)
    pinning.accelerator_available.cache_clear()
    yield
    pinning.accelerator_available.cache_clear()


def test_no_accelerator_and_no_builtin_pin_backend_when_torch_is_hidden(hidden_torch) -> None:
    assert pinning.accelerator_available() is False
    assert pinning.builtin_pin_backend() is None


def test_pin_memory_without_workers_warns_and_loads_when_torch_is_hidden(
        hidden_torch, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(pinning.ENV_BACKEND, raising=False)
    loader: shmloader.DataLoader[Any] = shmloader.DataLoader(shmloader.ArrayDataset(list(range(4))), batch_size=2,
                                                            pin_memory=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = [x.tolist() for (x,) in loader]
    assert got == [[0, 1], [2, 3]]
    assert any(pinning.NO_ACCELERATOR in str(w.message) for w in caught)


def test_an_epoch_drawn_from_fresh_entropy_is_not_saved_when_torch_is_hidden(hidden_torch) -> None:
    """Without torch a RandomSampler with generator=None draws from fresh OS entropy: its order
    cannot be re-created, so saving the position must refuse, as where torch is not installed."""
    loader: shmloader.DataLoader[Any] = shmloader.DataLoader(shmloader.ArrayDataset(list(range(8))), batch_size=2,
                                                            shuffle=True)
    it = iter(loader)
    next(it)
    with pytest.raises(StateError, match="generator=None draws its order from fresh OS entropy"):
        it.state_dict()


def test_a_device_name_is_taken_as_given_when_torch_is_hidden(hidden_torch) -> None:
    assert device_name("cuda:1") == "cuda:1"


def test_to_device_without_torch_says_it_needs_torch(hidden_torch) -> None:
    """``to_device`` hands batches out as tensors: without torch (and without a transfer of the
    user's own) its error names ``to_device`` and the extra to install, not a bare import failure
    from deep inside the first copy."""
    loader: shmloader.DataLoader[Any] = shmloader.DataLoader(shmloader.ArrayDataset(list(range(4))), batch_size=2)
    for device in ("cpu", 0):
        with pytest.raises(ModuleNotFoundError, match=r"to_device.*needs torch.*shmloader\[torch\]") as info:
            list(shmloader.to_device(loader, device))
        assert info.value.name == "torch"


def test_to_device_with_a_transfer_of_its_own_runs_without_torch(hidden_torch) -> None:
    from shmloader.gpu.fake import FakeBackend

    loader: shmloader.DataLoader[Any] = shmloader.DataLoader(shmloader.ArrayDataset(list(range(4))), batch_size=2)
    got = [x.tolist() for (x,) in shmloader.to_device(loader, "cpu", transfer=FakeBackend())]
    assert got == [[0, 1], [2, 3]]
