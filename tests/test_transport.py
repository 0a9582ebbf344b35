"""Unit tests of the transport: segments (the owner's lock, names, a failed create) and the sweep, the ring and
its leases, reorder. The allocator and the codec: test_codec.py."""

from __future__ import annotations

import errno
import fcntl
import gc
import json
import mmap
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from ring_helpers import OWNER, leased

from shmloader.engine.reorder import Reorder
from shmloader.errors import (
    LoaderError,
    RingExhausted,
    SegmentCollision,
)
from shmloader.transport import segment, sweep
from shmloader.transport.ring import Ring, SlotState
from shmloader.transport.segment import Segment, owner_pid
from shmloader.transport.sweep import sweep_dead_segments


def test_segment_is_page_rounded_reserved_and_unlinked(tmp_path):
    seg = Segment.create(str(tmp_path), 5000)
    assert seg.size_bytes == 2 * mmap.PAGESIZE
    assert os.stat(seg.path).st_blocks * 512 >= seg.size_bytes  # reserved up front (posix_fallocate)
    assert owner_pid(seg.name) == os.getpid()
    seg.unlink()
    assert not os.path.exists(seg.path) and seg.close()


def test_attached_segment_cannot_unlink(tmp_path):
    seg = Segment.create(str(tmp_path), 100)
    other = Segment.attach(str(tmp_path), seg.name, seg.size_bytes)
    with pytest.raises(PermissionError, match="only its owner unlinks it"):
        other.unlink()
    other.close()
    seg.unlink()
    seg.close()


@pytest.mark.parametrize("name", ["shml_²_x", "shml_99999999999999999999_x", "shml_123", "shml_0_x", "x_1_y"])
def test_names_that_are_not_ours_are_never_swept(tmp_path, name):
    (tmp_path / name).write_bytes(b"")
    assert owner_pid(name) is None
    assert sweep_dead_segments(str(tmp_path)) == []
    assert (tmp_path / name).exists()


def test_lease_returns_the_slot_only_when_the_last_view_dies(ring):
    slot = ring.grow(4096, OWNER)
    buf = leased(ring, slot)
    view = np.ndarray((4,), np.float64, buffer=buf, offset=64)[1:]  # a view of a view
    del buf
    gc.collect()
    assert ring.collect_released() == 0 and slot.state is SlotState.LEASED
    del view
    gc.collect()
    assert ring.collect_released() == 1 and slot.state is SlotState.FREE
    assert ring.take(4096, OWNER) is slot


def test_a_fired_lease_is_forgotten_and_one_outlives_its_ring():
    from shmloader.transport import lease as lease_module

    retired: list[str] = []
    r = Ring("/dev/shm", on_retire=lambda seg: retired.append(seg.name))
    before = len(lease_module.LIVE)
    slot = r.grow(4096, OWNER)
    buf = leased(r, slot)
    assert len(lease_module.LIVE) == before + 1
    del buf
    gc.collect()
    assert len(lease_module.LIVE) == before and r.collect_released() == 1  # fired once, then forgotten
    other = r.grow(4096, OWNER)
    view = np.ndarray((8,), np.uint8, buffer=leased(r, other))
    name = other.segment.name
    r.close()
    del r, other
    gc.collect()  # the ring is gone; the lease it made still fires when the batch dies
    assert len(lease_module.LIVE) == before + 1 and view.sum() == 0 and name not in retired
    del view
    gc.collect()  # the lingering segment is retired (unpinned) by the lease's finalizer
    assert len(lease_module.LIVE) == before and name in retired and not os.path.exists(f"/dev/shm/{name}")


def test_ring_resizes_a_small_free_slot_and_retires_the_old_segment(ring):
    slot = ring.grow(4096, OWNER)
    old = slot.segment.name
    ring.free(slot, OWNER)
    assert ring.take(3 * 4096, OWNER) is slot
    assert slot.size_bytes >= 3 * 4096 and old in ring.retired_names
    assert not os.path.exists(f"/dev/shm/{old}")


