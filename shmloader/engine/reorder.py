"""The reorder buffer: says which finished task the user gets next. Pure: no I/O, no processes.

Owns the outcomes of tasks that finished but were not yet handed out. Promises: with
``in_order=True`` outcomes come out in task-number order, each once, and a task marked skipped
(an iterable dataset's worker ran out) is passed over; with ``in_order=False`` they come out in
arrival order (``arrival_order()`` switches an in-order buffer to it, as a resumed unordered
epoch's fast-forward ends). Task numbers start at 0 each epoch and every dispatched task gets exactly one
outcome, so the buffer never waits for a number that will not come.
"""

from __future__ import annotations

from collections import deque
from typing import Any, Generic, TypeVar

T = TypeVar("T")


class Reorder(Generic[T]):
    def __init__(self, in_order: bool = True) -> None:
        self.in_order = in_order
        self.next_due = 0
        self._items: dict[int, T] = {}
        self._arrivals: deque[int] = deque()
        self._skipped: set[int] = set()

    def put(self, task: int, item: T) -> None:
        if task in self._items or task in self._skipped or (self.in_order and task < self.next_due):
            raise ValueError(f"task {task} already has an outcome")
        self._items[task] = item
        self._arrivals.append(task)

    def skip(self, task: int) -> None:
        """Task ``task`` will have no item (iterable dataset exhausted in its worker)."""
        if self.in_order and task >= self.next_due:
            self._skipped.add(task)

    def pop(self) -> T | None:
        """The next item due, or None if it has not arrived."""
        if not self.in_order:
            if not self._arrivals:
                return None
            return self._items.pop(self._arrivals.popleft())
        while self.next_due in self._skipped:
            self._skipped.discard(self.next_due)
            self.next_due += 1
        item = self._items.pop(self.next_due, None)
        if item is None:
            return None
        self._arrivals.remove(self.next_due)
        self.next_due += 1
        return item

    def arrival_order(self) -> None:
        """From now on, outcomes come out in arrival order (those already here first, as they came)."""
        self.in_order = False
        self._skipped.clear()

    def has_due(self) -> bool:
        """Whether ``pop`` would return an item now."""
        if not self.in_order:
            return bool(self._arrivals)
        due = self.next_due
        while due in self._skipped:
            due += 1
        return due in self._items

    def __len__(self) -> int:
        return len(self._items)

    def drain(self) -> list[Any]:
        """Remove and return every buffered item (abandoned epoch)."""
        items = list(self._items.values())
        self._items.clear()
        self._arrivals.clear()
        self._skipped.clear()
        return items
