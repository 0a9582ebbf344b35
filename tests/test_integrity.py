"""What a worker delivers is what the same collate gives in the main process: layout (strides,
memory order), values and object identity, for arrays and tensors a ``collate_fn`` or a collate
rule returns, in the slot or not. Each case compares ``num_workers=0`` with a worker, bit for bit."""

from __future__ import annotations

import gc
import io
import pickle
from typing import Any

import numpy as np
import pytest

import shmloader
from shmloader.collate import register_collate_rule, unregister_collate_rule

try:
    import torch
except ImportError:  # the numpy cases run without torch
    torch = None  # type: ignore[assignment]

needs_torch = pytest.mark.skipif(torch is None, reason="torch is not installed")


class Indices:
    """A map-style dataset of its indices."""

    def __len__(self) -> int:
        return 4

    def __getitem__(self, i: int) -> int:
        return i


def _both(collate_fn: Any, dataset: Any = None) -> tuple[list[Any], list[Any]]:
    """The batches of ``num_workers=0`` and of one worker, for the same collate."""
    dataset = Indices() if dataset is None else dataset
    return tuple(list(shmloader.DataLoader(dataset, batch_size=2, num_workers=n, collate_fn=collate_fn))
                 for n in (0, 1))  # type: ignore[return-value]


def _assert_same_array(a: np.ndarray, b: np.ndarray) -> None:
    assert (type(a), a.dtype, a.shape, a.strides) == (type(b), b.dtype, b.shape, b.strides)
    assert a.tobytes(order="A") == b.tobytes(order="A")


def _assert_same_tensor(a: Any, b: Any) -> None:
    assert (type(a), a.dtype, a.shape, a.stride(), a.is_conj(), a.is_neg()) == \
        (type(b), b.dtype, b.shape, b.stride(), b.is_conj(), b.is_neg())
    assert torch.equal(a.resolve_conj().resolve_neg(), b.resolve_conj().resolve_neg())


# ------------------------------------------------------------------ numpy arrays a collate_fn makes

def fortran_batch(indices: list[int]) -> list[np.ndarray]:
    x = np.arange(24, dtype=np.float64).reshape(4, 6) + sum(indices)
    return [np.asfortranarray(x), x.T, x]


@pytest.mark.timeout(60)
def test_fortran_ordered_arrays_keep_their_order() -> None:
    """A Fortran-ordered array from a collate_fn arrived C-ordered (strides (48, 8) for (8, 32));
    pickle, and so torch's workers, keep the order."""
    ref, got = _both(fortran_batch)
    for r, g in zip(ref, got):
        for a, b in zip(r, g):
            _assert_same_array(a, b)
        assert g[0].flags.f_contiguous and g[1].flags.f_contiguous


def empty_batch(indices: list[int]) -> list[np.ndarray]:
    return [np.zeros((0, 3)), np.zeros((3, 0), order="F"), np.empty((2, 0, 4))[:, :, ::2], np.zeros((0,), ">i2")]


@pytest.mark.timeout(60)
def test_zero_size_arrays_keep_their_strides() -> None:
    """A zero-size array arrived with the strides of a fresh array ((24, 8)), not its own ((0, 0)
    from numpy 2): no bytes to copy, so its record now carries its own strides."""
    ref, got = _both(empty_batch)
    for r, g in zip(ref, got):
        for a, b in zip(r, g):
            _assert_same_array(a, b)


PADDED = np.dtype([("a", "i1"), ("b", "f8")], align=True)  # 7 padding bytes after "a"


def padded_records(indices: list[int]) -> list[np.ndarray]:
    raw = np.frombuffer(bytes(range(16)) * 3, np.uint8).copy()  # padding bytes that are not zeros
    x = raw.view(PADDED)
    x["a"], x["b"] = sum(indices), -0.0
    return [x, x[1:], np.full(64, sum(indices), np.float64)]  # the last fills the slot for the next batch


