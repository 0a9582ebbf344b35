"""Walking a nested batch: what ``to_device`` and every transfer apply to each leaf of a batch.

Owns :func:`map_batch` (a batch rebuilt with each leaf replaced, as torch's ``pin_memory``
rebuilds batches) and :func:`iter_leaves` (the same leaves, in the same order, with nothing
built), and the role of each container type, decided once per type. Pure Python, no device, no
state but that per-type cache; runs wherever a batch is moved (the main process).
"""

from __future__ import annotations

import copy
from collections import UserDict, UserList
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

from shmloader.caches import remember

__all__ = ["iter_leaves", "map_batch"]

_ROLES: dict[type, str] = {}  # a type's role in a nested batch, decided once per type (a bounded cache)
# Containers whose copy.copy() owns its storage: copied and updated, they keep their type and state.
_COPIED_MAPPINGS, _COPIED_SEQUENCES = (dict, UserDict), (list, UserList)


def _role(kind: type) -> str:
    """"atom" (str, bytes: kept whole), "mapping", "copied mapping", "namedtuple", "sequence",
    "copied sequence" or "leaf"."""
    role = _ROLES.get(kind)
    if role is None:
        if issubclass(kind, (str, bytes)):
            role = "atom"
        elif issubclass(kind, Mapping):
            role = "copied mapping" if issubclass(kind, _COPIED_MAPPINGS) else "mapping"
        elif issubclass(kind, tuple) and hasattr(kind, "_fields"):
            role = "namedtuple"
        elif issubclass(kind, Sequence):
            role = "copied sequence" if issubclass(kind, _COPIED_SEQUENCES) else "sequence"
        else:
            role = "leaf"
        remember(_ROLES, kind, role)
    return role


def map_batch(batch: Any, leaf: Callable[[Any], Any]) -> Any:
    """Apply ``leaf`` to every non-container value of a nested batch, keeping its structure.

    As torch's ``pin_memory`` rebuilds batches: every mapping and sequence is walked (a
    ``UserList`` too); a dict or list subclass, ``defaultdict`` or ``UserDict`` is copied
    (``copy.copy``) and its values replaced, so it keeps its type and its own state (a
    ``default_factory``, a tokenizer batch's encodings); any other container is rebuilt with its
    own type where it accepts that, else as a dict / list. Unlike torch, a mutable container of
    another kind is rebuilt, not copied: its copy may share storage with the batch, which must
    keep its slot views until the copy is done. Strings and bytes are kept whole. Runs once per
    batch per device copy, so each type's role is looked up, not re-derived (an ``isinstance``
    against ``Mapping`` costs more than the whole lookup).
    """
    kind = type(batch)
    if kind is tuple or kind is list:
        return kind([map_batch(v, leaf) for v in batch])
    if kind is dict:
        return {k: map_batch(v, leaf) for k, v in batch.items()}
    role = _role(kind)
    if role == "leaf":
        return leaf(batch)
    if role == "atom":
        return batch
    if role == "namedtuple":
        return kind(*(map_batch(v, leaf) for v in batch))
    if role in ("mapping", "copied mapping"):
        return _rebuild(batch, {k: map_batch(v, leaf) for k, v in batch.items()}, role == "copied mapping")
    return _rebuild(batch, [map_batch(v, leaf) for v in batch], role == "copied sequence")


def _rebuild(batch: Any, values: Any, copied: bool) -> Any:
    """``batch``'s container holding ``values`` (a dict or list in ``batch``'s order)."""
    try:
        if copied:
            clone = copy.copy(batch)
            if isinstance(values, dict):
                clone.update(values)
            else:
                for i, value in enumerate(values):  # as torch: a subclass may not take a slice
                    clone[i] = value
            return clone
        return type(batch)(values)
    except TypeError:
        return values


def iter_leaves(batch: Any) -> Iterator[Any]:
    """Every value ``map_batch`` would apply its ``leaf`` to, in its order; builds no container."""
    role = _role(type(batch))
    if role == "leaf":
        yield batch
    elif role in ("mapping", "copied mapping"):
        for value in batch.values():
            yield from iter_leaves(value)
    elif role != "atom":
        for value in batch:
            yield from iter_leaves(value)
