"""Slot growth: a batch bigger than its slot (issue 16, time to the first batch).

What must hold: the built-in collate's size is read off the samples (``collate.sizing``), never
less than collate allocates, so a batch that did not fit is collated once, straight into its
grown slot, not on the heap first; a size that falls short still ends in the right batch (the
heap path); a batch is never fetched twice, nor an iterable dataset advanced twice; a growing
slot's segment is reserved a part at a time, the earliest task first, and no worker hears of it
before every byte is reserved; the main process stops reserving as soon as a reply waits; a full
shm directory while a slot grows is a ShmSpaceError, and the loader is shut.
"""

from __future__ import annotations

import collections
import errno
import mmap
import multiprocessing
import os
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
from engine_datasets import Big, BigStream
from iter_helpers import mp_iter
from shm_full import full_past_the_first_part

import shmloader
from shmloader.collate import collate, register_collate_rule, unregister_collate_rule
from shmloader.collate.sizing import needed_bytes
from shmloader.engine import growth
from shmloader.engine.growth import Growths
from shmloader.engine.ledger import Ledger
from shmloader.engine.stepguard import StepGuard
from shmloader.engine.wait import WaitAndRecover
from shmloader.errors import ShmSpaceError
from shmloader.transport import segment, shm_space
from shmloader.transport.alloc import SlotAllocator
from shmloader.transport.preflight import check_ring_fits
from shmloader.transport.ring import Ring

PAGE = mmap.PAGESIZE
FIRST = 1 << 20  # mp_iterator.FIRST_SLOT_BYTES
FLOATS = 1 << 17  # 512 KiB a sample: a batch of 4 needs 2 MiB, twice the first slot
Pair = collections.namedtuple("Pair", "a b")


# -- the size of a batch, read off its samples -------------------------------------------------
def _allocated(batch: list, to_torch: bool) -> int:
    alloc = SlotAllocator(mmap.mmap(-1, 1 << 20), 1 << 20)
    collate(batch, alloc, to_torch=to_torch)
    return alloc.pos


KINDS = ["arrays", "mapping", "tuple", "namedtuple", "tensors", "nested"]


def _batches(kind: str, to_torch: bool) -> list:
    """The samples of one batch of ``kind``; a torch-needing case skips without torch."""
    if kind == "tensors" or to_torch:
        torch = pytest.importorskip("torch")
        if kind == "tensors":
            return [torch.ones(4, 4, dtype=torch.bfloat16) for _ in range(3)]
    batches: dict[str, list] = {
        "arrays": [np.ones((3, 5), np.float32) for _ in range(4)],
        "mapping": [{"x": np.ones(7, np.int16), "y": i, "f": 1.5, "s": "a", "b": True, "n": np.float32(2)}
                    for i in range(5)],
        "tuple": [(np.ones(3), i) for i in range(3)],
        "namedtuple": [Pair(np.ones(2, np.uint8), 1.0) for _ in range(3)],
        "nested": [[{"a": np.zeros((2, 2))}, "x"] for _ in range(2)],
    }
    return batches[kind]


@pytest.mark.parametrize("to_torch", [False, True])
@pytest.mark.parametrize("kind", KINDS)
def test_the_size_read_off_the_samples_covers_what_collate_allocates(kind: str, to_torch: bool) -> None:
    batch = _batches(kind, to_torch)
    needed = needed_bytes(batch, to_torch=to_torch)
    assert needed is not None and needed >= _allocated(batch, to_torch)


def test_the_size_is_unknown_where_the_rules_are_not_the_builtin_ones() -> None:
    arrays = [np.ones(3), np.ones(3)]
    assert needed_bytes(arrays, rules={np.ndarray: lambda batch, ctx: batch}) is None
    assert needed_bytes([np.ones(3, np.float32), np.ones(3)]) is None  # mixed dtypes: collate promotes
    assert needed_bytes([object(), object()]) is None  # collate raises
    assert needed_bytes([{"a": 1}, {"b": 2}]) is None  # a key missing: collate raises
    register_collate_rule(complex, lambda batch, ctx: list(batch))
    try:
        assert needed_bytes([1j, 2j]) is None
    finally:
        unregister_collate_rule(complex)


