"""The GPU handoff on a real CUDA device (marked ``gpu``; skipped without torch or CUDA).

Run on a GPU machine: ``python -m pytest -m gpu tests/test_gpu.py``. What must hold there:
batches from pinned slots are pinned with no copy (``is_pinned()``); the torch backend was chosen
and registered each slot once; ``to_device`` yields exactly the CPU batches; a slot is never
rewritten while the GPU still reads it, even with slow work queued on the caller's stream, whether
the copy is ``to_device``'s or the caller's own ``.to("cuda", non_blocking=True)`` (the release
fence); a batch held past ``close()`` stays correct and pinned until dropped; a second loader whose
forked workers collect the first one's CUDA garbage (moved batches, events, leases in a reference
cycle) runs to the end, as torch's DataLoader does (issue 13: it died with SIGABRT).
"""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import textwrap
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
    loader: shmloader.DataLoader[Any] = shmloader.DataLoader(dataset(), batch_size=16, num_workers=1, pin_memory=True)
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


@pytest.mark.timeout(120)
def test_single_process_pins_numpy_batches_by_copy_too() -> None:
    """Without workers a numpy batch is copied into pinned memory, as it is pinned (in its slot)
    with workers; torch's ``pin_memory`` passes numpy arrays through unpinned."""
    loader: shmloader.DataLoader[Any] = shmloader.DataLoader(dataset(), batch_size=16, pin_memory=True)
    x, y = next(iter(loader))
    assert isinstance(x, np.ndarray) and torch.from_numpy(x).is_pinned()
    assert torch.from_numpy(y).is_pinned()
    np.testing.assert_array_equal(x, expected(0, 16))


@pytest.mark.timeout(180)
@pytest.mark.parametrize("loader_class", ["numpy", "torch"])
def test_to_device_equals_the_cpu_batches(loader_class: str) -> None:
    cls = shmloader.torch.DataLoader if loader_class == "torch" else shmloader.DataLoader
    loader: shmloader.DataLoader[Any] = cls(dataset(), batch_size=16, num_workers=2, pin_memory=True,
                                             persistent_workers=True)
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
    ballast = torch.randn(2048, 2048, device="cuda")
    _check_three_epochs(lambda loader: moved_batches(_Slow(loader, ballast), how))


@pytest.mark.timeout(300)
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_no_slot_is_rewritten_while_another_device_reads_it() -> None:
    # The copies go to cuda:1 while cuda:0 stays current (no set_device, as torch's DDP tutorial):
    # the release fence must wait on cuda:1's stream, where the copies queue behind slow work.
    assert torch.cuda.current_device() == 0
    ballast = torch.randn(2048, 2048, device="cuda:1")
    _check_three_epochs(lambda loader: ((x.to("cuda:1", non_blocking=True), y) for x, y in _Slow(loader, ballast)))


def _check_three_epochs(moved: Any) -> None:
    """Three epochs over few, pinned, quickly reused slots; ``moved(loader)`` yields each batch on
    the device. Every batch's sum must be the one its samples give."""
    loader = shmloader.torch.DataLoader(dataset(), batch_size=8, num_workers=2, prefetch_factor=1,
                                        pin_memory=True, persistent_workers=True)
    sums = []
    try:
        for _epoch in range(3):
            for x, _y in moved(loader):
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
def test_a_batch_held_past_close_stays_pinned_until_it_is_dropped() -> None:
    loader = shmloader.torch.DataLoader(dataset(), batch_size=16, num_workers=1, pin_memory=True)
    it = iter(loader)
    x, _y = next(it)
    backend = loader._pinner
    del it
    loader.close()
    gc.collect()
    assert x.is_pinned()  # still registered: unregistered only when its last view dies
    assert torch.equal(x.to("cuda", non_blocking=True).cpu(), torch.from_numpy(expected(0, 16)))
    del x, _y
    gc.collect()
    assert backend.registered == {}


FORKED_GARBAGE = textwrap.dedent("""
    import gc, numpy as np, torch, shmloader, shmloader.torch

    def init(_):
        gc.collect()

    if __name__ == "__main__":
        ds = shmloader.ArrayDataset(np.arange(256 * 4096, dtype=np.float32).reshape(256, 4096), np.arange(256))
        A = shmloader.torch.DataLoader(ds, batch_size=32, num_workers=2, pin_memory=True,
                                       multiprocessing_context="fork")
        held = list(shmloader.to_device(A, "cuda")); cycle = [held]; cycle.append(cycle)
        gc.disable()  # the garbage is still there when B forks (in real jobs: by chance)
        del held, cycle, A
        B = shmloader.torch.DataLoader(ds, batch_size=32, num_workers=2, worker_init_fn=init,
                                       multiprocessing_context="fork")
        print(sum(1 for _ in B))
        gc.enable()
""")


@pytest.mark.timeout(180)
def test_workers_forked_over_cuda_garbage_do_not_touch_cuda(tmp_path: Any) -> None:
    """Issue 13's repro: the second loader's workers collect the first one's CUDA garbage."""
    env = {**os.environ, "PYTHONPATH": os.path.dirname(os.path.dirname(os.path.abspath(shmloader.__file__)))}
    env.pop(pinning.ENV_BACKEND, None)
    script = tmp_path / "repro.py"
    script.write_text(FORKED_GARBAGE)
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=170, env=env)
    report = f"exit code {done.returncode}\n--- stdout\n{done.stdout}\n--- stderr\n{done.stderr}"
    assert done.returncode == 0 and done.stdout.split() == ["8"], report
    assert "Traceback" not in done.stderr and "terminate called" not in done.stderr, report
