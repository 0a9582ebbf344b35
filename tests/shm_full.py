"""A shared-memory directory that fills up as a slot grows, for the growth tests."""

from __future__ import annotations

import errno
import os
from collections.abc import Callable

import pytest


def full_past_the_first_part(monkeypatch: pytest.MonkeyPatch, on_refusal: Callable[[], object] | None = None) -> None:
    """The shm directory full once a growing slot is reserved past its first part (only a growing
    slot is reserved in parts); ``on_refusal`` is called as each such reservation is refused."""
    reserve = os.posix_fallocate

    def refused_past_the_first_part(fd: int, offset: int, length: int) -> None:
        if offset > 0:
            if on_refusal is not None:
                on_refusal()
            raise OSError(errno.ENOSPC, "No space left on device")
        reserve(fd, offset, length)

    monkeypatch.setattr(os, "posix_fallocate", refused_past_the_first_part)
