"""Unit tests of the slot allocator and the descriptor codec: aligned regions, records checked
against the slot before any view, the flat descriptor of in-slot arrays and its trip inside a reply,
the main script's classes named where plain pickle refuses them."""

from __future__ import annotations

import gc
import io
import pickle

import numpy as np
import pytest
from ring_helpers import OWNER, leased

from shmloader.collate import SlotFull
from shmloader.errors import DescriptorError
from shmloader.transport import codec
from shmloader.transport.alloc import SlotAllocator


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


def test_codec_flat_descriptor_for_arrays_in_the_slot(ring):
    slot = ring.grow(1 << 16, OWNER)
    alloc = SlotAllocator(slot.segment.buf, slot.size_bytes)
    x, y = alloc((4, 3), np.float32), alloc((4,), np.int64)
    x[:], y[:] = np.arange(12).reshape(4, 3), np.arange(4)
    heap = [x, np.zeros(2)]  # an array outside the slot: the general (pickled) descriptor copies it in
    assert type(codec.encode(heap, alloc)[0]) is bytes
    buf = leased(ring, slot)
    for batch in ([x, y], (x, y[::-1])):
        payload, nbytes = codec.encode(batch, alloc)
        assert type(payload) is tuple and nbytes == x.nbytes + y.nbytes
        got, views = codec.decode(payload, buf, slot.size_bytes)
        assert type(got) is type(batch) and views == 2 and not got[0].flags.owndata
        for a, b in zip(got, batch):
            np.testing.assert_array_equal(a, b)
    del x, y, heap, alloc, got, buf
    gc.collect()


def test_codec_flat_descriptor_checks_every_layout_against_the_slot(ring):
    """The flat path's contiguous shortcut (issue 16) keeps the extent check: a transposed view is
    described by its strides, and an array past the task's capacity is never described in place."""
    slot = ring.grow(1 << 16, OWNER)
    alloc = SlotAllocator(slot.segment.buf, 4096)  # the task may use the first 4096 bytes only
    x = alloc((4, 3), np.float32)
    x[:] = np.arange(12).reshape(4, 3)
    payload, nbytes = codec.encode((x.T, x[::2, ::-1]), alloc)
    assert type(payload) is tuple and nbytes == x.nbytes + x.nbytes // 2
    past = np.frombuffer(slot.segment.buf, np.float32, count=4, offset=4096 - 8)  # straddles the end
    assert type(codec.encode([x, past], alloc)[0]) is bytes
    buf = leased(ring, slot)
    got, _views = codec.decode(payload, buf, slot.size_bytes)
    np.testing.assert_array_equal(got[0], np.arange(12).reshape(4, 3).T)
    np.testing.assert_array_equal(got[1], np.arange(12).reshape(4, 3)[::2, ::-1])
    del x, past, alloc, got, buf
    gc.collect()


def test_codec_flat_descriptor_travels_inside_the_reply_frame(ring):
    from shmloader.transport import wire
    from shmloader.transport.messages import Filled

    slot = ring.grow(1 << 16, OWNER)
    alloc = SlotAllocator(slot.segment.buf, slot.size_bytes)
    x = alloc((4, 3), np.float32)
    x[:] = np.arange(12).reshape(4, 3)
    payload, nbytes = codec.encode((x,), alloc)
    msg = wire.decode(wire.reply_frame(Filled(0, 5, slot.id, payload, nbytes, 0.0, 0.0)))
    assert msg.payload == payload  # one pickle for the reply: the descriptor is not pickled inside it
    buf = leased(ring, slot)
    got, views = codec.decode(msg.payload, buf, slot.size_bytes)
    np.testing.assert_array_equal(got[0], x)
    with pytest.raises(DescriptorError, match="bytes or a flat tuple, not list"):
        codec.decode([False, ()], buf, slot.size_bytes)
    with pytest.raises(DescriptorError, match=r"is \(is_tuple, records\)"):
        codec.decode((False,), buf, slot.size_bytes)
    del x, alloc, got, buf
    gc.collect()


def test_codec_rejects_a_flat_record_outside_the_slot(ring):
    slot = ring.grow(4096, OWNER)
    buf = leased(ring, slot)
    for record in ((4000, "<f8", (100,), (8,)), (-8, "<f8", (1,), (8,)), (0, "<f8", (2,), (-8,))):
        payload = (False, (record,))
        with pytest.raises(DescriptorError, match="outside the slot"):
            codec.decode(payload, buf, slot.size_bytes)
    del buf
    gc.collect()


