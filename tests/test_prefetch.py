"""The device prefetcher on a CPU: the fake backend's events stand in for CUDA events.

What must hold: batch k+1's copy is started before batch k is handed out, and the caller's
stream waits on batch k's event; the source batch (and with it its slot lease) lives until its
copy's event has completed and is let go after; past ``max_held`` unfinished copies the host
waits for the oldest; an epoch's end or an early stop waits for every copy; nested structures
arrive whole; the prefetcher's ``state_dict()`` is the loader's as of the batch the caller last
received (not the one read ahead), so a resume loses and repeats nothing; a non-CUDA device is
copied with a plain ``.to()`` whatever the loader's backend (only the fake one drives any device).
"""

from __future__ import annotations

import gc
import json
import weakref
from collections import namedtuple
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

from iter_helpers import mp_iter
import numpy as np
import pytest

import shmloader
from shmloader.gpu import pinning
from shmloader.gpu.backends import segment_address
from shmloader.gpu.fake import FakeBackend
from shmloader.gpu.prefetch import DevicePrefetcher, transfer_for
from shmloader.transport.ring import SlotState

ROWS, COLS = 64, 8
Pair = namedtuple("Pair", "left right")




def pinned_loader(**kwargs: Any) -> shmloader.DataLoader:
    data = np.arange(ROWS * COLS, dtype=np.float32).reshape(ROWS, COLS)
    return shmloader.DataLoader(shmloader.ArrayDataset(data), batch_size=8, num_workers=1, pin_memory=True,
                                persistent_workers=True, **kwargs)


def expected(k: int) -> np.ndarray:
    return np.arange(k * 8 * COLS, (k + 1) * 8 * COLS, dtype=np.float32).reshape(8, COLS)


def alive(refs: list[weakref.ref]) -> bool:
    gc.collect()
    return any(r() is not None for r in refs)


def slot_of(ring: Any, array: np.ndarray) -> Any:
    """The ring's slot whose segment holds ``array``."""
    address = array.__array_interface__["data"][0]
    return next(s for s in ring.slots
                if 0 <= address - segment_address(s.segment) < s.segment.size_bytes)


def leased(loader: Any) -> int:
    ring = loader._iterator._ring
    ring.collect_released()
    return ring.count(SlotState.LEASED)


@pytest.mark.timeout(60)
def test_source_lease_is_held_until_its_event_completes(fake: FakeBackend) -> None:
    loader = pinned_loader()
    it = iter(shmloader.to_device(loader, "cpu", max_held=8))
    (first,) = next(it)
    assert [c.kind for c in fake.calls if c.kind in ("copy", "wait")] == ["copy", "copy", "wait"]
    source0 = fake.sources[0]
    assert source0 and alive(source0)  # batch 0's slot views: held while its copy may read them
    for _ in range(3):
        next(it)  # further batches; event 0 still not complete
        assert alive(source0)
    held_before = leased(loader)
    fake.events[0].complete()
    next(it)
    assert not alive(source0)  # let go at the first step after its event completed
    assert leased(loader) == held_before  # one released, the new batch's source took one
    assert not fake.events[0].synchronized  # released by query(), no host wait
    np.testing.assert_array_equal(np.asarray(first), expected(0))
    del it
    gc.collect()
    loader.close()


@pytest.mark.timeout(60)
def test_slot_state_follows_the_event(fake: FakeBackend) -> None:
    loader = pinned_loader()
    it = iter(shmloader.to_device(loader, "cpu", max_held=8))
    next(it)
    ring = mp_iter(loader._iterator)._ring
    source = fake.sources[0][0]()  # batch 0's array
    assert source is not None
    slot0 = slot_of(ring, source)  # the slot batch 0's copy reads
    del source  # the copy's lease alone holds the slot now
    gc.collect()
    ring.collect_released()
    assert slot0.state is SlotState.LEASED  # its copy has not finished: the lease is held
    fake.events[0].complete()
    next(it)
    gc.collect()
    ring.collect_released()
    assert slot0.state is not SlotState.LEASED  # free (or already reassigned to a later task)
    del it
    gc.collect()
    loader.close()


@pytest.mark.timeout(60)
def test_past_max_held_the_host_waits_for_the_oldest_copy(fake: FakeBackend) -> None:
    loader = pinned_loader()
    prefetcher = shmloader.to_device(loader, "cpu", max_held=1)
    it = iter(prefetcher)
    next(it)
    next(it)  # two unfinished copies handed out: the older one is waited for and let go
    assert fake.events[0].synchronized and not fake.events[1].synchronized
    assert len(prefetcher.held) == 1
    assert not alive(fake.sources[0]) and alive(fake.sources[1])
    del it
    gc.collect()
    loader.close()


