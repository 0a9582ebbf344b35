"""Pin backends: how a slot's segment is page-locked, and how a batch is copied to a device.

Owns the two small interfaces of the GPU handoff (issue 5, docs/gpu.md) and the built-in
implementations:

- :class:`PinBackend` — ``register_segment`` (pin a new segment, once), ``unregister_segment``
  (unpin it before it is unmapped), ``finish`` (the last step of each batch before the user) and
  ``fence`` (an event recorded on the caller's current stream when a batch is dropped: the ring
  hands that slot to a worker only once it has completed, so a ``.to(device, non_blocking=True)``
  the caller enqueued never reads bytes a worker is rewriting; torch's own pinned buffers get the
  same guarantee from its caching host allocator).
- :class:`Transfer` — what the device prefetcher (``shmloader.gpu.prefetch``) needs: a side stream,
  an asynchronous copy of a whole batch that returns an event, and "make the caller's stream
  wait on that event". Events answer ``query()`` and ``synchronize()``.

:class:`TorchCudaBackend` (``cudaHostRegister`` through torch's CUDA runtime bindings) and
:class:`CupyBackend` (``cupy.cuda.runtime.hostRegister``) implement both; :class:`MlockBackend`
(best-effort ``mlock`` without a GPU) only pins. The fake backend for CI is in ``gpu.fake``.

Runs in the main process only: a CUDA context belongs to one process, so workers never pin.
Promises: each segment is registered at most once and unregistered at most once, and only what
was registered is unregistered; ``unregister_segment`` never raises (the ring calls it while it
closes); a failed registration warns once and leaves the batch correct but unpinned. Importing
this module imports neither torch nor cupy.
"""

from __future__ import annotations

import ctypes
import errno
import os
import sys
import warnings
from collections.abc import Callable, Iterator, Mapping
from typing import Any, Protocol

import numpy as np

from shmloader.gpu.cudart import clear_last_error
from shmloader.log import logger
from shmloader.transport.segment import Segment

_HOST_REGISTER_PORTABLE = 1  # cudaHostRegisterPortable: pinned for every CUDA context, as torch uses


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


def map_batch(batch: Any, leaf: Callable[[Any], Any]) -> Any:
    """Apply ``leaf`` to every non-container value of a nested batch, keeping its structure.

    Dicts (and other mappings), lists, tuples and namedtuples are rebuilt with their own type
    where it accepts it (torch's pin_memory does the same), else as dict / list.
    """
    if isinstance(batch, (str, bytes)):
        return batch
    if isinstance(batch, Mapping):
        items = {k: map_batch(v, leaf) for k, v in batch.items()}
        try:
            return type(batch)(items)  # type: ignore[call-arg]
        except TypeError:
            return items
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):
        return type(batch)(*(map_batch(v, leaf) for v in batch))
    if isinstance(batch, (list, tuple)):
        items_list = [map_batch(v, leaf) for v in batch]
        try:
            return type(batch)(items_list)
        except TypeError:
            return items_list
    return leaf(batch)


def iter_leaves(batch: Any) -> Iterator[Any]:
    """Every value ``map_batch`` would apply its ``leaf`` to, in its order; builds no container."""
    if isinstance(batch, (str, bytes)):
        return
    if isinstance(batch, Mapping):
        for value in batch.values():
            yield from iter_leaves(value)
    elif isinstance(batch, (list, tuple)):
        for value in batch:
            yield from iter_leaves(value)
    else:
        yield batch


def as_tensor(leaf: Any) -> Any:
    """A numpy array as a tensor sharing its memory (``torch.from_numpy``); anything else as is."""
    if isinstance(leaf, np.ndarray) and not leaf.dtype.hasobject:
        import torch

        try:
            return torch.from_numpy(leaf)
        except TypeError:  # a dtype torch has no type for (strings, datetimes): leave it
            return leaf
    return leaf


def leaf_to(leaf: Any, device: str, non_blocking: bool) -> Any:
    """One leaf moved: a numpy array as a tensor first (``as_tensor``), a tensor ``.to(device)``,
    anything else as is."""
    leaf = as_tensor(leaf)
    torch = sys.modules.get("torch")  # a tensor means torch is imported
    if torch is not None and isinstance(leaf, torch.Tensor):
        return leaf.to(device, non_blocking=non_blocking)
    return leaf