def test_codec_an_array_held_twice_is_copied_once_and_rebuilt_as_one_object(ring):
    """``{"input": x, "target": x}`` (an autoencoder's collate_fn): pickle's memo gives torch's loader
    one object; the descriptor names the first record again instead of copying the array twice."""
    slot = ring.grow(1 << 16, OWNER)
    alloc = SlotAllocator(slot.segment.buf, slot.size_bytes)
    x = np.arange(6, dtype=np.float32)  # on the heap: copied into the slot once
    batch = {"input": x, "target": x, "both": [x, x[::-1]]}
    payload, nbytes = codec.encode(batch, alloc)
    assert nbytes == 2 * x.nbytes and codec.measure(batch) <= 64 + 2 * x.nbytes
    got, views = codec.decode(payload, leased(ring, slot), slot.size_bytes)
    assert views == 2 and got["input"] is got["target"] is got["both"][0]
    got["input"][0] = 100.0  # one object: a change shows through every name, as in torch
    assert got["target"][0] == 100.0 and got["both"][1][-1] == 0.0  # x[::-1] was its own copy
    del got, alloc
    gc.collect()


def test_codec_refuses_a_repeat_of_a_record_it_has_not_seen(ring):
    import io
    import pickle

    slot = ring.grow(4096, OWNER)

    class Forger(pickle.Pickler):
        def persistent_id(self, obj):
            return ("=", 3) if isinstance(obj, np.ndarray) else None

    buf = io.BytesIO()
    Forger(buf, protocol=5).dump([np.zeros(1)])
    with pytest.raises(DescriptorError, match="names no earlier array"):
        codec.decode(buf.getvalue(), leased(ring, slot), slot.size_bytes)
    gc.collect()


@pytest.mark.timeout(60)
def test_a_tensor_held_twice_by_a_collate_fn_arrives_as_one_tensor():
    torch = pytest.importorskip("torch")
    import shmloader.torch

    def same_twice(batch):
        x = torch.tensor(batch, dtype=torch.float32)
        return {"input": x, "target": x}

    loader = shmloader.torch.DataLoader([0.0, 1.0, 2.0, 3.0], batch_size=2, num_workers=1, collate_fn=same_twice)
    try:
        b = next(iter(loader))
        assert b["input"] is b["target"]
        b["input"].add_(10)
        assert b["target"].tolist() == [10.0, 11.0]
    finally:
        loader.close()


def _nested_and_quantized() -> dict:
    torch = pytest.importorskip("torch")
    nested = torch.nested.nested_tensor([torch.arange(1.0), torch.arange(2.0)])
    quantized = torch.quantize_per_tensor(torch.full((3,), 2.0), 0.5, 0, torch.quint8)
    return {"nested": nested, "quantized": quantized, "plain": torch.ones(2)}


@pytest.mark.filterwarnings("ignore::UserWarning")  # nested: "prototype stage"; quantized: deprecated
def test_codec_inlines_nested_and_quantized_tensors(ring):
    # strided layout and type Tensor, yet no plain memory to copy into the slot: pickled by value
    batch = _nested_and_quantized()
    slot = ring.grow(1 << 16, OWNER)
    alloc = SlotAllocator(slot.segment.buf, slot.size_bytes)
    payload, nbytes = codec.encode(batch, alloc)
    assert codec.measure(batch) >= nbytes  # the nested tensor's pickle holds its buffer, a plain tensor
    del alloc
    got, _ = codec.decode(payload, leased(ring, slot), slot.size_bytes)
    assert got["plain"].tolist() == [1.0, 1.0]
    assert got["nested"].is_nested and [t.tolist() for t in got["nested"].unbind()] == [[0.0], [0.0, 1.0]]
    assert got["quantized"].is_quantized and got["quantized"].dequantize().tolist() == [2.0] * 3
    del got
    gc.collect()


def _copy_of_a_main_class(name: str) -> type:
    """A class that says it is ``__main__.<name>`` but is not what ``__main__`` holds under that
    name: what a spawned worker has once cloudpickle rebuilt the main script's class there."""
    import collections

    cls = collections.namedtuple(name, "x n")  # type: ignore[misc]  # a name chosen at run time
    cls.__module__ = "__main__"
    return cls


