"""Errors kept on an object to be raised later, without a reference cycle through their traceback.

The iterators keep some errors for later so that what came before them is handed out first (an
observer's error until the next ``next()``, a refused growth until its task is due, the batch
``to_device`` read ahead). A traceback holds every frame the error passed through; each frame,
once finished, holds its caller's frame (``f_back``) up to the loader's ``next()``, and those hold
their locals, the keeper among them. Kept as it is, the error makes a cycle (keeper -> error ->
traceback -> frames -> keeper) that only the cyclic collector frees, so a keeper dropped before the
error is raised kept its workers, pipes and segments until a collection (``frame.clear()`` does not
help: a cleared frame still holds its caller).

Also here: :func:`call_each`, which keeps the first error of a series of calls (every iterator
to close, every device copy to wait for) and raises it once all were made, and :func:`note`, which
adds a note to an error on every Python we support.
"""

from __future__ import annotations

import traceback
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

E = TypeVar("E", bound=BaseException)
T = TypeVar("T")

NOTE = "Traceback when this error was met (it was kept, and raised after the batches before it):"


def keep(exc: E) -> E:
    """``exc``, ready to be stored on its keeper and raised later; returns the same object.

    ``exc`` and every error chained to it (``__cause__``, ``__context__``) keep their type, message
    and chain, but not their traceback: each traceback becomes text, in a note on its error
    (``__notes__``, which Python 3.11+ prints after the message; a raise adds the new traceback).
    No frame is kept, so nothing in the error refers back to its keeper. A debugger's post-mortem
    sees the frames of the later raise, not those of where the error was met.
    """
    seen: set[int] = set()
    todo: list[BaseException] = [exc]
    while todo:
        error = todo.pop()
        if id(error) in seen:
            continue
        seen.add(id(error))
        tb = error.__traceback__
        if tb is not None:
            error.__traceback__ = None
            note(error, NOTE + "\n" + "".join(traceback.format_tb(tb)).rstrip())
            del tb
        todo.extend(e for e in (error.__cause__, error.__context__) if e is not None)
    return exc


def note(error: BaseException, text: str) -> None:
    """``error.add_note(text)``; on Python 3.10 the same list, which that version does not print."""
    notes = getattr(error, "__notes__", None)
    if not isinstance(notes, list):
        notes = []
        try:
            error.__notes__ = notes  # type: ignore[attr-defined]
        except AttributeError:  # an error type that refuses new attributes: no note
            return
    notes.append(text)


def call_each(items: Iterable[T], call: Callable[[T], Any]) -> None:
    """``call`` on every one of ``items`` whatever one of them raises (a Ctrl-C, raised as a wait
    returns; a device error; a ``close()`` that gave up), then raise the first error."""
    first: list[BaseException] = []
    for item in items:
        try:
            call(item)
        except BaseException as exc:
            if not first:
                first.append(exc)
    if first:  # popped as raised: no local here holds the error whose traceback holds this frame
        raise first.pop()
