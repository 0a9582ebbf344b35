"""Plugin manager placeholder: no plugins yet (the pluggy manager replaces this)."""

from __future__ import annotations

from typing import Any, Iterable


class _NoPlugins:
    hook = None

    def collate_rules(self) -> dict:
        return {}


def build_plugin_manager(plugins: Iterable[Any] | None = None) -> _NoPlugins:
    return _NoPlugins()
