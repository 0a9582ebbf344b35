"""Reuse of large batch buffers when collating in the main process (``num_workers=0``, issue 16).

Owns a few heap buffers (``np.empty`` of uint8) for arrays of at least ``REUSE_MIN_BYTES``, until its
``SingleProcessIter`` ends its epoch or is closed. Why: an array that large is ``mmap``ed afresh for every batch
by the C allocator (glibc stops reusing freed memory for blocks over 32 MiB), so each batch's copy
also faults in and zeroes every page: a 64 MiB ``big`` stack took 11.5–11.7 ms into fresh memory
against 4.3–5.0 ms into memory already written (docs/performance.md, "Reused buffers without
workers"). Smaller arrays come back from the allocator's free lists already faulted in, and are
left to it.

Promises:

- :meth:`HeapPool.alloc` returns a C-contiguous ``np.ndarray`` of ``shape`` and ``dtype``, as
  ``np.empty`` does (uninitialised), whose memory no live object refers to: a buffer is reused
  only when the pool's own reference is the only one left. Every array (and every torch tensor
  from ``torch.from_numpy``, memoryview, or view) made from a buffer holds a reference to it, so a
  batch the caller keeps is never written again, whatever it keeps and for however long.
  What no reference protects is a raw address (``ctypes``, ``__array_interface__``) kept past the
  array it came from, as for any freed memory.
- below ``REUSE_MIN_BYTES``, for object dtypes and for zero-size arrays, ``alloc`` is ``np.empty``;
- at most ``keep`` buffers are held; a buffer of another size that nobody refers to makes room for
  a new one; with every buffer in use, the array is ``np.empty``'s, not pooled;
- not thread-safe: one iterator's ``next()`` calls it, as it is itself.
"""

from __future__ import annotations

import math
import sys
from typing import Any

import numpy as np

__all__ = ["REUSE_MIN_BYTES", "HeapPool"]

REUSE_MIN_BYTES = 32 * 1024 * 1024  # glibc's largest mmap threshold: below it freed memory is reused
_UINT8 = np.dtype(np.uint8)


def _refs(buffers: list[np.ndarray], i: int) -> int:
    """``sys.getrefcount`` of ``buffers[i]``, counted the one way the pool counts it."""
    return sys.getrefcount(buffers[i])


# What _refs counts for a buffer that only the pool's list refers to: measured, not assumed, since
# CPython's counts change between versions (3.14 borrows references to locals it loads: a
# getrefcount(local) one lower than 3.11's would make a buffer a batch still holds look free).
_OWN_REFS = _refs([np.empty(0, dtype=_UINT8)], 0)


class HeapPool:
    """Up to ``keep`` reusable heap buffers for large arrays of one iterator; see the module docstring."""

    def __init__(self, keep: int = 4, min_bytes: int | None = None) -> None:
        self._keep = keep
        self._min_bytes = REUSE_MIN_BYTES if min_bytes is None else min_bytes
        self._buffers: list[np.ndarray] = []

    def alloc(self, shape: tuple[int, ...], dtype: Any) -> np.ndarray:
        """An uninitialised C-contiguous array; from a reused buffer when large (module docstring)."""
        dtype = np.dtype(dtype)
        nbytes = dtype.itemsize * math.prod(shape)  # np.prod costs 5 µs a call: this is per array
        if nbytes < self._min_bytes or nbytes == 0 or dtype.hasobject:
            return np.empty(shape, dtype=dtype)
        raw = self._free(nbytes)
        if raw is None:
            return np.empty(shape, dtype=dtype)
        return raw.view(dtype).reshape(shape)

    def _free(self, nbytes: int) -> np.ndarray | None:
        """A buffer of exactly ``nbytes`` that only the pool refers to: one held, or a new one."""
        other = None
        for i in range(len(self._buffers)):  # not enumerate(): its reused tuple holds a reference
            if _refs(self._buffers, i) > _OWN_REFS:
                continue  # a live batch (or anything made from it) still refers to it
            raw = self._buffers[i]
            if raw.nbytes == nbytes:
                return raw
            other = i
        if len(self._buffers) >= self._keep:
            if other is None:
                return None
            del self._buffers[other]  # a size no longer asked for (the epoch's short last batch)
        raw = np.empty(nbytes, dtype=_UINT8)
        self._buffers.append(raw)
        return raw

    def clear(self) -> None:
        """Let go of every buffer (the epoch is over): those batches still refer to stay theirs."""
        self._buffers.clear()

    def __len__(self) -> int:
        return len(self._buffers)
