"""Pin backends: how a slot's segment is page-locked, and how a batch is copied to a device.

Owns the two small interfaces of the GPU handoff (issue 5, docs/gpu.md) and the built-in
implementations:

- :class:`PinBackend` — ``register_segment`` (pin a new segment, once), ``unregister_segment``
  (unpin it before it is unmapped), ``finish`` (the last step of each batch before the user) and
  ``fence`` (an event recorded on the caller's current stream — torch: of every device in use —
  when a batch is dropped: the ring hands that slot to a worker only once it has completed, so a
  ``.to(device, non_blocking=True)`` the caller enqueued never reads bytes a worker is rewriting;
  torch's own pinned buffers get the same guarantee from its caching host allocator).
- :class:`Transfer` — what the device prefetcher (``shmloader.gpu.prefetch``) needs: a side stream,
  an asynchronous copy of a whole batch that returns an event, and "make the caller's stream
  wait on that event". Events answer ``query()`` and ``synchronize()``.

:class:`TorchCudaBackend` (``cudaHostRegister`` through torch's CUDA runtime bindings) and
``gpu.cupy_backend`` (``cupy.cuda.runtime.hostRegister``) implement both; ``gpu.mlock`` (best-effort
``mlock`` without a GPU) only pins. The fake backend for CI is in ``gpu.fake``.

Runs in the main process only: a CUDA context belongs to one process, so workers never pin.
Every backend and every event it hands out belongs to the process that created it
(``gpu.owned``): in any other process — a forked worker collecting inherited garbage — its entry
points do nothing (``fence`` gives None, an event's ``query`` True) and explicit device work
(``copy``, ``new_stream``) raises ``ForeignProcessError``; no accelerator call is ever made there.
Promises: each segment is registered at most once and unregistered at most once, and only what
was registered is unregistered; ``unregister_segment`` never raises (the ring calls it while it
closes); a failed registration warns once (a ``PinWarning``, also a ``RuntimeWarning``) and leaves the batch correct but unpinned. The torch
transfer allocates each batch's device memory on the caller's stream and calls no
``record_stream``, so freeing a moved batch never needs the device (not even in a forked child).
Importing this module imports neither torch nor cupy. Also here: the helpers every backend
uses (``as_tensor``, ``segment_address``; ``map_batch`` and ``iter_leaves`` come from
``gpu.batch_tree`` and are importable from here too).
"""

from __future__ import annotations

import ctypes
import warnings
from typing import Any, Protocol

import numpy as np

from shmloader.gpu.batch_tree import iter_leaves, map_batch  # noqa: F401  (iter_leaves: importable here, as before)
from shmloader.gpu.cudart import clear_last_error
from shmloader.gpu.owned import Owned, owner_only
from shmloader.kept import call_each
from shmloader.log import logger
from shmloader.owner import ProcessOwner
from shmloader.transport.segment import Segment
from shmloader.warning_types import PinWarning

HOST_REGISTER_PORTABLE = 1  # cudaHostRegisterPortable: pinned for every CUDA context, as torch uses


class Event(Protocol):
    def query(self) -> bool: ...
    def synchronize(self) -> None: ...


class PinBackend(Protocol):
    """Pins the ring's segments. ``device_pinned``: batches become pinned for a device copy."""

    name: str
    device_pinned: bool

    def register_segment(self, segment: Segment) -> None: ...
    def unregister_segment(self, segment: Segment) -> None: ...
    def finish(self, batch: Any) -> Any: ...
    def fence(self) -> Event | None: ...


class Transfer(Protocol):
    """The device side of a backend, driven by the prefetcher."""

    def new_stream(self, device: str) -> Any: ...
    def copy(self, batch: Any, device: str, stream: Any, non_blocking: bool) -> tuple[Any, Event]: ...
    def wait(self, moved: Any, event: Event, device: str) -> None: ...


def segment_address(segment: Segment) -> int:
    """The address of a segment's mapping. The probe's buffer export is released before return,
    so the ring can still unmap the segment."""
    probe = ctypes.c_char.from_buffer(segment.buf)
    try:
        return ctypes.addressof(probe)
    finally:
        del probe


def import_torch_for(what: str) -> Any:
    """``torch``, or a ModuleNotFoundError (``name="torch"``) saying that ``what`` needs it and how
    to install it, in place of a bare import failure from deep inside."""
    try:
        import torch
    except ImportError as exc:
        raise ModuleNotFoundError(f"{what} hands batches out as torch tensors and needs torch: pip install "
                                  "'shmloader[torch]' (or torch), or pass a transfer= of your own",
                                  name="torch") from exc
    return torch


