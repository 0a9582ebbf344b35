"""The cupy pin backend driven through a recording stand-in for cupy's runtime, streams, devices and
arrays (see test_cuda_mock.py for the contract): each segment registered once, page-aligned, with
the portable flag, unregistered at close; the transfer copies on the side stream and the caller's
stream waits on it."""

from __future__ import annotations

import sys
import types
from typing import Any

import numpy as np
import pytest
from cuda_fakes import FakeRuntime, data, kinds

import shmloader
from shmloader.gpu import pinning
from shmloader.gpu.cupy_backend import CupyBackend
from shmloader.transport.segment import PAGE_BYTES


@pytest.fixture
def fake_cupy(monkeypatch: pytest.MonkeyPatch) -> FakeRuntime:
    """A ``cupy`` module with the runtime, streams, events, devices and arrays the backend uses."""
    runtime = FakeRuntime()
    log = runtime.log

    class Event:
        def __init__(self, stream: Any) -> None:
            self.stream, self.done = stream, True

        def synchronize(self) -> None:
            log.append(("event_sync",))

    class Stream:
        def __init__(self, non_blocking: bool = False, name: str = "side") -> None:
            self.name = name

        def record(self) -> Event:
            log.append(("record", self.name))
            return Event(self)

        def wait_event(self, event: Event) -> None:
            log.append(("wait", self.name, event.stream.name))

        def synchronize(self) -> None:
            log.append(("stream_sync", self.name))

        def __enter__(self) -> Stream:
            return self

        def __exit__(self, *exc: Any) -> None:
            return None

    class Device:
        def __init__(self, index: int = 0) -> None:
            self.index = index

        def synchronize(self) -> None:
            log.append(("synchronize",))

        def __enter__(self) -> Device:
            return self

        def __exit__(self, *exc: Any) -> None:
            return None

    class DeviceArray:
        def __init__(self, shape: Any, dtype: Any) -> None:
            self.host = np.empty(shape, dtype)

        def set(self, array: np.ndarray, stream: Any = None) -> None:
            log.append(("set", getattr(stream, "name", None)))
            self.host[...] = array

    def host_register(ptr: int, size: int, flags: int) -> None:
        runtime.cudaHostRegister(ptr, size, flags)

    current = Stream(name="default")
    cupy = types.ModuleType("cupy")
    cupy.cuda = types.SimpleNamespace(  # type: ignore[attr-defined]
        runtime=types.SimpleNamespace(getDeviceCount=lambda: 1, hostRegister=host_register,
                                      hostUnregister=runtime.cudaHostUnregister),
        Stream=Stream, Device=Device, get_current_stream=lambda: current)
    cupy.empty = DeviceArray  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "cupy", cupy)
    monkeypatch.setenv(pinning.ENV_BACKEND, "cupy")
    return runtime


@pytest.mark.timeout(60)
def test_cupy_registers_each_segment_once_and_moves_batches(fake_cupy: FakeRuntime) -> None:
    loader: shmloader.DataLoader[Any] = shmloader.DataLoader(shmloader.ArrayDataset(data()), batch_size=8,
                                                             num_workers=1, pin_memory=True, persistent_workers=True)
    try:
        assert CupyBackend.usable()
        moved = [x.host.copy() for (x,) in shmloader.to_device(loader, "cuda:0")]
        assert isinstance(loader._pinner, CupyBackend)
    finally:
        loader.close()
    np.testing.assert_array_equal(np.concatenate(moved), data())
    registered = kinds(fake_cupy.log, "register")
    assert registered and all(r[1] % PAGE_BYTES == 0 and r[3] == 1 for r in registered)
    assert sorted(u[1] for u in kinds(fake_cupy.log, "unregister")) == sorted(r[1] for r in registered)
    assert {s[1] for s in kinds(fake_cupy.log, "set")} == {"side"}  # non_blocking: on the side stream
    assert ("wait", "default", "side") in fake_cupy.log  # the caller's stream waits on the copy


def test_a_cupy_copy_that_fails_midway_finishes_what_it_enqueued_before_raising(fake_cupy: FakeRuntime) -> None:
    """As the torch backend (test_cuda_mock.py): the caller lets the batch go when copy() raises."""
    cupy = sys.modules["cupy"]
    made: list[Any] = []

    class Failing:
        def __init__(self, shape: Any, dtype: Any) -> None:
            made.append(self)

        def set(self, array: np.ndarray, stream: Any = None) -> None:
            if len(made) == 2:
                raise MemoryError("out of memory allocating 4 bytes")
            fake_cupy.log.append(("set", getattr(stream, "name", None)))

    cupy.empty = Failing  # type: ignore[attr-defined]
    backend = CupyBackend()
    stream = backend.new_stream("cuda:0")
    with pytest.raises(MemoryError):
        backend.copy([data(), data()], "cuda:0", stream, True)
    assert kinds(fake_cupy.log, "set", "stream_sync") == [("set", "side"), ("stream_sync", "side")]
