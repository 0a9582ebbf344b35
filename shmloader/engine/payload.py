"""The worker spec as spawn and forkserver workers receive it: cloudpickled, once per pool (or, when
it holds multiprocessing objects, pickled by each ``Process.start``).

Owns nothing; runs in the main process. Promises: the bytes that each such worker unpickles, or,
when a part of the spec does not pickle, an error of the same type that names the loader argument
it came from (``dataset``, ``collate_fn``, ``worker_init_fn``, a plugin's collate rules) and the
start method, with pickle's own error as its ``__cause__``. pickle's bare ``TypeError: cannot pickle
'_thread.lock' object`` named none of them (an open file, a lock or a connection in a dataset is
the usual cause, and the usual surprise where spawn is the default).

Also owns torch's warning for a worker that cannot start because its arguments do not pickle
(:func:`warn_if_unpicklable`): torch 2.13 gives it, in these words and from
``torch.utils.data.dataloader``, before it re-raises a ``Process.start`` that failed with
``TypeError``, ``AttributeError`` or ``pickle.PicklingError``; the torch flavour gives it at the same
failures (here, or in ``Process.start``), the numpy flavour never (docs/frameworks.md, "Warnings").
"""

from __future__ import annotations

import pickle
from typing import Any

from shmloader.errors import retyped
from shmloader.warning_origin import warn
from shmloader.worker.main import WorkerSpec

# spec field -> the loader argument it comes from, in the order they are tried
_ARGUMENTS = {"dataset": "dataset", "collate_fn": "collate_fn", "worker_init_fn": "worker_init_fn",
              "collate_rules": "plugins' collate rules"}

# what torch's loader takes for a pickle error when a worker's Process.start fails
_PICKLE_ERRORS = (TypeError, AttributeError, pickle.PicklingError)
_TORCH_PICKLE_WORDS = (
    "Got pickle error when attempting to start a worker Process. "
    "This might be because the worker Process arguments are not picklable. "
    "Python 3.14+ changed the multiprocessing start method in non-Mac POSIX platforms "
    "to 'forkserver', which requires the worker Process arguments to be picklable. "
    "You can also try multiprocessing.set_start_method('fork').")


def warn_if_unpicklable(exc: BaseException, torch_module: str | None) -> None:
    """torch's "Got pickle error" warning, naming ``torch_module``, when ``exc`` (what pickling the
    spec or starting a worker raised, about to be re-raised) is one torch warns of; nothing for the
    numpy flavour (``torch_module`` None). The warning names the caller's line."""
    if torch_module is not None and isinstance(exc, _PICKLE_ERRORS):
        warn(_TORCH_PICKLE_WORDS, stacklevel=2, torch_module=torch_module)


def pickled_spec(spec: WorkerSpec, start_method: str) -> bytes | WorkerSpec:
    """``cloudpickle.dumps(spec)``; a failure names the argument that does not pickle.

    A spec holding multiprocessing objects (Lock, Event, Value, Queue: they pickle only while a
    process starts) comes back as it is: ``Process.start`` then pickles it for each worker, as
    torch's workers receive their dataset."""
    import cloudpickle

    try:
        return cloudpickle.dumps(spec)
    except Exception as exc:
        if _shared_by_inheritance_only(exc):
            return spec
        raise _unpicklable(spec, start_method, exc) from exc


def _shared_by_inheritance_only(exc: Exception) -> bool:
    """multiprocessing's refusal to pickle its objects outside ``Process.start`` (assert_spawning)."""
    return isinstance(exc, RuntimeError) and "should only be shared between processes through inheritance" in str(exc)


def _unpicklable(spec: WorkerSpec, start_method: str, exc: Exception) -> BaseException:
    """``exc``, retyped with a message that names the first argument that does not pickle."""
    import cloudpickle

    argument, value = "worker spec", spec
    for field, name in _ARGUMENTS.items():
        part = getattr(spec, field)
        try:
            cloudpickle.dumps(part)
        except Exception:
            argument, value = name, part
            break
    return retyped(exc, f"the {argument} ({_type_name(value)}) cannot be pickled, as the {start_method!r} start "
                        f"method needs to send it to each worker: {type(exc).__name__}: {exc}. Make it picklable "
                        "(open files, locks and connections in worker_init_fn or on first use, or leave them out "
                        "in __getstate__), or use multiprocessing_context='fork'.")


def _type_name(value: Any) -> str:
    return type(value).__qualname__
