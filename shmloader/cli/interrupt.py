"""Ctrl-C for ``python -m shmloader``: a KeyboardInterrupt, raised where it cannot be lost or do harm.

Owns the SIGINT handler the command line runs under (:func:`ctrl_c_handled`) and the shield that
holds Ctrl-C back while something must finish (:func:`shielded`). Runs in the CLI's main thread.

Why a handler of our own: Python's default one raises KeyboardInterrupt wherever the main thread
is, and two kinds of place are bad ones. (1) A ``__del__`` (torch's DataLoader iterator shuts its
workers down in one) or a finalizer (multiprocessing's ``Finalize``, weakref callbacks), where
Python prints "Exception ignored in ..." with a traceback and swallows the exception, so the
command goes on as if no Ctrl-C had come. (2) Inside
``multiprocessing.resource_sharer``: torch's workers hand each batch's storage over as a file
descriptor, the main process connecting to a thread of the worker for an authentication
exchange; interrupted in the middle of it, the main process closes the connection under the
worker's thread, which prints an EOFError traceback of its own.

Promises: under :func:`ctrl_c_handled`, SIGINT raises KeyboardInterrupt in the main thread, except
(a) inside :func:`shielded`, where it is raised when the shield ends, and (b) inside a ``__del__``
or the resource sharer, where it is raised again :data:`RETRY_S` later, up to
:data:`MAX_DEFERRALS` times (five seconds), then regardless. A KeyboardInterrupt that a finalizer
swallows anyway reaches ``sys.unraisablehook``: it is not printed but raised again
:data:`RETRY_S` later (any other unraisable exception goes to the previous hook). On exit
Python's default handler and the previous hook are back and no retry is pending. Where SIGINT is
not Python's default handler (ignored, or someone else's) or off the main thread, nothing is
installed and :func:`shielded` holds nothing back.

A process forked meanwhile (torch's DataLoader workers) inherits the handler, and Ctrl-C, sent to
the whole process group, reaches it too: there the handler does nothing, ending the children being
the main process's part (dropping or closing a loader ends its workers). A KeyboardInterrupt in a
torch worker can land between its taking the lock of its ``done_event`` (``Event.is_set``, every
batch) and its releasing it; the worker, and the main process shutting it down, then wait on that
lock forever.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType

from shmloader.redeliver import SOON_S, interrupt_main_later

__all__ = ["MAX_DEFERRALS", "RETRY_S", "ctrl_c_handled", "shielded", "unsafe_to_raise"]

RETRY_S = SOON_S
MAX_DEFERRALS = 250  # five seconds in all: what takes longer is stuck, interrupt it anyway
_SHARER = os.path.join("multiprocessing", "resource_sharer.py")


def unsafe_to_raise(frame: FrameType | None) -> bool:
    """Whether ``frame`` or a caller of it is a ``__del__`` or code of the resource sharer."""
    while frame is not None:
        if frame.f_code.co_name == "__del__" or frame.f_code.co_filename.endswith(_SHARER):
            return True
        frame = frame.f_back
    return False


class _Handler:
    """The SIGINT handler: raise now, when the shield ends, or a little later (module docstring)."""

    def __init__(self) -> None:
        self.shields = 0
        self.held = False  # a Ctrl-C came while shielded
        self.deferrals = 0
        self.retries: list[threading.Timer] = []  # every retry started: all are cancelled at the end
        self.previous_hook = sys.unraisablehook
        self.pid = os.getpid()  # the process whose Ctrl-C this is, not a forked child's

    def __call__(self, signum: int, frame: FrameType | None) -> None:
        if os.getpid() != self.pid:  # a forked child: the main process ends it (module docstring)
            return
        if self.shields:
            self.held = True
            return
        if self.deferrals < MAX_DEFERRALS and unsafe_to_raise(frame):
            self.deferrals += 1
            self.raise_later()
            return
        self.deferrals = 0
        raise KeyboardInterrupt

    def raise_later(self) -> None:
        """SIGINT again, as if Ctrl-C had been pressed again, :data:`RETRY_S` from now."""
        retry = interrupt_main_later(RETRY_S)
        self.retries.append(retry)  # list.append is atomic: the unraisable hook may run in any thread

    def unraisable(self, args: sys.UnraisableHookArgs) -> None:
        """``sys.unraisablehook``: a KeyboardInterrupt a finalizer swallowed is raised again later."""
        if isinstance(args.exc_value, KeyboardInterrupt) and os.getpid() == self.pid:
            self.raise_later()
        else:
            self.previous_hook(args)

    def cancel(self) -> None:
        """Cancel every pending retry, not only the last one, and join them: none fires later."""
        for retry in self.retries:
            retry.cancel()
        for retry in self.retries:
            retry.join()


_active: _Handler | None = None


@contextmanager
def ctrl_c_handled() -> Iterator[None]:
    """Run the block under :class:`_Handler` (see the module docstring); restore the default one."""
    global _active
    if threading.current_thread() is not threading.main_thread() \
            or signal.getsignal(signal.SIGINT) is not signal.default_int_handler:  # fmt: skip
        yield
        return
    handler = _active = _Handler()
    signal.signal(signal.SIGINT, handler)
    sys.unraisablehook = handler.unraisable
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)
        sys.unraisablehook = handler.previous_hook
        _active = None
        handler.cancel()


@contextmanager
def shielded() -> Iterator[None]:
    """Hold a Ctrl-C back until the block has ended (closing loaders, killing processes), then raise it."""
    handler = _active
    if handler is None:
        yield
        return
    handler.shields += 1
    try:
        yield
    finally:
        handler.shields -= 1
        if not handler.shields and handler.held:
            handler.held = False
            raise KeyboardInterrupt
