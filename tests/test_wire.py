"""The pipes' framing (transport/wire.py): tagged task frames, and a reader that takes every
waiting reply in one read, keeps a frame cut in two until its rest arrives, and speaks
``multiprocessing.connection``'s framing in both directions."""

from __future__ import annotations

import os
import pickle
import struct
from multiprocessing import Pipe

import numpy as np
import pytest

import shmloader
from shmloader.transport import wire
from shmloader.transport.messages import Failed, Filled, SlotRef, Task


@pytest.fixture
def pipe():
    r, w = os.pipe()
    yield r, w
    for fd in (r, w):
        try:
            os.close(fd)
        except OSError:
            pass


def _frame(obj: object) -> bytes:
    payload = pickle.dumps(obj)
    return struct.pack("!i", len(payload)) + payload


def test_task_frame_round_trip():
    frame = wire.task_frame(3, 17, [5, 9, 11], 2, "shml_x", 4096, 1234)
    assert frame[:1] == wire.TASK_TAG
    assert wire.decode(frame) == Task(3, 17, [5, 9, 11], SlotRef(2, "shml_x", 4096), 1234)


def test_task_frame_keeps_any_index_objects():
    indices = ["a", (1, 2), {"k": 3}, None]
    task = wire.decode(wire.task_frame(0, 0, indices, 0, "s", 4096, None))
    assert task.indices == indices and task.seed is None


def test_reply_frame_round_trip():
    filled = Filled(2, 40, 3, b"\x01descriptor", 4608, 0.5, 0.25)
    frame = wire.reply_frame(filled)
    assert frame[:1] == wire.FILLED_TAG
    assert wire.decode(frame) == filled
    failed = Failed(2, 41, "ValueError", None, "Traceback ...")
    assert wire.decode(wire.reply_frame(failed)) == failed


def test_decode_reads_plain_pickles():
    msg = Filled(0, 1, 2, b"payload", 7, 0.5, 0.25)
    assert wire.decode(pickle.dumps(msg)) == msg
    assert wire.decode(pickle.dumps(None)) is None


def test_reader_takes_every_waiting_frame_in_one_read(pipe):
    r, w = pipe
    os.write(w, _frame(("a", 1)) + _frame(("b", 2)) + _frame(("c", 3)))
    frames = wire.FrameReader(r).read()
    assert [pickle.loads(f) for f in frames] == [("a", 1), ("b", 2), ("c", 3)]


def test_reader_keeps_a_frame_cut_in_two_until_its_rest_arrives(pipe):
    r, w = pipe
    reader = wire.FrameReader(r)
    data = _frame("first") + _frame("second")
    cut = len(_frame("first")) + 6  # the second frame's header and two bytes of its payload
    os.write(w, data[:cut])
    assert [pickle.loads(f) for f in reader.read()] == ["first"]
    os.write(w, data[cut:])
    assert [pickle.loads(f) for f in reader.read()] == ["second"]


def test_reader_cut_inside_the_header(pipe):
    r, w = pipe
    reader = wire.FrameReader(r)
    data = _frame(list(range(10)))
    os.write(w, data[:2])
    assert reader.read() == []
    os.write(w, data[2:])
    assert [pickle.loads(f) for f in reader.read()] == [list(range(10))]


def test_reader_long_header(pipe):
    """The -1 + 8-byte length header (what Connection writes for 2 GiB and more) parses too."""
    r, w = pipe
    payload = pickle.dumps("long")
    os.write(w, struct.pack("!i", -1) + struct.pack("!Q", len(payload)) + payload)
    assert [pickle.loads(f) for f in wire.FrameReader(r).read()] == ["long"]


def test_reader_alternates_single_whole_frames_and_cut_ones(pipe):
    """A read that is exactly one frame is taken as it is (the common case); one that is not goes
    through the buffer, and the next whole one after it is still whole and in order."""
    r, w = pipe
    reader = wire.FrameReader(r)
    os.write(w, _frame("one"))
    assert [pickle.loads(f) for f in reader.read()] == ["one"]
    os.write(w, struct.pack("!i", 0))  # an empty payload: a frame of its own
    assert reader.read() == [b""]
    two, three = _frame("two"), _frame("three")
    os.write(w, two + three[:5])
    assert [pickle.loads(f) for f in reader.read()] == ["two"]
    os.write(w, three[5:])
    assert [pickle.loads(f) for f in reader.read()] == ["three"]
    os.write(w, _frame("four"))
    assert [pickle.loads(f) for f in reader.read()] == ["four"]


