"""The torch and cupy pin backends driven through a recording stand-in for the CUDA runtime.

CI has no GPU, so these tests replace the few runtime entry points the backends call (torch's
``torch.cuda.cudart()`` bindings, streams and events; cupy's ``runtime``, ``Stream`` and ``Device``)
with fakes that record each call, and run real loaders against them. What they pin down is our
side of the contract, the part a GPU run would otherwise be the first to exercise:

- the built-in selection picks the torch backend when ``torch.cuda.is_available()``;
- ``cudaHostRegister`` gets each segment's page-aligned address, its full size and the portable
  flag, once per segment; ``cudaHostUnregister`` gets the same address after a device
  synchronisation and before the segment is unmapped;
- a failing registration warns once with the error's number and text, clears the runtime's last
  error (or torch's next launch check would report it), and the batches stay correct;
- dropping a batch records a fence event on the current stream;
- the torch transfer copies on the side stream, records the event there, and the caller's stream
  waits on it before the batch is handed out;
- cupy (test_cuda_mock_cupy.py): the same registration contract, and its transfer fills device
  arrays with the batch;
- numpy batches (``shmloader.DataLoader``) view registered memory, also when taken with
  ``next(iter(loader))``.

The mocks hold whether or not the machine has a real CUDA device (issue 13): garbage of earlier
loaders is collected before the runtime is replaced, the runtime records only the segments this
test created, every ``torch.cuda`` entry point a loader could reach is replaced, and the warning
checks look only at shmloader's pinning warnings (Python 3.12 warns about forking a process that
has threads, which a CUDA driver starts).

The real thing runs in tests/test_gpu.py on a CUDA machine.
"""

from __future__ import annotations

import contextlib
import gc
import warnings
from collections.abc import Iterator
from typing import Any

from iter_helpers import mp_iter
import numpy as np
import pytest
from cuda_fakes import (
    ROWS,
    FakeEvent,
    FakeRuntime,
    FakeStream,
    Status,
    data,
    expected,
    kinds,
    pin_warnings,
    registered_range,
)

import shmloader
from shmloader.gpu import backends as pin_backends
from shmloader.gpu import cudart, pinning
from shmloader.gpu.backends import TorchCudaBackend, segment_address
from shmloader.transport.segment import PAGE_BYTES, Segment


@pytest.fixture
def fake_cuda(monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeRuntime]:
    """torch.cuda as seen by the torch backend, with a recording runtime behind it (also on a
    machine with a real CUDA device: see the module docstring)."""
    torch = pytest.importorskip("torch")
    gc.collect()  # an earlier loader's finalizers run now, against the real runtime (if any)
    runtime = FakeRuntime(ours=set())
    log = runtime.log
    create = Segment.create

    def create_ours(*args: Any, **kwargs: Any) -> Segment:
        segment = create(*args, **kwargs)
        runtime.ours.add(segment_address(segment))  # type: ignore[union-attr]
        return segment

    monkeypatch.setattr(Segment, "create", staticmethod(create_ours))
    streams = {"current": FakeStream("default", log)}

    @contextlib.contextmanager
    def stream(s: FakeStream) -> Any:
        saved, streams["current"] = streams["current"], s
        try:
            yield
        finally:
            streams["current"] = saved

    cuda = torch.cuda
    for name, stub in (("is_initialized", lambda: True), ("_lazy_init", lambda: None), ("init", lambda: None),
                       ("current_device", lambda: 0), ("device_count", lambda: 1)):
        monkeypatch.setattr(cuda, name, stub)  # nothing reaches a real device, if there is one
    monkeypatch.setattr(cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch._C, "_cuda_hasPrimaryContext", lambda device: device == 0, raising=False)
    monkeypatch.setattr(cuda, "cudart", lambda: runtime)
    monkeypatch.setattr(cuda, "synchronize", lambda device=None: log.append(("synchronize",)))
    monkeypatch.setattr(cuda, "Event", lambda **kw: FakeEvent(log, lambda: streams["current"]))
    monkeypatch.setattr(cuda, "Stream", lambda device=None, **kw: FakeStream("side", log))
    monkeypatch.setattr(cuda, "stream", stream)
    monkeypatch.setattr(cuda, "current_stream", lambda device=None: streams["current"])
    monkeypatch.setattr(torch.Tensor, "record_stream", lambda self, s: log.append(("record_stream", s)))
    monkeypatch.setattr(torch.accelerator, "is_available", lambda: True, raising=False)
    monkeypatch.delenv(pinning.ENV_BACKEND, raising=False)

    def clear_last_error() -> bool:
        log.append(("clear_last_error",))
        return True

    monkeypatch.setattr(pin_backends, "clear_last_error", clear_last_error)
    pinning.accelerator_available.cache_clear()
    yield runtime
    pinning.accelerator_available.cache_clear()


