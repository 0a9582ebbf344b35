"""Which device ``to_device`` moves batches to, for each way torch lets a caller name one.

torch reads an int device as an index of the current accelerator (``x.to(rank)`` in torch's DDP
tutorial is ``x.to("cuda:<rank>")``); ``to_device(loader, rank)`` must mean the same, not the
string "0", which no device is.
"""

from __future__ import annotations

import numpy as np
import pytest

import shmloader
from shmloader.gpu.fake import FakeBackend


def _streams(fake: FakeBackend) -> list[str]:
    return [c.target for c in fake.calls if c.kind == "stream"]


@pytest.mark.parametrize("device", [1, "cuda:1"])
def test_an_int_device_is_an_index_of_the_current_accelerator(device: object, monkeypatch: pytest.MonkeyPatch) -> None:
    torch = pytest.importorskip("torch")
    monkeypatch.setattr(torch.accelerator, "current_accelerator", lambda *a, **k: torch.device("cuda"))
    fake = FakeBackend(auto_complete=True)
    batches = [(np.full(3, k, np.float32),) for k in range(2)]
    moved = list(shmloader.to_device(batches, device, transfer=fake))
    assert _streams(fake) == ["cuda:1"]
    assert [float(np.asarray(x).sum()) for (x,) in moved] == [0.0, 3.0]


def test_an_int_device_without_an_accelerator_is_torch_s_error(monkeypatch: pytest.MonkeyPatch) -> None:
    torch = pytest.importorskip("torch")
    monkeypatch.setattr(torch.accelerator, "current_accelerator", lambda *a, **k: None)
    with pytest.raises(RuntimeError, match="Cannot access accelerator device when none is available"):
        iter(shmloader.to_device([], 0))
