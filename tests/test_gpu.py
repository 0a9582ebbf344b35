"""The GPU handoff on a real CUDA device (marked ``gpu``; skipped without torch or CUDA).

Run on a GPU machine: ``python -m pytest -m gpu tests/test_gpu.py``. What must hold there:
batches from pinned slots are pinned with no copy (``is_pinned()``); the torch backend was chosen
and registered each slot once; ``to_device`` yields exactly the CPU batches; a slot is never
rewritten while the GPU still reads it, even with slow work queued on the caller's stream, whether
the copy is ``to_device``'s or the caller's own ``.to("cuda", non_blocking=True)`` (the release
fence); a batch held past ``close()`` is still correct (no longer pinned).
"""

from __future__ import annotations

import gc
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import shmloader  # noqa: E402
import shmloader.torch  # noqa: E402
from shmloader.gpu import pinning  # noqa: E402
from shmloader.gpu.backends import TorchCudaBackend  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

ROWS, COLS = 256, 1024


@pytest.fixture(autouse=True)
def _auto_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(pinning.ENV_BACKEND, raising=False)


def dataset() -> Any:
    return shmloader.ArrayDataset(np.arange(ROWS * COLS, dtype=np.float32).reshape(ROWS, COLS), np.arange(ROWS))


def expected(k: int, batch_size: int) -> np.ndarray:
    first, last = k * batch_size * COLS, (k + 1) * batch_size * COLS
    return np.arange(first, last, dtype=np.float32).reshape(batch_size, COLS)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("start_method", ["fork", "spawn"])
def test_batches_from_slots_are_pinned(start_method: str) -> None:
    loader = shmloader.torch.DataLoader(dataset(), batch_size=16, num_workers=2, pin_memory=True,
                                        persistent_workers=True, multiprocessing_context=start_method)
    try:
        for _epoch in range(2):
            for k, (x, y) in enumerate(loader):
                assert isinstance(x, torch.Tensor) and x.is_pinned() and y.is_pinned()
                assert torch.equal(x, torch.from_numpy(expected(k, 16)))
        backend = loader._pinner
        assert isinstance(backend, TorchCudaBackend)
        ring = loader._iterator._ring
        assert set(backend.registered) == {s.segment.name for s in ring.slots}
    finally:
        loader.close()
    assert backend.registered == {}


@pytest.mark.timeout(120)
def test_numpy_batches_view_pinned_memory() -> None:
    loader = shmloader.DataLoader(dataset(), batch_size=16, num_workers=1, pin_memory=True)
    x, _y = next(iter(loader))
    assert isinstance(x, np.ndarray) and torch.from_numpy(x).is_pinned()
    del x, _y
    gc.collect()
    loader.close()


@pytest.mark.timeout(120)
def test_single_process_pins_by_copy_as_torch() -> None:
    loader = shmloader.torch.DataLoader(dataset(), batch_size=16, pin_memory=True)
    x, _y = next(iter(loader))
    assert x.is_pinned()


@pytest.mark.timeout(180)
@pytest.mark.parametrize("loader_class", ["numpy", "torch"])
def test_to_device_equals_the_cpu_batches(loader_class: str) -> None:
    cls = shmloader.torch.DataLoader if loader_class == "torch" else shmloader.DataLoader
    loader = cls(dataset(), batch_size=16, num_workers=2, pin_memory=True, persistent_workers=True)
    try:
        for _epoch in range(2):
            n = 0
            for k, (x, y) in enumerate(shmloader.to_device(loader, "cuda")):
                assert x.is_cuda and y.is_cuda
                assert torch.equal(x.cpu(), torch.from_numpy(expected(k, 16)))
                assert torch.equal(y.cpu(), torch.arange(k * 16, (k + 1) * 16))
                n += 1
            assert n == ROWS // 16
    finally:
        loader.close()


def moved_batches(loader: Any, how: str) -> Any:
    """The loader's batches on the GPU: through ``to_device``, or torch's own pattern, which drops
    the pinned source as soon as its ``non_blocking`` copy is enqueued (the release fence's case)."""
    if how == "to_device":
        yield from shmloader.to_device(loader, "cuda")
        return
    for x, y in loader:
        x, y = x.to("cuda", non_blocking=True), y.to("cuda", non_blocking=True)
        yield x, y


@pytest.mark.timeout(300)
@pytest.mark.parametrize("how", ["to_device", "own_non_blocking_copy"])
def test_no_slot_is_rewritten_while_the_gpu_reads_it(how: str) -> None:
    # Few slots, reused at once; slow work queued on the caller's stream before each copy, so the
    # copies would race the workers' rewrites if a slot were let go before its copy finished.
    loader = shmloader.torch.DataLoader(dataset(), batch_size=8, num_workers=2, prefetch_factor=1,
                                        pin_memory=True, persistent_workers=True)
    ballast = torch.randn(2048, 2048, device="cuda")
    sums = []
    try:
        for _epoch in range(3):
            for x, _y in moved_batches(_Slow(loader, ballast), how):
                sums.append(x.sum(dtype=torch.float64))
    finally:
        loader.close()
    got = torch.stack(sums).cpu().numpy()
    want = np.array([expected(k, 8).sum(dtype=np.float64) for k in range(ROWS // 8)] * 3)
    np.testing.assert_array_equal(got, want)


class _Slow:
    """The loader, with slow work queued on the current stream before each batch is handed on."""

    def __init__(self, loader: Any, ballast: Any) -> None:
        self.loader, self.ballast = loader, ballast

    def __iter__(self) -> Any:
        for batch in self.loader:
            for _ in range(4):
                self.ballast = self.ballast @ self.ballast
                self.ballast /= self.ballast.norm()
            yield batch


@pytest.mark.timeout(120)
def test_a_batch_held_past_close_is_correct_but_no_longer_pinned() -> None:
    loader = shmloader.torch.DataLoader(dataset(), batch_size=16, num_workers=1, pin_memory=True)
    it = iter(loader)
    x, _y = next(it)
    assert x.is_pinned()
    del it
    loader.close()
    gc.collect()
    assert not x.is_pinned()  # unregistered before the ring let go of its segment
    assert torch.equal(x.to("cuda").cpu(), torch.from_numpy(expected(0, 16)))

