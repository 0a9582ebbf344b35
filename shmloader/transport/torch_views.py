"""Torch tensors over a slot's bytes, and the hold that keeps a batch tensor's lease with its storage.

Owns the torch side of the descriptor codec (``transport/codec.py``): a tensor of a dtype and
shape (and strides: ``strided_record``/``strided_tensor``) over a uint8 array's bytes (no copy),
and, in the main process, one *hold* per batch tensor.
Runs in both processes (the worker copies tensors into the slot through ``torch_view``; only the
main process holds leases).

Why the hold (tests/test_share_memory.py): a batch tensor comes from ``torch.from_numpy`` of a view
of the lease buffer, so its storage's DataPtr is what keeps the slot leased. ``share_memory_()``
(which ``torch.multiprocessing.Queue.put``, ``multiprocessing`` queues and
``nn.Module.share_memory`` call) swaps that DataPtr for fresh shared memory in place and drops the
old one: the lease fired and the slot was reused while a numpy alias taken before
(``x.numpy()``, ``np.from_dlpack(x)``) still pointed into it. torch's own batches are in shared
memory already, so there ``share_memory_()`` does nothing and the alias stays valid.

Promises: a hold keeps the lease buffer alive for as long as the tensor's *storage*
(``StorageImpl``) lives, whatever DataPtr it holds by then. Every alias that references the
storage keeps it: the tensor, its views and slices, ``x.numpy()`` (whose base is a detached tensor
over the same storage), ``np.from_dlpack(x)`` and ``torch.from_dlpack`` (their capsule holds the
tensor), ``x.untyped_storage()``, and anything that references one of those (``memoryview``,
``np.frombuffer``, ``torch.from_numpy`` of the alias). An alias made from a raw address
(``x.data_ptr()``, ``.ctypes.data``, an ``__array_interface__`` copied by hand) references no
storage and is not covered, with or without ``share_memory_()``. After ``share_memory_()`` the
slot stays leased as long as the storage lives, as it would have without the call.

The hold is an attribute (``LEASE_ATTRIBUTE``) of the storage's Python object, which torch keeps
as long as the storage itself (storage PyObject preservation: in the 2.1 series as far as we know,
checked on 2.13); on a torch without it that object dies at once and the hold with it: the
behaviour before the hold. The tensor gains no
attribute, and neither ``pickle``, ``torch.save`` nor ``copy.deepcopy`` of the tensor or its
storage carries the storage's attributes: a batch saves, sends and copies as before. About 0.6 µs
per tensor decoded and dropped; a weak reference to the storage kept in a module dict, the other
way to tie the lease to the storage, cost about 0.8.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from shmloader.errors import DescriptorError

LEASE_ATTRIBUTE = "_shmloader_lease"
"""The attribute of a batch tensor's storage object (``x.untyped_storage()``) that holds its lease."""


def leased_tensor(u8: np.ndarray, dtype: Any, shape: tuple[int, ...], lease: Any) -> Any:
    """A batch tensor over ``u8`` (a view of ``lease``) whose storage holds the lease."""
    tensor = torch_view(u8, dtype, shape)
    if u8.size:
        setattr(tensor.untyped_storage(), LEASE_ATTRIBUTE, lease)
    return tensor


def span_bytes(t: Any) -> int:
    """The bytes from a tensor's first element to past its last: what a copy that keeps its strides
    takes (its ``nbytes`` when contiguous, less when expanded, more when it skips elements)."""
    return span_of(tuple(t.shape), t.stride(), t.element_size())


class HeapCopies:
    """How one batch's tensors that live outside the slot are copied in, so that tensors sharing
    memory in the worker share it in the main process, as in-process and through torch's workers.

    A tensor that covers at least half of its storage has the whole storage copied, once: every
    later tensor of that storage (``[t[1:], t, t.t()]``) is described inside that copy. A smaller
    view of a larger storage (a sample sliced out of a dataset's tensor) has only its span copied.
    """

    __slots__ = ("alloc", "_storages")

    def __init__(self, alloc: Any) -> None:
        self.alloc = alloc
        # storage address -> (slot offset, bytes, the storage: alive, so no other takes its address)
        self._storages: dict[int, tuple[int, int, Any]] = {}

    def place(self, raw: Any, span: int) -> int:
        """The slot offset of ``raw``'s first element (a tensor of ``span`` bytes, lazy bits undone)."""
        import torch

        storage = raw.untyped_storage()
        base, size = storage.data_ptr(), storage.nbytes()
        copied = self._storages.get(base)
        if copied is not None and copied[1] == size:
            return copied[0] + raw.data_ptr() - base
        whole = whole_storage(size, span)
        start, count = (base, size) if whole else (raw.data_ptr(), span)
        u8 = self.alloc((count,), np.uint8)
        skip = start - base  # byte for byte, gaps included: no stale slot bytes, NaN payloads kept
        torch.from_numpy(u8).copy_(torch.empty(0, dtype=torch.uint8).set_(storage)[skip:skip + count])
        offset = u8.__array_interface__["data"][0] - self.alloc.base_address
        if whole:  # not ``start == base``: a span copy of the storage's first row starts there too
            self._storages[base] = (offset, size, storage)
        return offset + raw.data_ptr() - start


