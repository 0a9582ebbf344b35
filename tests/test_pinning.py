"""Pinning on a CPU: the fake backend stands in for CUDA (issue 5, docs/gpu.md).

What must hold whatever the device: slots are page-aligned; each segment is registered exactly
once, in the main process, when the ring creates it (new slot, growth, resize), never per batch
or per epoch; every registered segment is unregistered exactly once, before it is unmapped — also
when the user still holds its batch at close; without an accelerator ``pin_memory=True`` warns in
torch's words at each iterator made, as torch (tests/test_pin_warning_epochs.py), and the batches
are correct. The selection runs once per loader and asks the built-ins once (they answer through
the plugin hook); the choice lives on the loader; torch is asked about an accelerator once per process.
"""

from __future__ import annotations

import gc
import os
import warnings
import weakref
from collections import OrderedDict, namedtuple
from types import SimpleNamespace
from typing import Any

from iter_helpers import mp_iter
import numpy as np
import pytest
from ring_helpers import OWNER

import shmloader
from shmloader.errors import ConfigError
from shmloader.gpu import pinning
from shmloader.gpu.backends import (
    cuda_index,
    iter_leaves,
    map_batch,
    segment_address,
)
from shmloader.gpu.fake import Call, FakeBackend
from shmloader.gpu.mlock import MlockBackend
from shmloader.transport.ring import Ring
from shmloader.transport.segment import PAGE_BYTES, Segment

ROWS, COLS = 96, 16


@pytest.fixture
def fake(fake: FakeBackend, monkeypatch: pytest.MonkeyPatch) -> FakeBackend:
    """conftest's fake pin backend, whose log here also records Segment.close."""
    backend = fake
    original = Segment.close

    def close(self: Segment) -> bool:
        unmapped = original(self)
        backend.calls.append(Call("close", self.name, os.getpid(), mapped=not unmapped))
        return unmapped

    monkeypatch.setattr(Segment, "close", close)
    return backend


def dataset() -> shmloader.ArrayDataset:
    return shmloader.ArrayDataset(np.arange(ROWS * COLS, dtype=np.float32).reshape(ROWS, COLS), np.arange(ROWS))


def expected(batch_index: int, batch_size: int) -> np.ndarray:
    rows = np.arange(batch_index * batch_size, (batch_index + 1) * batch_size)
    return (rows[:, None] * COLS + np.arange(COLS)).astype(np.float32)


def order_of(backend: FakeBackend, name: str) -> list[str]:
    return [c.kind for c in backend.calls if c.target == name]


def registered_names(backend: FakeBackend) -> list[str]:
    return [c.target for c in backend.calls if c.kind == "register"]


# -- alignment and registration ---------------------------------------------------------------


@pytest.mark.timeout(60)
def test_every_slot_is_page_aligned(fake: FakeBackend) -> None:
    loader: shmloader.DataLoader[Any] = shmloader.DataLoader(dataset(), batch_size=8, num_workers=2, pin_memory=True,
                                                             persistent_workers=True)
    held = list(loader)  # holding every batch makes the ring grow: one slot per held batch at least
    ring = mp_iter(loader._iterator)._ring
    assert len(ring.slots) >= len(held) == ROWS // 8
    assert len(fake.registered) == len(ring.slots)
    assert all(address % PAGE_BYTES == 0 for address in fake.registered.values())
    assert all(segment_address(s.segment) % PAGE_BYTES == 0 for s in ring.slots)
    del held
    loader.close()


@pytest.mark.timeout(60)
def test_slot_addresses_are_page_aligned_in_a_bare_ring(tmp_path: Any) -> None:
    ring = Ring(str(tmp_path))
    try:
        slots = [ring.grow(n, OWNER) for n in (1, 4095, 4097, 3 * PAGE_BYTES + 5)]
        assert all(segment_address(s.segment) % PAGE_BYTES == 0 for s in slots)
        assert all(s.size_bytes % PAGE_BYTES == 0 for s in slots)
    finally:
        ring.close()
    assert not os.listdir(tmp_path)  # the address probe left no export: every segment unmapped


