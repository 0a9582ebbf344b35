"""Large batch buffers reused without workers (collate.heap_pool), and never while referred to."""

from __future__ import annotations

import gc
import weakref
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

import shmloader
from shmloader.collate.heap_pool import REUSE_MIN_BYTES, HeapPool

pytestmark = pytest.mark.timeout(120)

SMALL = 4096  # min_bytes of the unit tests' pools


def ptr(a: Any) -> int:
    return a.__array_interface__["data"][0] if isinstance(a, np.ndarray) else a.data_ptr()


def test_a_dropped_array_s_buffer_is_reused() -> None:
    pool = HeapPool(min_bytes=SMALL)
    a = pool.alloc((1024, 2), np.float32)
    first = ptr(a)
    del a
    b = pool.alloc((1024, 2), np.float32)
    assert ptr(b) == first
    assert b.shape == (1024, 2) and b.dtype == np.float32 and b.flags.c_contiguous and b.flags.writeable
    assert len(pool) == 1


def _torch_tensor(a: np.ndarray) -> Any:
    torch = pytest.importorskip("torch")
    return torch.from_numpy(a)[1:]


KEEPERS: dict[str, Callable[[np.ndarray], Any]] = {
    "itself": lambda a: a,
    "a slice": lambda a: a[3:],
    "a transpose": lambda a: a.T,
    "a dtype view": lambda a: a.view(np.uint8),
    # an ndarray is a buffer; numpy's stubs say so from Python 3.12 only (mypy checks as 3.10)
    "a memoryview": memoryview,  # type: ignore[dict-item]
    "np.frombuffer": lambda a: np.frombuffer(memoryview(a), dtype=np.float32),  # type: ignore[arg-type]
    "a list": lambda a: [a],
    "torch.from_numpy": _torch_tensor,
}


@pytest.mark.parametrize("how", KEEPERS)
def test_a_buffer_something_still_refers_to_is_never_written(how: str) -> None:
    pool = HeapPool(min_bytes=SMALL)
    a = pool.alloc((1024, 2), np.float32)
    a[...] = 7.0
    kept = KEEPERS[how](a)
    del a
    gc.collect()
    for _ in range(3):  # each a new buffer: the kept one is not free
        b = pool.alloc((1024, 2), np.float32)
        b[...] = -1.0
    values = np.ascontiguousarray(np.asarray(kept[0] if how == "a list" else kept))
    assert values.size and np.all(values.view(np.float32) == 7.0)