def as_tensor(leaf: Any) -> Any:
    """A numpy array as a tensor sharing its memory (``torch.from_numpy``), copied first only when
    its strides are negative (``img[:, ::-1]``), which torch cannot view; anything else as is."""
    if isinstance(leaf, np.ndarray) and not leaf.dtype.hasobject:
        torch = import_torch_for("to_device")
        if any(stride < 0 for stride in leaf.strides):  # torch has no negative strides: one copy
            leaf = np.ascontiguousarray(leaf)
        try:
            return torch.from_numpy(leaf)
        except TypeError:  # a dtype torch has no type for (strings, datetimes): leave it
            return leaf
    return leaf


def cuda_index(device: str) -> int:
    """The index of "cuda:N"; 0 for "cuda" (or any other device)."""
    head, _, index = device.partition(":")
    return int(index) if head == "cuda" and index else 0


def settle(stream: Any) -> None:
    """Wait for what a copy that is raising has enqueued on ``stream``: its caller lets the batch
    (and with it the slot those copies read) go at once. A wait that fails too is only logged: the
    copy's own error is the one to raise."""
    try:
        stream.synchronize()
    except Exception as exc:
        logger.debug("could not wait for the copies of a failed transfer: %s", exc)


class RegisteringBackend(Owned):
    """Book-keeping shared by the backends: what is registered, at which address. Every entry
    point that reaches the device is inert outside the creating process (``gpu.owned``)."""

    name = "base"
    device_pinned = True

    def __init__(self) -> None:
        super().__init__()
        self.registered: dict[str, int] = {}
        self.warned = False  # a failed registration warns once per backend

    @owner_only()
    def register_segment(self, segment: Segment) -> None:
        if segment.name in self.registered:
            return
        address = segment_address(segment)
        try:
            problem = self._pin(address, segment.size_bytes)
        except Exception as exc:  # e.g. CUDA cannot initialise in this process
            problem = f"{type(exc).__name__}: {exc}"
        except BaseException:  # a Ctrl-C in the pin call is raised as it returns: the pages may be pinned
            self._unpin_quietly(address, segment.size_bytes)
            raise
        if problem:
            if not self.warned:
                self.warned = True
                warnings.warn(f"shmloader could not pin slot memory with the {self.name} backend ({problem}); "
                              "batches stay correct but unpinned, so device copies are not asynchronous.",
                              PinWarning, stacklevel=4)
            return
        self.registered[segment.name] = address

    @owner_only()
    def unregister_segment(self, segment: Segment) -> None:
        address = self.registered.pop(segment.name, None)
        if address is None:
            return
        try:
            problem = self._unpin(address, segment.size_bytes)
        except Exception as exc:  # the ring is closing: report, never raise
            problem = f"{type(exc).__name__}: {exc}"
        if problem:
            logger.debug("%s backend: unpinning segment %s failed: %s", self.name, segment.name, problem)

    def finish(self, batch: Any) -> Any:
        """Slot-backed arrays are already pinned (their pages are registered): nothing to copy.
        Touches no device, so it needs no guard."""
        return batch

    @owner_only()
    def fence(self) -> Event | None:
        """No device reads the slot asynchronously: it is reusable at once."""
        return None

    def _unpin_quietly(self, address: int, nbytes: int) -> None:
        """Undo a pin that may or may not have happened (its segment is about to go)."""
        try:
            self._unpin(address, nbytes)
        except Exception as exc:
            logger.debug("%s backend: undoing an interrupted pin failed: %s", self.name, exc)

    def _pin(self, address: int, nbytes: int) -> str | None:
        raise NotImplementedError

    def _unpin(self, address: int, nbytes: int) -> str | None:
        raise NotImplementedError


class _SideStream:
    """The torch transfer's stream for one epoch, with the event it marks the caller's stream with."""

    __slots__ = ("raw", "ready")

    def __init__(self, raw: Any, ready: Any) -> None:
        self.raw, self.ready = raw, ready


class _TorchEvent(Owned):
    """A ``torch.cuda.Event`` that answers only in the process that recorded it."""

    def __init__(self, raw: Any, owner: ProcessOwner) -> None:
        self._owner, self.raw = owner, raw

    @owner_only(True)
    def query(self) -> bool:
        return bool(self.raw.query())

    @owner_only()
    def synchronize(self) -> None:
        self.raw.synchronize()


class _TorchFence(Owned):
    """A release fence over several devices: one ``torch.cuda.Event`` each, done when all are."""

    def __init__(self, raws: list[Any], owner: ProcessOwner) -> None:
        self._owner, self.raws = owner, raws

    @owner_only(True)
    def query(self) -> bool:
        return all(raw.query() for raw in self.raws)

    @owner_only()
    def synchronize(self) -> None:
        for raw in self.raws:
            raw.synchronize()