@pytest.mark.timeout(60)
def test_finished_copies_give_their_slots_back_before_the_next_read(fake: FakeBackend) -> None:
    """At the fewest slots a loader accepts (workers x prefetch_factor + 1), ``to_device`` runs to
    the end when the device keeps up: a slot whose copy has finished goes back before the loader is
    asked for the next batch, which may need that slot (it raised RingExhausted)."""
    loader = pinned_loader(prefetch_factor=2, max_slots=3)
    moved = []
    for (x,) in shmloader.to_device(loader, "cpu", max_held=2):
        moved.append(x)
        for event in fake.events:  # the device finished every copy while the model worked
            event.complete()
    assert len(moved) == ROWS // 8
    for k, x in enumerate(moved):
        np.testing.assert_array_equal(np.asarray(x), expected(k))
    loader.close()


@pytest.mark.timeout(60)
def test_stopping_early_waits_for_every_copy_then_lets_go(fake: FakeBackend) -> None:
    loader = pinned_loader()
    prefetcher = shmloader.to_device(loader, "cpu", max_held=8)
    got = []
    for k, (x,) in enumerate(prefetcher):
        got.append(x)
        if k == 2:
            break
    gc.collect()  # closes the abandoned generator: its finally waits for the copies
    assert len(fake.events) == 4  # batches 0..2 handed out, batch 3 already in flight
    assert all(e.synchronized for e in fake.events)
    assert not prefetcher.held
    assert not any(alive(s) for s in fake.sources)
    for k, x in enumerate(got):
        np.testing.assert_array_equal(np.asarray(x), expected(k))
    loader.close()


@pytest.mark.timeout(60)
def test_every_epoch_arrives_whole_and_equal(fake: FakeBackend) -> None:
    fake.auto_complete = True
    loader = pinned_loader()
    prefetcher = shmloader.to_device(loader, "cpu")
    assert len(prefetcher) == ROWS // 8
    for _epoch in range(2):
        moved = [x for (x,) in prefetcher]
        assert len(moved) == ROWS // 8
        for k, x in enumerate(moved):
            np.testing.assert_array_equal(np.asarray(x), expected(k))
    assert fake.count("stream") == 2  # one side stream per epoch
    assert not any(alive(s) for s in fake.sources)
    del moved, x
    loader.close()


def test_nested_structures_move_whole() -> None:
    backend = FakeBackend(auto_complete=True)
    a, b = np.ones((2, 3), np.float32), np.arange(4)
    batch = {"x": [a, (b, "label")], "pair": Pair(a, 7), "name": "s"}
    (moved,) = list(shmloader.to_device([batch], "cpu", transfer=backend))
    assert set(moved) == {"x", "pair", "name"} and moved["name"] == "s"
    assert isinstance(moved["x"], list) and isinstance(moved["x"][1], tuple)
    assert isinstance(moved["pair"], Pair) and moved["pair"].right == 7
    for out, src in ((moved["x"][0], a), (moved["x"][1][0], b), (moved["pair"].left, a)):
        assert not isinstance(out, np.ndarray) or not np.shares_memory(out, src)
        np.testing.assert_array_equal(np.asarray(out), src)
    assert moved["x"][1][1] == "label"


def test_numpy_arrays_become_tensors_on_the_device() -> None:
    torch = pytest.importorskip("torch")
    a = np.arange(6, dtype=np.float32).reshape(2, 3)
    ((x, label),) = list(shmloader.to_device([(a, "l")], "cpu"))  # no pin backend: a plain .to()
    assert isinstance(x, torch.Tensor) and x.device.type == "cpu" and label == "l"
    assert torch.equal(x, torch.from_numpy(a))
    ((flipped,),) = list(shmloader.to_device([(a[:, ::-1],)], "cpu"))  # torch has no negative strides
    assert torch.equal(flipped, torch.from_numpy(a[:, ::-1].copy()))


def shuffled_loader(num_workers: int, pin_memory: bool) -> shmloader.DataLoader:
    data = np.arange(ROWS * COLS, dtype=np.float32).reshape(ROWS, COLS)
    kwargs: dict[str, Any] = {"persistent_workers": True} if num_workers else {}
    return shmloader.DataLoader(shmloader.ArrayDataset(data), batch_size=4, shuffle=True, generator=11,
                                num_workers=num_workers, pin_memory=pin_memory, **kwargs)


def first_column(batch: Any) -> list[float]:
    (x,) = batch
    return np.asarray(x)[:, 0].tolist()


@pytest.mark.timeout(90)
@pytest.mark.parametrize(("num_workers", "pin_memory", "saved_after"), [(1, True, 3), (2, False, 5), (0, False, 1)])
def test_state_dict_resumes_after_the_last_batch_received(
        fake: FakeBackend, num_workers: int, pin_memory: bool, saved_after: int) -> None:
    pytest.importorskip("torch")  # a plain "cpu" copy makes tensors
    fake.auto_complete = True
    uninterrupted = [first_column(b) for b in shuffled_loader(0, False)]
    loader = shuffled_loader(num_workers, pin_memory)
    moved = shmloader.to_device(loader, "cpu")
    it = iter(moved)
    before = [first_column(next(it)) for _ in range(saved_after)]
    state = moved.state_dict()  # batch saved_after is already read ahead from the loader
    assert loader.state_dict()["delivered"] == [[0, saved_after + 1]]
    assert state["delivered"] == [[0, saved_after]] and state["yielded"] == saved_after
    checkpoint = json.dumps(state)
    del it
    gc.collect()
    loader.close()
    resumed = shuffled_loader(num_workers, pin_memory)
    resumed.load_state_dict(json.loads(checkpoint))
    after = [first_column(b) for b in shmloader.to_device(resumed, "cpu")]
    assert before + after == uninterrupted  # no batch lost, none repeated
    resumed.close()