def test_below_the_threshold_object_dtypes_and_empty_arrays_are_not_pooled() -> None:
    pool = HeapPool(min_bytes=SMALL)
    assert pool.alloc((SMALL // 4 - 1,), np.float32).base is None
    objects = pool.alloc((SMALL,), object)
    assert objects.dtype == object and objects[0] is None
    assert pool.alloc((0, SMALL), np.float64).size == 0
    assert len(pool) == 0


def test_at_most_keep_buffers_and_then_plain_arrays() -> None:
    pool = HeapPool(keep=2, min_bytes=SMALL)
    held = [pool.alloc((SMALL,), np.uint8) for _ in range(3)]
    assert len(pool) == 2
    assert held[2].base is None  # every pooled buffer in use: np.empty's own
    assert len({ptr(a) for a in held}) == 3


def test_a_size_no_longer_asked_for_makes_room() -> None:
    pool = HeapPool(keep=1, min_bytes=SMALL)
    a = pool.alloc((SMALL,), np.uint8)
    del a
    b = pool.alloc((2 * SMALL,), np.uint8)  # the epoch's short last batch, the other way round
    assert len(pool) == 1 and b.base is not None and b.base.nbytes == 2 * SMALL


def test_structured_and_non_native_dtypes_come_back_as_asked() -> None:
    pool = HeapPool(min_bytes=SMALL)
    for dtype in (np.dtype([("a", "<i4"), ("b", "<f8")], align=True), np.dtype(">f8"), np.dtype("c16")):
        out = pool.alloc((SMALL, 2), dtype)
        assert out.dtype == dtype and out.shape == (SMALL, 2) and out.flags.c_contiguous


class Big:
    """Samples whose batch (16 x float32[1024, 512]) is REUSE_MIN_BYTES: pooled without workers."""

    def __len__(self) -> int:
        return 16 * 5 + 4  # 5 full batches and a short one

    def __getitem__(self, i: int) -> np.ndarray:
        return np.full((1024, 512), i, dtype=np.float32)


def _check(batch: np.ndarray, k: int) -> None:
    expected = np.arange(16 * k, min(16 * k + 16, len(Big())), dtype=np.float32)
    assert np.array_equal(batch[:, 0, 0], expected) and np.array_equal(batch[:, -1, -1], expected)


def test_without_workers_a_big_batch_reuses_the_buffer_of_one_dropped() -> None:
    assert 16 * 1024 * 512 * 4 == REUSE_MIN_BYTES
    pointers = []
    for k, batch in enumerate(shmloader.DataLoader(Big(), batch_size=16, num_workers=0)):
        _check(batch, k)
        if k < 5:
            assert batch.base is not None and batch.base.nbytes == batch.nbytes, "not from a pooled buffer"
            pointers.append(ptr(batch))
    # the loop's variable holds batch k while batch k+1 is made: two buffers take turns
    assert len(set(pointers)) == 2
    assert pointers[0] == pointers[2] == pointers[4] and pointers[1] == pointers[3]


def test_without_workers_batches_kept_keep_their_values() -> None:
    loader: shmloader.DataLoader[Any] = shmloader.DataLoader(Big(), batch_size=16, num_workers=0)
    kept = list(loader)
    for k, batch in enumerate(kept):
        _check(batch, k)
    assert len({ptr(b) for b in kept}) == len(kept)


def test_without_workers_torch_tensors_kept_keep_their_values() -> None:
    torch = pytest.importorskip("torch")
    from shmloader.torch import DataLoader

    kept = []
    for k, batch in enumerate(DataLoader(Big(), batch_size=16, num_workers=0)):
        assert isinstance(batch, torch.Tensor)
        kept.append(batch[::2])  # a view: the batch itself is dropped
    for k, view in enumerate(kept):
        assert torch.equal(view[:, 0, 0], torch.arange(16 * k, min(16 * k + 16, len(Big())), 2,
                                                        dtype=torch.float32))


def test_the_iterator_lets_go_of_its_buffers_at_the_epoch_s_end_and_at_close() -> None:
    loader: shmloader.DataLoader[Any] = shmloader.DataLoader(Big(), batch_size=16, num_workers=0)
    it = iter(loader)
    buffer = weakref.ref(next(it).base)  # the batch is dropped at once: only the pool holds it
    assert buffer() is not None
    for _ in it:
        pass
    gc.collect()
    assert buffer() is None, "an exhausted iterator still holds its buffers"
    it = iter(loader)
    buffer = weakref.ref(next(it).base)
    it.close()
    gc.collect()
    assert buffer() is None, "a closed iterator still holds its buffers"


def test_the_pool_s_own_count_is_measured_on_this_interpreter() -> None:
    """CPython's reference counts differ between versions (3.14 borrows references to the locals it
    loads): the count that means "only the pool refers to it" is this interpreter's own, so one
    more reference, however small, always reads as a buffer in use."""
    from shmloader.collate import heap_pool

    pool = HeapPool(min_bytes=SMALL)
    a = pool.alloc((SMALL,), np.uint8)
    del a
    buffers = pool._buffers
    assert heap_pool._refs(buffers, 0) == heap_pool._OWN_REFS
    kept = buffers[0][:1]  # a one-byte view: one reference more
    assert heap_pool._refs(buffers, 0) == heap_pool._OWN_REFS + 1
    assert ptr(pool.alloc((SMALL,), np.uint8)) != ptr(kept)
