"""The torch floor (``torch>=2.1``, pyproject.toml): what newer torch added is asked for with a
fallback, so an older torch within the floor still works. Each guard is exercised here by taking
the newer attribute away (the CI venv has a current torch)."""

from __future__ import annotations

import pytest

from shmloader.gpu import pinning
from shmloader.gpu.prefetch import device_name

torch = pytest.importorskip("torch")


@pytest.fixture
def no_accelerator_module(monkeypatch: pytest.MonkeyPatch):
    """torch as before 2.6, which has no ``torch.accelerator``; the cached answer asked again."""
    monkeypatch.delattr(torch, "accelerator", raising=False)
    pinning.accelerator_available.cache_clear()
    yield
    pinning.accelerator_available.cache_clear()


def test_an_accelerator_is_cuda_where_torch_has_no_accelerator_module(
        no_accelerator_module, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert pinning.accelerator_available() is True
    pinning.accelerator_available.cache_clear()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert pinning.accelerator_available() is False


def test_an_int_device_is_a_cuda_index_where_torch_has_no_accelerator_module(no_accelerator_module) -> None:
    assert device_name(1) == "cuda:1"  # torch before 2.6 reads x.to(1) as cuda:1
    assert device_name("cpu") == "cpu"