class TorchCudaBackend(RegisteringBackend):
    """``cudaHostRegister`` / ``cudaHostUnregister`` through ``torch.cuda.cudart()``."""

    name = "torch"

    def __init__(self) -> None:
        super().__init__()
        import torch

        self._torch = torch
        self._devices: dict[str, tuple[Any, bool, int | None]] = {}  # see _target

    @staticmethod
    def usable() -> bool:
        import torch

        return bool(torch.cuda.is_available())

    def _pin(self, address: int, nbytes: int) -> str | None:
        status = self._torch.cuda.cudart().cudaHostRegister(address, nbytes, HOST_REGISTER_PORTABLE)
        return None if int(status) == 0 else self._failed("cudaHostRegister", status)

    def _unpin(self, address: int, nbytes: int) -> str | None:
        # A copy the caller enqueued may still read these pages: let every device finish first. Each
        # is waited for even if a wait raises, and the pages are unpinned before the segment is unmapped.
        try:
            call_each(self._devices_in_use(), self._torch.cuda.synchronize)
        finally:
            status = self._torch.cuda.cudart().cudaHostUnregister(address)
        return None if int(status) == 0 else self._failed("cudaHostUnregister", status)

    def _failed(self, call: str, status: Any) -> str:
        """The error in words (``status``: the binding's cudaError value). The runtime's last error
        is cleared, or torch's next launch check would raise it as its own."""
        clear_last_error()
        try:
            text = str(self._torch.cuda.cudart().cudaGetErrorString(status))
        except Exception:
            text = "no description"
        return f"{call} returned cudaError {int(status)} ({text})"

    def _devices_in_use(self) -> list[int]:
        """The devices this process has a CUDA context on (a copy to any of them may read a slot);
        the current device where torch cannot tell."""
        torch = self._torch
        has_context = getattr(torch._C, "_cuda_hasPrimaryContext", None)
        devices = [] if has_context is None else [d for d in range(torch.cuda.device_count()) if has_context(d)]
        return devices or [torch.cuda.current_device()]

    @owner_only()
    def fence(self) -> Event:
        """An event on the current stream of every device in use: it completes after every copy
        enqueued there so far. Not only the current device's: ``x.to("cuda:1", non_blocking=True)``
        runs on cuda:1's current stream whichever device is current."""
        torch, raws = self._torch, []
        for device in self._devices_in_use():
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(device))
            raws.append(event)
        return _TorchEvent(raws[0], self._owner) if len(raws) == 1 else _TorchFence(raws, self._owner)

    def _device(self, device: str) -> Any:
        return self._target(device)[0]

    def _target(self, device: str) -> tuple[Any, bool, int | None]:
        """``device`` parsed once: (torch.device, whether it is a CUDA device, its index or None)."""
        target = self._devices.get(device)
        if target is None:
            parsed = self._torch.device(device)
            target = self._devices[device] = (parsed, parsed.type == "cuda", parsed.index)
        return target

    # -- Transfer ----------------------------------------------------------------------------
    @owner_only(refuse=True)
    def new_stream(self, device: str) -> _SideStream:
        return _SideStream(self._torch.cuda.Stream(device=self._device(device)), self._torch.cuda.Event())

    @owner_only(refuse=True)
    def copy(self, batch: Any, device: str, stream: Any, non_blocking: bool) -> tuple[Any, Event]:
        """Every tensor leaf (numpy arrays first become tensors) copied on ``stream``.

        The device memory is allocated on the caller's current stream, and ``stream`` first waits
        for what that stream has enqueued so far (memory freed by an earlier batch may still be in
        use there): so the caller needs no ``record_stream``, and freeing a moved batch later never
        calls into CUDA (cupy's transfer works the same way).
        """
        torch = self._torch
        target, to_cuda, index = self._target(device)
        pairs: list[tuple[Any, Any]] = []

        def allocate(leaf: Any) -> Any:
            leaf = as_tensor(leaf)
            if not isinstance(leaf, torch.Tensor):
                return leaf
            if to_cuda:  # a leaf already on a CUDA device stays there unless another index is named
                there = leaf.is_cuda and (index is None or leaf.get_device() == index)
            else:
                there = leaf.device == target
            if there:
                return leaf
            out = torch.empty_like(leaf, device=target)
            pairs.append((out, leaf))
            return out

        moved = map_batch(batch, allocate)
        side = stream.raw
        if pairs:  # one event, recorded again each time: a wait captures the latest record
            stream.ready.record(torch.cuda.current_stream(target))
            side.wait_event(stream.ready)
        with torch.cuda.stream(side):
            try:
                for out, leaf in pairs:
                    out.copy_(leaf, non_blocking=non_blocking)
            except BaseException:
                settle(side)
                raise
            event = torch.cuda.Event()
            event.record(side)
        return moved, _TorchEvent(event, self._owner)

    @owner_only()
    def wait(self, moved: Any, event: Event, device: str) -> None:
        raw: Any = getattr(event, "raw", event)  # ours wraps torch's event
        self._torch.cuda.current_stream(self._device(device)).wait_event(raw)
