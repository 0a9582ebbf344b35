"""Collation: a list of samples becomes one batch, every output array written through an allocator.

Owns the collate entry points (:func:`collate`, :func:`default_collate`,
:func:`torch_default_collate`, :func:`default_convert`), the rule registry and the way a sample
type finds its rule. Runs in worker processes (collating straight into a shared-memory slot) and
in the main process when ``num_workers=0``.

Promises:

- every output array is asked of ``alloc(shape, dtype)`` and written once; an allocator's
  :class:`SlotFull` propagates untouched, so the engine can grow the slot and retry;
- numpy mode (``to_torch=False``, :class:`shmloader.DataLoader`'s default): numpy in, numpy out;
  torch tensors in, torch tensors out;
- torch mode (``to_torch=True``, ``shmloader.torch.DataLoader``): the result equals
  ``torch.utils.data.default_collate``'s — values, dtypes, shapes and container types;
- a sample type finds its rule by exact type, then along its MRO, then by ``issubclass`` (ABCs,
  tuples of types): first in the ``rules`` passed in, then in the registry
  (:func:`register_collate_rule`), then in the built-in rules, which follow torch's order;
  lookups are cached (a ``rules`` mapping is read once per sample type while the same mapping
  object is passed, so pass a new mapping rather than changing one in place); in torch mode a
  type the user added to torch's ``default_collate_fn_map`` (or whose function they replaced)
  comes before all of these, collated by that function as torch's ``collate`` dispatches it,
  and a key of torch's own that the user deleted no longer selects its built-in rule (the type
  goes on through torch's dispatch), the map read at each call
  (:mod:`shmloader.collate.torch_map`);
- each stack of numpy arrays is written by the ``stack`` passed in: one thread by default (workers),
  split over the threads of :mod:`shmloader.collate.threads` when large and ``num_workers=0``;
- errors name the field (``batch['image'][0]``) and keep torch's type and wording (an empty
  batch: torch's IndexError, with a note saying so);
- importing this module does not import torch.

Sample-type semantics are in :mod:`shmloader.collate.rules` (numpy mode and containers) and
:mod:`shmloader.collate.torch_rules` (tensors and torch mode); the types they share are in
:mod:`shmloader.collate.context`.
"""

from __future__ import annotations

import collections.abc as abc
import sys
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from shmloader.caches import remember
from shmloader.collate import rules as _rules
from shmloader.collate import torch_map as _torch_map
from shmloader.collate import torch_rules as _torch_rules
from shmloader.collate.context import (
    Alloc,
    CollateContext,
    CollateRule,
    FindRule,
    SlotFull,
    Stack,
    heap_alloc,
)
from shmloader.collate.rules import (
    _STR_OBJ_DTYPE,
    CollateShapeError,
    rebuild_mapping,
    rebuild_sequence,
)
from shmloader.kept import note

__all__ = [
    "Alloc",
    "CollateContext",
    "CollateRule",
    "CollateShapeError",
    "SlotFull",
    "Stack",
    "collate",
    "default_collate",
    "default_convert",
    "heap_alloc",
    "register_collate_rule",
    "registered_collate_rules",
    "torch_default_collate",
    "torch_default_convert",
    "unregister_collate_rule",
]

# ------------------------------------------------------------------------ rules and lookup

_registry: dict[Any, CollateRule] = {}
_resolved: tuple[dict[type, CollateRule], dict[type, CollateRule]] = ({}, {})
# The last ``rules`` mapping passed in and what it gives each sample type (None: no rule there).
# One entry, keyed by the mapping object itself: workers pass the same mapping for every batch.
_passed: tuple[Mapping[Any, CollateRule] | None, dict[type, CollateRule | None]] = (None, {})


def register_collate_rule(type_: type | tuple[type, ...], fn: CollateRule) -> CollateRule:
    """Make ``fn`` collate samples of ``type_`` (and subclasses) in every later collate call.

    Registered rules take precedence over the built-in ones; ``rules`` passed to :func:`collate`
    take precedence over both. Returns ``fn``.
    """
    if not callable(fn):
        raise TypeError(f"a collate rule must be callable as fn(batch, ctx), got {fn!r}")
    _registry[type_] = fn
    _clear_resolved()
    return fn


