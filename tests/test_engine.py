"""The multi-process engine end to end: slots, leases, reorder, workers under fork and spawn."""

from __future__ import annotations

import gc
import os

import numpy as np
import pytest
from engine_datasets import FailsAt, Range, Squares, VarLen, pair_collate

import shmloader

pytestmark = pytest.mark.timeout(90)
METHODS = ["fork", "spawn"]


def loader(ds, **kw):
    kw.setdefault("multiprocessing_context", "fork")
    return shmloader.DataLoader(ds, **kw)


def _segment_path(arr: np.ndarray) -> bool:
    """True when ``arr``'s memory is a view of a loader slot (a ctypes lease buffer)."""
    base = arr
    while isinstance(base, np.ndarray) and base.base is not None:
        base = base.base
    return type(base).__module__ == "ctypes" or "c_char_Array" in type(base).__name__


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("workers", [1, 2, 3])
def test_batches_equal_single_process(method, workers):
    ds = Squares(40)
    expect = list(shmloader.DataLoader(ds, batch_size=6))
    with pytest.warns(UserWarning) if workers > (os.cpu_count() or 1) else _nullcontext():
        got = list(loader(ds, batch_size=6, num_workers=workers, multiprocessing_context=method))
    assert len(got) == len(expect) == 7
    for a, b in zip(got, expect):
        np.testing.assert_array_equal(a["x"], b["x"])
        np.testing.assert_array_equal(a["y"], b["y"])
        assert a["name"] == b["name"]
        assert a["x"].dtype == np.float32 and a["y"].dtype == np.int64


class _nullcontext:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


def test_batches_are_zero_copy_views_of_slots():
    batch = next(iter(loader(Squares(), batch_size=4, num_workers=1)))
    x = batch["x"]
    assert not x.flags.owndata
    assert _segment_path(x)
    assert x.ctypes.data % 64 == 0  # arrays inside a slot are 64-byte aligned


def test_slot_reuse_keeps_segments_bounded_over_epochs():
    dl = loader(Squares(200), batch_size=5, num_workers=2, persistent_workers=True)
    for _ in range(5):
        for b in dl:
            assert b["x"].shape == (5, 8)
    ring = dl._iterator._ring
    # 2 workers x prefetch 2 + consumer: a handful of slots, never one per batch (200 batches seen)
    assert ring.created_total <= 8
    dl.close()


def test_list_of_all_batches_grows_ring_and_stays_correct():
    dl = loader(Squares(60), batch_size=3, num_workers=2)
    kept = list(dl)
    assert len(kept) == 20
    for k, b in enumerate(kept):  # no slot was rewritten while its batch was alive
        assert b["y"].tolist() == [3 * k, 3 * k + 1, 3 * k + 2]
        np.testing.assert_array_equal(b["x"][:, 0], np.array(b["y"]) ** 2)


def test_dropping_batches_returns_slots():
    dl = loader(Squares(30), batch_size=3, num_workers=1, persistent_workers=True)
    it = iter(dl)
    first = next(it)
    ring = dl._iterator._ring
    slot = next(s for s in ring.slots if s.state.value == "leased")
    del first
    gc.collect()
    ring.collect_released()
    assert slot.state.value != "leased"
    list(it)
    dl.close()


def test_segments_unlinked_at_close_but_views_stay_valid():
    dl = loader(Squares(12), batch_size=4, num_workers=1, persistent_workers=True)
    held = list(dl)
    names = [s.segment.name for s in dl._iterator._ring.slots]
    dl.close()
    assert names and not any(os.path.exists(f"/dev/shm/{n}") for n in names)
    assert held[2]["y"].tolist() == [8, 9, 10, 11]  # still mapped while viewed


@pytest.mark.parametrize("method", METHODS)
def test_oversize_batches_get_bigger_slots(method):
    ds = VarLen(24, grow=60_000)  # the last batches need ~2.9 MB, more than the first 1 MiB slots
    got = list(loader(ds, batch_size=4, num_workers=2, multiprocessing_context=method))
    assert len(got) == 6
    for k, b in enumerate(got):
        assert b.shape == (4, 60_000 * (k + 1))
        np.testing.assert_array_equal(b[:, 0], [4 * k, 4 * k + 1, 4 * k + 2, 4 * k + 3])