@pytest.mark.timeout(90)
def test_each_slot_registered_once_across_epochs(fake: FakeBackend) -> None:
    loader: shmloader.DataLoader[Any] = shmloader.DataLoader(dataset(), batch_size=8, num_workers=2, pin_memory=True,
                                                             persistent_workers=True)
    batches = 0
    for _epoch in range(4):
        for i, (x, _y) in enumerate(loader):
            np.testing.assert_array_equal(x, expected(i, 8))
            batches += 1
    ring = mp_iter(loader._iterator)._ring
    registered = registered_names(fake)
    assert len(registered) == len(set(registered)) == ring.created_total
    assert {s.segment.name for s in ring.slots} == set(registered)
    assert batches == 4 * ROWS // 8 and fake.finished == batches
    assert fake.count("unregister") == 0  # nothing retired while the loader runs
    assert {c.pid for c in fake.calls} == {os.getpid()}  # main process only, never a worker
    del x, _y
    loader.close()
    for name in registered:
        assert order_of(fake, name) == ["register", "unregister", "close"]
    assert all(not c.mapped for c in fake.calls if c.kind == "close")  # nothing viewed: all unmapped


@pytest.mark.timeout(90)
def test_resize_registers_the_new_segment_and_unregisters_the_old_first(fake: FakeBackend) -> None:
    # The first slots are 1 MiB (mp_iterator.FIRST_SLOT_BYTES); these batches are 2 MiB, so each
    # slot's first task makes the ring give it a new, larger segment.
    big = np.arange(32 * 65536, dtype=np.float32).reshape(32, 65536)
    loader: shmloader.DataLoader[Any] = shmloader.DataLoader(shmloader.ArrayDataset(big), batch_size=8, num_workers=2,
                                                             pin_memory=True, persistent_workers=True)
    for i, (x,) in enumerate(loader):
        np.testing.assert_array_equal(x, big[i * 8:(i + 1) * 8])
    del x
    live = {s.segment.name for s in mp_iter(loader._iterator)._ring.slots}
    retired = [n for n in registered_names(fake) if n not in live]
    assert retired  # resized while running
    for name in retired:
        assert order_of(fake, name) == ["register", "unregister", "close"]
    assert all(order_of(fake, n) == ["register"] for n in live)
    loader.close()
    assert all(order_of(fake, n) == ["register", "unregister", "close"] for n in registered_names(fake))


@pytest.mark.timeout(90)
def test_batches_held_past_the_end_of_an_epoch_stay_valid_and_pinned(fake: FakeBackend) -> None:
    loader: shmloader.DataLoader[Any] = shmloader.DataLoader(dataset(), batch_size=8, num_workers=2, pin_memory=True)
    held = list(loader)  # the ring grows; the epoch ends and the iterator closes its ring
    names = registered_names(fake)
    assert len(names) == len(set(names)) >= len(held)
    orders = [order_of(fake, name) for name in names]
    assert all(o in (["register"], ["register", "unregister", "close"]) for o in orders)
    assert orders.count(["register"]) == len(held)  # each held batch's segment is still pinned
    for i, (x, _y) in enumerate(held):
        np.testing.assert_array_equal(x, expected(i, 8))  # and still mapped: the views keep them
    del held, x, _y
    gc.collect()
    for name in names:  # the last views died: unpinned (while mapped), then unmapped
        assert order_of(fake, name) == ["register", "unregister", "close"]
    assert all(c.mapped for c in fake.calls if c.kind == "unregister")


@pytest.mark.timeout(60)
def test_a_batch_held_past_close_stays_pinned_and_is_unpinned_before_unmap(fake: FakeBackend) -> None:
    loader: shmloader.DataLoader[Any] = shmloader.DataLoader(dataset(), batch_size=8, num_workers=1, pin_memory=True,
                                                             persistent_workers=True)
    it = iter(loader)
    x, y = next(it)
    slots = mp_iter(loader._iterator)._ring.slots
    held = next(s.segment for s in slots if s.state.value == "leased")
    name, mapping = held.name, weakref.ref(held.buf)
    del held, slots
    loader.close()
    assert order_of(fake, name) == ["register"]  # unlinked, but pinned and mapped while viewed
    np.testing.assert_array_equal(x, expected(0, 8))
    assert mapping() is not None
    del x, y, it
    gc.collect()
    assert order_of(fake, name) == ["register", "unregister", "close"]
    unregister = next(c for c in fake.calls if c.kind == "unregister" and c.target == name)
    assert unregister.mapped  # unpinned while the pages were still mapped...
    assert mapping() is None  # ...and unmapped right after, with the last view


# -- selection ----------------------------------------------------------------------------------


class _Hook:
    def __init__(self, answer: Any) -> None:
        self.answer = answer
        self.devices: list[str] = []

    def shmloader_pin_backend(self, *, device: str) -> Any:
        self.devices.append(device)
        return self.answer


class _Plugins:
    def __init__(self, answer: Any) -> None:
        self.hook = _Hook(answer)