# -- a growing slot, in the ring ---------------------------------------------------------------
def test_a_growing_segment_replaces_the_slot_only_once_every_byte_is_reserved(tmp_path: Path) -> None:
    created: list[str] = []
    ring = Ring(str(tmp_path), on_create=lambda s: created.append(s.name))
    slot = ring.grow(PAGE, "t")
    old = slot.segment
    ring.begin_resize(slot, 3 * PAGE, "t")
    grown = slot.growing
    assert grown is not None and os.path.exists(grown.path) and slot.segment is old
    assert [ring.reserve(slot, "t", PAGE) for _ in range(3)] == [False, False, True]
    assert slot.segment is grown and slot.growing is None and slot.size_bytes == 3 * PAGE
    assert created == [old.name, grown.name]  # the pin backend sees it once it is whole, not before
    assert ring.retired_names == [old.name]
    ring.close()


def test_a_full_directory_while_a_slot_grows_drops_the_growth(tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    ring = Ring(str(tmp_path))
    slot = ring.grow(PAGE, "t")
    ring.begin_resize(slot, 4 * PAGE, "t")
    assert ring.reserve(slot, "t", PAGE) is False

    def full(fd: int, offset: int, length: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", full)
    with pytest.raises(ShmSpaceError, match="No space left on device"):
        ring.reserve(slot, "t", PAGE)
    assert slot.growing is None and slot.size_bytes == PAGE
    assert os.listdir(tmp_path) == [slot.segment.name]
    ring.close()


def test_free_and_close_unlink_growing_segments(tmp_path: Path) -> None:
    ring = Ring(str(tmp_path))
    a, b = ring.grow(PAGE, "a"), ring.grow(PAGE, "b")
    ring.begin_resize(a, 2 * PAGE, "a")
    ring.begin_resize(b, 2 * PAGE, "b")
    ring.free(a, "a")  # the task ended while its slot grew
    assert a.growing is None and len(os.listdir(tmp_path)) == 3
    ring.close()
    assert os.listdir(tmp_path) == [] and ring.retired_names == [a.segment.name, b.segment.name]


def test_preflight_counts_the_bytes_a_growing_slot_still_needs(tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    ring = Ring(str(tmp_path))
    slot = ring.grow(PAGE, "t")
    ring.begin_resize(slot, 8 * PAGE, "t")
    ring.reserve(slot, "t", 2 * PAGE)
    # 2 slots of 8 pages: the growing one counts as that large, one more is new, and the growing
    # one's 6 pages not reserved yet are needed too: 14 pages
    monkeypatch.setattr(shm_space, "shm_free_bytes", lambda d: 14 * PAGE)
    check_ring_fits(ring, 8 * PAGE, 2, num_workers=1, prefetch_factor=1)
    monkeypatch.setattr(shm_space, "shm_free_bytes", lambda d: 14 * PAGE - 1)
    with pytest.raises(ShmSpaceError, match=f"needs {14 * PAGE} more bytes"):
        check_ring_fits(ring, 8 * PAGE, 2, num_workers=1, prefetch_factor=1)
    ring.close()


def test_prefault_maps_a_range_or_does_nothing_but_never_raises(tmp_path: Path) -> None:
    seg = segment.Segment.create(str(tmp_path), 4 * PAGE)
    for nbytes in (0, 3 * PAGE, 100 * PAGE):  # past the mapping: up to its end
        segment.prefault(seg.buf, nbytes)
    seg.buf[:3] = b"abc"
    assert bytes(seg.buf[:4]) == b"abc\0"  # an ordinary mapping still, its bytes untouched
    seg.unlink()
    seg.close()
    segment.prefault(seg.buf, PAGE)  # closed: nothing


# -- growing while waiting: the engine's step -----------------------------------------------------
class _Engine(WaitAndRecover):
    """``_grow`` over a real ring, with one pretend worker whose reply pipe the test controls."""

    def __init__(self, ring: Ring) -> None:
        self._ring = ring
        self._ledger = Ledger(ring)
        self._growths = Growths(self._ledger)
        self.replies_r, self.replies_w = multiprocessing.Pipe(duplex=False)
        self._quiet_r, self._quiet_w = os.pipe()
        worker = SimpleNamespace(id=0, results=self.replies_r, exit_fd=self._quiet_r, retired=False)
        self._pool = SimpleNamespace(workers=[worker], generation=0)
        self._guard = StepGuard()
        self.sent: list[tuple[int, int]] = []

    def _send(self, w: Any, rec: Any) -> None:
        self.sent.append((rec.task, rec.slot.size_bytes))

    def _flush_detach(self) -> None:
        pass

    def _fail(self, exc: BaseException) -> BaseException:
        return exc

    def close(self) -> None:
        self.replies_r.close()
        self.replies_w.close()
        os.close(self._quiet_r)
        os.close(self._quiet_w)
        self._guard.close_pipe()
        self._ring.close()


@pytest.fixture
def engine(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    monkeypatch.setattr(growth, "CHUNK_BYTES", PAGE)
    eng = _Engine(Ring(str(tmp_path)))
    yield eng
    eng.close()


def test_grow_reserves_the_earliest_task_first_and_sends_each_task_once_grown(engine: _Engine) -> None:
    late = engine._ledger.assign(0, 5, [5], PAGE)
    early = engine._ledger.assign(0, 2, [2], PAGE)
    engine._growths.start(late, 3 * PAGE)
    engine._growths.start(early, 2 * PAGE)
    engine._grow()  # no reply waits: it reserves everything
    assert engine.sent == [(2, 2 * PAGE), (5, 3 * PAGE)] and not engine._growths.waiting


def test_grow_returns_after_one_part_when_a_reply_waits(engine: _Engine) -> None:
    rec = engine._ledger.assign(0, 0, [0], PAGE)
    engine._growths.start(rec, 4 * PAGE)
    engine.replies_w.send("a batch became due")
    engine._grow()
    assert rec.slot is not None and rec.slot.growing is not None and rec.slot.growing.reserved == PAGE
    assert engine.sent == [] and len(engine._growths.waiting) == 1  # the reply first; the slot grows on later
    engine.replies_r.recv()
    engine._grow()
    assert engine.sent == [(0, 4 * PAGE)]


# -- end to end -----------------------------------------------------------------------------------
def _no_heap(shape: Any, dtype: Any) -> np.ndarray:
    raise AssertionError("a batch was collated on the heap")


def _count_regrows(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    tasks: list[int] = []
    regrow = WaitAndRecover._regrow

    def counting(self: Any, w: Any, rec: Any, needed: int) -> None:
        tasks.append(rec.task)
        regrow(self, w, rec, needed)

    monkeypatch.setattr(WaitAndRecover, "_regrow", counting)
    return tasks


def _fetches(log: Path) -> list[int]:
    return sorted(int(line) for line in log.read_text().split())


@pytest.mark.timeout(60)
@pytest.mark.parametrize("to_torch", [False, True])
def test_a_batch_bigger_than_its_slot_is_collated_once_into_the_grown_slot(
        to_torch: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import shmloader.worker.main

    if to_torch:
        pytest.importorskip("torch")
        import shmloader.torch

    monkeypatch.setattr(shmloader.worker.main, "heap_alloc", _no_heap)  # forked workers inherit it
    regrows = _count_regrows(monkeypatch)
    log = tmp_path / "fetches"
    loader_class = shmloader.torch.DataLoader if to_torch else shmloader.DataLoader
    got = list(loader_class(Big(16, FLOATS, str(log)), batch_size=4, num_workers=2,
                            multiprocessing_context="fork"))
    assert [np.asarray(b["y"]).tolist() for b in got] == [[4 * k + j for j in range(4)] for k in range(4)]
    for k, b in enumerate(got):
        assert np.asarray(b["x"]).shape == (4, FLOATS) and float(b["x"][3][-1]) == 4 * k + 3
    assert _fetches(log) == list(range(16))  # each sample fetched once
    assert sorted(set(regrows)) == sorted(regrows) and regrows  # each task grew at most once


@pytest.mark.timeout(60)
def test_each_retry_into_a_grown_slot_prefaults_the_bytes_its_batch_needs(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import shmloader.worker.main

    log, real = tmp_path / "prefaulted", shmloader.worker.main.prefault

    def logged(buf: Any, nbytes: int) -> None:
        with open(log, "a") as f:
            f.write(f"{nbytes} {len(buf)}\n")
        real(buf, nbytes)

    monkeypatch.setattr(shmloader.worker.main, "prefault", logged)  # forked workers inherit it
    regrows = _count_regrows(monkeypatch)
    got = list(shmloader.DataLoader(Big(16, FLOATS), batch_size=4, num_workers=2, multiprocessing_context="fork"))
    assert [b["y"].tolist()[0] for b in got] == [0, 4, 8, 12]
    calls = [tuple(map(int, line.split())) for line in log.read_text().splitlines()]
    assert len(calls) == len(regrows) > 0  # once per retry; never on the ordinary path
    assert all(4 * FLOATS * 4 <= nbytes <= size for nbytes, size in calls)


@pytest.mark.timeout(60)
def test_a_size_that_falls_short_still_ends_in_the_right_batch_fetched_once(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import shmloader.worker.main

    monkeypatch.setattr(shmloader.worker.main, "needed_bytes", lambda data, **kw: FIRST + PAGE)
    regrows = _count_regrows(monkeypatch)
    log = tmp_path / "fetches"
    got = list(shmloader.DataLoader(Big(8, FLOATS, str(log)), batch_size=4, num_workers=1,
                                    multiprocessing_context="fork"))
    assert [b["y"].tolist() for b in got] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert float(got[1]["x"][2][0]) == 6
    assert regrows.count(0) == 2  # too small twice: the size read off the samples, then the heap's
    assert _fetches(log) == list(range(8))


@pytest.mark.timeout(60)
def test_an_iterable_dataset_is_not_advanced_twice_by_growth(tmp_path: Path) -> None:
    log = tmp_path / "drawn"
    got = list(shmloader.DataLoader(BigStream(16, FLOATS, str(log)), batch_size=4, num_workers=2,
                                    multiprocessing_context="fork"))
    assert sorted(y for b in got for y in b["y"].tolist()) == list(range(16))
    assert all(float(b["x"][j][0]) == b["y"][j] for b in got for j in range(4))
    assert _fetches(log) == list(range(16))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("how", ["slot_bytes", "env"])
def test_slot_bytes_skips_growth(how: str, monkeypatch: pytest.MonkeyPatch) -> None:
    regrows = _count_regrows(monkeypatch)
    kw: dict[str, Any] = {}
    if how == "env":
        monkeypatch.setenv("SHMLOADER_SLOT_BYTES", str(4 << 20))
    else:
        kw["slot_bytes"] = 4 << 20
    got = list(shmloader.DataLoader(Big(8, FLOATS), batch_size=4, num_workers=2, multiprocessing_context="fork",
                                    **kw))
    assert [b["y"].tolist() for b in got] == [[0, 1, 2, 3], [4, 5, 6, 7]] and regrows == []


@pytest.mark.timeout(60)
def test_a_full_directory_while_a_slot_grows_is_shm_space_error(monkeypatch: pytest.MonkeyPatch) -> None:
    full_past_the_first_part(monkeypatch)
    it = iter(shmloader.DataLoader(Big(8, 3 * FLOATS), batch_size=4, num_workers=1, multiprocessing_context="fork"))
    try:
        with pytest.raises(ShmSpaceError, match="No space left on device"):
            next(it)
        assert mp_iter(it).closed and multiprocessing.active_children() == []
    finally:
        it.close()


@pytest.mark.timeout(60)
def test_an_epoch_abandoned_while_slots_grow_leaves_nothing_behind(monkeypatch: pytest.MonkeyPatch) -> None:
    dl: shmloader.DataLoader[Any] = shmloader.DataLoader(Big(16, FLOATS), batch_size=4, num_workers=2,
                                                         persistent_workers=True, multiprocessing_context="fork")
    first = next(iter(dl))  # the other tasks' slots may still be growing
    assert first["y"].tolist() == [0, 1, 2, 3]
    del first
    assert [b["y"].tolist()[0] for b in dl] == [0, 4, 8, 12]
    ring = mp_iter(dl._iterator)._ring
    assert all(s.growing is None for s in ring.slots)
    ours = [n for n in os.listdir("/dev/shm") if n.startswith(f"shml_{os.getpid()}_")]
    assert len(ours) == len(ring.slots)
    dl.close()