@pytest.mark.timeout(60)
def test_state_dict_at_the_last_batch_and_after_the_epoch(fake: FakeBackend) -> None:
    fake.auto_complete = True
    loader = pinned_loader()
    moved = shmloader.to_device(loader, "cpu")
    it = iter(moved)
    for _ in range(ROWS // 8):
        next(it)
    holding_last = moved.state_dict()  # the loader already saw the end; the caller did not
    assert holding_last["in_progress"] and holding_last["delivered"] == [[0, ROWS // 8]]
    assert list(it) == []
    after_epoch = moved.state_dict()
    assert not after_epoch["in_progress"] and after_epoch == loader.state_dict()
    assert holding_last["epoch"] == 0 and after_epoch["epoch"] == 1
    loader.close()


@dataclass(eq=False)
class TorchNamedFake(FakeBackend):
    """A fake that says it is the torch backend: its transfer must only be used for CUDA devices."""

    name: str = "torch"


def test_a_cuda_backend_transfers_only_to_cuda_devices() -> None:
    stub, fake = TorchNamedFake(), FakeBackend()
    assert type(transfer_for(SimpleNamespace(_pinner=stub), "cpu")).__name__ == "_SyncTransfer"
    assert type(transfer_for(SimpleNamespace(_pinner=stub), "meta")).__name__ == "_SyncTransfer"
    assert transfer_for(SimpleNamespace(_pinner=stub), "cuda") is stub
    assert transfer_for(SimpleNamespace(_pinner=stub), "cuda:1") is stub
    assert transfer_for(SimpleNamespace(_pinner=fake), "cpu") is fake  # the fake drives any device


@pytest.mark.timeout(60)
def test_to_cpu_with_a_cuda_backend_is_a_plain_copy(monkeypatch: pytest.MonkeyPatch) -> None:
    torch = pytest.importorskip("torch")
    stub = TorchNamedFake()
    monkeypatch.setenv(pinning.ENV_BACKEND, "fake")
    monkeypatch.setattr(pinning, "make_backend", lambda name: stub)
    loader = pinned_loader()
    moved = [x for (x,) in shmloader.to_device(loader, "cpu")]
    assert loader._pinner is stub and stub.registered  # the loader pins with it...
    assert stub.count("stream") == stub.count("copy") == stub.count("wait") == 0  # ...the copy is .to()
    for k, x in enumerate(moved):
        assert isinstance(x, torch.Tensor) and x.device.type == "cpu"
        np.testing.assert_array_equal(x.numpy(), expected(k))
    del moved, x
    loader.close()


def test_max_held_must_not_be_negative() -> None:
    with pytest.raises(ValueError, match="max_held must be non-negative, got -1"):
        DevicePrefetcher([], "cpu", max_held=-1)


def test_importing_shmloader_imports_neither_torch_nor_cupy() -> None:
    import subprocess
    import sys

    code = ("import sys, shmloader, shmloader.gpu.prefetch, shmloader.gpu.pinning, shmloader.gpu.fake; "
            "print('torch' in sys.modules, 'cupy' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    assert out.stdout.split() == ["False", "False"]


class BadSample3(shmloader.Dataset):
    def __len__(self) -> int:
        return 6

    def __getitem__(self, i: int) -> np.ndarray:
        if i == 3:
            raise KeyError("bad sample 3")
        return np.full(2, i, np.float32)


def _firsts(iterable: Any) -> list[Any]:
    """The first value of each batch, "KeyError" for an error, going on past errors, "STOP" at the end."""
    out: list[Any] = []
    it = iter(iterable)
    for _ in range(10):
        try:
            out.append(int(np.asarray(next(it)).ravel()[0]))
        except StopIteration:
            return [*out, "STOP"]
        except KeyError:
            out.append("KeyError")
    return out


@pytest.mark.timeout(60)
@pytest.mark.parametrize("num_workers", [0, 2])
def test_an_error_read_ahead_comes_after_the_batch_before_it_and_the_epoch_goes_on(num_workers: int) -> None:
    """The prefetcher reads batch k+1 before it hands out batch k: the loader's error for k+1 used to
    be raised in place of k (a good batch lost) and ended the epoch (the rest lost too)."""
    pytest.importorskip("torch")  # to_device makes tensors of the numpy batches
    loader: shmloader.DataLoader[Any] = shmloader.DataLoader(BadSample3(), batch_size=1, num_workers=num_workers)
    try:
        plain = _firsts(loader)
        assert plain == [0, 1, 2, "KeyError", 4, 5, "STOP"]
        assert _firsts(shmloader.to_device(loader, "cpu")) == plain
    finally:
        loader.close()