@pytest.mark.timeout(60)
def test_each_segment_is_registered_once_with_its_address_size_and_flag(
        fake_cuda: FakeRuntime, monkeypatch: pytest.MonkeyPatch) -> None:
    addresses: dict[str, int] = {}
    create = Segment.create

    def remember(*args: Any, **kwargs: Any) -> Segment:
        segment = create(*args, **kwargs)
        addresses[segment.name] = segment_address(segment)
        return segment

    monkeypatch.setattr(Segment, "create", staticmethod(remember))
    loader: shmloader.DataLoader[Any] = shmloader.DataLoader(shmloader.ArrayDataset(data()), batch_size=8,
                                                             num_workers=2, pin_memory=True, persistent_workers=True)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _epoch in range(2):
                for k, (x,) in enumerate(loader):
                    np.testing.assert_array_equal(x, expected(k))
            del x  # held, its segment would stay pinned until dropped
        assert pin_warnings(caught) == []  # neither "no accelerator" nor a failed registration
        assert isinstance(loader._pinner, TorchCudaBackend)
        segments = {s.segment.name: s.segment for s in mp_iter(loader._iterator)._ring.slots}
    finally:
        loader.close()
    registered = kinds(fake_cuda.log, "register")
    assert len(registered) == len(addresses) == len({r[1] for r in registered}) >= 1
    for _kind, ptr, size, flags in registered:
        assert ptr % PAGE_BYTES == 0 and flags == 1  # cudaHostRegisterPortable
        assert ptr in addresses.values()
    sizes = {addresses[name]: seg.size_bytes for name, seg in segments.items()}
    assert all(sizes.get(ptr, size) == size for _k, ptr, size, _f in registered)
    # Unregistered each once, the device synchronised just before each.
    unregistered = kinds(fake_cuda.log, "unregister")
    assert sorted(u[1] for u in unregistered) == sorted(r[1] for r in registered)
    flow = [e[0] for e in kinds(fake_cuda.log, "synchronize", "unregister")]
    assert all(flow[i - 1] == "synchronize" for i, k in enumerate(flow) if k == "unregister")


@pytest.mark.timeout(60)
def test_unregister_comes_before_unmap_for_a_batch_held_past_close(
        fake_cuda: FakeRuntime, monkeypatch: pytest.MonkeyPatch) -> None:
    order: list[str] = []
    close = Segment.close

    def recording_close(self: Segment) -> bool:
        unmapped = close(self)
        if unmapped:
            order.append("unmap")
        return unmapped

    def recording_unregister(ptr: Any) -> Status:
        order.append("unregister")
        return Status(0)

    monkeypatch.setattr(Segment, "close", recording_close)
    monkeypatch.setattr(fake_cuda, "cudaHostUnregister", recording_unregister)
    loader: shmloader.DataLoader[Any] = shmloader.DataLoader(shmloader.ArrayDataset(data()), batch_size=8,
                                                             num_workers=1, pin_memory=True)
    it = iter(loader)
    (x,) = next(it)
    del it
    loader.close()
    np.testing.assert_array_equal(x, expected(0))  # still mapped: the user holds it
    assert "unregister" in order and "unmap" not in order[:order.index("unregister")]
    del x
    gc.collect()
    assert order.count("unmap") >= 1


