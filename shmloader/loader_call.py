"""How a ``DataLoader`` call is read: which arguments the caller passed, and a bad call's words.

Owns :func:`records_explicit`, the decorator of ``DataLoader.__init__`` that stores the arguments the
caller actually passed as ``self._explicit`` (so ``SHMLOADER_*`` variables fill only the others,
and the torch flavour can read shmloader's extras back as given). Runs in the main process.
Promises: a call that does not bind raises TypeError in Python's own words, naming the function,
as torch's does (``DataLoader.__init__() got an unexpected keyword argument 'foo'``).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

__all__ = ["bind_error", "records_explicit"]


def records_explicit(init: Callable[..., None]) -> Callable[..., None]:
    """Record which arguments the caller actually passed (so env vars fill only the others)."""
    signature = inspect.signature(init)

    @functools.wraps(init)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> None:
        try:
            bound = signature.bind(self, *args, **kwargs)
        except TypeError as exc:  # in Python's own words, which name the function, as torch's do
            raise TypeError(f"{type(self).__name__}.__init__() {bind_error(signature, exc, len(args) + 1)}") from None
        object.__setattr__(self, "_explicit", {k: v for k, v in bound.arguments.items() if k != "self"})
        init(self, *args, **kwargs)

    return wrapper


def bind_error(signature: inspect.Signature, exc: TypeError, given: int) -> str:
    """``Signature.bind``'s complaint as the interpreter words it for a call."""
    if "too many positional arguments" not in str(exc):
        return str(exc)
    positional = [p for p in signature.parameters.values()
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    required = sum(1 for p in positional if p.default is p.empty)
    takes = f"{required}" if required == len(positional) else f"from {required} to {len(positional)}"
    return f"takes {takes} positional arguments but {given} were given"
