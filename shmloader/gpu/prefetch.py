"""The device prefetcher: batches arrive already on the device, copied while the model works.

Owns :func:`to_device` and :class:`DevicePrefetcher`; the iterator of one epoch and the batches it
has in flight are :mod:`shmloader.gpu.prefetch_epoch`'s. One step, for batch k of a loader::

    loader ──batch k+1 (views of a pinned slot)──▶ copy on a side stream ──▶ event k+1
    caller's stream ──waits on event k──▶ the caller gets batch k on the device
    source k (and its slot lease) ──kept until event k has completed──▶ dropped: slot free

So while the caller works on batch k, batch k+1 is already being copied; the caller's current
stream waits on the copy's event (no host synchronisation); and the slot a copy reads is never
handed back to a worker before the copy has finished (``event.query()``; ``synchronize()`` only
when more than ``max_held`` copies are unfinished, or at the end of an epoch / when the caller
stops early).

Runs in the main process, in the caller's thread, and belongs to the process that created it: in a
forked child that inherits a prefetcher mid-epoch (and collects it), releasing and draining do
nothing, so no event is queried or synchronised there (``gpu.owned``). The stream and event work goes through a
:class:`~shmloader.gpu.backends.Transfer`: for a CUDA device, the loader's pin backend when it is
one (torch, cupy) else torch's CUDA transfer; the fake backend (which drives all of this on a CPU
in CI) for any device; else a plain synchronous ``.to(device)`` (e.g. "cpu", whatever the backend).
Nested mappings and sequences are moved whole (``batch_tree.map_batch``); numpy arrays become tensors
(``torch.from_numpy``, no copy) before moving. Importing this module imports neither torch nor cupy.

Resuming: the prefetcher reads batch k+1 from the loader before it hands out batch k, so the
loader's own ``state_dict()`` already counts k+1 as delivered. :meth:`DevicePrefetcher.state_dict`
gives the loader's state as of the batch the caller last received (the loader's epoch record is
copied just before each look-ahead read); save that one (docs/resume.md).
"""

from __future__ import annotations

import functools
import importlib.util
import sys
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from shmloader import state as _state
from shmloader.gpu.backends import Event, Transfer, as_tensor, import_torch_for
from shmloader.gpu.batch_tree import map_batch
from shmloader.gpu.owned import Owned, owner_only
from shmloader.gpu.prefetch_epoch import DONE, Copy, Epoch, Mark
from shmloader.kept import call_each

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


def leaf_to(leaf: Any, device: str, non_blocking: bool) -> Any:
    """One leaf moved: a numpy array as a tensor first (``as_tensor``), a tensor ``.to(device)``,
    anything else as is."""
    leaf = as_tensor(leaf)
    torch = sys.modules.get("torch")  # a tensor means torch is imported
    if torch is not None and isinstance(leaf, torch.Tensor):
        return leaf.to(device, non_blocking=non_blocking)
    return leaf


class _SyncTransfer:
    """A device without streams (e.g. "cpu"): ``.to(device)`` now; the event is already done."""

    def new_stream(self, device: str) -> None:
        return None

    def copy(self, batch: Any, device: str, stream: Any, non_blocking: bool) -> tuple[Any, Event]:
        return map_batch(batch, lambda x: leaf_to(x, device, non_blocking)), DONE

    def wait(self, moved: Any, event: Event, device: str) -> None:
        return None


def device_name(device: Any) -> str:
    """``device`` as a string; an int read as torch reads it, as an index of the current
    accelerator (``x.to(rank)``), which without one is torch's error. A string torch cannot read
    as a device raises here, naming the argument, before the loader starts anything."""
    if not isinstance(device, int) or isinstance(device, bool):
        name = str(device)
        if sys.modules.get("torch") is not None or importlib.util.find_spec("torch") is not None:  # else unread
            import torch

            try:
                torch.device(name)
            except RuntimeError as exc:
                raise RuntimeError(f"to_device: device={device!r} is not a device: {exc}") from None
        return name
    torch = import_torch_for("to_device")  # an index means the current accelerator's, which torch knows
    current = getattr(torch, "accelerator", None)
    accelerator = current.current_accelerator() if current is not None else torch.device("cuda")
    if accelerator is None:
        raise RuntimeError("Cannot access accelerator device when none is available.")
    return f"{accelerator.type}:{device}"


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


