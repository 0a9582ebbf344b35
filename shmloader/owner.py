"""Process ownership: an object of ours acts only in the process that created it.

A worker started with ``fork`` inherits a copy of everything the parent held, garbage included:
batches, leases and their finalizers, rings, iterators, pin backends, CUDA events. When the
worker's garbage collector later frees that garbage, the finalizers run *in the worker*: a
segment would be unlinked and unregistered from the resource tracker twice, a CUDA fence would
be recorded in a process where CUDA was never initialised (SIGABRT). DESIGN.md's rule is that such
inherited objects are inert. This module is the one way to say so.

Owns nothing but the creating pid of each ``ProcessOwner``. Runs in every process. Promises:
``owner.here`` is True only in the process that made ``owner``; code that acts on a resource
(unlink, unregister, fence, close workers) checks it first and does nothing elsewhere. The check
compares with this process's pid, cached and refreshed in every forked child by
``os.register_at_fork`` (``getpid()`` is a system call, 0.26–0.45 µs on a 2-core VM; the cached
compare about 0.03 µs). See docs/design/ownership.md; ``gpu/owned.py`` builds its method guard on
this.
"""

from __future__ import annotations

import gc
import os
import threading
from collections.abc import Callable

__all__ = ["ProcessOwner", "at_fork_in_child"]

_pid = os.getpid()  # this process's pid, refreshed in every forked child
_child_hooks: list[Callable[[], None]] = []


def at_fork_in_child(hook: Callable[[], None]) -> None:
    """Run ``hook`` in every forked child, after this module has refreshed the pid and before the
    collector can run there (``_hold_collector``)."""
    _child_hooks.append(hook)


# The collector is held (disabled) from just before a fork until this module's child hook has
# run. threading registers its own at-fork hook before any of ours, and an allocation there (or
# in any hook registered before ours) could otherwise start a collection in the child while the
# cached pid is still the parent's and nothing is frozen: the parent's garbage (an iterator, a
# ring) would be finalized in the child as if it were the parent, unlinking live segments
# (tests/test_fork_gc.py). A count, not a flag: two threads may fork at once.
_hold_lock = threading.Lock()
_holds = 0
_was_enabled = False


def _hold_collector() -> None:
    global _holds, _was_enabled
    with _hold_lock:
        if _holds == 0:
            _was_enabled = gc.isenabled()
            gc.disable()
        _holds += 1


def _release_in_parent() -> None:
    global _holds
    with _hold_lock:
        _holds -= 1
        if _holds == 0 and _was_enabled:
            gc.enable()


def _forked() -> None:
    """In the child, the one thread left: refresh the pid, run the hooks, give the collector back."""
    global _pid, _holds, _hold_lock
    _pid = os.getpid()
    _hold_lock = threading.Lock()  # another thread of the parent may have held it at the fork
    _holds = 0
    try:
        for hook in _child_hooks:
            hook()
    finally:
        if _was_enabled:
            gc.enable()


if hasattr(os, "register_at_fork"):  # POSIX; without fork there is nothing to refresh
    os.register_at_fork(before=_hold_collector, after_in_parent=_release_in_parent, after_in_child=_forked)


class ProcessOwner:
    """The process that created an object; ``here`` says whether that is the current process."""

    __slots__ = ("pid",)

    def __init__(self) -> None:
        self.pid = _pid

    @property
    def here(self) -> bool:
        return _pid == self.pid

    def __repr__(self) -> str:
        return f"ProcessOwner(pid={self.pid})"
