"""The built-in collate-rules plugin: this process's registered rules, shipped to every worker.

Runs in the main process (collected once per loader) and in each worker at start (where it
contributes that worker's own registry). Promises: the rules given to
:func:`shmloader.register_collate_rule <shmloader.collate.register_collate_rule>` in the training
script reach the workers under every start method — under spawn and forkserver the worker imports
a fresh copy of shmloader, so only the worker spec (cloudpickled) can carry them.

The numpy and torch rules themselves are the collate engine's final fallback
(:func:`shmloader.collate.builtin_rule_for`), consulted after every plugin rule and registered rule.
They are not a type mapping: torch's default_collate order (tensors before arrays, namedtuples
before tuples, the numpy/torch mode switch) is a dispatch, and keeping it out of the merged rules
keeps the common case — no plugin rules at all — on the collate engine's cached lookup.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from shmloader.collate import registered_collate_rules
from shmloader.hookspecs import hookimpl


class RegisteredRules:
    """Contributes ``registered_collate_rules()`` (empty unless the user registered a rule)."""

    @hookimpl
    def shmloader_collate_rules(self) -> Mapping[Any, Any] | None:
        return registered_collate_rules() or None