@pytest.mark.timeout(60)
def test_records_with_padding_arrive_byte_for_byte() -> None:
    """A structured array was copied field by field, so its padding bytes arrived as whatever the
    slot held before: another batch's bytes. It is now copied byte for byte, padding included."""
    ref, got = _both(padded_records)
    for r, g in zip(ref, got):
        for a, b in zip(r, g):
            _assert_same_array(a, b)
            assert np.ascontiguousarray(a).view(np.uint8).tobytes() == np.ascontiguousarray(b).view(np.uint8).tobytes()


# ----------------------------------------------------------------- tensors a collate_fn makes

def strided_tensors(indices: list[int]) -> list[Any]:
    t = torch.arange(24, dtype=torch.float32).reshape(4, 6) + sum(indices)
    image = torch.arange(120, dtype=torch.float32).reshape(2, 3, 4, 5) + sum(indices)
    return [t.t(), t[:, ::2], t[0].expand(5, 6), image.contiguous(memory_format=torch.channels_last),
            t[1:], t[:, 1], t.to(torch.complex64).conj().imag]


@needs_torch
@pytest.mark.timeout(60)
def test_non_contiguous_tensors_keep_their_strides() -> None:
    """Transposed, strided, expanded (stride 0) and channels_last tensors, and the imaginary part of
    a conjugate (a negative view), arrived contiguous; in the main process and through torch's
    workers they keep their strides."""
    ref, got = _both(strided_tensors)
    for r, g in zip(ref, got):
        for a, b in zip(r, g):
            _assert_same_tensor(a, b)
        assert g[3].is_contiguous(memory_format=torch.channels_last)


def sharing_tensors(indices: list[int]) -> list[Any]:
    t = torch.arange(24, dtype=torch.float32).reshape(4, 6) + sum(indices)
    u = torch.arange(12, dtype=torch.int64) + sum(indices)
    return [t[1:], t, t.t(), t[:, 1], u, u[2:]]  # views met before and after the whole tensor


@needs_torch
@pytest.mark.timeout(60)
def test_tensors_that_share_memory_still_share_it() -> None:
    """Views of one tensor a collate_fn returns were copied apart, so a write to one was not seen
    in the others, as it is in the main process and through torch's workers."""
    ref, got = _both(sharing_tensors)
    for r, g in zip(ref, got):
        for a, b in zip(r, g):
            _assert_same_tensor(a, b)
        for batch in (r, g):
            batch[1].fill_(7)
            batch[4].fill_(-1)
            assert all(bool((x == 7).all()) for x in batch[:4]) and all(bool((x == -1).all()) for x in batch[4:])


def big_strided_tensors(indices: list[int]) -> list[Any]:
    t = torch.arange(600 * 600, dtype=torch.float32).reshape(600, 600) + sum(indices)
    return [t.t(), t[0].expand(4000, 600)]  # 1.4 MB past the first 1 MiB slot; 9.6 MB expanded in 2.4 kB


@needs_torch
@pytest.mark.timeout(60)
def test_strided_tensors_that_outgrow_the_slot_arrive_whole() -> None:
    """The slot a strided batch needs is measured by its span, so the retry fits it."""
    ref, got = _both(big_strided_tensors)
    for r, g in zip(ref, got):
        for a, b in zip(r, g):
            _assert_same_tensor(a, b)


# --------------------------------------------------------------- what a collate rule returns

class Item:
    """A sample type that only a registered collate rule knows."""

    def __init__(self, v: int) -> None:
        self.v = v


class Items(Indices):
    def __getitem__(self, i: int) -> Item:  # type: ignore[override]  # a dataset of Items, not of ints
        return Item(i)


def _in_slot_values(batch: list[Item], ctx: Any, dtype: Any = np.int64) -> np.ndarray:
    out = ctx.alloc((len(batch),), np.dtype(dtype))
    out[:] = [item.v for item in batch]
    return out


