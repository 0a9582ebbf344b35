"""A worker's exception type on its way to the main process (``Failed.exc_type``).

Owns nothing; runs in both processes: ``dumps`` in the worker, ``loads`` in the main process.
Promises: a class travels by reference, as pickle sends it, so the main process raises its own
class; one of the main script travels by its name and comes back as the main process's
``__main__.<qualname>``, as a batch's classes do (``transport/main_names.py``). Why: under spawn and
forkserver the dataset reaches a worker by value (cloudpickle), so an exception class of the main
script is there a copy that the worker's ``__main__`` does not hold, and plain pickle refused it
("not the same object as __main__.BadSample"): the main process had no type to rebuild, and raised
a RuntimeError that the caller's ``except BadSample`` (or ``except ValueError``) did not catch.
"""

from __future__ import annotations

import io
import pickle
from typing import Any

from shmloader.transport.main_names import main_object, main_ref


class _Pickler(pickle.Pickler):
    """Names a class or function of the main script (``("m", qualname)``); pickles the rest."""

    def persistent_id(self, obj: Any) -> Any:
        return main_ref(obj) if isinstance(obj, type) else None


class _Unpickler(pickle.Unpickler):
    """Turns ``("m", qualname)`` back into the main process's own object of that name."""

    def persistent_load(self, pid: Any) -> Any:
        return main_object(pid)


def dumps(exc_type: type[BaseException]) -> bytes | None:
    """``exc_type`` pickled for the main process; None when it cannot be (a local class)."""
    buf = io.BytesIO()
    try:
        _Pickler(buf, pickle.HIGHEST_PROTOCOL).dump(exc_type)
    except Exception:
        return None
    return buf.getvalue()


def loads(data: bytes | None) -> Any:
    """The class ``dumps`` described, or None when this process has none of that name (the caller
    then raises the nearest type it can, or a RuntimeError)."""
    if data is None:
        return None
    try:
        return _Unpickler(io.BytesIO(data)).load()
    except Exception:
        return None