def test_reader_eof_after_the_last_whole_frame(pipe):
    r, w = pipe
    reader = wire.FrameReader(r)
    os.write(w, _frame("last"))
    os.close(w)
    assert [pickle.loads(f) for f in reader.read()] == ["last"]
    with pytest.raises(EOFError):
        reader.read()


def test_the_reader_reads_what_connection_sends():
    recv, send = Pipe(duplex=False)
    try:
        send.send({"batch": np.arange(1000)})
        (frame,) = wire.FrameReader(recv.fileno()).read()
        np.testing.assert_array_equal(pickle.loads(frame)["batch"], np.arange(1000))
    finally:
        recv.close()
        send.close()


def test_reader_gathers_a_frame_longer_than_the_pipe(pipe):
    r, w = pipe
    reader = wire.FrameReader(r)
    data = _frame(b"z" * 150_000)  # more than a pipe holds: written and read in pieces
    got, pos = [], 0
    while not got:
        pos += os.write(w, data[pos:pos + 50_000])
        got = reader.read()
    assert pos == len(data) and pickle.loads(got[0]) == b"z" * 150_000


def test_write_frame_is_what_connection_reads():
    recv, send = Pipe(duplex=False)
    try:
        wire.write_frame(send.fileno(), b"abc")
        wire.write_frame(send.fileno(), b"")
        assert recv.recv_bytes() == b"abc" and recv.recv_bytes() == b""
    finally:
        recv.close()
        send.close()


@pytest.mark.timeout(30)
def test_write_frame_longer_than_the_pipe_is_written_whole(pipe):
    import threading

    r, w = pipe
    payload = bytes(range(256)) * 1200  # 300 KiB: more than a pipe holds, so os.write takes part
    got: list[bytes] = []
    reader = wire.FrameReader(r)

    def drain_until_whole() -> None:
        while not got:
            got.extend(reader.read())

    drain = threading.Thread(target=drain_until_whole)
    drain.start()
    wire.write_frame(w, payload)
    drain.join(20)
    assert got == [payload]


def test_write_frame_on_a_closed_handle_raises_oserror():
    from shmloader.engine.workers import WorkerHandle

    recv, send = Pipe(duplex=False)
    handle = WorkerHandle(0, None, send, recv)
    send.close()
    with pytest.raises(OSError):
        handle.send_frame(b"x")
    recv.close()


class _BigInline(shmloader.Dataset):
    """Batches whose descriptor is far larger than one pipe read (strings travel inline)."""

    def __len__(self) -> int:
        return 12

    def __getitem__(self, i: int) -> tuple:
        return (np.full(4, i), f"{i:06d}" + "x" * 40_000)


@pytest.mark.timeout(60)
def test_loader_replies_larger_than_one_read_arrive_whole():
    loader = shmloader.DataLoader(_BigInline(), batch_size=3, num_workers=2)
    got = [(arr.copy(), list(text)) for arr, text in loader]
    assert [a[:, 0].tolist() for a, _ in got] == [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9, 10, 11]]
    assert all(len(s) == 40_006 and s.startswith(f"{k * 3 + j:06d}") for k, (_, t) in enumerate(got)
               for j, s in enumerate(t))


def test_worker_task_frames_in_order_then_quiet_then_closed():
    from shmloader.worker.task_frames import QUIET, TaskFrames

    recv, send = Pipe(duplex=False)
    try:
        frames = TaskFrames(recv)
        send.send_bytes(wire.task_frame(0, 1, [1], 0, "s", 4096, None))
        send.send(None)  # a plain pickled message behind a tagged one, both in one read
        assert wire.decode(frames.next(5.0)).task == 1
        assert wire.decode(frames.next(5.0)) is None
        assert frames.next(0.01) is QUIET
        send.close()
        assert frames.next(5.0) is None
    finally:
        recv.close()
        send.close()
