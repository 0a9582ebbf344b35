"""How a class or function of the main script travels: by its name, and back as the main
process's own object of that name.

Owns the record ``("m", qualname)``, used by the batch codec (``transport/codec.py``) and by a
worker's exception types (``transport/exc_types.py``). Runs in both processes: ``main_ref`` in the
worker, ``main_object`` in the main process. Why by name: under spawn and forkserver a worker's
copy of such a class is not what its ``__main__`` holds, so plain pickle refuses it ("not the same
object as __main__.Pair"), and by value (cloudpickle) would overwrite the main class's attributes
with the worker's copies.

Promises: ``main_ref`` names only what its name can find again (not a local class, nor a lambda);
``main_object`` returns the main process's ``__main__.<qualname>`` untouched, or raises: a
``DescriptorError`` for a malformed record, a ``pickle.UnpicklingError`` when ``__main__`` holds
no object of that name.
"""

from __future__ import annotations

import pickle
import sys
import types
from typing import Any

from shmloader.errors import DescriptorError


def main_ref(obj: type | types.FunctionType) -> tuple[str, str] | None:
    """``("m", qualname)`` for a class or function of ``__main__`` that its name can find (not a
    local one, nor a lambda), else None."""
    if obj.__module__ != "__main__":
        return None
    qualname = obj.__qualname__
    return None if "<" in qualname else ("m", qualname)


def main_object(record: tuple) -> Any:
    """The main script's class or function that a ``("m", qualname)`` record names (``main_ref``)."""
    qualname = record[1] if len(record) == 2 else None
    if type(qualname) is not str or not qualname:
        raise DescriptorError(f"descriptor record {record!r} names no object of the main script")
    obj: Any = sys.modules.get("__main__")
    try:
        for part in qualname.split("."):
            obj = getattr(obj, part)
    except AttributeError:  # a data error (raised with the task's worker and indices), not the engine's
        raise pickle.UnpicklingError(f"the batch holds __main__.{qualname}, which this process's main "
                                     f"module does not define") from None
    return obj