class DevicePrefetcher(Owned):
    """Iterable over a loader's batches on a device; see the module docstring for the protocol.

    Owns the batches it has read but whose copies may still read their slots (``held``, and the
    one read ahead) and, during an epoch, the stream it copies on.
    """

    def __init__(self, source: Iterable[Any], device: Any, non_blocking: bool = True, *,
                 transfer: Transfer | None = None, max_held: int = MAX_HELD) -> None:
        if max_held < 0:
            raise ValueError(f"max_held must be non-negative, got {max_held}")
        super().__init__()
        self.source = source
        self.device = device_name(device)
        self.non_blocking = non_blocking
        self.max_held = max_held
        self._transfer = transfer
        self.held: deque[Copy] = deque()  # yielded batches whose copy may still read their slot
        # Where the loader's epoch stood before the latest look-ahead read (None: no epoch under
        # way here, the loader's own state is right); and after it, when that read raised.
        self._mark: Mark | None = None
        self.failed_mark: Mark | None = None

    def __len__(self) -> int:
        return len(self.source)  # type: ignore[arg-type]

    def __iter__(self) -> Iterator[Any]:
        return Epoch(self)

    def state_dict(self) -> dict[str, Any]:
        """The loader's ``state_dict()`` as of the batch the caller last received (not the one
        already read ahead); load it with ``loader.load_state_dict`` (docs/resume.md)."""
        if self._mark is not None:
            return self._mark.state()
        state_dict = getattr(self.source, "state_dict", None)
        if not callable(state_dict):
            raise TypeError(f"{type(self.source).__name__} has no state_dict(): only a loader's position can be saved")
        return state_dict()  # type: ignore[no-any-return]

    def _epoch_transfer(self) -> Transfer:
        """The stream/event implementation of a new epoch: the one given, else :func:`transfer_for`."""
        return self._transfer or transfer_for(self.source, self.device)

    def _start(self, batches: Iterator[Any], transfer: Transfer, stream: Any, pending: deque[Copy],
               save: Callable[[_state.EpochRecord], dict[str, Any]] | None) -> bool:
        """Read the next batch and enqueue its copy (False: the epoch has no more); first mark
        where the loader's epoch stood. The batch is pending from its read on: a Ctrl-C inside
        its copy leaves it there, uncopied, for ``_copy_again``."""
        record = getattr(batches, "_record", None)  # a loader's iterator keeps its epoch record
        mark = None
        if save is not None and isinstance(record, _state.EpochRecord):
            mark = functools.partial(Mark, save, record)
            self._mark = mark()
        self.failed_mark = None
        try:
            source = next(batches)
        except StopIteration:
            return False
        except Exception:  # the batch's error: once raised, the epoch stands after it (it is delivered)
            self.failed_mark = mark() if mark is not None else None
            raise
        pending.append(Copy(source, self._mark))
        self._copy(pending, transfer, stream)
        return True

    def _copy_again(self, pending: deque[Copy], transfer: Transfer, stream: Any) -> None:
        """Copy the batch read last, whose copy a Ctrl-C or SystemExit cut short. The loader
        counts it handed over already: the state stands where it stood before its read."""
        self._mark = pending[-1].mark
        self.failed_mark = None
        self._copy(pending, transfer, stream)

    def _copy(self, pending: deque[Copy], transfer: Transfer, stream: Any) -> None:
        """Enqueue the copy of the batch read last. A ``BaseException`` (Ctrl-C) leaves it pending,
        uncopied; the copy's own error (a CUDA error) lets it go as the error passes."""
        copy = pending[-1]
        try:
            moved, event = transfer.copy(copy.source, self.device, stream, self.non_blocking)
        except Exception:
            pending.pop()
            raise
        copy.moved = moved
        copy.event = event  # last: a copy with its event is whole

    @owner_only()
    def _release_finished(self) -> None:
        """Drop the sources whose copies have finished; wait for the oldest past ``max_held``."""
        held = self.held
        while held and held[0].event.query():
            held.popleft()
        while len(held) > self.max_held:
            held[0].event.synchronize()  # then let go: a wait that raises keeps the source
            held.popleft()

    @owner_only()
    def _drain(self, pending: deque[Copy]) -> None:
        """End of the epoch or an early stop: every copy finishes before its slot is let go.
        Inert in a process that inherited this prefetcher (its copies are not this process's)."""
        try:  # every copy, even after a wait raised (UNCOPIED, a copy a Ctrl-C cut short: no wait)
            call_each((*self.held, *pending), _synchronize)
        finally:
            self.held.clear()
            pending.clear()


def _synchronize(copy: Copy) -> None:
    copy.event.synchronize()


