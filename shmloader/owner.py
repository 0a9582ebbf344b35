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
costs one ``getpid()`` (about 0.1 µs). See docs/design/ownership.md.
"""

from __future__ import annotations

import os

__all__ = ["ProcessOwner"]


class ProcessOwner:
    """The process that created an object; ``here`` says whether that is the current process."""

    __slots__ = ("pid",)

    def __init__(self) -> None:
        self.pid = os.getpid()

    @property
    def here(self) -> bool:
        return os.getpid() == self.pid

    def __repr__(self) -> str:
        return f"ProcessOwner(pid={self.pid})"
