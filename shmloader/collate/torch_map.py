"""torch's ``default_collate_fn_map`` as the user changed it: collated as torch's ``collate`` dispatches it.

torch documents two ways to extend ``default_collate``; the second ("Option 2") puts a type in
``torch.utils.data._utils.collate.default_collate_fn_map``, or replaces the function of a type
already there; a user may also delete one of torch's own keys. This module owns reading that map
for torch mode. Runs wherever a batch is collated, at collate time: a worker reads its own copy
of the map, so under spawn or forkserver the user's change must have run in the worker too (at
import of the dataset's module, or in ``worker_init_fn``), exactly as with torch's own workers.
Importing it does not import torch.

Promises:

- :func:`overrides` is None while the map holds exactly torch's own entries (the common case: the
  built-in rules apply, nothing else is looked up); otherwise it dispatches a sample type as
  torch's ``collate`` does — its exact type among the keys first, then the first key it is an
  instance of, in the map's order;
- when that dispatch lands on an entry the user added or changed, the sample's field is
  collated by ``fn(batch, collate_fn_map=default_collate_fn_map)``; when it lands on one of
  torch's own entries, or on no entry, shmloader's rule applies (into the slot, as before);
- once one of torch's own keys is deleted (or the tensor entry is not torch's), the built-in rule
  is the one of the key the dispatch lands on — a deleted key's rule is never used: a type it
  matched goes on to the next key it is an instance of, or to torch's containers and its
  TypeError — and numpy arrays are collated as tensors through the map, as torch's
  ``collate_numpy_array_fn`` does; ``rules`` passed in and the registry still come first;
- the map is compared with the one last seen on each call (one tuple comparison per batch),
  so a change takes effect at the next batch; what it gives a sample type is cached until the
  map changes.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

from shmloader.caches import remember
from shmloader.collate.context import CollateContext, CollateRule, FindRule
from shmloader.collate.rules import check_array_dtype

__all__ = ["Lookups", "TorchMapRules", "overrides"]

_COLLATE_MODULE = "torch.utils.data._utils.collate"
# torch's own entries, key -> the name of its function in _COLLATE_MODULE (torch 2.x's map)
_STOCK_NAMES: dict[Any, str] = {
    float: "collate_float_fn",
    int: "collate_int_fn",
    str: "collate_str_fn",
    bytes: "collate_str_fn",
}
_last: tuple[tuple[tuple[Any, Any], ...] | None, TorchMapRules | None] = (None, None)


class Lookups(NamedTuple):
    """The rule lookups of :mod:`shmloader.collate` a changed map builds on (passed in: no import cycle)."""

    find: FindRule  # the whole lookup: passed rules, registry, built-ins
    custom: Callable[[type, Mapping[Any, CollateRule] | None], CollateRule | None]  # passed rules, registry
    builtin: Callable[[type, bool], CollateRule]  # the built-in rule of a type
    fallback: Callable[[type, bool], CollateRule]  # the built-in rule of a type no stock key matches


def overrides() -> TorchMapRules | None:
    """The dispatch of torch's map as it is now, or None while it holds exactly torch's own entries."""
    global _last
    module = sys.modules.get(_COLLATE_MODULE)
    if module is None:
        return None
    fn_map = module.default_collate_fn_map
    items = tuple(fn_map.items())
    seen, rules = _last
    if items != seen:  # the map changed since the last call (or this is the first)
        stock = _stock(module)
        changed = any(stock.get(key) is not fn for key, fn in items) or bool(_deleted(stock, fn_map))
        rules = TorchMapRules(fn_map, items, stock, module) if changed else None
        _last = (items, rules)
    return rules


def _stock(module: Any) -> dict[Any, Any]:
    """torch's own entries of the map: key -> the function torch's module defines for it."""
    torch = sys.modules["torch"]
    names = {torch.Tensor: "collate_tensor_fn", **_STOCK_NAMES}
    np = sys.modules.get("numpy")
    if np is not None:
        names[np.ndarray] = "collate_numpy_array_fn"
        names[(np.bool_, np.number, np.object_)] = "collate_numpy_scalar_fn"
    return {key: getattr(module, name, None) for key, name in names.items()}


def _deleted(stock: dict[Any, Any], fn_map: Mapping[Any, Any]) -> list[Any]:
    """torch's own keys (those its module has a function for) that are not in the map now."""
    return [key for key, fn in stock.items() if fn is not None and key not in fn_map]