@pytest.mark.parametrize("method", METHODS)
def test_user_collate_fn_arrays_are_copied_into_the_slot(method):
    got = list(loader(Squares(8), batch_size=4, num_workers=1, collate_fn=pair_collate,
                      multiprocessing_context=method))
    x, names = got[1]
    np.testing.assert_array_equal(x[:, 0], np.array([16, 25, 36, 49]) + 1)
    assert names == ["s4", "s5", "s6", "s7"]
    assert _segment_path(x)


def test_lambdas_and_local_classes_under_spawn():
    class Local(shmloader.Dataset):
        def __len__(self):
            return 6

        def __getitem__(self, i):
            return i * 10

    dl = shmloader.DataLoader(Local(), batch_size=2, num_workers=2, multiprocessing_context="spawn",
                              collate_fn=lambda b: np.array(b) + 1, worker_init_fn=lambda wid: None)
    assert [b.tolist() for b in dl] == [[1, 11], [21, 31], [41, 51]]


@pytest.mark.parametrize("method", METHODS)
def test_persistent_workers_keep_processes_across_epochs(method):
    dl = loader(Squares(12), batch_size=4, num_workers=2, persistent_workers=True,
                multiprocessing_context=method)
    list(dl)
    pids = [w.pid for w in dl._iterator._pool.workers]
    for _ in range(3):
        assert [b["y"][0] for b in dl] == [0, 4, 8]
    assert [w.pid for w in dl._iterator._pool.workers] == pids
    dl.close()


def test_breaking_out_with_persistent_workers_reclaims_the_epoch():
    dl = loader(Squares(40), batch_size=2, num_workers=2, persistent_workers=True)
    for k, _b in enumerate(dl):
        if k == 3:
            break
    assert [int(b["y"][0]) for b in dl] == list(range(0, 40, 2))
    dl.close()


@pytest.mark.filterwarnings("ignore:This DataLoader will create 3 worker processes")  # torch warns too
def test_in_order_false_yields_every_batch_once():
    got = [int(b["y"][0]) for b in loader(Squares(40), batch_size=2, num_workers=3, in_order=False)]
    assert sorted(got) == list(range(0, 40, 2))


@pytest.mark.parametrize("method", METHODS)
def test_iterable_dataset_interleaves_like_torch(method):
    dl = loader(Range(3, 7), batch_size=None, num_workers=2, multiprocessing_context=method)
    assert [int(x) for x in dl] == [3, 5, 4, 6]


def test_iterable_dataset_per_worker_drop_last():
    keep = [b.tolist() for b in loader(Range(0, 10), batch_size=2, num_workers=2)]
    assert keep == [[0, 1], [5, 6], [2, 3], [7, 8], [4], [9]]
    drop = [b.tolist() for b in loader(Range(0, 10), batch_size=2, num_workers=2, drop_last=True)]
    assert drop == [[0, 1], [5, 6], [2, 3], [7, 8]]


@pytest.mark.parametrize("method", METHODS)
def test_worker_exception_keeps_type_and_iteration_continues(method):
    it = iter(loader(FailsAt(5), batch_size=2, num_workers=2, multiprocessing_context=method))
    assert next(it).tolist() == [0, 1]
    assert next(it).tolist() == [2, 3]
    with pytest.raises(KeyError) as info:
        next(it)
    text = str(info.value)
    assert "Caught KeyError in DataLoader worker process" in text
    assert "task 2" in text and "[4..5]" in text and "no sample 5" in text
    assert [b.tolist() for b in it] == [[6, 7], [8, 9], [10, 11]]


