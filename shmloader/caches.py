"""Bounded per-type caches: what a lookup keyed by a type (or dtype) remembers, and how much.

Owns ``CACHE_LIMIT`` and :func:`remember`, which the caches of collate rules, batch container
roles and dtype bridges store through. Why a bound: a cache keyed by type keeps each type it
saw alive; a dataset that makes its sample class at run time (a ``namedtuple`` per dataset, per
config) would grow the process by one class per type, for ever. Promises: a cache stored through
``remember`` never holds more than ``CACHE_LIMIT`` entries (a full one is emptied and fills again
from the next lookups: the types in use are few, so it refills at once); lookups cost nothing more.
"""

from __future__ import annotations

from typing import TypeVar

__all__ = ["CACHE_LIMIT", "remember"]

CACHE_LIMIT = 128  # entries per cache: far above the types of one batch, small beside a class's bytes

K = TypeVar("K")
V = TypeVar("V")


def remember(cache: dict[K, V], key: K, value: V) -> V:
    """Store ``value`` under ``key`` (emptying ``cache`` first once it holds ``CACHE_LIMIT``); return it."""
    if len(cache) >= CACHE_LIMIT:
        cache.clear()
    cache[key] = value
    return value