class TorchMapRules:
    """torch's dispatch over one state of its map: which types a user's function collates and,
    once a stock entry is gone, which built-in rule each type gets instead of shmloader's own order."""

    def __init__(self, fn_map: dict[Any, Any], items: tuple[tuple[Any, Any], ...], stock: dict[Any, Any],
                 module: Any) -> None:
        self._map = fn_map
        self._items = items
        self._stock = stock
        self._rules: dict[type, CollateRule | None] = {}
        self._builtins: dict[type, CollateRule] = {}
        tensor = sys.modules["torch"].Tensor
        self._array_fn = getattr(module, "collate_numpy_array_fn", None)
        # arrays are collated through the map's tensor entry once it is not torch's own
        self._arrays_via_map = fn_map.get(tensor) is not stock.get(tensor)
        # shmloader's built-in order assumes every stock key: once one is gone, torch's dispatch picks
        self._redispatch = self._arrays_via_map or bool(_deleted(stock, fn_map))

    def rule_for(self, tp: type) -> CollateRule | None:
        """The user's function for samples of ``tp`` as a collate rule, or None (shmloader's rule)."""
        try:
            return self._rules[tp]
        except KeyError:
            pass
        key, fn = self._dispatch(tp)
        rule = None if fn is None or self._stock.get(key) is fn else _user_rule(fn, self._map)
        return remember(self._rules, tp, rule)

    def _dispatch(self, tp: type) -> tuple[Any, Callable[..., Any] | None]:
        """torch's ``collate``: the exact type, then the first key it is an instance of."""
        if tp in self._map:
            return tp, self._map[tp]
        for key, fn in self._items:
            if isinstance(key, (type, tuple)) and issubclass(tp, key):
                return key, fn
        return None, None

    def _builtin_for(self, tp: type, lookups: Lookups) -> CollateRule:
        """The built-in rule of the stock key torch's dispatch lands on (none: containers, TypeError)."""
        try:
            return self._builtins[tp]
        except KeyError:
            pass
        key, fn = self._dispatch(tp)  # a stock entry or none: rule_for took the user's
        if key is None:
            rule = lookups.fallback(tp, True)
        elif self._arrays_via_map and fn is self._array_fn:
            rule = _arrays_as_tensors
        else:  # a key's first type has the key's rule: (np.bool_, np.number, np.object_) -> np.bool_
            rule = lookups.builtin(key if isinstance(key, type) else key[0], True)
        return remember(self._builtins, tp, rule)

    def finder(self, lookups: Lookups) -> FindRule:
        """A rule lookup that asks this map first and ``lookups`` for every other type."""
        find = lookups.find

        def find_with_map(tp: type, rules: Any, to_torch: bool) -> CollateRule:
            rule = self.rule_for(tp)
            if rule is not None:
                return rule
            if not self._redispatch:
                return find(tp, rules, to_torch)
            custom = lookups.custom(tp, rules)
            return custom if custom is not None else self._builtin_for(tp, lookups)

        return find_with_map


def _user_rule(fn: Callable[..., Any], fn_map: dict[Any, Any]) -> CollateRule:
    """A collate rule that calls the user's map function as torch's ``collate`` calls it."""

    def rule(batch: Sequence[Any], ctx: CollateContext) -> Any:
        return fn(batch, collate_fn_map=fn_map)

    return rule


def _arrays_as_tensors(batch: Sequence[Any], ctx: CollateContext) -> Any:
    """torch's ``collate_numpy_array_fn``: strings or objects refused, then the arrays collated as
    tensors (``torch.as_tensor`` each) through the map again, so its tensor entry (the user's
    function, or none) decides."""
    check_array_dtype(batch[0], ctx)
    torch = sys.modules["torch"]
    return ctx.collate([torch.as_tensor(sample) for sample in batch])