@pytest.mark.timeout(60)
def test_a_failed_registration_warns_once_clears_the_error_and_stays_correct(fake_cuda: FakeRuntime) -> None:
    fake_cuda.fail_register = 712
    loader: shmloader.DataLoader[Any] = shmloader.DataLoader(shmloader.ArrayDataset(data()), batch_size=8,
                                                             num_workers=2, pin_memory=True)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            got = [x.copy() for (x,) in loader]
        (text,) = pin_warnings(caught)  # once, however many segments failed
        assert "cudaHostRegister returned cudaError 712" in text and "already mapped" in text
        assert "unpinned" in text
    finally:
        loader.close()
    np.testing.assert_array_equal(np.concatenate(got), data())
    assert kinds(fake_cuda.log, "clear_last_error")
    assert not kinds(fake_cuda.log, "unregister")  # nothing was registered, nothing unregistered


@pytest.mark.timeout(60)
def test_a_dropped_batch_records_a_fence_on_the_current_stream(fake_cuda: FakeRuntime) -> None:
    loader: shmloader.DataLoader[Any] = shmloader.DataLoader(shmloader.ArrayDataset(data()), batch_size=8,
                                                             num_workers=1, pin_memory=True)
    try:
        it = iter(loader)
        (x,) = next(it)
        before = len(kinds(fake_cuda.log, "record"))
        del x
        gc.collect()
        records = kinds(fake_cuda.log, "record")[before:]
        assert len(records) == 1 and repr(records[0][2]) == "default"
        del it
    finally:
        loader.close()


def test_a_fence_and_an_unpin_cover_every_device_this_process_uses(
        fake_cuda: FakeRuntime, monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> None:
    """``x.to("cuda:1", non_blocking=True)`` with cuda:0 current (no ``set_device``, as in torch's
    DDP tutorial) runs on cuda:1's current stream: an event on cuda:0 alone would free the slot
    under that copy, and synchronising cuda:0 alone would unpin pages it still reads."""
    torch = pytest.importorskip("torch")
    log = fake_cuda.log
    streams = {d: FakeStream(f"default:{d}", log) for d in range(3)}
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 3)
    monkeypatch.setattr(torch._C, "_cuda_hasPrimaryContext", lambda d: d in (0, 2), raising=False)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: streams[device or 0])
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: log.append(("synchronize", device)))
    backend = TorchCudaBackend()
    fence = backend.fence()
    assert [repr(r[2]) for r in kinds(log, "record")] == ["default:0", "default:2"]
    assert not fence.query()
    fence.synchronize()
    assert fence.query() and len(kinds(log, "event_sync")) == 2
    segment = Segment.create(str(tmp_path), PAGE_BYTES)
    address = segment_address(segment)
    try:
        backend.register_segment(segment)
        backend.unregister_segment(segment)
    finally:
        segment.unlink()
        segment.close()
    assert kinds(log, "synchronize", "unregister")[-3:] == [
        ("synchronize", 0), ("synchronize", 2), ("unregister", address)]


