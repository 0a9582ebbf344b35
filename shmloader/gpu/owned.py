"""Ownership of the GPU handoff's objects: a backend, its events and the prefetcher act only in the
process that created them (issue 13, docs/design/ownership.md).

A worker started with ``fork`` inherits the parent's pin backend, its CUDA events, the device
prefetcher's pending copies and every batch whose lease still references them. When the worker's
garbage collector frees that garbage, finalizers run *in the worker*; a CUDA call there fails
(CUDA is not initialised in a forked child) or aborts the process. Rather than rely on every
caller to check, each entry point that could reach an accelerator is guarded here:

- :class:`Owned` — a base (or dataclass field ``_owner``) that records the creating process.
- :func:`owner_only` — decorates a method of an :class:`Owned` object: outside the creating process
  the method does nothing and returns its documented inert result (``None`` for ``fence``,
  ``unregister_segment``, ``wait``; ``True`` for an event's ``query``), or, for work that was
  asked for explicitly (``copy``, ``new_stream``), raises :class:`ForeignProcessError`.

Runs in every process; owns nothing but the creator of each object. Promises: a guarded method
never runs its body outside the creating process, whatever the caller (a lease finalizer, a
generator closed by a worker's garbage collector, user code). The check is
``owner.ProcessOwner.here`` (a compare with a pid cached per process); a guarded call costs about
0.13 µs more than a plain one, wrapper included, and the guarded entry points run a few times per
batch.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from typing import Any, TypeVar, cast

from shmloader.owner import ProcessOwner

__all__ = ["ForeignProcessError", "Owned", "owner_only"]

F = TypeVar("F", bound=Callable[..., Any])

class ForeignProcessError(RuntimeError):
    """Device work was asked of a backend in a process other than the one that created it."""


class Owned:
    """An object of the GPU handoff that belongs to the process that created it.

    Subclasses call ``super().__init__()`` (a dataclass instead declares
    ``_owner: ProcessOwner = field(default_factory=ProcessOwner)``). ``_foreign_call`` is told of
    every guarded call refused outside that process (the fake backend records them).
    """

    _owner: ProcessOwner

    def __init__(self) -> None:
        self._owner = ProcessOwner()

    @property
    def owned_here(self) -> bool:
        """True in the process that created this object, False in a forked child."""
        return self._owner.here

    def _foreign_call(self, method: str, args: tuple[Any, ...]) -> None:
        """Called (instead of ``method``) outside the creating process; does nothing by default."""


def owner_only(inert: Any = None, *, refuse: bool = False) -> Callable[[F], F]:
    """Guard a method of an :class:`Owned` object: outside its creating process it returns
    ``inert`` without running (or raises :class:`ForeignProcessError` with ``refuse=True``)."""

    def decorate(method: F) -> F:
        name = method.__name__

        @functools.wraps(method)
        def guarded(self: Owned, *args: Any, **kwargs: Any) -> Any:
            if self._owner.here:
                return method(self, *args, **kwargs)
            self._foreign_call(name, args)
            if refuse:
                raise ForeignProcessError(
                    f"{type(self).__name__}.{name} was called in process {os.getpid()}, but this object "
                    f"belongs to process {self._owner.pid} (it was inherited through fork): create the "
                    "loader, backend or prefetcher in the process that uses the device")
            return inert

        return cast(F, guarded)

    return decorate
