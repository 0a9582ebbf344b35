"""A pin backend's runtime call cut short by a Ctrl-C: no page stays pinned past its segment.

Python raises a SIGINT only once the C call it interrupted has returned, so a Ctrl-C during
``cudaHostRegister`` (slow for a large slot: every page is locked) is raised right after the pages
were pinned, before the backend noted the registration; one during the device synchronisation
that precedes ``cudaHostUnregister`` is raised before the unregistration. Either way the ring
then unmaps the segment with its pages still registered: the driver keeps them locked, and a later
segment mapped at the same address fails to pin ("already mapped"). What must hold, with the
runtime of each backend replaced by a recording stand-in (tests/cuda_fakes.py): every address the
runtime pinned is unpinned before its segment goes, and the interrupt still reaches the caller.
"""

from __future__ import annotations

import sys
import types
from typing import Any

import pytest
from cuda_fakes import FakeRuntime, Status, kinds

from shmloader.gpu.backends import RegisteringBackend, TorchCudaBackend, segment_address
from shmloader.gpu.cupy_backend import CupyBackend
from shmloader.gpu.mlock import MlockBackend
from shmloader.transport.ring import Ring
from shmloader.transport.segment import Segment

PAGE = 4096


class InterruptedRuntime(FakeRuntime):
    """cudaHostRegister pins (is recorded), then a Ctrl-C is raised as it returns."""

    def cudaHostRegister(self, ptr: int, size: int, flags: int) -> Status:  # noqa: N802
        super().cudaHostRegister(ptr, size, flags)
        raise KeyboardInterrupt


def torch_backend(runtime: FakeRuntime, synchronize: Any = None) -> TorchCudaBackend:
    """The torch backend with ``torch.cuda`` as far as it reaches replaced: one device, in use."""
    pytest.importorskip("torch")
    backend = TorchCudaBackend()

    def synchronized(device: int) -> None:
        runtime.log.append(("synchronize", device))
        if synchronize is not None:
            synchronize()

    cuda = types.SimpleNamespace(cudart=lambda: runtime, synchronize=synchronized, device_count=lambda: 2,
                                 current_device=lambda: 0)
    backend._torch = types.SimpleNamespace(  # type: ignore[assignment]
        cuda=cuda, _C=types.SimpleNamespace(_cuda_hasPrimaryContext=lambda d: True))
    return backend


def pinned_now(runtime: FakeRuntime) -> set[int]:
    """Addresses registered and not unregistered since, by the runtime's log."""
    pinned: set[int] = set()
    for entry in kinds(runtime.log, "register", "unregister"):
        (pinned.add if entry[0] == "register" else pinned.discard)(entry[1])
    return pinned


@pytest.mark.timeout(60)
def test_a_ctrl_c_in_cuda_host_register_unpins_before_the_segment_goes(tmp_path: Any) -> None:
    runtime = InterruptedRuntime()
    backend = torch_backend(runtime)
    ring = Ring(str(tmp_path), on_create=backend.register_segment, on_retire=backend.unregister_segment)
    try:
        with pytest.raises(KeyboardInterrupt):
            ring.grow(PAGE, (0, 0))
    finally:
        ring.close()
    assert kinds(runtime.log, "register") and pinned_now(runtime) == set()
    assert backend.registered == {} and list(tmp_path.iterdir()) == []


@pytest.mark.timeout(60)
def test_a_ctrl_c_in_the_wait_before_cuda_host_unregister_still_unpins(tmp_path: Any) -> None:
    runtime = FakeRuntime()
    interrupts = [KeyboardInterrupt]

    def wait_then_interrupt() -> None:  # the first wait completes, then the Ctrl-C lands
        if interrupts:
            raise interrupts.pop()()

    backend = torch_backend(runtime, wait_then_interrupt)
    segment = Segment.create(str(tmp_path), PAGE)
    try:
        backend.register_segment(segment)
        with pytest.raises(KeyboardInterrupt):
            backend.unregister_segment(segment)
    finally:
        segment.unlink()
        segment.close()
    assert pinned_now(runtime) == set()
    # every device in use was waited for before the pages were unpinned, the interrupted wait's too
    flow = [entry[:2] for entry in kinds(runtime.log, "synchronize", "unregister")]
    assert flow == [("synchronize", 0), ("synchronize", 1), ("unregister", segment_address_of(runtime))]


def segment_address_of(runtime: FakeRuntime) -> int:
    (register,) = kinds(runtime.log, "register")
    return int(register[1])


class CupyRecorder:
    """``cupy`` as the cupy backend reaches it for pinning: hostRegister pins, then a Ctrl-C lands."""

    def __init__(self) -> None:
        self.pinned: set[int] = set()
        runtime = types.SimpleNamespace(hostRegister=self.register, hostUnregister=self.pinned.discard)
        device = types.SimpleNamespace(synchronize=lambda: None)
        self.cuda = types.SimpleNamespace(runtime=runtime, Device=lambda *a: device)

    def register(self, address: int, nbytes: int, flags: int) -> None:
        self.pinned.add(address)
        raise KeyboardInterrupt


class Libc:
    """libc's mlock / munlock: mlock locks, then a Ctrl-C lands."""

    def __init__(self) -> None:
        self.locked: set[int] = set()
        self.mlock = self._call(self._lock)
        self.munlock = self._call(self._unlock)

    @staticmethod
    def _call(body: Any) -> Any:
        class Function:  # argtypes and restype are set on it, as on a ctypes function
            def __call__(self, *args: Any) -> Any:
                return body(*args)

        return Function()

    def _unlock(self, address: int, nbytes: int) -> int:
        self.locked.discard(address)
        return 0

    def _lock(self, address: int, nbytes: int) -> int:
        self.locked.add(address)
        raise KeyboardInterrupt


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", ["cupy", "mlock"])
def test_a_ctrl_c_in_the_other_backends_pin_call_unpins_too(kind: str, tmp_path: Any,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    backend: RegisteringBackend
    if kind == "cupy":
        cupy = CupyRecorder()
        monkeypatch.setitem(sys.modules, "cupy", cupy)
        backend, pinned = CupyBackend(), cupy.pinned
    else:
        libc = Libc()
        backend, pinned = MlockBackend(libc=libc), libc.locked
    segment = Segment.create(str(tmp_path), PAGE)
    try:
        with pytest.raises(KeyboardInterrupt):
            backend.register_segment(segment)
        assert segment_address(segment) not in pinned and backend.registered == {}
    finally:
        segment.unlink()
        segment.close()
