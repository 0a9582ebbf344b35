"""Process ownership: an object of ours acts only in the process that created it.

A worker started with ``fork`` inherits a copy of everything the parent held, garbage included:
batches, leases and their finalizers, rings, iterators, pin backends, CUDA events. When the
worker's garbage collector later frees that garbage, the finalizers run *in the worker*: a
segment would be unlinked and unregistered from the resource tracker twice, a CUDA fence would
be recorded in a process where CUDA was never initialised (SIGABRT). The ownership rule
(docs/design/ownership.md) is that such inherited objects are inert. This module is the one way
to say so.

Owns nothing but the creating pid of each ``ProcessOwner``. Runs in every process. Promises:
``owner.here`` is True only in the process that made ``owner``; code that acts on a resource
(unlink, unregister, fence, close workers) checks it first and does nothing elsewhere. The check
compares with this process's pid, cached and refreshed in every forked child by
``os.register_at_fork`` (``getpid()`` is a system call; docs/gpu.md, "Ownership", times it against
the cached compare). See docs/design/ownership.md; ``gpu/owned.py`` builds its method guard on
this.

It is also the one place that owns this package's fork hooks (``os.register_at_fork``): besides
the pid, it tells our own forks (a worker's start, ``our_fork``) from every other fork of the
process, and counts the others (``fork_mark``, ``forked_since``): a batch the user holds while
another's fork copies the process may be in use in that child, so its slot is never reused
(docs/design/slot-lifecycle.md, "Forks by other code"). Other modules add child hooks through
``at_fork_in_child``, and hooks to run in the forking thread before each fork of ours
(``before_our_fork``: the collate helpers are joined there, so a worker is never forked while a
thread of ours lives).
"""

from __future__ import annotations

import contextlib
import gc
import os
import threading
import weakref
from collections.abc import Callable, Iterator
from typing import TypeVar

__all__ = ["ProcessOwner", "at_fork_in_child", "before_our_fork", "fork_mark", "forked_since", "our_fork",
           "renewed_in_child", "started_by_us"]

_T = TypeVar("_T")

_pid = os.getpid()  # this process's pid, refreshed in every forked child
_child_hooks: list[Callable[[], None]] = []
_our_fork_hooks: list[Callable[[], None]] = []
# The threads of this process forking one of our own processes right now (``our_fork``). A thread's
# ident survives the fork (the child's one thread is the one that forked), so a hook tells by the
# forking thread's ident whether a fork is ours, whatever the other threads start or fork meanwhile.
_our_forks: set[int] = set()
_by_us = False  # in a forked child: one of our forks made this process (read by ``started_by_us``)
# Forks by other code: how many have begun in this process, and how many of those have not yet
# returned in the parent (both changed under ``_hold_lock``, ``_foreign_forking`` first).
_foreign_forks = 0
_foreign_forking = 0


@contextlib.contextmanager
def our_fork() -> Iterator[None]:
    """Mark the calling thread as forking a process of ours (a worker) for the block: that fork is
    not counted as another's (``fork_mark``), and its child knows itself ours (``started_by_us``).
    The ``before_our_fork`` hooks run first: one that raises (a Ctrl-C) stops the fork."""
    for hook in _our_fork_hooks:
        hook()
    me = threading.get_ident()
    try:
        _our_forks.add(me)  # inside the try: a Ctrl-C raised as add() returns still unmarks the thread
        yield
    finally:
        try:
            _our_forks.discard(me)  # set.add/discard are atomic under the GIL: no lock needed
        finally:
            _give_back(me)  # the fork is over: a hold its after-hooks did not give back (see below)


def before_our_fork(hook: Callable[[], None]) -> None:
    """Run ``hook`` in the forking thread as each ``our_fork`` block begins, before the fork."""
    _our_fork_hooks.append(hook)


def started_by_us() -> bool:
    """In a child hook (``at_fork_in_child``): whether one of our own forks made this process."""
    return _by_us


def fork_mark() -> int:
    """A mark of the forks by other code so far, for ``forked_since``; -1 while one is under way
    (its child may copy whatever is made now). Reads the count before the forks under way, which
    a fork's hook raises first, so no interleaving yields a mark that misses a fork."""
    begun = _foreign_forks
    return -1 if _foreign_forking else begun


def forked_since(mark: int) -> bool:
    """Whether a fork by other code may have copied this process since ``fork_mark()`` gave
    ``mark``: one began since, or one is under way now. Errs only towards True."""
    return mark != _foreign_forks or _foreign_forking > 0