def _cuda_index(device: str) -> int:
    """The index of "cuda:N"; 0 for "cuda" (or any other device)."""
    head, _, index = device.partition(":")
    return int(index) if head == "cuda" and index else 0


class _RegisteringBackend:
    """Book-keeping shared by the backends: what is registered, at which address."""

    name = "base"
    device_pinned = True

    def __init__(self) -> None:
        self.registered: dict[str, int] = {}
        self.warned = False  # a failed registration warns once per backend

    def register_segment(self, segment: Segment) -> None:
        if segment.name in self.registered:
            return
        address = segment_address(segment)
        try:
            problem = self._pin(address, segment.size_bytes)
        except Exception as exc:  # e.g. CUDA cannot initialise in this process
            problem = f"{type(exc).__name__}: {exc}"
        if problem:
            if not self.warned:
                self.warned = True
                warnings.warn(f"shmloader could not pin slot memory with the {self.name} backend ({problem}); "
                              "batches stay correct but unpinned, so device copies are not asynchronous.",
                              RuntimeWarning, stacklevel=3)
            return
        self.registered[segment.name] = address

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
        """Slot-backed arrays are already pinned (their pages are registered): nothing to copy."""
        return batch

    def fence(self) -> Event | None:
        """No device reads the slot asynchronously: it is reusable at once."""
        return None

    def _pin(self, address: int, nbytes: int) -> str | None:
        raise NotImplementedError

    def _unpin(self, address: int, nbytes: int) -> str | None:
        raise NotImplementedError


class TorchCudaBackend(_RegisteringBackend):
    """``cudaHostRegister`` / ``cudaHostUnregister`` through ``torch.cuda.cudart()``."""

    name = "torch"

    def __init__(self) -> None:
        super().__init__()
        import torch

        self._torch = torch

    @staticmethod
    def usable() -> bool:
        import torch

        return bool(torch.cuda.is_available())

    def _pin(self, address: int, nbytes: int) -> str | None:
        status = self._torch.cuda.cudart().cudaHostRegister(address, nbytes, _HOST_REGISTER_PORTABLE)
        return None if int(status) == 0 else self._failed("cudaHostRegister", status)

    def _unpin(self, address: int, nbytes: int) -> str | None:
        # A copy the caller enqueued may still read these pages: let the device finish first.
        self._torch.cuda.synchronize()
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

    def fence(self) -> Event:
        """An event on the current stream: it completes after every copy enqueued there so far."""
        event = self._torch.cuda.Event()
        event.record()
        return event  # type: ignore[no-any-return]

    # -- Transfer ----------------------------------------------------------------------------
    def new_stream(self, device: str) -> Any:
        return self._torch.cuda.Stream(device=self._torch.device(device))

    def copy(self, batch: Any, device: str, stream: Any, non_blocking: bool) -> tuple[Any, Event]:
        torch = self._torch
        with torch.cuda.stream(stream):
            moved = map_batch(batch, lambda x: leaf_to(x, device, non_blocking))
            event = torch.cuda.Event()
            event.record(stream)
        return moved, event

    def wait(self, moved: Any, event: Event, device: str) -> None:
        torch = self._torch
        current = torch.cuda.current_stream(torch.device(device))
        current.wait_event(event)
        for leaf in iter_leaves(moved):
            if isinstance(leaf, torch.Tensor) and leaf.is_cuda:
                leaf.record_stream(current)  # made on the side stream, used on the caller's