def test_a_plugin_backend_is_used_and_asked_with_the_device(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(pinning.ENV_BACKEND, raising=False)
    mine = FakeBackend()
    plugins = _Plugins(mine)
    assert pinning.select(True, plugins, device="cuda:1") is mine
    assert plugins.hook.devices == ["cuda:1"]
    assert pinning.select(False, plugins) is None


class _OffersFake:
    def __init__(self) -> None:
        self.backend = FakeBackend()

    def shmloader_pin_backend(self, device: str) -> FakeBackend:
        return self.backend


class _Broken:
    def shmloader_pin_backend(self, device: str) -> None:
        raise KeyError("no such card")


@pytest.mark.timeout(60)
def test_a_loader_plugin_provides_the_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(pinning.ENV_BACKEND, raising=False)
    plugin = _OffersFake()
    loader: shmloader.DataLoader[Any] = shmloader.DataLoader(dataset(), batch_size=8, num_workers=1, pin_memory=True,
                                                             plugins=[plugin])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = [x for x, _y in loader]
    assert loader._pinner is plugin.backend and plugin.backend.finished == len(got) == ROWS // 8
    assert not [w for w in caught if str(w.message) == pinning.NO_ACCELERATOR]  # it pins for a device
    del got
    gc.collect()
    assert plugin.backend.registered == {} and plugin.backend.count("unregister") >= 1


def test_a_failing_plugin_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(pinning.ENV_BACKEND, raising=False)
    from shmloader.plugins import PluginError, build_plugin_manager

    with pytest.raises(PluginError, match="shmloader_pin_backend") as info:
        pinning.select(True, build_plugin_manager([_Broken()], entry_points=False))
    assert info.value.hook == "shmloader_pin_backend" and isinstance(info.value.__cause__, KeyError)


def test_a_named_backend_beats_plugins_and_a_bad_name_is_an_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(pinning.ENV_BACKEND, "mlock")
    assert isinstance(pinning.select(True, _Plugins(FakeBackend())), MlockBackend)
    assert pinning.select(True, _Plugins(FakeBackend()), name="none") is None
    monkeypatch.setenv(pinning.ENV_BACKEND, "cudaa")
    with pytest.raises(ConfigError, match="SHMLOADER_PIN_BACKEND='cudaa'"):
        pinning.select(True, None)


def test_the_hook_answer_is_final_and_the_built_ins_are_asked_once(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(pinning.ENV_BACKEND, raising=False)
    from shmloader.plugins import build_plugin_manager

    devices: list[str] = []
    monkeypatch.setattr(pinning, "builtin_pin_backend", lambda device="": devices.append(device))
    assert pinning.select(True, build_plugin_manager([], entry_points=False), device="cuda:0") is None
    assert devices == ["cuda:0"]  # through BuiltinPinPlugin only, not again after it answered None
    assert pinning.select(True, _Plugins(None)) is None and devices == ["cuda:0"]  # a hook's None is final
    assert pinning.select(True, None, device="x") is None and devices == ["cuda:0", "x"]  # no hook: built-ins


def test_the_choice_is_kept_on_the_loader_and_the_warning_given_at_each_call(monkeypatch: pytest.MonkeyPatch) -> None:
    chosen = [FakeBackend(), FakeBackend()]
    monkeypatch.setattr(pinning, "select", lambda *args, **kwargs: chosen.pop(0))
    monkeypatch.setattr(pinning, "will_pin", lambda loader: False)
    first, second = (SimpleNamespace(pin_memory=True, _plugins=None, pin_memory_device="", _pin=pinning.PinState())
                     for _ in range(2))
    mine = pinning.backend_for(first)
    assert pinning.backend_for(first) is mine and first._pin.backend is mine  # selected once
    assert pinning.backend_for(second) is not mine and not chosen  # each loader has its own
    none_chosen = SimpleNamespace(pin_memory=True, _plugins=None, pin_memory_device="",
                                  _pin=pinning.PinState(backend=None, chosen=True))
    assert pinning.backend_for(none_chosen) is None  # None is a choice too: not selected again
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for loader in (first, second, first, second):
            pinning.warn_if_unpinned(loader)
    assert [str(w.message) for w in caught] == [pinning.NO_ACCELERATOR] * 4  # at each iterator, as torch


def test_torch_is_asked_about_an_accelerator_once_per_process(monkeypatch: pytest.MonkeyPatch) -> None:
    torch = pytest.importorskip("torch")
    asked: list[bool] = []

    def is_available() -> bool:
        asked.append(True)
        return False

    monkeypatch.setattr(torch.accelerator, "is_available", is_available)
    pinning.accelerator_available.cache_clear()
    try:
        assert [pinning.accelerator_available() for _ in range(3)] == [False] * 3 and asked == [True]
    finally:
        pinning.accelerator_available.cache_clear()  # the real answer again for later tests


def test_iter_leaves_lists_what_map_batch_maps_and_cuda_index_defaults_to_zero() -> None:
    a, b = np.zeros(2), np.ones(3)
    Pair = namedtuple("Pair", "l r")
    batch = OrderedDict(x=[a, (b, "label", b"raw")], pair=Pair(7, {"deep": [a]}), n=None)
    mapped: list[Any] = []
    map_batch(batch, mapped.append)
    leaves = list(iter_leaves(batch))
    assert len(leaves) == len(mapped) == 5 and all(x is y for x, y in zip(leaves, mapped))
    assert list(iter_leaves("text")) == [] and list(iter_leaves(3)) == [3]
    assert [cuda_index(d) for d in ("cuda", "cuda:0", "cuda:3", "cpu")] == [0, 0, 3, 0]


@pytest.mark.skipif(pinning.accelerator_available(), reason="this machine has an accelerator")
def test_asking_for_torch_without_cuda_is_an_error() -> None:
    with pytest.raises(ConfigError, match="sees no CUDA device"):
        pinning.select(True, None, name="torch")


# -- no accelerator -----------------------------------------------------------------------------


@pytest.mark.skipif(pinning.accelerator_available(), reason="this machine has an accelerator")
@pytest.mark.timeout(90)
@pytest.mark.parametrize("num_workers", [0, 2])
def test_without_accelerator_a_persistent_loader_warns_once_and_batches_are_correct(
        num_workers: int, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(pinning.ENV_BACKEND, raising=False)
    kwargs = {"persistent_workers": True} if num_workers else {}  # one iterator: one warning, as torch
    loader: shmloader.DataLoader[Any] = shmloader.DataLoader(dataset(), batch_size=8, num_workers=num_workers,
                                                             pin_memory=True, **kwargs)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _epoch in range(3):
            for i, (x, _y) in enumerate(loader):
                np.testing.assert_array_equal(x, expected(i, 8))
    messages = [str(w.message) for w in caught]
    assert messages.count(pinning.NO_ACCELERATOR) == (1 if num_workers else 3), messages
    assert loader._pinner is None
    loader.close()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("num_workers", [0, 1])
def test_a_bad_pin_backend_is_the_same_error_with_or_without_workers(
        num_workers: int, monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    monkeypatch.setenv(pinning.ENV_BACKEND, "Bogus")
    loader: shmloader.DataLoader[Any] = shmloader.DataLoader(dataset(), batch_size=8, num_workers=num_workers,
                                                             pin_memory=True)
    for _attempt in range(2):  # and again at the next iter(), not only the first
        with pytest.raises(ConfigError) as info:
            iter(loader)
        assert str(info.value) == ("SHMLOADER_PIN_BACKEND='Bogus' is not a pin backend; expected one of "
                                   "auto, torch, cupy, mlock, fake, none")  # fmt: skip
        assert (info.value.name, info.value.value) == (pinning.ENV_BACKEND, "Bogus")
    loader.close()
    # the variable is not read
    unpinned: shmloader.DataLoader[Any] = shmloader.DataLoader(dataset(), batch_size=8, num_workers=num_workers)
    assert len(list(unpinned)) == ROWS // 8
    unpinned.close()


@pytest.mark.skipif(pinning.accelerator_available(), reason="this machine has an accelerator")
@pytest.mark.timeout(60)
@pytest.mark.parametrize("num_workers", [0, 1])
def test_a_pin_backend_that_cannot_work_here_is_an_error_with_or_without_workers(
        num_workers: int, monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    monkeypatch.setenv(pinning.ENV_BACKEND, "torch")
    loader: shmloader.DataLoader[Any] = shmloader.DataLoader(dataset(), batch_size=8, num_workers=num_workers,
                                                             pin_memory=True)
    with pytest.raises(ConfigError, match="pin backend 'torch' was asked for .* sees no CUDA device"):
        iter(loader)
    loader.close()


@pytest.mark.timeout(60)
def test_pin_memory_device_is_deprecated_as_in_torch(fake: FakeBackend) -> None:
    loader: shmloader.DataLoader[Any] = shmloader.DataLoader(dataset(), batch_size=8, num_workers=1, pin_memory=True,
                                                             pin_memory_device="cuda:0")
    with pytest.warns(UserWarning, match="pin_memory_device is deprecated"):
        first = next(iter(loader))
    np.testing.assert_array_equal(first[0], expected(0, 8))
    del first
    gc.collect()
