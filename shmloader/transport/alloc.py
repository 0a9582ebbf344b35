"""The slot allocator: hands out aligned regions of one slot to the collate step.

Runs in a worker, one allocator per task. Promises: every array it returns starts on a
``ALIGN_BYTES`` (64-byte) boundary inside ``[0, capacity)`` of the slot; it never hands out a byte
twice within a task; when a request does not fit it raises ``SlotFull`` (nothing is written) and
remembers how many bytes the task asked for in all, so the worker can report the size it needs.
"""

from __future__ import annotations

import math
import mmap

import numpy as np

from shmloader.collate.context import SlotFull

ALIGN_BYTES = 64


def align_up(nbytes: int, align: int = ALIGN_BYTES) -> int:
    return (nbytes + align - 1) & ~(align - 1)


class SlotAllocator:
    """Bump allocator over ``buf[0:capacity]`` (a worker's mapping of the task's slot)."""

    __slots__ = ("buf", "capacity", "pos", "base_address", "_u8")

    def __init__(self, buf: mmap.mmap, capacity: int, u8: np.ndarray | None = None) -> None:
        self.buf = buf
        self.capacity = capacity
        self.pos = 0
        self._u8 = np.frombuffer(buf, dtype=np.uint8, count=capacity) if u8 is None else u8
        self.base_address: int = self._u8.__array_interface__["data"][0]

    def __call__(self, shape: tuple[int, ...], dtype: np.dtype | type | str) -> np.ndarray:
        dt = dtype if isinstance(dtype, np.dtype) else np.dtype(dtype)
        shape = tuple(map(int, shape))  # plain ints: numpy's would travel in the descriptor
        nbytes = math.prod(shape) * dt.itemsize
        offset = align_up(self.pos)
        if offset + nbytes > self.capacity:
            self.pos = offset + nbytes
            raise SlotFull(f"slot of {self.capacity} bytes cannot hold {offset + nbytes} bytes")
        self.pos = offset + nbytes
        return np.ndarray(shape, dtype=dt, buffer=self._u8, offset=offset)

    def offset_of(self, address: int, nbytes: int) -> int | None:
        """The slot offset of ``[address, address+nbytes)`` if it lies inside this slot."""
        offset = address - self.base_address
        if 0 <= offset and offset + nbytes <= self.capacity:
            return offset
        return None