def unregister_collate_rule(type_: type | tuple[type, ...]) -> None:
    """Remove a rule added by :func:`register_collate_rule` (KeyError if there is none)."""
    del _registry[type_]
    _clear_resolved()


def registered_collate_rules() -> dict[Any, CollateRule]:
    """A copy of the registry: type -> rule."""
    return dict(_registry)


def _clear_resolved() -> None:
    global _passed
    for cache in _resolved:
        cache.clear()
    _passed = (None, {})


def find_rule(tp: type, rules: Mapping[Any, CollateRule] | None, to_torch: bool) -> CollateRule:
    """The rule for sample type ``tp``: the ``rules`` given, then the registry, then built-ins.

    Lookups are cached: the built-in and registered ones until the registry changes; those in
    ``rules`` for as long as the same mapping object is passed (so a mapping changed in place
    after use is not re-read: pass a new mapping instead).
    """
    if rules:
        passed_rule = _passed_rule(tp, rules)
        if passed_rule is not None:
            return passed_rule
    cache = _resolved[to_torch]
    try:
        return cache[tp]
    except KeyError:
        pass
    rule = _lookup(_registry, tp) if _registry else None
    if rule is None:
        rule = builtin_rule_for(tp, to_torch)
    return remember(cache, tp, rule)


def _passed_rule(tp: type, rules: Mapping[Any, CollateRule]) -> CollateRule | None:
    """The rule ``rules`` gives ``tp`` (None: none), cached while the same mapping is passed."""
    global _passed
    cached_rules, found = _passed
    if cached_rules is not rules:
        found = {}
        _passed = (rules, found)
    try:
        return found[tp]
    except KeyError:
        return remember(found, tp, _lookup(rules, tp))


def find_custom_rule(tp: type, rules: Mapping[Any, CollateRule] | None) -> CollateRule | None:
    """The rule the ``rules`` given, then the registry, give ``tp``: :func:`find_rule` without the
    built-in rules (None where neither has one)."""
    if rules:
        passed_rule = _passed_rule(tp, rules)
        if passed_rule is not None:
            return passed_rule
    return _lookup(_registry, tp) if _registry else None


def _lookup(rules: Mapping[Any, CollateRule], tp: type) -> CollateRule | None:
    """Exact type, then the nearest class along the MRO, then the first key ``tp`` subclasses."""
    for cls in tp.__mro__:
        rule = rules.get(cls)
        if rule is not None:
            return rule
    for key, rule in rules.items():
        if isinstance(key, (type, tuple)) and issubclass(tp, key):
            return rule
    return None


def builtin_rule_for(tp: type, to_torch: bool) -> CollateRule:
    """The built-in rule for a sample type, checked in the order torch's default_collate uses."""
    rules, torch_rules = _rules, _torch_rules
    torch = sys.modules.get("torch")
    if torch is not None and issubclass(tp, torch.Tensor):
        return torch_rules.collate_tensors
    if issubclass(tp, np.ndarray):
        return torch_rules.collate_arrays if to_torch else rules.collate_arrays
    if issubclass(tp, (np.bool_, np.number, np.object_)):
        return torch_rules.collate_numpy_scalars if to_torch else rules.collate_numpy_scalars
    if issubclass(tp, float):
        return torch_rules.collate_floats if to_torch else rules.collate_floats
    if issubclass(tp, int):
        return torch_rules.collate_ints if to_torch else rules.collate_ints
    if issubclass(tp, (str, bytes)):
        return rules.keep_batch
    return fallback_rule_for(tp, to_torch)


def fallback_rule_for(tp: type, to_torch: bool) -> CollateRule:
    """The built-in rule of a type that no key of torch's own ``default_collate_fn_map`` matches
    (tensors, arrays, numpy scalars, float, int, str, bytes): containers as torch's ``collate``
    rebuilds them, a few numpy-mode types, and torch's TypeError for the rest."""
    rules = _rules
    if issubclass(tp, np.generic):  # datetime64, timedelta64, void: numpy-native only
        return rules.reject if to_torch else rules.collate_numpy_scalars
    if issubclass(tp, complex):  # not a number to torch's default_collate
        return rules.reject if to_torch else rules.collate_complex
    if issubclass(tp, abc.Mapping):
        return rules.collate_mappings
    if issubclass(tp, tuple) and hasattr(tp, "_fields"):
        return rules.collate_namedtuples
    if issubclass(tp, abc.Sequence):
        return rules.collate_sequences
    return rules.reject


