"""Wire types: everything that crosses a worker's pipes. Few, frozen, small.

main → worker: ``Task`` (fetch these indices, collate into this slot), ``Reset`` (a new epoch of
an iterable dataset: restart the worker's iterator), ``Detach`` (unmap retired segments), and
``None`` (stop).

worker → main: ``Ready`` (initialised), ``Filled`` (the batch is in the slot; here is its
descriptor), ``TooSmall`` (the slot cannot hold the batch; this many bytes are needed), ``Failed``
(user code raised; the exception travels as type + traceback text; ``starting``: the worker's
start-up failed, and this is its answer to every task), ``Exhausted`` (an iterable dataset's
worker ran out of data), ``ResetDone`` (the worker restarted its iterator for that epoch and has
read nothing of it yet: one per epoch, before any reply to the epoch's tasks).

Every reply names the epoch and task it answers, so a reply from an abandoned epoch (a user who
broke out of a loop with persistent workers) is recognised and its slot reclaimed.

The three that travel once per batch — ``Task``, its ``SlotRef`` and ``Filled`` — are named
tuples, which ``transport.wire`` builds straight from the unpickled tuple: 4x cheaper to make than
a frozen slots dataclass, whose ``__init__`` sets each field through ``object.__setattr__``
(issue 16). The rest are frozen dataclasses.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, NamedTuple, TypeVar

C = TypeVar("C")


def _compact(cls: type[C]) -> type[C]:
    """Pickle as (class, field values): 5x cheaper than the slots dataclass default (hot path)."""
    names = tuple(f.name for f in fields(cls))  # type: ignore[arg-type]

    def __reduce__(self: Any) -> tuple[Any, tuple[Any, ...]]:
        return cls, tuple(getattr(self, n) for n in names)

    cls.__reduce__ = __reduce__  # type: ignore[method-assign, assignment]
    return cls


class SlotRef(NamedTuple):
    """Which segment a worker must write: the slot id, segment name and its size."""

    slot_id: int
    name: str
    size_bytes: int


class Task(NamedTuple):
    epoch: int
    task: int
    indices: Any  # the batch sampler's batch as it is, [index] without batching; None for an iterable dataset
    slot: SlotRef
    seed: int | None = None  # per-task seeding (base_seed, task) when enabled


@_compact
@dataclass(frozen=True, slots=True)
class Reset:
    epoch: int
    seed: int | None = None  # re-seeds the workers' dataset (WorkerSpec.reseed)


@_compact
@dataclass(frozen=True, slots=True)
class Detach:
    names: tuple[str, ...]


@_compact
@dataclass(frozen=True, slots=True)
class Ready:
    worker_id: int
    pid: int


class Filled(NamedTuple):
    epoch: int
    task: int
    slot_id: int
    payload: bytes | tuple  # codec.encode's descriptor: a pickle, or the flat tuple
    nbytes: int
    fetch_s: float
    collate_s: float
    used_bytes: int = -1  # the slot's bytes the batch occupies from its start (-1: not said, all of them)


@_compact
@dataclass(frozen=True, slots=True)
class TooSmall:
    epoch: int
    task: int
    slot_id: int
    needed_bytes: int


@_compact
@dataclass(frozen=True, slots=True)
class Failed:
    epoch: int
    task: int | None  # None: the task's frame did not unpickle in the worker (its oldest task)
    type_name: str
    exc_type: bytes | None  # the pickled exception type, when it pickles
    traceback: str
    # the worker's start-up (unpickling, seeding, a worker_init_fn's sys.exit()) failed: its answer to each task it
    # is sent (task None: one that did not unpickle there), as torch's worker answers its first index
    starting: bool = False
    # the worker's worker_init_fn raised: its answer to its first task only, after which it serves
    # tasks without its init, as torch's worker does (worker.failed_start.run_init)
    init: bool = False


@_compact
@dataclass(frozen=True, slots=True)
class ResetDone:
    epoch: int


@_compact
@dataclass(frozen=True, slots=True)
class Exhausted:
    epoch: int
    task: int

