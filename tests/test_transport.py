"""Unit tests of the transport: segments, the ring and its leases, the allocator, the codec, reorder."""

from __future__ import annotations

import gc
import mmap
import os

import numpy as np
import pytest

from ring_helpers import OWNER, leased
from shmloader.collate import SlotFull
from shmloader.engine.reorder import Reorder
from shmloader.errors import DescriptorError, RingExhausted
from shmloader.transport import codec
from shmloader.transport.alloc import SlotAllocator
from shmloader.transport.ring import Ring, SlotState
from shmloader.transport.segment import Segment, owner_pid
from shmloader.transport.sweep import sweep_dead_segments


@pytest.fixture
def ring():
    r = Ring("/dev/shm")
    yield r
    r.close()


def test_segment_is_page_rounded_reserved_and_unlinked(tmp_path):
    seg = Segment.create(str(tmp_path), 5000)
    assert seg.size_bytes == 2 * mmap.PAGESIZE
    assert os.stat(seg.path).st_blocks * 512 >= seg.size_bytes  # reserved up front (posix_fallocate)
    assert owner_pid(seg.name) == os.getpid()
    seg.unlink()
    assert not os.path.exists(seg.path) and seg.close()


def test_attached_segment_cannot_unlink(tmp_path):
    seg = Segment.create(str(tmp_path), 100)
    other = Segment.attach(str(tmp_path), seg.name, seg.size_bytes)
    with pytest.raises(PermissionError, match="only its owner unlinks it"):
        other.unlink()
    other.close()
    seg.unlink()
    seg.close()


@pytest.mark.parametrize("name", ["shml_²_x", "shml_99999999999999999999_x", "shml_123", "shml_0_x", "x_1_y"])
def test_names_that_are_not_ours_are_never_swept(tmp_path, name):
    (tmp_path / name).write_bytes(b"")
    assert owner_pid(name) is None
    assert sweep_dead_segments(str(tmp_path)) == []
    assert (tmp_path / name).exists()


def test_lease_returns_the_slot_only_when_the_last_view_dies(ring):
    slot = ring.grow(4096, OWNER)
    buf = leased(ring, slot)
    view = np.ndarray((4,), np.float64, buffer=buf, offset=64)[1:]  # a view of a view
    del buf
    gc.collect()
    assert ring.collect_released() == 0 and slot.state is SlotState.LEASED
    del view
    gc.collect()
    assert ring.collect_released() == 1 and slot.state is SlotState.FREE
    assert ring.take(4096, OWNER) is slot


def test_ring_resizes_a_small_free_slot_and_retires_the_old_segment(ring):
    slot = ring.grow(4096, OWNER)
    old = slot.segment.name
    ring.free(slot, OWNER)
    assert ring.take(3 * 4096, OWNER) is slot
    assert slot.size_bytes >= 3 * 4096 and old in ring.retired_names
    assert not os.path.exists(f"/dev/shm/{old}")


def test_max_slots_raises_ring_exhausted():
    r = Ring("/dev/shm", max_slots=1)
    r.grow(4096, OWNER)
    with pytest.raises(RingExhausted, match="max_slots=1"):
        r.grow(4096, OWNER)
    r.close()


def test_close_unlinks_but_keeps_viewed_memory_mapped():
    r = Ring("/dev/shm")
    slot = r.grow(4096, OWNER)
    view = np.ndarray((8,), np.uint8, buffer=leased(r, slot))
    view[:] = 7
    r.close()
    assert not os.path.exists(f"/dev/shm/{slot.segment.name}")
    assert view.sum() == 56  # still readable


def test_allocator_aligns_and_raises_slot_full(ring):
    slot = ring.grow(4096, OWNER)
    alloc = SlotAllocator(slot.segment.buf, slot.size_bytes)
    a, b = alloc((3,), np.uint8), alloc((5,), np.float64)
    assert a.ctypes.data % 64 == 0 and b.ctypes.data % 64 == 0 and b.ctypes.data - a.ctypes.data == 64
    with pytest.raises(SlotFull):
        alloc((4096,), np.uint8)
    del a, b, alloc


def test_codec_round_trip_records_arrays_and_inlines_the_rest(ring):
    slot = ring.grow(1 << 16, OWNER)
    alloc = SlotAllocator(slot.segment.buf, slot.size_bytes)
    inside = alloc((4, 3), np.float32)
    inside[:] = np.arange(12).reshape(4, 3)
    outside = np.arange(6, dtype=np.int64)[::-1]  # negative strides, heap memory: copied in once
    batch = {"x": inside, "y": outside, "name": ["a", "b"], "obj": np.array([None, 1], dtype=object)}
    payload, nbytes = codec.encode(batch, alloc)
    assert len(payload) < 600 and nbytes == inside.nbytes + outside.nbytes
    assert codec.measure(batch) >= nbytes
    del inside, alloc
    got, views = codec.decode(payload, leased(ring, slot), slot.size_bytes)
    assert views == 2
    np.testing.assert_array_equal(got["x"], np.arange(12).reshape(4, 3))
    np.testing.assert_array_equal(got["y"], np.arange(6)[::-1])
    assert got["name"] == ["a", "b"] and got["obj"].dtype == object
    assert not got["x"].flags.owndata


def test_codec_rejects_a_record_outside_the_slot(ring):
    slot = ring.grow(4096, OWNER)
    import pickle

    class Forger(pickle.Pickler):
        def persistent_id(self, obj):
            return ("a", 4000, np.dtype("f8"), (100,), (8,)) if isinstance(obj, np.ndarray) else None

    import io

    buf = io.BytesIO()
    Forger(buf, protocol=5).dump(np.zeros(1))
    with pytest.raises(DescriptorError, match="outside the slot"):
        codec.decode(buf.getvalue(), leased(ring, slot), slot.size_bytes)
    gc.collect()


def test_reorder_in_order_skips_and_out_of_order():
    r: Reorder[str] = Reorder(in_order=True)
    r.put(1, "b")
    assert r.pop() is None
    r.skip(0)
    assert r.pop() == "b"
    r.put(2, "c")
    with pytest.raises(ValueError, match="already has an outcome"):
        r.put(2, "again")
    assert r.pop() == "c" and r.pop() is None
    free: Reorder[str] = Reorder(in_order=False)
    free.put(5, "late")
    free.put(3, "early")
    assert [free.pop(), free.pop(), free.pop()] == ["late", "early", None]