def test_max_slots_raises_ring_exhausted():
    r = Ring("/dev/shm", max_slots=1)
    r.grow(4096, OWNER)
    with pytest.raises(RingExhausted, match="max_slots=1"):
        r.grow(4096, OWNER)
    r.close()


def test_close_unlinks_but_keeps_viewed_memory_mapped():
    r = Ring("/dev/shm")
    slot = r.grow(4096, OWNER)
    view = np.ndarray((8,), np.uint8, buffer=leased(r, slot))
    view[:] = 7
    r.close()
    assert not os.path.exists(f"/dev/shm/{slot.segment.name}")
    assert view.sum() == 56  # still readable


def test_reorder_in_order_skips_and_out_of_order():
    r: Reorder[str] = Reorder(in_order=True)
    r.put(1, "b")
    assert r.pop() is None and not r.has_due()
    r.skip(0)
    assert r.has_due()  # the skipped task is passed over
    assert r.pop() == "b"
    r.put(2, "c")
    with pytest.raises(ValueError, match="already has an outcome"):
        r.put(2, "again")
    assert r.has_due() and r.pop() == "c" and r.pop() is None and not r.has_due()
    free: Reorder[str] = Reorder(in_order=False)
    assert not free.has_due()
    free.put(5, "late")
    free.put(3, "early")
    assert free.has_due()
    assert [free.pop(), free.pop(), free.pop()] == ["late", "early", None]


def test_reorder_switched_to_arrival_order_hands_out_what_waits_as_it_came():
    r: Reorder[str] = Reorder(in_order=True)
    r.put(2, "third")
    r.put(1, "second")
    r.skip(3)
    assert r.pop() is None  # task 0 is due
    r.arrival_order()  # a resumed unordered epoch's fast-forward ended
    assert r.has_due() and [r.pop(), r.pop(), r.pop()] == ["third", "second", None]
    r.put(0, "first")
    assert r.pop() == "first" and not r.has_due()


# -- segments: the owner's lock and the sweep (issue 15) ----------------------------------------


