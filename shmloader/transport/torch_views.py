"""Torch tensors over a slot's bytes, and the hold that keeps a batch tensor's lease with its storage.

Owns the torch side of the descriptor codec (``transport/codec.py``): a tensor of a dtype and
shape over a uint8 array's bytes (no copy), and, in the main process, one *hold* per batch tensor.
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
