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

import os

__all__ = ["ProcessOwner"]

_pid = os.getpid()  # this process's pid, refreshed in every forked child


def _forked() -> None:
    global _pid
    _pid = os.getpid()


if hasattr(os, "register_at_fork"):  # POSIX; without fork there is nothing to refresh
    os.register_at_fork(after_in_child=_forked)


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
