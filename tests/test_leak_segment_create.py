"""A Ctrl-C that lands as a segment's file is created loses neither the file nor its descriptor.

Python runs a SIGINT handler right after a C call returns: after ``os.open(O_CREAT | O_EXCL)``
had made the file in the shm directory but before its descriptor was stored anywhere, the
``KeyboardInterrupt`` left an empty ``shml_`` file (not yet registered with the resource
tracker, so it outlived the process too) and an open descriptor that nothing could close. A
caller that catches the interrupt and goes on (a notebook cell) kept both for the rest of the run.
The real signal is sent here, from inside the open, as a Ctrl-C at that instant would be.
"""

from __future__ import annotations

import os
import signal
from typing import Any

import pytest

from shmloader.transport import segment


def test_a_ctrl_c_as_the_file_is_created_leaves_no_file_and_no_descriptor(tmp_path: Any,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    real_open = os.open

    def open_then_ctrl_c(path: Any, flags: int, *args: Any, **kw: Any) -> int:
        fd = real_open(path, flags, *args, **kw)
        if flags & os.O_EXCL:
            os.kill(os.getpid(), signal.SIGINT)  # its handler runs as soon as Python may run it
        return fd

    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    before = sorted(os.listdir("/proc/self/fd"))
    monkeypatch.setattr(segment.os, "open", open_then_ctrl_c)
    try:
        with pytest.raises(KeyboardInterrupt):
            segment.Segment.create(str(tmp_path), 4096)
    finally:
        monkeypatch.undo()
        signal.signal(signal.SIGINT, previous)
    assert os.listdir(tmp_path) == []
    assert len(os.listdir("/proc/self/fd")) <= len(before)