# ------------------------------------------------------------------------------ entry points


def collate(
    batch: Sequence[Any],
    alloc: Alloc = heap_alloc,
    *,
    to_torch: bool = False,
    rules: Mapping[Any, CollateRule] | None = None,
    stack: Stack | None = None,
) -> Any:
    """Collate a list of samples into one batch, asking ``alloc`` for every output array.

    ``stack(batch, out)`` writes each stack of numpy arrays: ``rules.stack_into`` (one thread) when
    None; with ``num_workers=0`` the loader passes a ``collate.threads.ThreadedStack``.
    """
    find: FindRule = find_rule
    if to_torch:
        _torch_rules._torch()  # torch mode makes tensors; imported only now, not with shmloader
        torch_map = _torch_map.overrides()
        if torch_map is not None:  # the user changed torch's default_collate_fn_map
            find = torch_map.finder(_MAP_LOOKUPS)
    ctx = CollateContext(alloc, to_torch, rules, find, stack or _rules.stack_into)
    try:
        first = batch[0]
    except IndexError as error:  # torch's own IndexError, kept; a note says why
        note(error, "(the batch is empty: no sample to collate; does the batch_sampler yield an empty list?)")
        raise
    return find(type(first), rules, to_torch)(batch, ctx)


_MAP_LOOKUPS = _torch_map.Lookups(find_rule, find_custom_rule, builtin_rule_for, fallback_rule_for)


def default_collate(batch: Sequence[Any]) -> Any:
    """numpy-native default collation (``collate(batch)``), with torch's signature."""
    return collate(batch)


def torch_default_collate(batch: Sequence[Any]) -> Any:
    """What ``torch.utils.data.default_collate`` returns: ``collate(batch, to_torch=True)``."""
    return collate(batch, to_torch=True)


def torch_default_convert(data: Any) -> Any:
    """Exactly what ``torch.utils.data.default_convert`` returns (``default_convert(data, to_torch=True)``)."""
    return default_convert(data, to_torch=True)


def default_convert(data: Any, *, to_torch: bool = False) -> Any:
    """Convert one sample when batching is off (``batch_size=None``), as torch's default_convert.

    Containers are rebuilt as torch rebuilds them (tuples become lists). In torch mode numpy
    arrays and scalars become tensors (``torch.as_tensor``, sharing memory where torch does),
    except arrays of strings or objects; in numpy mode every leaf is returned unchanged.
    """
    return _convert(data, _torch_rules._torch() if to_torch else None)


def _convert(data: Any, torch: Any) -> Any:
    elem_type = type(data)
    tensor_type = getattr(sys.modules.get("torch"), "Tensor", None)
    if tensor_type is not None and isinstance(data, tensor_type):
        return data
    if elem_type.__module__ == "numpy" and elem_type.__name__ not in ("str_", "string_"):
        if torch is None or (
            elem_type.__name__ == "ndarray" and _STR_OBJ_DTYPE.search(data.dtype.str) is not None
        ):
            return data
        return torch.as_tensor(data)
    if isinstance(data, abc.Mapping):
        return rebuild_mapping(data, {key: _convert(data[key], torch) for key in data})
    if isinstance(data, tuple) and hasattr(data, "_fields"):  # namedtuple
        return elem_type(*(_convert(d, torch) for d in data))
    if isinstance(data, abc.Sequence) and not isinstance(data, (str, bytes)):
        # tuples become lists here (torch: "Backwards compatibility.")
        return rebuild_sequence(data, [_convert(d, torch) for d in data])
    return data


def worker_plan(fn: Any) -> tuple[str, bool]:
    """(collate kind, to_torch) a worker runs for the loader's ``collate_fn``: ours or torch's own
    default is collated straight into the slot ("builtin", "convert"); any other is the user's."""
    torch = sys.modules.get("torch")
    torch_data = None if torch is None else getattr(getattr(torch, "utils", None), "data", None)
    if fn is default_collate:
        return "builtin", False
    if fn is torch_default_collate or (torch_data is not None and fn is torch_data.default_collate):
        return "builtin", True
    if fn is default_convert:
        return "convert", False
    if fn is torch_default_convert or (torch_data is not None and fn is torch_data.default_convert):
        return "convert", True
    return "user", False