def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_a_live_segment_whose_owner_looks_dead_is_not_swept(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    seg = Segment.create(str(tmp_path), 4096)
    try:
        monkeypatch.setattr(sweep, "_alive", lambda pid: False)  # as seen from another pid namespace
        assert sweep.dead_segments(str(tmp_path)) == []
        assert sweep.sweep_dead_segments(str(tmp_path)) == []
        assert os.path.exists(seg.path)
        [item] = sweep.leftovers(str(tmp_path))
        assert item.name == seg.name and item.owner_alive  # its lock says so, whatever its pid says
    finally:
        seg.unlink()
        seg.close()


SWEEPER_SCRIPT = textwrap.dedent("""
    import json, sys
    from shmloader.transport import sweep
    sweep._alive = lambda pid: False  # a sweeper in another pid namespace: every pid of ours looks dead
    print(json.dumps(sweep.sweep_dead_segments(sys.argv[1])))
""")


@pytest.mark.timeout(60)
def test_a_sweeper_in_another_process_that_thinks_the_owner_dead_leaves_it(tmp_path: Path) -> None:
    seg = Segment.create(str(tmp_path), 4096)
    try:
        out = subprocess.run([sys.executable, "-c", SWEEPER_SCRIPT, str(tmp_path)], capture_output=True, text=True,
                             timeout=50, check=True)
        assert json.loads(out.stdout) == [] and os.path.exists(seg.path)
        seg.buf[:5] = b"alive"  # still ours, still mapped
    finally:
        seg.unlink()
        seg.close()
    assert not os.path.exists(seg.path)


OWNER_SCRIPT = textwrap.dedent("""
    import os, signal, sys
    from shmloader.transport.segment import Segment
    seg = Segment.create(sys.argv[1], 4096)
    print(seg.name, flush=True)
    if sys.argv[2] == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    os._exit(0)  # exits without unlinking: no finalizer, no atexit
""")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("how", ["exit", "kill"])
def test_a_dead_owners_segment_is_swept(tmp_path: Path, how: str) -> None:
    owner = subprocess.run([sys.executable, "-c", OWNER_SCRIPT, str(tmp_path), how], capture_output=True, text=True,
                           timeout=50, check=False)
    assert owner.returncode == (-9 if how == "kill" else 0), owner.stderr[-2000:]
    name = owner.stdout.strip()
    assert segment.owner_pid(name) not in (None, os.getpid()) and (tmp_path / name).exists()
    assert sweep.dead_segments(str(tmp_path)) == [name]
    assert sweep.sweep_dead_segments(str(tmp_path)) == [name]
    assert os.listdir(tmp_path) == []


def test_an_unlocked_segment_of_a_live_pid_is_kept(tmp_path: Path) -> None:
    """The pid check stays as a second condition: a pid alive here is never swept, lock or not."""
    (tmp_path / f"shml_{os.getpid()}_handmade").write_bytes(b"\0" * 4096)
    assert sweep.sweep_dead_segments(str(tmp_path)) == []
    (tmp_path / f"shml_{dead_pid()}_handmade").write_bytes(b"\0" * 4096)
    assert sweep.sweep_dead_segments(str(tmp_path)) != []
    assert os.listdir(tmp_path) == [f"shml_{os.getpid()}_handmade"]


def test_a_sweep_never_follows_or_blocks_on_a_strangers_file(tmp_path: Path) -> None:
    pid = dead_pid()
    os.mkfifo(tmp_path / f"shml_{pid}_fifo")  # opening a FIFO for reading would block
    target = tmp_path / "target"
    target.write_bytes(b"keep")
    os.symlink(target, tmp_path / f"shml_{pid}_link")
    assert sweep.sweep_dead_segments(str(tmp_path)) == []
    assert target.read_bytes() == b"keep" and len(os.listdir(tmp_path)) == 3


@pytest.mark.parametrize("sweeper", ["removed_it", "holds_its_lock"])
def test_a_sweeper_that_wins_the_race_for_a_fresh_file_makes_create_retry(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, sweeper: str
) -> None:
    """A sweeper may lock or remove a file in the instant between its creation and the owner's lock."""
    flock = fcntl.flock
    raced: list[str] = []
    held: list[int] = []

    def swept_first(fd_: int, operation: int) -> None:
        if not raced:
            [name] = os.listdir(tmp_path)
            raced.append(name)
            if sweeper == "removed_it":
                os.unlink(tmp_path / name)  # the other sweeper's unlink, before our lock
            else:
                held.append(os.open(tmp_path / name, os.O_RDONLY))
                flock(held[0], fcntl.LOCK_EX)  # the other sweeper, about to unlink it
        flock(fd_, operation)

    monkeypatch.setattr(fcntl, "flock", swept_first)
    try:
        seg = Segment.create(str(tmp_path), 4096)
    finally:
        monkeypatch.undo()
        for fd_ in held:
            os.close(fd_)
    try:
        assert raced and seg.name != raced[0] and os.listdir(tmp_path) == [seg.name]
        assert sweep.dead_segments(str(tmp_path)) == []
    finally:
        seg.unlink()
        seg.close()


def test_the_owner_holds_the_lock_until_unlink(tmp_path: Path) -> None:
    seg = Segment.create(str(tmp_path), 4096)
    probe = os.open(seg.path, os.O_RDONLY)
    try:
        with pytest.raises(BlockingIOError):
            fcntl.flock(probe, fcntl.LOCK_EX | fcntl.LOCK_NB)
        worker = Segment.attach(str(tmp_path), seg.name, seg.size_bytes)  # attaching takes no lock
        with pytest.raises(BlockingIOError):
            fcntl.flock(probe, fcntl.LOCK_EX | fcntl.LOCK_NB)
        worker.close()
        seg.unlink()
        seg.close()
        fcntl.flock(probe, fcntl.LOCK_EX | fcntl.LOCK_NB)  # released with the owner's descriptor
    finally:
        os.close(probe)


def test_a_directory_without_flock_gets_unlocked_segments_and_one_warning(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def no_flock(fd_: int, operation: int) -> None:
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(fcntl, "flock", no_flock)
    monkeypatch.setattr(segment, "_warned_unlocked", set())
    with caplog.at_level("WARNING", logger="shmloader"):
        made = [Segment.create(str(tmp_path), 4096) for _ in range(2)]
    for seg in made:
        seg.unlink()
        seg.close()
    assert [r.getMessage() for r in caplog.records if "cannot lock" in r.getMessage()] == [
        f"cannot lock segment files in {tmp_path} (No locks available): segments there are made unlocked, so a "
        "loader in another pid namespace sharing that directory could sweep them; give each its own "
        "SHMLOADER_SHM_DIR, or set SHMLOADER_SWEEP=0 for those loaders"
    ]


# -- segments: a failed create leaves nothing ------------------------------------------------


@pytest.mark.parametrize("where", ["mmap", "register", "interrupt"])
def test_a_failed_create_leaves_no_file_and_no_descriptor(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, where: str
) -> None:
    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise KeyboardInterrupt if where == "interrupt" else OSError(errno.EMFILE, "Too many open files")

    if where == "register":
        monkeypatch.setattr(segment, "_tracked", lambda shm_dir: True)
        monkeypatch.setattr(segment, "_register", refuse)
    else:
        monkeypatch.setattr(segment.mmap, "mmap", refuse)
    fds = open_fds()
    with pytest.raises(KeyboardInterrupt if where == "interrupt" else OSError):
        Segment.create(str(tmp_path), 4096)
    assert os.listdir(tmp_path) == [] and open_fds() == fds


# -- segments: unpredictable names, a taken name retried -------------------------------------


def test_names_carry_the_pid_and_an_unpredictable_part() -> None:
    names = {segment.new_name() for _ in range(100)}
    assert len(names) == 100
    for name in names:
        pid, _, rest = name[len("shml_"):].partition("_")
        assert int(pid) == os.getpid() and len(rest) >= 16 and int(rest, 16) >= 0


def test_a_taken_name_is_retried(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    taken = tmp_path / f"shml_{os.getpid()}_{'a' * 16}"
    taken.write_bytes(b"someone else's")
    parts = iter(["a" * 16, "b" * 16])
    monkeypatch.setattr(segment, "_random_part", lambda: next(parts))
    seg = Segment.create(str(tmp_path), 4096)
    try:
        assert seg.name == f"shml_{os.getpid()}_{'b' * 16}"
        assert taken.read_bytes() == b"someone else's"  # untouched
    finally:
        seg.unlink()
        seg.close()


def test_a_name_that_stays_taken_is_a_clear_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    taken = tmp_path / f"shml_{os.getpid()}_{'a' * 16}"
    taken.write_bytes(b"")
    monkeypatch.setattr(segment, "_random_part", lambda: "a" * 16)
    fds = open_fds()
    with pytest.raises(SegmentCollision) as info:
        Segment.create(str(tmp_path), 4096)
    exc = info.value
    assert isinstance(exc, LoaderError) and isinstance(exc, RuntimeError)
    assert (exc.directory, exc.name, exc.attempts) == (str(tmp_path), taken.name, segment.CREATE_ATTEMPTS)
    assert str(exc).startswith(f"could not create a shared-memory segment in {tmp_path}: ")
    assert taken.name in str(exc) and f"{segment.CREATE_ATTEMPTS} attempts" in str(exc)
    assert os.listdir(tmp_path) == [taken.name] and open_fds() == fds
