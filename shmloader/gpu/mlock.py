"""The mlock pin backend: page-locks slots with libc ``mlock`` when there is no device.

Owns :class:`MlockBackend` and the words for ``RLIMIT_MEMLOCK`` (:func:`memlock_limit_text`). Runs
in the main process, like every backend (``gpu.backends``), and is inert in any other process.
Promises: a refused lock (EPERM/ENOMEM) warns once, names the limit and how to raise it, and leaves
the batches correct; only what was locked is unlocked.
"""

from __future__ import annotations

import ctypes
import errno
import os
from typing import Any

from shmloader.gpu.backends import RegisteringBackend
from shmloader.rlimits import soft_limit

__all__ = ["MlockBackend", "memlock_limit_text"]


class MlockBackend(RegisteringBackend):
    """Best-effort page lock with libc ``mlock``/``munlock`` (no device; for CPU-side latency).

    Locked pages are not pinned for a device (``device_pinned`` is False). EPERM/ENOMEM — an
    ``RLIMIT_MEMLOCK`` smaller than the ring — warn once and leave the rest unlocked.
    """

    name = "mlock"
    device_pinned = False

    def __init__(self, libc: Any = None) -> None:
        super().__init__()
        self._libc = libc if libc is not None else ctypes.CDLL(None, use_errno=True)
        for fn in (self._libc.mlock, self._libc.munlock):
            fn.argtypes, fn.restype = [ctypes.c_void_p, ctypes.c_size_t], ctypes.c_int

    def _pin(self, address: int, nbytes: int) -> str | None:
        if self._libc.mlock(address, nbytes) == 0:
            return None
        err = ctypes.get_errno()
        if err in (errno.EPERM, errno.ENOMEM):
            return f"mlock: {os.strerror(err)}; {memlock_limit_text()}"
        return f"mlock: {os.strerror(err)}"

    def _unpin(self, address: int, nbytes: int) -> str | None:
        if self._libc.munlock(address, nbytes) == 0:
            return None
        return f"munlock: {os.strerror(ctypes.get_errno())}"


def memlock_limit_text() -> str:
    """RLIMIT_MEMLOCK in words (``shmloader.rlimits``), with how to raise it."""
    limit = soft_limit("RLIMIT_MEMLOCK")
    return f"{limit.describe()}: {limit.remedy()} to lock the whole ring"
