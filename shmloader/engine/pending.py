"""A ``num_workers=0`` task in hand, and the per-task seeding of the main process.

Owns :class:`Pending` (a task between its sampler item and its batch's hand-out, which a
``KeyboardInterrupt`` or ``SystemExit`` leaves for the next ``next()``) and :func:`seeded`, which
seeds the main process for one task as a worker would seed itself, then puts the caller's RNG
states back. Used by ``engine.iterator.SingleProcessIter`` only; runs in the main process.
"""

from __future__ import annotations

import contextlib
import random
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from shmloader.worker_info import generate_state, seed_rngs

__all__ = ["INTERRUPTS", "UNFETCHED", "UNMADE", "Pending", "rng_states", "seeded"]

# What interrupts a task rather than failing it: the task stays pending. Any other exception (a
# GeneratorExit or asyncio.CancelledError a dataset raises too) is the batch's own error, as in torch.
INTERRUPTS = (KeyboardInterrupt, SystemExit)
UNFETCHED: Any = object()
UNMADE: Any = object()


@dataclass
class Pending:
    """A ``num_workers=0`` task between its sampler item and its batch's hand-out. A
    ``KeyboardInterrupt`` or ``SystemExit`` there is not the batch's error: the batch was never
    handed out, so the next ``next()`` makes it (from ``data`` once fetched: an iterable dataset's
    samples cannot be fetched twice) and the epoch stays the uninterrupted one, no task left out of
    the delivered set for a later state to fetch again (docs/resume.md, "An interrupted batch")."""

    task: int
    index: Any
    data: Any = UNFETCHED
    rngs: tuple[Any, Any, Any] | None = None  # with per-task seeding: where a retry's RNGs go on from
    batch: Any = UNMADE  # made, and waiting for its report (an interrupt in an observer) to be handed out
    times: tuple[float, float, float] = (0.0, 0.0, 0.0)  # fetch, collate, both: what the report says


@contextlib.contextmanager
def seeded(seed: int | None, pending: Pending, iterable: bool) -> Iterator[None]:
    """Per-task seeding in the main process: seed as ``worker_info.seed_task`` does, then put back the
    caller's random, numpy and torch CPU RNG states (torch.manual_seed would also reseed CUDA's).

    A task made again after an interrupt goes on from ``pending.rngs`` where it has them, so its
    samples draw what they would have drawn uninterrupted: taken once its samples were fetched (a
    collate made again), or, for an iterable dataset, when the interrupt came (its fetch goes on from
    the samples it kept). A map-style fetch is made again from the start: seeded afresh."""
    if seed is None:
        yield
        return
    saved = rng_states()
    if pending.rngs is None:
        seed_rngs(seed, generate_state(seed, 0), cuda=False)
    else:
        _set_rng_states(pending.rngs)
    try:
        yield
    except INTERRUPTS:
        if pending.data is UNFETCHED:
            pending.rngs = rng_states() if iterable else None
        raise
    finally:
        _set_rng_states(saved)


def rng_states() -> tuple[Any, Any, Any]:
    """random's, numpy's global and (when imported) torch's CPU RNG states."""
    import numpy as np

    torch = sys.modules.get("torch")
    return random.getstate(), np.random.get_state(), None if torch is None else torch.get_rng_state()


def _set_rng_states(states: tuple[Any, Any, Any]) -> None:
    import numpy as np

    random.setstate(states[0])
    np.random.set_state(states[1])
    torch = sys.modules.get("torch")
    if torch is not None and states[2] is not None:
        torch.set_rng_state(states[2])