def test_prefetch_factor_bounds_outstanding_tasks():
    dl = loader(Squares(100), batch_size=1, num_workers=2, prefetch_factor=3, persistent_workers=True)
    it = iter(dl)
    next(it)
    eng = dl._iterator
    assert all(len(w.outstanding) <= 3 for w in eng._pool.workers)
    assert eng._ledger.in_epoch(eng._epoch) + len(eng._reorder) <= 6
    list(it)
    dl.close()


def test_tensors_in_tensors_out_zero_copy():
    torch = pytest.importorskip("torch")
    ds = shmloader.ArrayDataset(torch.arange(24, dtype=torch.float32).reshape(12, 2), torch.arange(12))
    got = list(loader(ds, batch_size=4, num_workers=2))
    assert isinstance(got[0][0], torch.Tensor) and got[0][0].dtype == torch.float32
    assert got[2][1].tolist() == [8, 9, 10, 11]
    assert got[1][0].data_ptr() % 64 == 0


@pytest.mark.parametrize("method", METHODS)
def test_worker_seeds_and_draws_match_torch(method):
    torch = pytest.importorskip("torch")
    from engine_datasets import WorkerSeeds

    def per_worker(loader_cls):
        g = torch.Generator().manual_seed(1234)
        dl = loader_cls(WorkerSeeds(), batch_size=None, num_workers=2, generator=g,
                        multiprocessing_context=method)
        seen: dict[int, list] = {}
        for wid, seed, nw, r, npr, _pid in dl:
            seen.setdefault(int(wid), []).append((int(seed), int(nw), float(r), float(npr)))
        return seen  # per worker, in the order it ran its tasks

    ours = per_worker(shmloader.DataLoader)
    theirs = per_worker(torch.utils.data.DataLoader)
    assert sorted(ours) == sorted(theirs) == [0, 1]
    for wid in (0, 1):  # round-robin dispatch, as torch: each worker runs the same tasks, same draws
        assert ours[wid] == theirs[wid]
    assert ours[0][0][0] + 1 == ours[1][0][0]  # seed = base_seed + worker_id


def test_get_worker_info_is_none_in_main_process():
    assert shmloader.get_worker_info() is None


def test_explicit_slot_bytes_sizes_the_first_slots():
    dl = loader(Squares(8), batch_size=4, num_workers=1, slot_bytes=8192, persistent_workers=True)
    assert [b["y"].tolist() for b in dl] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert all(s.size_bytes == 8192 for s in dl._iterator._ring.slots)
    dl.close()


def test_ring_shrinks_back_after_held_batches_are_dropped():
    dl = loader(Squares(60), batch_size=3, num_workers=2, persistent_workers=True)
    kept = list(dl)
    ring = dl._iterator._ring
    grown = len(ring.slots)
    assert grown >= 20  # every batch was held, so every one got its own slot
    names = {s.segment.name for s in ring.slots}
    del kept
    gc.collect()
    assert [int(b["y"][0]) for b in dl] == list(range(0, 60, 3))  # next epoch, batches dropped as we go
    assert len(ring.slots) <= 2 * 2 + 2
    assert sum(os.path.exists(f"/dev/shm/{n}") for n in names) <= 2 * 2 + 2
    dl.close()


@pytest.mark.parametrize("method", ["fork", "spawn", "forkserver"])
def test_one_behaviour_under_every_start_method(method):
    """Oversize regrowth, a worker exception and iterable interleaving, under each start method."""
    got = list(loader(VarLen(8, grow=150_000), batch_size=4, num_workers=2, multiprocessing_context=method))
    assert [b.shape for b in got] == [(4, 150_000), (4, 300_000)]
    it = iter(loader(FailsAt(2, n=6), batch_size=2, num_workers=1, multiprocessing_context=method))
    assert next(it).tolist() == [0, 1]
    with pytest.raises(KeyError, match="no sample 2"):
        next(it)
    assert [b.tolist() for b in it] == [[4, 5]]
    assert [int(x) for x in loader(Range(3, 7), batch_size=None, num_workers=2,
                                   multiprocessing_context=method)] == [3, 5, 4, 6]
