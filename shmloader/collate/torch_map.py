"""Types the user added to torch's ``default_collate_fn_map``: collated by the user's function, as torch does.

torch documents two ways to extend ``default_collate``; the second ("Option 2") puts a type in
``torch.utils.data._utils.collate.default_collate_fn_map``, or replaces the function of a type
already there. This module owns reading that map for torch mode. Runs wherever a batch is
collated, at collate time: a worker reads its own copy of the map, so under spawn or forkserver
the user's registration must have run in the worker too (at import of the dataset's module, or in
``worker_init_fn``), exactly as with torch's own workers. Importing it does not import torch.

Promises:

- :func:`overrides` is None while the map holds only torch's own entries (the common case: the
  built-in rules apply, nothing else is looked up); otherwise it dispatches a sample type as
  torch's ``collate`` does — its exact type among the keys first, then the first key it is an
  instance of, in the map's order;
- when that dispatch lands on an entry the user added or changed, the sample's field is
  collated by ``fn(batch, collate_fn_map=default_collate_fn_map)``; when it lands on one of
  torch's own entries, or on no entry, shmloader's rule applies (into the slot, as before);
- the map is compared with the one last seen on each call, so a change takes effect at the next
  batch; a found dispatch is cached per sample type until the map changes.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from typing import Any

from shmloader.collate.context import CollateContext, CollateRule, FindRule

__all__ = ["TorchMapRules", "overrides"]

_COLLATE_MODULE = "torch.utils.data._utils.collate"
# torch's own entries, key -> the name of its function in _COLLATE_MODULE (torch 2.x's map)
_STOCK_NAMES: dict[Any, str] = {
    float: "collate_float_fn",
    int: "collate_int_fn",
    str: "collate_str_fn",
    bytes: "collate_str_fn",
}
_last: tuple[tuple[tuple[Any, Any], ...] | None, TorchMapRules | None] = (None, None)


def overrides() -> TorchMapRules | None:
    """The dispatch of torch's map as it is now, or None while it holds only torch's own entries."""
    global _last
    module = sys.modules.get(_COLLATE_MODULE)
    if module is None:
        return None
    fn_map = module.default_collate_fn_map
    items = tuple(fn_map.items())
    seen, rules = _last
    if items != seen:
        stock = _stock(module)
        changed = any(stock.get(key) is not fn for key, fn in items)
        rules = TorchMapRules(fn_map, items, stock) if changed else None
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


class TorchMapRules:
    """torch's dispatch over one state of its map: which types a user's function collates."""

    def __init__(self, fn_map: dict[Any, Any], items: tuple[tuple[Any, Any], ...], stock: dict[Any, Any]) -> None:
        self._map = fn_map
        self._items = items
        self._stock = stock
        self._rules: dict[type, CollateRule | None] = {}

    def rule_for(self, tp: type) -> CollateRule | None:
        """The user's function for samples of ``tp`` as a collate rule, or None (shmloader's rule)."""
        try:
            return self._rules[tp]
        except KeyError:
            pass
        key, fn = self._dispatch(tp)
        rule = None if fn is None or self._stock.get(key) is fn else _user_rule(fn, self._map)
        self._rules[tp] = rule
        return rule

    def _dispatch(self, tp: type) -> tuple[Any, Callable[..., Any] | None]:
        """torch's ``collate``: the exact type, then the first key it is an instance of."""
        if tp in self._map:
            return tp, self._map[tp]
        for key, fn in self._items:
            if isinstance(key, (type, tuple)) and issubclass(tp, key):
                return key, fn
        return None, None

    def finder(self, find: FindRule) -> FindRule:
        """A rule lookup that asks this map first and ``find`` for every other type."""

        def find_with_map(tp: type, rules: Any, to_torch: bool) -> CollateRule:
            rule = self.rule_for(tp)
            return find(tp, rules, to_torch) if rule is None else rule

        return find_with_map


def _user_rule(fn: Callable[..., Any], fn_map: dict[Any, Any]) -> CollateRule:
    """A collate rule that calls the user's map function as torch's ``collate`` calls it."""

    def rule(batch: Sequence[Any], ctx: CollateContext) -> Any:
        return fn(batch, collate_fn_map=fn_map)

    return rule
