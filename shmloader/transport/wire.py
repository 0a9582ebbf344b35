"""Framing on the workers' pipes: the hot-path encodings and a reader that takes every waiting reply.

The pipes carry ``multiprocessing.connection`` frames: a 4-byte big-endian length (or ``-1`` and
an 8-byte length, for 2 GiB and more) and a payload, which is a pickle. Two things here are
faster than ``Connection.send``/``recv`` and speak the same framing, so either end may still use
``Connection`` for the rare messages:

- ``task_frame`` and ``reply_frame``: a ``Task`` (main → worker) and a ``Filled`` (worker → main),
  the two messages of every batch, as a tagged pickle of a plain tuple (no ``ForkingPickler``, no
  ``__reduce__`` per object), turned back into the message by ``decode``;
- ``write_frame``: the framing ``Connection.send_bytes`` writes, in one ``os.write`` for any frame
  a pipe takes whole: 0.8 against 1.8 µs of CPU per 120-byte frame (issue 16: once per batch in
  each worker); the main process frames a task the same way (``frame``) and writes it to a
  non-blocking pipe with ``write_some``, keeping what the pipe does not take
  (``engine.workers.WorkerHandle``: it never blocks on a busy worker);
- ``FrameReader``: in the main process (and in each worker, on its task pipe), one ``os.read`` takes every reply a worker has written so
  far (a ``Connection.recv`` costs two reads per reply), and a frame cut in two by the pipe waits
  in its buffer for the rest.

Owns nothing but the reader's buffer of bytes not yet parsed. Promises: a frame is returned once,
whole, in the order written; a closed pipe is ``EOFError`` once every whole frame before it has
been returned.
"""

from __future__ import annotations

import os
import pickle
import struct
from typing import Any

from shmloader.transport.messages import Filled, SlotRef, Task

__all__ = ["FrameReader", "decode", "frame", "reply_frame", "task_frame", "write_frame", "write_some"]

TASK_TAG = b"T"  # a pickle payload starts with b"\x80" (PROTOCOL 2+): a tag cannot be mistaken
FILLED_TAG = b"F"
_HEADER = struct.Struct("!i")
_LONG = struct.Struct("!Q")
_READ_BYTES = 1 << 16


def task_frame(epoch: int, task: int, indices: list[Any] | None, slot_id: int, segment: str, size_bytes: int,
               seed: int | None) -> bytes:
    """The payload of one ``Task`` message: the task's fields and its ``SlotRef``'s (``decode``
    reverses it)."""
    return TASK_TAG + pickle.dumps((epoch, task, indices, slot_id, segment, size_bytes, seed), pickle.HIGHEST_PROTOCOL)


def reply_frame(msg: Any) -> bytes:
    """The payload of a worker's reply: ``Filled`` (one per batch) as a tagged tuple, the rest pickled."""
    if type(msg) is Filled:
        return FILLED_TAG + pickle.dumps(tuple(msg), pickle.HIGHEST_PROTOCOL)
    return pickle.dumps(msg, pickle.HIGHEST_PROTOCOL)


def decode(payload: bytes) -> Any:
    """A message from its frame's payload: a tagged task or batch, or any pickled message."""
    tag = payload[:1]
    if tag == FILLED_TAG:
        return Filled._make(pickle.loads(memoryview(payload)[1:]))
    if tag == TASK_TAG:
        epoch, task, indices, slot_id, name, size, seed = pickle.loads(memoryview(payload)[1:])
        return Task(epoch, task, indices, SlotRef(slot_id, name, size), seed)
    return pickle.loads(payload)


def frame(payload: bytes) -> bytes:
    """``payload`` framed: its length header (what ``Connection.recv_bytes`` and ``FrameReader``
    read first), then the payload."""
    n = len(payload)
    return _HEADER.pack(n) + payload if n < 0x7FFFFFFF else _HEADER.pack(-1) + _LONG.pack(n) + payload


def write_some(fd: int, data: bytes | bytearray | memoryview) -> int:
    """Write what a non-blocking pipe takes now of ``data``; returns how many bytes (0 when it is
    full). ``BrokenPipeError`` (an ``OSError``) once the reader is gone."""
    try:
        return os.write(fd, data)
    except BlockingIOError:
        return 0


def write_frame(fd: int, payload: bytes) -> None:
    """Write ``payload`` as one frame to a blocking pipe (a worker's replies).

    One ``os.write`` of header and payload together; if the pipe takes only part (a frame larger
    than the pipe's free space), the rest is written as the reader makes room."""
    data = frame(payload)
    written = os.write(fd, data)
    if written != len(data):
        view = memoryview(data)[written:]
        while view:
            view = view[os.write(fd, view):]


class FrameReader:
    """Whole frames from a pipe's read end, as many as have arrived, without blocking once the
    pipe is readable."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self._buf = bytearray()

    def read(self) -> list[bytes]:
        """One ``os.read`` (call it when the pipe polls readable); the whole frames now buffered.
        ``EOFError`` when the writer has closed its end and no whole frame is left."""
        if self._buf:
            chunk = os.read(self.fd, max(_READ_BYTES, self._missing()))
        else:  # the common case: nothing left over, and the read is one whole frame (issue 16)
            chunk = os.read(self.fd, _READ_BYTES)
            if len(chunk) >= 4 and _HEADER.unpack_from(chunk)[0] == len(chunk) - 4:
                return [chunk[4:]]
        if not chunk:
            raise EOFError(f"pipe {self.fd} closed")
        self._buf += chunk
        return self._frames()

    def _missing(self) -> int:
        """Bytes still to come for the frame at the head of the buffer (0 when unknown)."""
        buf = self._buf
        if len(buf) < 4:
            return 0
        n = _HEADER.unpack_from(buf)[0]
        if n == -1:
            return _LONG.unpack_from(buf, 4)[0] + 12 - len(buf) if len(buf) >= 12 else 0
        return n + 4 - len(buf)

    def _frames(self) -> list[bytes]:
        buf, pos, out = self._buf, 0, []
        end = len(buf)
        while end - pos >= 4:
            n = _HEADER.unpack_from(buf, pos)[0]
            start = pos + 4
            if n == -1:
                if end - pos < 12:
                    break
                n = _LONG.unpack_from(buf, start)[0]
                start += 8
            if end - start < n:
                break
            out.append(bytes(buf[start:start + n]))
            pos = start + n
        del buf[:pos]
        return out