def repeated_rule(batch: list[Item], ctx: Any) -> list[np.ndarray]:
    out = _in_slot_values(batch, ctx)
    return [out, out, out[::-1]]


def conj_rule(batch: list[Item], ctx: Any) -> list[Any]:
    out = torch.from_numpy(_in_slot_values(batch, ctx, np.complex64))
    out.imag[:] = 1
    return [out.conj(), torch._neg_view(out), out, out.unsqueeze(1).expand(len(batch), 3), out.real]


@pytest.fixture
def rule(request: pytest.FixtureRequest) -> Any:
    register_collate_rule(Item, request.param)
    yield request.param
    unregister_collate_rule(Item)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("rule", [repeated_rule], indirect=True)
def test_an_in_slot_array_held_twice_arrives_as_one_object(rule: Any) -> None:
    """A list of in-slot arrays (the flat descriptor) that holds one array twice arrived as two
    objects; pickle, the in-process batch and torch's workers give one."""
    ref, got = _both(None, Items())
    for r, g in zip(ref, got):
        assert r[0] is r[1] and g[0] is g[1] and g[0] is not g[2]
        for a, b in zip(r, g):
            _assert_same_array(a, b)


@needs_torch
@pytest.mark.timeout(60)
@pytest.mark.parametrize("rule", [conj_rule], indirect=True)
def test_conjugate_and_negative_views_of_in_slot_tensors_keep_their_values(rule: Any) -> None:
    """``out.conj()`` of a tensor in the slot arrived as ``out`` (its lazy conjugation lost, so every
    imaginary part had the wrong sign); so did a negative view. Strided views of it are described
    where they lie, not copied."""
    ref, got = _both(None, Items())
    for r, g in zip(ref, got):
        for a, b in zip(r, g):
            _assert_same_tensor(a, b)
        assert {t.data_ptr() for t in g} == {g[2].data_ptr()}


# ------------------------------------------------------------------------ the strided record

@needs_torch
def test_a_strided_record_is_measured_as_encoded_and_checked_before_any_view(ring: Any) -> None:
    """A copied strided tensor takes its span (gaps included, less when expanded); ``measure``
    says so, and a record whose strides reach past its span is refused."""
    from ring_helpers import OWNER, leased

    from shmloader.errors import DescriptorError
    from shmloader.transport import codec
    from shmloader.transport.alloc import SlotAllocator

    slot = ring.grow(1 << 16, OWNER)
    alloc = SlotAllocator(slot.segment.buf, slot.size_bytes)
    t = torch.arange(64, dtype=torch.float64).reshape(8, 8)
    batch = [t[:, ::3], t[0].expand(100, 8), t.t()]
    payload, _ = codec.encode(batch, alloc)
    assert alloc.pos <= codec.measure(batch) and codec.measure(batch) < sum(x.numel() * 8 for x in batch)
    buf = leased(ring, slot)
    got, views = codec.decode(payload, buf, slot.size_bytes)
    assert views == 3
    for a, b in zip(got, batch):
        _assert_same_tensor(a, b)
    forged = _forge(("v", 0, 64, "torch.float64", (8, 8), (8, 1), False, False))
    with pytest.raises(DescriptorError, match="reach past"):
        codec.decode(forged, buf, slot.size_bytes)
    # a zero-size record is checked too: negative or missing strides were taken (or torch's errors)
    for strides in [(-1, 1), (1,), (2**70, 1)]:
        forged = _forge(("v", 0, 0, "torch.float64", (0, 3), strides, False, False))
        with pytest.raises(DescriptorError, match="reach past"):
            codec.decode(forged, buf, slot.size_bytes)
    del got, buf, alloc
    gc.collect()


def _forge(record: tuple) -> bytes:
    buf = io.BytesIO()

    class Forger(pickle.Pickler):
        def persistent_id(self, obj: Any) -> Any:
            return record if obj == "record" else None

    Forger(buf, protocol=5).dump("record")
    return buf.getvalue()
