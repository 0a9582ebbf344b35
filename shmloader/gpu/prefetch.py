"""The device prefetcher: batches arrive already on the device, copied while the model works.

Owns :func:`to_device` and :class:`DevicePrefetcher`. One step, for batch k of a loader::

    loader ──batch k+1 (views of a pinned slot)──▶ copy on a side stream ──▶ event k+1
    caller's stream ──waits on event k──▶ the caller gets batch k on the device
    source k (and its slot lease) ──kept until event k has completed──▶ dropped: slot free

So while the caller works on batch k, batch k+1 is already being copied; the caller's current
stream waits on the copy's event (no host synchronisation); and the slot a copy reads is never
handed back to a worker before the copy has finished (``event.query()``; ``synchronize()`` only
when more than ``max_held`` copies are unfinished, or at the end of an epoch / when the caller
stops early).

Runs in the main process, in the caller's thread. The stream and event work goes through a
:class:`~shmloader.gpu.backends.Transfer`: for a CUDA device, the loader's pin backend when it is
one (torch, cupy) else torch's CUDA transfer; the fake backend (which drives all of this on a CPU
in CI) for any device; else a plain synchronous ``.to(device)`` (e.g. "cpu", whatever the backend).
Nested dicts, lists, tuples and namedtuples are moved whole; numpy arrays become tensors
(``torch.from_numpy``, no copy) before moving. Importing this module imports neither torch nor cupy.

Resuming: the prefetcher reads batch k+1 from the loader before it hands out batch k, so the
loader's own ``state_dict()`` already counts k+1 as delivered. :meth:`DevicePrefetcher.state_dict`
gives the loader's state as of the batch the caller last received (the loader's epoch record is
copied just before each look-ahead read); save that one (docs/resume.md).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, replace
from typing import Any

from shmloader import state as _state
from shmloader.gpu.backends import Event, Transfer, leaf_to, map_batch

__all__ = ["DevicePrefetcher", "to_device"]

MAX_HELD = 2


def to_device(loader: Iterable[Any], device: Any, non_blocking: bool = True, *,
              transfer: Transfer | None = None, max_held: int = MAX_HELD) -> DevicePrefetcher:
    """Iterate ``loader`` with every batch already on ``device``, the next one copied meanwhile.

    ``loader`` is a shmloader DataLoader (or any iterable of batches); iterate the result as you
    would the loader, once per epoch. ``transfer`` overrides the stream/event implementation;
    ``max_held``: unfinished copies allowed before the host waits for the oldest.
    """
    return DevicePrefetcher(loader, device, non_blocking, transfer=transfer, max_held=max_held)


@dataclass(eq=False)
class _Copy:
    """One batch in flight: its source (which holds the slot lease), its copy and the event."""

    source: Any
    moved: Any
    event: Event


class _SyncTransfer:
    """A device without streams (e.g. "cpu"): ``.to(device)`` now; the event is already done."""

    def new_stream(self, device: str) -> None:
        return None

    def copy(self, batch: Any, device: str, stream: Any, non_blocking: bool) -> tuple[Any, Event]:
        return map_batch(batch, lambda x: leaf_to(x, device, non_blocking)), _DONE

    def wait(self, moved: Any, event: Event, device: str) -> None:
        return None


class _Done:
    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        return None


_DONE = _Done()


def _is_cuda(device: str) -> bool:
    return device.partition(":")[0] == "cuda"


def transfer_for(source: Any, device: str) -> Transfer:
    """For a CUDA device the loader's pin backend if it can transfer, else torch CUDA; the fake
    backend for any device; else a plain ``.to(device)`` (a "cpu" copy needs no stream)."""
    pinner: Any = getattr(source, "_pinner", None)
    can_transfer = pinner is not None and all(hasattr(pinner, m) for m in ("new_stream", "copy", "wait"))
    if can_transfer and (_is_cuda(device) or getattr(pinner, "name", None) == "fake"):
        return pinner  # type: ignore[no-any-return]
    if _is_cuda(device):
        from shmloader.gpu.backends import TorchCudaBackend

        return TorchCudaBackend()  # type: ignore[return-value]
    return _SyncTransfer()


class DevicePrefetcher:
    """Iterable over a loader's batches on a device; see the module docstring for the protocol."""

    def __init__(self, source: Iterable[Any], device: Any, non_blocking: bool = True, *,
                 transfer: Transfer | None = None, max_held: int = MAX_HELD) -> None:
        if max_held < 0:
            raise ValueError(f"max_held must be non-negative, got {max_held}")
        self.source = source
        self.device = str(device)
        self.non_blocking = non_blocking
        self.max_held = max_held
        self._transfer = transfer
        self.held: deque[_Copy] = deque()  # yielded batches whose copy may still read their slot
        # The loader and its epoch record as they were before the latest look-ahead read (None:
        # no epoch under way here, the loader's own state is right).
        self._saved: tuple[Any, _state.EpochRecord] | None = None

    def __len__(self) -> int:
        return len(self.source)  # type: ignore[arg-type]

    def __iter__(self) -> Iterator[Any]:
        return self._run()

    def state_dict(self) -> dict[str, Any]:
        """The loader's ``state_dict()`` as of the batch the caller last received (not the one
        already read ahead); load it with ``loader.load_state_dict`` (docs/resume.md)."""
        if self._saved is not None:
            return _state.loader_state(*self._saved)
        state_dict = getattr(self.source, "state_dict", None)
        if not callable(state_dict):
            raise TypeError(f"{type(self.source).__name__} has no state_dict(): only a loader's position can be saved")
        return state_dict()  # type: ignore[no-any-return]

    def _run(self) -> Iterator[Any]:
        self._saved = None
        batches = iter(self.source)  # first: a loader picks its pin backend when it starts
        transfer = self._transfer or transfer_for(self.source, self.device)
        stream = transfer.new_stream(self.device)
        pending: deque[_Copy] = deque()
        try:
            self._start(batches, transfer, stream, pending)
            while pending:
                current = pending.popleft()
                self._start(batches, transfer, stream, pending)  # batch k+1 copies during k's work
                transfer.wait(current.moved, current.event, self.device)
                moved, current.moved = current.moved, None
                self.held.append(current)
                del current
                self._release_finished()
                yield moved
            self._saved = None  # the epoch ended: the loader's state (the next epoch's start) is right
        finally:
            self._drain(pending)

    def _snapshot(self, batches: Iterator[Any]) -> None:
        """Copy the loader's epoch record: what it has delivered (and yielded) before the next read."""
        record = getattr(batches, "_record", None)
        if isinstance(record, _state.EpochRecord):
            delivered = _state.TaskSet.from_ranges(record.delivered.to_ranges())
            self._saved = (getattr(batches, "_loader", self.source), replace(record, delivered=delivered))

    def _start(self, batches: Iterator[Any], transfer: Transfer, stream: Any, pending: deque[_Copy]) -> None:
        self._snapshot(batches)
        try:
            source = next(batches)
        except StopIteration:
            return
        moved, event = transfer.copy(source, self.device, stream, self.non_blocking)
        pending.append(_Copy(source, moved, event))

    def _release_finished(self) -> None:
        """Drop the sources whose copies have finished; wait for the oldest past ``max_held``."""
        held = self.held
        while held and held[0].event.query():
            held.popleft()
        while len(held) > self.max_held:
            held.popleft().event.synchronize()

    def _drain(self, pending: deque[_Copy]) -> None:
        """End of the epoch or an early stop: every copy finishes before its slot is let go."""
        for copy in (*self.held, *pending):
            copy.event.synchronize()
        self.held.clear()
        pending.clear()