def whole_storage(size: int, span: int) -> bool:
    """Whether a tensor of ``span`` bytes has its storage of ``size`` bytes copied whole (``HeapCopies``)."""
    return size <= 2 * span


def copy_bytes(t: Any) -> int:
    """The slot bytes ``HeapCopies`` may take for a tensor outside the slot (``codec.measure``)."""
    span = span_bytes(t)
    size = t.untyped_storage().nbytes() if span else 0
    return size if whole_storage(size, span) else span


def strided_record(t: Any, alloc: Any, copies: HeapCopies) -> tuple:
    """``("v", offset, span, dtype name, shape, strides, conj, neg)``: a tensor the ``"t"`` record
    cannot describe — not contiguous (transposed, expanded, channels_last) or a lazy conjugate or
    negative view — with its strides and lazy bits, as the main process has it (torch 2.13's workers
    keep the strides but drop the lazy bits, and with them the values: ``x.conj()`` comes back
    unconjugated, ``torch._neg_view(x)`` as ``x``).

    Its stored values (the lazy bits undone: views, no copy) are described where they are when
    they lie in the slot, else copied in once, byte for byte (``HeapCopies``).
    """
    import torch

    conj, neg = t.is_conj(), t.is_neg()
    raw = t.conj() if conj else t  # each toggles its bit: the values as stored
    raw = torch._neg_view(raw) if neg else raw
    span = span_bytes(raw)
    offset = alloc.offset_of(raw.data_ptr(), span) if span else 0
    if offset is None:
        offset = copies.place(raw, span)
    return ("v", offset, span, str(t.dtype), tuple(t.shape), tuple(t.stride()), conj, neg)


_MAX_STRIDE = 1 << 63  # torch's strides are int64


def strided_tensor(u8: np.ndarray, dtype: Any, shape: tuple[int, ...], strides: tuple[int, ...],
                   conj: bool, neg: bool, lease: Any) -> Any:
    """The tensor a ``"v"`` record describes, over ``u8`` (its span, a view of ``lease``)."""
    import torch

    itemsize = torch.empty((), dtype=dtype).element_size()
    if any(type(s) is not int or not 0 <= s < _MAX_STRIDE for s in strides) or len(strides) != len(shape) or \
            u8.size % itemsize or span_of(shape, strides, itemsize) > u8.size:
        raise DescriptorError(f"descriptor strides {strides} of shape {shape} reach past their "
                              f"{u8.size} bytes; no view was made")
    if u8.size == 0:  # checked as any other: a zero-size tensor keeps its strides, as torch's do
        return torch.empty_strided(shape, strides, dtype=dtype)
    made = torch_view(u8, dtype, (u8.size // itemsize,)).as_strided(shape, strides)
    made = torch._neg_view(made) if neg else made
    made = made.conj() if conj else made
    setattr(made.untyped_storage(), LEASE_ATTRIBUTE, lease)
    return made


def span_of(shape: tuple[int, ...], strides: tuple[int, ...], itemsize: int) -> int:
    """``span_bytes`` of a layout (non-negative strides, in elements)."""
    if 0 in shape:
        return 0
    return (sum((n - 1) * s for n, s in zip(shape, strides)) + 1) * itemsize


def fresh_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    """The strides (in elements) of a fresh contiguous tensor of ``shape``, as torch computes them
    (a dimension of size 0 counts as 1): what a ``"t"`` record's tensor gets in the main process."""
    strides = [1] * len(shape)
    for i in range(len(shape) - 1, 0, -1):
        strides[i - 1] = strides[i] * max(shape[i], 1)
    return tuple(strides)


def torch_dtype(name: str) -> Any:
    """The torch dtype a descriptor names (``"torch.float32"``); ``DescriptorError`` if none."""
    import torch  # a worker sent a tensor, so torch is installed (and usually imported already)

    dtype = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise DescriptorError(f"unknown torch dtype in descriptor: {name!r}")
    return dtype


def torch_view(u8: np.ndarray, dtype: Any, shape: tuple[int, ...]) -> Any:
    """A tensor of ``dtype``/``shape`` over the bytes of ``u8`` (no copy)."""
    import torch

    if u8.size == 0:
        return torch.empty(shape, dtype=dtype)
    return torch.from_numpy(u8).view(dtype).view(shape)
