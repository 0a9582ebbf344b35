"""The mlock pin backend (no accelerator: page-locking by ``mlock``): a refusal under a small
RLIMIT_MEMLOCK warns once and locks nothing; otherwise each slot is locked while it lives and
unlocked when the ring retires it."""

from __future__ import annotations

import ctypes
import errno
import os
import warnings
from typing import Any

import pytest
from ring_helpers import OWNER

from shmloader.gpu.mlock import MlockBackend
from shmloader.transport.ring import Ring
from shmloader.transport.segment import PAGE_BYTES


class _RefusingLibc:
    """libc whose mlock fails as under a small RLIMIT_MEMLOCK without CAP_IPC_LOCK."""

    def __init__(self) -> None:
        self.mlock = self._Fn(self, errno.EPERM)
        self.munlock = self._Fn(self, 0)
        self.calls = 0

    class _Fn:
        def __init__(self, owner: Any, err: int) -> None:
            self.owner, self.err = owner, err

        def __call__(self, address: int, nbytes: int) -> int:
            self.owner.calls += 1
            if self.err:
                ctypes.set_errno(self.err)
                return -1
            return 0


def test_mlock_refused_warns_once_citing_rlimit_memlock(tmp_path: Any) -> None:
    libc = _RefusingLibc()
    backend = MlockBackend(libc=libc)
    ring = Ring(str(tmp_path), on_create=backend.register_segment, on_retire=backend.unregister_segment)
    with pytest.warns(RuntimeWarning, match="RLIMIT_MEMLOCK") as caught:
        ring.grow(PAGE_BYTES, OWNER)
        ring.grow(PAGE_BYTES, OWNER)
    assert len([w for w in caught if "RLIMIT_MEMLOCK" in str(w.message)]) == 1
    assert libc.calls == 2 and backend.registered == {}
    ring.close()
    assert libc.calls == 2  # nothing was locked, so nothing is unlocked
    assert not os.listdir(tmp_path)


def _locked_bytes() -> int:
    with open("/proc/self/status") as f:
        line = next(l for l in f if l.startswith("VmLck:"))
    return int(line.split()[1]) * 1024


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="needs /proc")
def test_mlock_locks_and_unlocks_or_says_why(tmp_path: Any) -> None:
    backend = MlockBackend()
    ring = Ring(str(tmp_path), on_create=backend.register_segment, on_retire=backend.unregister_segment)
    before = _locked_bytes()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        slot = ring.grow(4 * PAGE_BYTES, OWNER)
    if backend.registered:
        assert _locked_bytes() - before >= slot.size_bytes
    else:
        assert any("RLIMIT_MEMLOCK" in str(w.message) for w in caught)
    ring.close()
    assert _locked_bytes() == before and backend.registered == {}