@pytest.mark.timeout(60)
def test_the_torch_transfer_copies_on_the_side_stream_and_the_caller_waits(fake_cuda: FakeRuntime) -> None:
    torch = pytest.importorskip("torch")
    loader: shmloader.DataLoader[Any] = shmloader.DataLoader(shmloader.ArrayDataset(data()), batch_size=8,
                                                             num_workers=1, pin_memory=True, persistent_workers=True)
    backend = TorchCudaBackend()
    # "cpu" stands in for a CUDA device: the copies are real, streams and events are the fakes'.
    backend._target = lambda device: (torch.device("cpu"), True, None)  # type: ignore[method-assign]
    try:
        for k, (x,) in enumerate(shmloader.to_device(loader, "cuda", transfer=backend)):
            assert isinstance(x, torch.Tensor)
            np.testing.assert_array_equal(x.numpy(), expected(k))
            log = fake_cuda.log
            copy_events = [e for e in kinds(log, "record") if repr(e[2]) == "side"]
            waits = [e for e in kinds(log, "wait") if e[1] == "default"]
            assert len(waits) == k + 1
            assert waits[-1][2] == copy_events[k][1]  # the caller waits on batch k's own event
            assert len(copy_events) == min(k + 2, ROWS // 8)  # batch k+1 is already on its way
        # Before each copy the side stream waited for what the caller's stream had enqueued (its
        # memory may reuse blocks the caller freed), so nothing needs record_stream afterwards.
        ready = {e[2] for e in kinds(log, "wait") if e[1] == "side"}  # what the side stream waited on
        flow = [("mark caller" if e[1] in ready and repr(e[2]) == "default" else "copy done") if e[0] == "record"
                else "side waits" for e in kinds(log, "record", "wait")
                if (e[0] == "record" and (e[1] in ready or repr(e[2]) == "side")) or e[1] == "side"]
        assert flow == ["mark caller", "side waits", "copy done"] * (ROWS // 8)
        assert kinds(log, "record_stream") == []
    finally:
        loader.close()


def test_a_copy_that_fails_midway_finishes_what_it_enqueued_before_raising(
        fake_cuda: FakeRuntime, monkeypatch: pytest.MonkeyPatch) -> None:
    """The caller lets the batch (and its slot) go when copy() raises: the leaves already enqueued on
    the side stream must have been read by then."""
    torch = pytest.importorskip("torch")
    backend = TorchCudaBackend()
    backend._target = lambda device: (torch.device("cpu"), True, None)  # type: ignore[method-assign]
    stream = backend.new_stream("cuda")
    real_copy, copies = torch.Tensor.copy_, []

    def copy_(self: Any, src: Any, non_blocking: bool = False) -> Any:
        copies.append(non_blocking)
        if len(copies) == 2:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        return real_copy(self, src, non_blocking=non_blocking)

    monkeypatch.setattr(torch.Tensor, "copy_", copy_)
    with pytest.raises(RuntimeError, match="illegal memory access"):
        backend.copy({"a": data(), "b": data()}, "cuda", stream, True)
    assert len(copies) == 2 and kinds(fake_cuda.log, "stream_sync") == [("stream_sync", "side")]


@pytest.mark.timeout(60)
def test_numpy_batches_view_registered_memory(fake_cuda: FakeRuntime) -> None:
    loader: shmloader.DataLoader[Any] = shmloader.DataLoader(shmloader.ArrayDataset(data()), batch_size=8,
                                                             num_workers=1, pin_memory=True)
    try:
        it = iter(loader)
        (x,) = next(it)
        assert isinstance(x, np.ndarray) and registered_range(fake_cuda, x) is not None
        del it
    finally:
        loader.close()


@pytest.mark.timeout(60)
def test_a_batch_from_a_dropped_iterator_stays_registered_while_held(fake_cuda: FakeRuntime) -> None:
    """``next(iter(loader))``: the iterator is dropped at once (tests/test_gpu.py's numpy test)."""
    loader: shmloader.DataLoader[Any] = shmloader.DataLoader(shmloader.ArrayDataset(data()), batch_size=8,
                                                             num_workers=1, pin_memory=True)
    try:
        (x,) = next(iter(loader))
        gc.collect()
        ptr = registered_range(fake_cuda, x)
        assert ptr is not None and ("unregister", ptr) not in fake_cuda.log  # still pinned while held
        del x
        gc.collect()
        assert ("unregister", ptr) in fake_cuda.log  # let go with the last view
    finally:
        loader.close()


# -- the runtime library ------------------------------------------------------------------------
def test_find_cudart_reads_proc_maps_lines() -> None:
    lines = [
        "7f00-7f10 r-xp 00000000 08:01 1234 /usr/lib/x86_64-linux-gnu/libc.so.6\n",
        "7f20-7f30 r-xp 00000000 08:01 99 /opt/site-packages/nvidia/cuda_runtime/lib/libcudart.so.12\n",
        "7f40-7f50 rw-p 00000000 00:00 0\n",
    ]
    assert cudart.find_cudart(lines) == "/opt/site-packages/nvidia/cuda_runtime/lib/libcudart.so.12"
    assert cudart.find_cudart(lines[:1] + lines[2:]) is None


def test_clear_last_error_is_a_no_op_without_a_loaded_runtime() -> None:
    with open(cudart.MAPS) as maps:
        loaded = cudart.find_cudart(maps)
    assert cudart.clear_last_error() is (loaded is not None)
