"""What must match between the loader that saved a state and the loader that loads it.

Owns the ``config`` field of a saved state (``config_of``) and the check that refuses a state its
loader would not resume exactly (``check_config``). Pure: reads the loader's attributes, changes
nothing. Promises: a state loads only where its delivered task numbers mean the same batches, each
difference printed with both sides in a ``StateError``; lengths alone may differ when the loaded
objects' own states may change them (a curriculum level); an iterable dataset's epoch, which is
resumed by making its first batches again and dropping them, loads mid-way only with the worker
count that saved it, and from an ``in_order=False`` epoch only with one worker or none, once its
batches were handed out in task order (each worker iterates its own shard, and an unordered
epoch's arrival order is not replayed: loaded otherwise, batches were lost and others repeated
without a word, tests/test_resume_iterable_shards.py).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from shmloader.errors import StateError

_LENGTHS = {"dataset_len", "batches_per_epoch"}  # what the loaded objects' own states may change
_MID_EPOCH = {"num_workers"}  # what must match only to resume inside an epoch


def config_of(loader: Any) -> dict[str, Any]:
    """What must match for delivered task numbers to mean the same batches."""
    iterable = loader._is_iterable
    return {
        "dataset_len": _len_or_none(loader.dataset),
        "iterable": iterable,
        "batch_size": loader.batch_size,
        "drop_last": loader.drop_last,
        "sampler": type_name(loader.sampler),
        "batch_sampler": None if loader.batch_sampler is None else type_name(loader.batch_sampler),
        "batches_per_epoch": None if iterable else _len_or_none(loader._index_sampler),
        "task_seeding": bool(loader._config.task_seeding),
        # an iterable dataset's shards follow the worker count; a map-style epoch resumes with any
        "num_workers": loader.num_workers if iterable else None,
        "in_order": bool(loader.in_order) if iterable else None,
    }


def check_config(loader: Any, state: Mapping[str, Any], lengths_may_follow: bool) -> None:
    """StateError (both sides printed) unless the state's configuration is this loader's. With
    ``lengths_may_follow``, lengths alone that differ are left for after the objects are loaded:
    a dataset's or sampler's length may follow its own state (a curriculum level)."""
    saved, current = state["config"], config_of(loader)
    mid_epoch = bool(state["in_progress"])
    if mid_epoch and current["iterable"] and saved.get("in_order") is False:
        _check_unordered(saved, current, state["delivered"])
    ignored = {"in_order"} | (set() if mid_epoch else _MID_EPOCH)
    diff = [k for k in sorted(set(saved) | set(current)) if k not in ignored and saved.get(k) != current.get(k)]
    if diff and lengths_may_follow and set(diff) <= _LENGTHS:
        return
    if diff:
        lines = "\n".join(f"  {k}: saved {saved.get(k)!r}, this loader {current.get(k)!r}" for k in diff)
        raise StateError(f"the state was saved by a loader configured differently; its delivered tasks would "
                         f"not be the same batches here:\n{lines}\nsaved:       {json.dumps(saved)}\n"
                         f"this loader: {json.dumps(current)}", saved, current)
    total = current["batches_per_epoch"]
    if mid_epoch and total is not None and state["delivered"] and state["delivered"][-1][1] > total:
        raise StateError(f"the state says task {state['delivered'][-1][1] - 1} was delivered, but an epoch of "
                         f"this loader has {total} tasks", state["delivered"], total)


def _check_unordered(saved: Mapping[str, Any], current: Mapping[str, Any], delivered: list[list[int]]) -> None:
    """A state saved inside an ``in_order=False`` epoch of an iterable dataset: StateError unless
    its resume is exact. Its fast-forward makes the first ``yielded`` tasks again in task order,
    which are the batches handed out only where one worker (or none) ran the epoch, so that task t
    is its stream's t-th batch, and they were handed out in task order: the delivered tasks are
    ``[0, n)``. One worker hands a later batch out first while an earlier one's slot grows."""
    workers = saved.get("num_workers")
    if not isinstance(workers, int) or workers > 1:
        raise StateError(f"the state was saved inside an epoch of an iterable dataset loaded with in_order=False "
                         f"and num_workers={workers}: its batches were handed out in an arrival order that a rerun "
                         "does not repeat, so resuming it would lose some batches and repeat others; save with "
                         "in_order=True, with num_workers 0 or 1, or between epochs",
                         saved.get("in_order"), current["in_order"])
    if len(delivered) > 1 or (delivered and delivered[0][0] != 0):
        missing = 0 if delivered[0][0] != 0 else delivered[0][1]
        raise StateError(f"the state was saved inside an epoch of an iterable dataset loaded with in_order=False, "
                         f"with its batches handed out not in task order (tasks delivered: {delivered}, as "
                         f"[start, stop) ranges; task {missing} not yet: one worker hands a later batch out first "
                         f"while an earlier one's slot grows to fit it), "
                         f"so resuming it, which makes the first batches again in task order, would lose task "
                         f"{missing} and repeat a later one; save once every earlier batch is handed out, with "
                         "in_order=True, or between epochs", delivered, current["in_order"])


def type_name(obj: Any) -> str:
    cls = type(obj)
    return f"{cls.__module__}.{cls.__qualname__}"


def _len_or_none(obj: Any) -> int | None:
    """``len(obj)``; None where it has none, or says it does not know (``NotImplementedError``, as
    stream libraries' ``__len__`` do): iteration never asks an iterable dataset or a batch sampler
    for it, so saving must not either."""
    try:
        return len(obj)
    except (TypeError, NotImplementedError):
        return None
