"""Slot growth: a batch bigger than its slot (issue 16, time to the first batch).

What must hold: the built-in collate's size is read off the samples (``collate.sizing``), never
less than collate allocates, so a batch that did not fit is collated once, straight into its
grown slot, not on the heap first; a size that falls short still ends in the right batch (the
heap path); a batch is never fetched twice, nor an iterable dataset advanced twice.
"""

from __future__ import annotations

import collections
import mmap
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from engine_datasets import Big, BigStream

import shmloader
from shmloader.collate import collate, register_collate_rule, unregister_collate_rule
from shmloader.collate.sizing import needed_bytes
from shmloader.engine.wait import WaitAndRecover
from shmloader.transport.alloc import SlotAllocator

PAGE = mmap.PAGESIZE
FIRST = 1 << 20  # mp_iterator.FIRST_SLOT_BYTES
FLOATS = 1 << 17  # 512 KiB a sample: a batch of 4 needs 2 MiB, twice the first slot
Pair = collections.namedtuple("Pair", "a b")


# -- the size of a batch, read off its samples -------------------------------------------------
def _allocated(batch: list, to_torch: bool) -> int:
    alloc = SlotAllocator(mmap.mmap(-1, 1 << 20), 1 << 20)
    collate(batch, alloc, to_torch=to_torch)
    return alloc.pos


def _batches() -> dict[str, list]:
    import torch

    return {
        "arrays": [np.ones((3, 5), np.float32) for _ in range(4)],
        "mapping": [{"x": np.ones(7, np.int16), "y": i, "f": 1.5, "s": "a", "b": True, "n": np.float32(2)}
                    for i in range(5)],
        "tuple": [(np.ones(3), i) for i in range(3)],
        "namedtuple": [Pair(np.ones(2, np.uint8), 1.0) for _ in range(3)],
        "tensors": [torch.ones(4, 4, dtype=torch.bfloat16) for _ in range(3)],
        "nested": [[{"a": np.zeros((2, 2))}, "x"] for _ in range(2)],
    }


@pytest.mark.parametrize("to_torch", [False, True])
@pytest.mark.parametrize("kind", list(_batches()))
def test_the_size_read_off_the_samples_covers_what_collate_allocates(kind: str, to_torch: bool) -> None:
    batch = _batches()[kind]
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
    import shmloader.torch
    import shmloader.worker.main

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