def test_codec_names_a_main_script_class_that_plain_pickle_refuses(ring, monkeypatch):
    """The retry starts from the slot position the first try started from: the same placement and
    the same one copy of an array held twice as a single try; the main process gets its own class."""
    import sys

    monkeypatch.setattr(codec, "_by_name", False)
    pair = _copy_of_a_main_class("CodecPair")
    slot, other = ring.grow(1 << 16, OWNER), ring.grow(1 << 16, OWNER)
    x, y = np.arange(6, dtype=np.float32), np.arange(3, dtype=np.int64)
    batch = {"a": x, "p": pair(x, 3), "b": y}  # x is copied into the slot before the class fails
    calls: list[str] = []
    encode_with = codec._encode_with
    monkeypatch.setattr(codec, "_encode_with", lambda enc, *a: calls.append(enc.__name__) or encode_with(enc, *a))
    alloc = SlotAllocator(slot.segment.buf, slot.size_bytes)
    payload, nbytes = codec.encode(batch, alloc)
    alone = SlotAllocator(other.segment.buf, other.size_bytes)
    assert (payload, nbytes) == encode_with(codec._NamingEncoder, batch, alone) and alloc.pos == alone.pos
    assert nbytes == x.nbytes + y.nbytes and calls == ["_Encoder", "_NamingEncoder"] and codec._by_name
    codec.encode(batch, SlotAllocator(other.segment.buf, other.size_bytes))
    assert calls == ["_Encoder", "_NamingEncoder", "_NamingEncoder"]  # the failed try is paid once
    del alloc, alone
    with pytest.raises(pickle.UnpicklingError, match="holds __main__.CodecPair, which this process's main"):
        codec.decode(payload, leased(ring, other), other.size_bytes)  # a data error: not a DescriptorError
    monkeypatch.setattr(sys.modules["__main__"], "CodecPair", pair, raising=False)
    got, views = codec.decode(payload, leased(ring, slot), slot.size_bytes)
    assert views == 2 and type(got["p"]) is pair and got["p"].x is got["a"] and got["p"].n == 3
    np.testing.assert_array_equal(got["a"], x)
    np.testing.assert_array_equal(got["b"], y)
    del got
    gc.collect()


def test_the_naming_encoder_describes_any_other_batch_as_the_plain_one_does(ring):
    """Its ``persistent_id`` is a copy of ``_Encoder``'s with one test more: the same bytes, the same placement."""
    slot = ring.grow(1 << 16, OWNER)
    first, second = (SlotAllocator(slot.segment.buf, slot.size_bytes) for _ in range(2))
    inside = first((4, 3), np.float32)
    x = np.arange(6, dtype=np.float32)
    batch: dict = {"in": inside, "x": x, "again": [x, x[::-1]], "obj": np.array([None]), "s": "a", "n": 3,
                   "cls": SlotAllocator}
    try:
        import torch
    except ImportError:
        pass
    else:
        t = torch.arange(4.0)
        batch.update(t=t, t_again=t, grad=torch.ones(2, requires_grad=True))
    second.pos = first.pos
    plain = codec._encode_with(codec._Encoder, batch, first)
    assert codec._encode_with(codec._NamingEncoder, batch, second) == plain and first.pos == second.pos
    del inside, first, second


def test_codec_measures_a_main_script_class_as_it_encodes_it(monkeypatch):
    monkeypatch.setattr(codec, "_by_name", False)
    x = np.zeros(100, dtype=np.float64)
    assert codec.measure([_copy_of_a_main_class("MeasuredPair")(x, x)]) == x.nbytes  # held twice: once
    assert codec._by_name
    assert codec.measure({"y": np.zeros(3)}) == 24


def test_codec_keeps_the_first_error_when_naming_does_not_help(ring, monkeypatch):
    """A local class (or lambda) pickles under no name in any process: the error is plain pickle's."""
    monkeypatch.setattr(codec, "_by_name", False)

    class Local:
        pass

    def f() -> int:
        return 0

    nameless = lambda: 0  # noqa: E731
    for obj in (Local, f, nameless):
        obj.__module__ = "__main__"  # as a worker's copies of the main script's are: still no name to find
    slot = ring.grow(1 << 16, OWNER)
    alloc = SlotAllocator(slot.segment.buf, slot.size_bytes)
    for batch in ({"x": np.zeros(3), "c": Local()}, {"f": f}, [nameless]):
        with pytest.raises((AttributeError, pickle.PicklingError), match="local object|lambda"):
            codec.encode(batch, alloc)
        with pytest.raises((AttributeError, pickle.PicklingError), match="local object|lambda"):
            codec.measure(batch)
    assert not codec._by_name
    del alloc


def test_codec_refuses_a_main_script_record_without_a_name(ring):
    slot = ring.grow(4096, OWNER)

    class Forger(pickle.Pickler):
        def persistent_id(self, obj):
            return ("m", 7) if obj is dict else None

    buf = io.BytesIO()
    Forger(buf, protocol=5).dump(dict)
    with pytest.raises(DescriptorError, match="names no object of the main script"):
        codec.decode(buf.getvalue(), leased(ring, slot), slot.size_bytes)
    gc.collect()
