"""How errors word sample indices and tasks: plain values, compact runs (``[0..7, 9]``).

Pure functions, used by :mod:`shmloader.errors` (which re-exports them) and the engine's messages,
in any process. Promises: numpy and torch numbers show as Python's; runs of consecutive integers
become ``a..b``; long lists are cut with a count; nothing here raises on odd indices.
"""

from __future__ import annotations

import numbers
from collections.abc import Mapping, Sequence
from typing import Any


def plain_indices(indices: Any) -> list[Any]:
    """A task's sample indices as a list of plain values, whatever the sampler put them in (a list,
    tuple, range, ndarray or tensor): numpy and torch numbers become Python's (``tolist()``), so
    messages and error attributes show numbers. None (an iterable dataset's task) gives ``[]``."""
    if indices is None:
        return []
    whole = _tolist(indices)
    if whole is not indices:
        return whole if isinstance(whole, list) else [whole]  # a 0-d array or tensor: one index
    try:
        items = list(indices)
    except TypeError:  # one index that is no sequence
        return [indices]
    return [_tolist(value) for value in items]


def _tolist(value: Any) -> Any:
    """``value.tolist()`` for an ndarray, tensor or numpy scalar; anything else as it is."""
    tolist = getattr(value, "tolist", None)
    return tolist() if callable(tolist) else value


def plain_tasks(tasks: Mapping[int, Any] | None) -> dict[int, list[Any] | None]:
    """An error's ``tasks`` attribute: task number -> plain sample indices (None: iterable dataset)."""
    return {task: None if indices is None else plain_indices(indices) for task, indices in (tasks or {}).items()}


def format_indices(indices: Any, limit: int = 12) -> str:
    """Compact sample indices: runs of consecutive integers become ``a..b``; long lists are cut
    with a count. Anything that is not an integer (a float, a string key) prints as it is."""
    if indices is None:
        return "(iterable dataset: no sample indices)"
    items = plain_indices(indices)
    if not items:
        return "[]"
    parts: list[str] = []
    start = prev = items[0]
    for value in items[1:] + [_END]:
        if _is_index(prev) and _is_index(value) and value == prev + 1:
            prev = value
            continue
        parts.append(f"{_show(start)}..{_show(prev)}" if prev is not start else _show(start))
        start = prev = value
    text = ", ".join(parts[:limit])
    if len(parts) > limit:
        text += f", ... ({len(items)} indices in all)"
    return f"[{text}]"


_END = object()  # closes the last run


def _is_index(value: Any) -> bool:
    """An integer index (Python or numpy), not a bool: only these make ``a..b`` runs."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _show(value: Any) -> str:
    """An integer as digits, another number as ``str`` (``1.0``), anything else as ``repr``."""
    if _is_index(value):
        return str(int(value))
    return str(value) if isinstance(value, numbers.Number) and not isinstance(value, bool) else repr(value)


def format_tasks(tasks: Mapping[int, Sequence[int] | None]) -> str:
    """One line naming each task and its sample indices, for error messages."""
    if not tasks:
        return "no tasks"
    return "; ".join(f"task {t}: indices {format_indices(idx)}" for t, idx in sorted(tasks.items()))
