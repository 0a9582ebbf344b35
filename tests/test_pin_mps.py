"""``pin_memory=True`` where torch's current accelerator is MPS, side by side with torch 2.13.

torch's loader switches pinning off there (its pin_memory fails on MPS, pytorch#86060) and warns
"'pin_memory' argument is set as true but not supported on MPS now, device pinned memory won't be
used." from ``torch.utils.data.dataloader`` at each ``iter()``; its batches come unpinned. shmloader
does the same, warning at each ``iter()`` as it does "no accelerator is found" (docs/gpu.md). MPS is
faked (``torch.accelerator`` says MPS; this machine's torch has no accelerator, so a pin copy here
would raise "Cannot access accelerator device when none is available").
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from typing import Any, Literal

import pytest

torch = pytest.importorskip("torch")
from torch.utils import data as tdata  # noqa: E402

import shmloader.torch as st  # noqa: E402
from shmloader.gpu import pinning  # noqa: E402

MPS = "'pin_memory' argument is set as true but not supported on MPS now, device pinned memory won't be used."


@pytest.fixture
def mps(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """torch's current accelerator is MPS (the per-process answers are asked again before and after)."""
    monkeypatch.setattr(torch.accelerator, "is_available", lambda: True)
    monkeypatch.setattr(torch.accelerator, "current_accelerator", lambda check_available=False: torch.device("mps"))
    for cached in (pinning.accelerator_available, pinning.accelerator_type):
        cached.cache_clear()
    yield
    monkeypatch.undo()
    for cached in (pinning.accelerator_available, pinning.accelerator_type):
        cached.cache_clear()


def _two_epochs(cls: type, num_workers: int, *filters: tuple[Literal["ignore"], str]) -> tuple[list[Any], list[str]]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        # Python 3.12+ at a fork while another thread of this process (a loader's, torch's) is alive
        warnings.filterwarnings("ignore", r"This process .* is multi-threaded", DeprecationWarning)
        for action, module in filters:
            warnings.filterwarnings(action, module=module)
        loader = cls(tdata.TensorDataset(torch.arange(6.0)), batch_size=4, pin_memory=True, num_workers=num_workers)
        try:
            batches = [b[0].tolist() for _ in range(2) for b in loader]
        finally:
            if hasattr(loader, "close"):
                loader.close()
    return batches, [str(w.message) for w in caught]


@pytest.mark.timeout(60)
@pytest.mark.skipif(torch.cuda.is_available(), reason="MPS is faked: with CUDA here the torch backend would pin")
@pytest.mark.parametrize("num_workers", [0, 2])
def test_on_mps_pinning_is_off_with_torchs_warning(mps: None, num_workers: int) -> None:
    theirs, their_words = _two_epochs(tdata.DataLoader, num_workers)
    ours, our_words = _two_epochs(st.DataLoader, num_workers)
    assert ours == theirs == [[0.0, 1.0, 2.0, 3.0], [4.0, 5.0]] * 2
    assert their_words == [MPS, MPS]  # each iter()
    assert our_words == their_words
    for cls in (tdata.DataLoader, st.DataLoader):  # torch's module, for both
        assert _two_epochs(cls, num_workers, ("ignore", r"torch\.utils\.data\.dataloader"))[1] == []
