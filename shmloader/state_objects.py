"""Which of a loader's objects a state saves through their own state, and how an epoch-keyed sampler is saved.

Owns, for ``state.py``: the paths of those objects (the sampler, the batch sampler, the sampler
inside the batch sampler, the dataset), reaching the object at a path, and the saved form of a
sampler whose order is fixed by ``set_epoch`` but which has no ``state_dict`` of its own (torch's
``DistributedSampler`` and its subclasses): its epoch, and the seed and shard that the epoch's
order also depends on. Runs in the main process. Promises: every object that fixes an epoch's
order is reached, wherever the loader holds it, and saved once; a saved epoch state is refused
with a ``StateError`` naming the field when it is malformed or of another shard.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from shmloader.errors import StateError

#: Where the objects saved through their state sit, from the loader (the batch sampler's own
#: sampler too: a DistributedSampler handed in inside a BatchSampler fixes the epoch's order there).
PATHS = ("sampler", "batch_sampler", "batch_sampler.sampler", "dataset")

_SHARD = ("seed", "num_replicas", "rank")  # what an epoch-keyed sampler's order depends on besides its epoch


def object_at(loader: Any, path: str) -> Any:
    """The object at ``path`` (one of ``PATHS``), or None."""
    obj = loader
    for part in path.split("."):
        obj = getattr(obj, part, None)
    return obj


def stateful(obj: Any) -> Any:
    """``obj`` when it has ``state_dict``/``load_state_dict``; an ``EpochState`` of it when it is an
    epoch-keyed sampler without them; else None (nothing of it to save)."""
    if callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None)):
        return obj
    if callable(getattr(obj, "set_epoch", None)) and _is_count(getattr(obj, "epoch", None)):
        return EpochState(obj)
    return None


def saved_objects(loader: Any) -> dict[str, Any]:
    """Path → the stateful object (see ``stateful``) there, each object once (the default batch
    sampler's sampler is the loader's sampler: saved under ``sampler`` only)."""
    found: dict[str, Any] = {}
    seen: set[int] = set()
    for path in PATHS:
        obj = object_at(loader, path)
        target = stateful(obj)
        if target is not None and id(obj) not in seen:
            seen.add(id(obj))
            found[path] = target
    return found


def check_epochs(loader: Any, saved: Mapping[str, Any]) -> None:
    """At a resumed epoch's start: each epoch-keyed sampler whose state ``saved`` holds (path ->
    state) is still at the saved epoch. A ``set_epoch`` to another one since ``load_state_dict``
    changed the order the saved delivered tasks index into: StateError naming both epochs."""
    for path, state in saved.items():
        obj = object_at(loader, path)
        now = getattr(obj, "epoch", None)
        if not callable(getattr(obj, "set_epoch", None)) or not isinstance(state, Mapping) or not _is_count(now):
            continue
        if "epoch" in state and now != state["epoch"]:
            raise StateError(f"the loader's {path} ({type(obj).__name__}) is at epoch {now}, but the loaded "
                             f"state resumes its saved epoch {state['epoch']} part-way: set_epoch({now}) after "
                             f"load_state_dict would lose and repeat batches; call set_epoch({state['epoch']}) "
                             "to finish the saved epoch, or load no state to start a new one",
                             state["epoch"], now)  # fmt: skip


def check_epoch_state(owner: str, mine: Mapping[str, Any], state: Any) -> int:
    """The epoch of ``state``, a saved ``{"epoch", "seed", "num_replicas", "rank"}`` (those ``mine``
    has), checked against ``mine``: StateError naming the field for one that is not a mapping, lacks
    a key, is of another shard, or has an epoch that is no integer >= 0."""
    if not isinstance(state, Mapping):
        raise StateError(f"{owner} state must be a mapping of {', '.join(mine)}; "
                         f"got {type(state).__name__} {state!r:.80}", state, dict(mine))
    missing = [k for k in mine if k not in state]
    if missing:
        raise StateError(f"{owner} state lacks {', '.join(missing)} (saved keys: "
                         f"{', '.join(map(str, state))})", dict(state), dict(mine))
    wrong = [k for k in _SHARD if k in mine and state[k] != mine[k]]
    if wrong:
        raise StateError(f"{owner} state is for another shard: "
                         + ", ".join(f"{k} saved {state[k]!r}, this sampler {mine[k]!r}" for k in wrong),
                         dict(state), dict(mine))
    epoch = state["epoch"]
    if not _is_count(epoch):
        raise StateError(f"{owner} state's epoch must be an integer >= 0; got {epoch!r:.80}", epoch, None)
    return int(epoch)


class EpochState:
    """The state of an epoch-keyed sampler without ``state_dict`` (torch's DistributedSampler): its
    epoch and the shard fields it has; loading one calls its ``set_epoch``."""

    def __init__(self, sampler: Any) -> None:
        self.sampler = sampler

    def state_dict(self) -> dict[str, int]:
        state = {"epoch": int(self.sampler.epoch)}
        for name in _SHARD:
            value = getattr(self.sampler, name, None)
            if isinstance(value, int) and not isinstance(value, bool):
                state[name] = value
        return state

    def load_state_dict(self, state: Any) -> None:
        self.sampler.set_epoch(check_epoch_state(type(self.sampler).__name__, self.state_dict(), state))


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0
