"""The cupy pin backend: ``cupy.cuda.runtime.hostRegister`` pins the slots; transfers yield cupy
arrays.

Owns :class:`CupyBackend` and its events. Runs in the main process, like every backend
(``gpu.backends``, whose contract it implements), and is inert in any other process
(``gpu.owned``). Promises: as the torch backend — each segment registered and unregistered once,
a failed registration warns once, the side stream waits for the caller's stream before it copies
(cupy has no ``record_stream``). Importing this module does not import cupy.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from shmloader.gpu.backends import (
    HOST_REGISTER_PORTABLE,
    Event,
    RegisteringBackend,
    cuda_index,
    settle,
)
from shmloader.gpu.batch_tree import map_batch
from shmloader.gpu.owned import Owned, owner_only
from shmloader.owner import ProcessOwner

__all__ = ["CupyBackend"]


class CupyBackend(RegisteringBackend):
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
            self._cupy.cuda.runtime.hostRegister(address, nbytes, HOST_REGISTER_PORTABLE)
        except Exception as exc:  # cupy raises CUDARuntimeError
            return str(exc)
        return None

    def _unpin(self, address: int, nbytes: int) -> str | None:
        try:
            self._cupy.cuda.Device().synchronize()
        finally:  # a Ctrl-C lands as the wait returns: the pages are still unpinned before the unmap
            self._cupy.cuda.runtime.hostUnregister(address)
        return None

    @owner_only()
    def fence(self) -> Event:
        """An event on cupy's current stream (see :meth:`TorchCudaBackend.fence`)."""
        return _CupyEvent(self._cupy.cuda.get_current_stream().record(), self._owner)

    def _device(self, device: str) -> Any:
        """The cupy device for "cuda:N" (device 0 for "cuda"), a context manager."""
        return self._cupy.cuda.Device(cuda_index(device))

    # -- Transfer ----------------------------------------------------------------------------
    @owner_only(refuse=True)
    def new_stream(self, device: str) -> Any:
        with self._device(device):
            return self._cupy.cuda.Stream(non_blocking=True)

    @owner_only(refuse=True)
    def copy(self, batch: Any, device: str, stream: Any, non_blocking: bool) -> tuple[Any, Event]:
        cupy = self._cupy
        with self._device(device):
            # cupy has no record_stream: the side stream waits for what the caller enqueued so
            # far, so memory freed by an earlier batch is not overwritten while still in use.
            stream.wait_event(cupy.cuda.get_current_stream().record())
            with stream:
                try:
                    moved = map_batch(batch, lambda x: self._leaf(x, stream if non_blocking else None))
                except BaseException:
                    settle(stream)
                    raise
            event = stream.record()
        return moved, _CupyEvent(event, self._owner)

    def _leaf(self, leaf: Any, stream: Any) -> Any:
        if hasattr(leaf, "numpy") and hasattr(leaf, "is_pinned"):
            leaf = leaf.numpy()
        if not isinstance(leaf, np.ndarray) or leaf.dtype.hasobject:
            return leaf
        out = self._cupy.empty(leaf.shape, dtype=leaf.dtype)
        out.set(np.ascontiguousarray(leaf), stream=stream)
        return out

    @owner_only()
    def wait(self, moved: Any, event: Event, device: str) -> None:
        with self._device(device):
            self._cupy.cuda.get_current_stream().wait_event(getattr(event, "raw", event))


class _CupyEvent(Owned):
    """A cupy event that answers only in the process that recorded it."""

    def __init__(self, raw: Any, owner: ProcessOwner) -> None:
        self._owner, self.raw = owner, raw

    @owner_only(True)
    def query(self) -> bool:
        return bool(self.raw.done)

    @owner_only()
    def synchronize(self) -> None:
        self.raw.synchronize()