def at_fork_in_child(hook: Callable[[], None]) -> None:
    """Run ``hook`` in every forked child, after this module has refreshed the pid and before the
    collector can run there (``_before_fork`` holds it)."""
    _child_hooks.append(hook)


def renewed_in_child(renew: Callable[[_T], None]) -> weakref.WeakSet[_T]:
    """A weak set whose members each get ``renew(member)`` in every forked child (``at_fork_in_child``),
    in the child's one thread before anything else runs there: the way a per-process object (a
    lock that a parent's thread may have held at the fork, a timer whose thread was not forked)
    is made anew in the child. Promises: every member alive at the fork is renewed once; the set
    holds none of them alive."""
    members: weakref.WeakSet[_T] = weakref.WeakSet()

    def renew_all() -> None:
        for member in list(members):
            renew(member)

    at_fork_in_child(renew_all)
    return members


# The collector is held (disabled) from just before a fork until this module's child hook has
# run. threading registers its own at-fork hook before any of ours, and an allocation there (or
# in any hook registered before ours) could otherwise start a collection in the child while the
# cached pid is still the parent's and nothing is frozen: the parent's garbage (an iterator, a
# ring) would be finalized in the child as if it were the parent, unlinking live segments
# (tests/test_fork_gc.py). Two threads may fork at once: each forking thread holds a token.
#
# A Ctrl-C can land in these hooks: a SIGINT that arrives during the fork is raised as the next
# Python hook starts, before its first line, and os.fork only prints it ("Exception ignored") and
# goes on. A count that the before-hook raised and the after-hook lowered then went negative (the
# before-hook cut short) or stayed up (the after-hook cut short): the collector was no longer held
# around forks, or was never enabled again (tests/test_fork_gc.py). So the before-hook records
# what it took in ``_forking`` (this thread's token: whether the fork is another's) before it
# changes anything else, and the after-hook gives back only what a token says, removing the token
# before it changes anything else; each is registered twice and does nothing the second time, so
# the one pending Ctrl-C that a hook's start raises leaves the other registration to do the work.
# A token that outlives its fork anyway (two Ctrl-Cs) is given back when the thread's ``our_fork``
# ends, or by the thread's next fork.
_hold_lock = threading.Lock()
_forking: dict[int, bool] = {}  # forking thread's ident -> whether its fork is another's (its token)
_was_enabled = False


def _before_fork() -> None:
    """In the forking thread, just before the fork: hold the collector; count another's fork.
    A no-op when this thread holds a token already (the other registration of this hook ran)."""
    global _was_enabled, _foreign_forks, _foreign_forking
    me = threading.get_ident()
    foreign = me not in _our_forks
    with _hold_lock:
        if me in _forking:
            return
        enabled = gc.isenabled()
        first = not _forking
        _forking[me] = foreign  # first: the after-hook gives back exactly what is taken from here on
        if foreign:
            _foreign_forking += 1  # first: see fork_mark
            _foreign_forks += 1
        if first:
            _was_enabled = enabled
            gc.disable()


def _after_in_parent() -> None:
    """In the forking thread, the fork done: give the collector back; another's fork has returned."""
    _give_back(threading.get_ident())


def _give_back(me: int) -> None:
    """Give back what thread ``me``'s token holds, if it holds one (a no-op otherwise)."""
    global _foreign_forking
    with _hold_lock:
        foreign = _forking.get(me)
        if foreign is None:
            return
        del _forking[me]  # first: nothing below is undone twice
        if foreign:
            _foreign_forking -= 1
        if not _forking and _was_enabled:
            gc.enable()


def _forked() -> None:
    """In the child, the one thread left: refresh the pid, run the hooks, give the collector back."""
    global _pid, _hold_lock, _by_us, _foreign_forking
    _pid = os.getpid()
    _hold_lock = threading.Lock()  # another thread of the parent may have held it at the fork
    _forking.clear()  # the forks under way were the parent's threads'
    _foreign_forking = 0
    _by_us = threading.get_ident() in _our_forks
    _our_forks.clear()  # a process that this child forks in turn is not one of ours
    try:
        for hook in _child_hooks:
            hook()
    finally:
        if _was_enabled:
            gc.enable()


if hasattr(os, "register_at_fork"):  # POSIX; without fork there is nothing to refresh
    for _registration in range(2):  # twice: a Ctrl-C that one's start raises leaves the other to act
        os.register_at_fork(before=_before_fork, after_in_parent=_after_in_parent)
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
