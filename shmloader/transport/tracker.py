"""Our side of multiprocessing's resource tracker, kept through the tracker's death.

Owns every name this process has registered with the standard library's resource tracker and not
yet unregistered: the segments of the default shm directory (``segment.py``) and, under spawn and
forkserver, the stop flags' named semaphores (``worker/stop.py``, which CPython registers itself:
``adopt``). Runs in the main process; a forked child starts with none of its parent's names.

The tracker is a helper process that outlives nothing of ours on purpose: when its trainer dies
(SIGKILL included) it unlinks what is still registered. It can die first (an outside SIGKILL, the
OOM killer, a job script's ``pkill python``); the next call into it then finds it gone and
starts a new one. Promises:

- A dead tracker never kills the trainer. CPython finds it gone by writing a probe into its pipe;
  with SIGPIPE at its default action (``signal(SIGPIPE, SIG_DFL)``, as command-line tools set it)
  that write ended the trainer with exit code 141 and no message. Every call here holds SIGPIPE
  for the calling thread, so the write fails with EPIPE, and takes the signal it raised.
- A new tracker is told every name still live here as soon as we see it, so a trainer killed
  afterwards still leaves nothing behind, and each later unregister finds its name (the new
  tracker printed a ``KeyError`` traceback on stderr for each one it had never heard of).
  CPython's own warning of the relaunch ("resource_tracker: process died unexpectedly") stays.
- Names registered while the tracker was dead and not yet seen as such are not lost: the call
  that relaunches it is one of ours, before the name is sent.

A tracker stopped from outside (SIGSTOP) cannot be helped: it reads nothing, and once its pipe is
full the next registration blocks until it is continued (docs/reliability.md).
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Iterator
from multiprocessing import resource_tracker

from shmloader.log import logger

_lock = threading.RLock()
_owner_pid = os.getpid()  # the process whose names ``_live`` holds
_live: dict[str, str] = {}  # name -> resource type, as registered
_tracker_pid: int | None = None  # the tracker that holds ``_live``; None before the first call


def register(name: str, rtype: str) -> None:
    """Register ``name`` (a resource of type ``rtype``: "shared_memory", "semaphore") and keep it."""
    with _lock, _sigpipe_held():
        _sync()
        resource_tracker.register(name, rtype)
        _live[name] = rtype


def unregister(name: str, rtype: str) -> None:
    """Unregister ``name``: the tracker that holds it (a new one was told it first) forgets it."""
    with _lock, _sigpipe_held():
        _sync()
        _live.pop(name, None)
        resource_tracker.unregister(name, rtype)


def ensure_running() -> None:
    """Start the tracker now (a new one is told every live name) before CPython writes to it."""
    with _lock, _sigpipe_held():
        _sync()


def adopt(name: str, rtype: str) -> None:
    """Keep ``name``, which CPython registered itself (a named semaphore), live from here on: a new
    tracker is told it too, so CPython's own unregister later finds it."""
    with _lock:
        _own()[name] = rtype


def forget(name: str) -> None:
    """``name`` is about to be unregistered by CPython (a semaphore's finalizer): keep it no longer,
    and make sure the tracker it will write to lives. Nothing for a name this process does not keep
    (a finalizer inherited through fork). Never raises (it runs from finalizers)."""
    with contextlib.suppress(Exception), _lock, _sigpipe_held():
        if _own().pop(name, None) is not None:
            _sync()


def _own() -> dict[str, str]:
    """``_live``, emptied first in a process forked from the one that filled it: a child must never
    hand its parent's names to a tracker of its own, which would unlink them when the child exits."""
    global _owner_pid, _tracker_pid
    if os.getpid() != _owner_pid:
        _owner_pid, _tracker_pid = os.getpid(), None
        _live.clear()
    return _live


def _sync() -> None:
    """Make sure the tracker runs; a new one (the old one died) is told every live name."""
    global _tracker_pid
    live = _own()
    resource_tracker.ensure_running()
    pid = getattr(resource_tracker._resource_tracker, "_pid", None)
    if pid == _tracker_pid:
        return
    if _tracker_pid is not None and live:
        logger.warning("the resource tracker (pid %s) died; %d shared-memory names of this process are handed to "
                       "its successor (pid %s)", _tracker_pid, len(live), pid)
        for name, rtype in list(live.items()):
            resource_tracker.register(name, rtype)
    _tracker_pid = pid


@contextlib.contextmanager
def _sigpipe_held() -> Iterator[None]:
    """SIGPIPE held for this thread inside; one that a write raised meanwhile is taken, not delivered.
    A write to a pipe without readers raises SIGPIPE in the writing thread, so holding it here is
    enough whatever its action is. A no-op where ``pthread_sigmask`` is missing."""
    mask = getattr(signal, "pthread_sigmask", None)
    if mask is None:
        yield
        return
    previous = mask(signal.SIG_BLOCK, {signal.SIGPIPE})
    try:
        yield
    finally:
        if signal.SIGPIPE not in previous and signal.SIGPIPE in signal.sigpending():
            signal.sigtimedwait({signal.SIGPIPE}, 0)
        mask(signal.SIG_SETMASK, previous)