class CupyBackend(_RegisteringBackend):
    """``cupy.cuda.runtime.hostRegister``; its transfers yield cupy arrays."""

    name = "cupy"

    def __init__(self) -> None:
        super().__init__()
        import cupy

        self._cupy = cupy

    @staticmethod
    def usable() -> bool:
        try:
            import cupy

            return int(cupy.cuda.runtime.getDeviceCount()) > 0
        except Exception:
            return False

    def _pin(self, address: int, nbytes: int) -> str | None:
        try:
            self._cupy.cuda.runtime.hostRegister(address, nbytes, _HOST_REGISTER_PORTABLE)
        except Exception as exc:  # cupy raises CUDARuntimeError
            return str(exc)
        return None

    def _unpin(self, address: int, nbytes: int) -> str | None:
        self._cupy.cuda.Device().synchronize()
        self._cupy.cuda.runtime.hostUnregister(address)
        return None

    def fence(self) -> Event:
        """An event on cupy's current stream (see :meth:`TorchCudaBackend.fence`)."""
        return _CupyEvent(self._cupy.cuda.get_current_stream().record())

    def _device(self, device: str) -> Any:
        """The cupy device for "cuda:N" (device 0 for "cuda"), a context manager."""
        return self._cupy.cuda.Device(_cuda_index(device))

    # -- Transfer ----------------------------------------------------------------------------
    def new_stream(self, device: str) -> Any:
        with self._device(device):
            return self._cupy.cuda.Stream(non_blocking=True)

    def copy(self, batch: Any, device: str, stream: Any, non_blocking: bool) -> tuple[Any, Event]:
        cupy = self._cupy
        with self._device(device):
            # cupy has no record_stream: the side stream waits for what the caller enqueued so
            # far, so memory freed by an earlier batch is not overwritten while still in use.
            stream.wait_event(cupy.cuda.get_current_stream().record())
            with stream:
                moved = map_batch(batch, lambda x: self._leaf(x, stream if non_blocking else None))
            event = stream.record()
        return moved, _CupyEvent(event)

    def _leaf(self, leaf: Any, stream: Any) -> Any:
        if hasattr(leaf, "numpy") and hasattr(leaf, "is_pinned"):
            leaf = leaf.numpy()
        if not isinstance(leaf, np.ndarray) or leaf.dtype.hasobject:
            return leaf
        out = self._cupy.empty(leaf.shape, dtype=leaf.dtype)
        out.set(np.ascontiguousarray(leaf), stream=stream)
        return out

    def wait(self, moved: Any, event: Event, device: str) -> None:
        with self._device(device):
            self._cupy.cuda.get_current_stream().wait_event(event.raw)  # type: ignore[attr-defined]


class _CupyEvent:
    def __init__(self, raw: Any) -> None:
        self.raw = raw

    def query(self) -> bool:
        return bool(self.raw.done)

    def synchronize(self) -> None:
        self.raw.synchronize()


class MlockBackend(_RegisteringBackend):
    """Best-effort page lock with libc ``mlock``/``munlock`` (no device; for CPU-side latency).

    Locked pages are not pinned for a device (``device_pinned`` is False). EPERM/ENOMEM — an
    ``RLIMIT_MEMLOCK`` smaller than the ring — warn once and leave the rest unlocked.
    """

    name = "mlock"
    device_pinned = False

    def __init__(self, libc: Any = None) -> None:
        super().__init__()
        self._libc = libc if libc is not None else ctypes.CDLL(None, use_errno=True)
        for fn in (self._libc.mlock, self._libc.munlock):
            fn.argtypes, fn.restype = [ctypes.c_void_p, ctypes.c_size_t], ctypes.c_int

    def _pin(self, address: int, nbytes: int) -> str | None:
        if self._libc.mlock(address, nbytes) == 0:
            return None
        err = ctypes.get_errno()
        if err in (errno.EPERM, errno.ENOMEM):
            return f"mlock: {os.strerror(err)}; {memlock_limit_text()}"
        return f"mlock: {os.strerror(err)}"

    def _unpin(self, address: int, nbytes: int) -> str | None:
        if self._libc.munlock(address, nbytes) == 0:
            return None
        return f"munlock: {os.strerror(ctypes.get_errno())}"


def memlock_limit_text() -> str:
    """RLIMIT_MEMLOCK in words, with how to raise it."""
    try:
        import resource

        soft, _hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    except (ImportError, OSError):
        return "RLIMIT_MEMLOCK is unknown here"
    limit = "unlimited" if soft == resource.RLIM_INFINITY else f"{soft} bytes"
    return (f"RLIMIT_MEMLOCK is {limit}: raise it (ulimit -l unlimited, memlock in limits.conf, "
            "docker --ulimit memlock=-1) to lock the whole ring")
