"""The exception tree of shmloader, and the helpers that word its messages (sample indices:
:mod:`shmloader.error_words`, re-exported here).

Every error raised while loading subclasses something a torch user already catches::

    Exception
    ├── RuntimeError
    │   └── LoaderError             any failure of the loading machinery
    │       ├── WorkerDied          a worker exited unexpectedly (signal, os._exit, failed start)
    │       │   └── RestartBudgetExceeded   restart policy gave up: too many deaths this epoch
    │       ├── PoisonTask          one task killed workers on every one of its attempts
    │       ├── WorkerTimeout       no batch within ``timeout=`` seconds (torch's wording)
    │       │   └── WorkerHung      a worker exceeded the per-task deadline and was killed
    │       ├── ShmSpaceError       the ring does not fit in the shared-memory directory
    │       ├── TooManyOpenFiles    out of file descriptors as a slot was made (also an OSError)
    │       ├── SegmentCollision    no fresh segment name could be created (taken each time)
    │       ├── RingExhausted       the ring hit its slot limit while the user holds every slot
    │       ├── DescriptorError     a worker's descriptor failed validation (bug or corruption)
    │       ├── SlotOwnershipError  a slot transition by a party that does not hold it (refused)
    │       ├── LoaderClosed        next() on an iterator after close() stopped it
    │       └── PluginError         a plugin was refused at registration or raised inside a hook
    └── ValueError
        ├── ConfigError             a bad ``SHMLOADER_*`` value or loader option
        └── StateError              a resume state cannot be saved, or does not fit this loader

An exception raised by user code inside a worker (dataset, collate_fn, worker_init_fn) is re-raised
in the main process with its own type and torch's wording ("Caught KeyError in DataLoader worker
process 2. Original Traceback ..."), plus the task number and sample indices; see
:func:`rebuild_worker_exception`.

Messages put facts first (worker, pid, signal or exit code, tasks and sample indices), then hints
marked as such and backed by a measurement, then what to change.
"""

from __future__ import annotations

import signal as _signal
from collections.abc import Mapping, Sequence
from typing import Any

from shmloader.error_words import format_indices, format_tasks, plain_tasks
from shmloader.error_words import plain_indices as plain_indices  # re-exported: the engine's messages use it

__all__ = [
    "LoaderError",
    "WorkerDied",
    "RestartBudgetExceeded",
    "PoisonTask",
    "WorkerTimeout",
    "WorkerHung",
    "ShmSpaceError",
    "TooManyOpenFiles",
    "SegmentCollision",
    "RingExhausted",
    "DescriptorError",
    "SlotOwnershipError",
    "LoaderClosed",
    "ConfigError",
    "PluginError",
    "StateError",
    "describe_exit",
    "signal_name",
    "format_indices",
    "format_tasks",
    "rebuild_worker_exception",
]


class LoaderError(RuntimeError):
    """Base of every failure of the loading machinery (not of user code).

    Like torch's RuntimeErrors, each one is built from one message string (its facts are then
    None: ``raise type(err)(f"{err} ...") from err`` works) and pickles, its facts included, so it
    reaches a parent process intact (multiprocessing, concurrent.futures).
    """

    def __reduce__(self) -> tuple[Any, ...]:
        # BaseException's would call cls(*args) and drop keyword-only facts (or fail without them)
        return _rebuilt, (type(self), self.args, self.__dict__)


def _rebuilt(cls: type[LoaderError], args: tuple[Any, ...], facts: dict[str, Any]) -> LoaderError:
    """Unpickle a LoaderError: its message (``args``) and facts, without calling ``__init__``."""
    error = cls.__new__(cls, *args)
    error.__dict__.update(facts)
    return error


class WorkerDied(LoaderError):
    """A worker process exited while it held tasks, or failed to start.

    Attributes: ``worker_id``, ``pid``, ``exitcode`` (negative for a signal, as
    ``multiprocessing`` reports it), ``signal`` (the signal number or None), ``tasks``
    (task number -> sample indices it held).
    """

    def __init__(
        self,
        message: str,
        *,
        worker_id: int | None = None,
        pid: int | None = None,
        exitcode: int | None = None,
        tasks: Mapping[int, Any] | None = None,
    ) -> None:
        super().__init__(message)
        self.worker_id = worker_id
        self.pid = pid
        self.exitcode = exitcode
        self.signal = -exitcode if exitcode is not None and exitcode < 0 else None
        self.tasks = plain_tasks(tasks)


class RestartBudgetExceeded(WorkerDied):
    """The restart policy replaced workers ``max_restarts`` times this epoch and gives up."""


class PoisonTask(LoaderError):
    """A task killed its worker on each of ``attempts`` tries; it is not retried again.

    Attributes: ``task``, ``indices``, ``attempts``, ``deaths`` (one description per death).
    """

    tasks: dict[int, list[Any] | None]  # {task: indices}, as the other errors carry it (set by engine.faults.poison)

    def __init__(
        self, message: str, *, task: int | None = None, indices: Any = None, attempts: int | None = None,
        deaths: Sequence[str] = (),
    ) -> None:
        super().__init__(message)
        self.task = task
        self.indices = plain_indices(indices)
        self.attempts = attempts
        self.deaths = list(deaths)


class WorkerTimeout(LoaderError):
    """No batch arrived within ``timeout`` seconds. Attributes: ``timeout_s``, ``tasks``."""

    def __init__(
        self, message: str, *, timeout_s: float | None = None,
        tasks: Mapping[int, Any] | None = None,
        worker_id: int | None = None, pid: int | None = None,
    ) -> None:
        super().__init__(message)
        self.timeout_s = timeout_s
        self.tasks = plain_tasks(tasks)
        self.worker_id = worker_id
        self.pid = pid


class WorkerHung(WorkerTimeout):
    """A worker exceeded the per-task deadline and was killed (``task_timeout_s``)."""


class TooManyOpenFiles(OSError, LoaderError):
    """The process (or system) ran out of file descriptors as a slot was made: each slot keeps one
    open, and each batch the caller holds keeps its slot. An OSError with its errno (EMFILE or
    ENFILE), and a LoaderError, as torch raises a RuntimeError when held batches exhaust them.
    Pickles as an OSError does (errno and message: ``OSError.__reduce__`` comes first)."""


class ShmSpaceError(LoaderError):
    """The ring would not fit in the free space of the shared-memory directory.

    Attributes: ``needed_bytes``, ``free_bytes``, ``directory``.
    """

    def __init__(self, message: str, *, needed_bytes: int | None = None, free_bytes: int | None = None,
                 directory: str | None = None) -> None:
        super().__init__(message)
        self.needed_bytes = needed_bytes
        self.free_bytes = free_bytes
        self.directory = directory


class SegmentCollision(LoaderError):
    """Every fresh segment name tried was already taken (or removed before the owner could lock it).

    Names carry 64 random bits, so this means another process creates or removes files named like
    ours in that directory. Attributes: ``directory``, ``name`` (the last name tried), ``attempts``.
    """

    def __init__(self, message: str, *, directory: str | None = None, name: str | None = None,
                 attempts: int | None = None) -> None:
        super().__init__(message)
        self.directory = directory
        self.name = name
        self.attempts = attempts


class RingExhausted(LoaderError):
    """Every slot is leased by the user and the ring may not grow past ``max_slots``."""


class DescriptorError(LoaderError):
    """A descriptor named a slot or a region that fails validation; nothing was viewed."""


class SlotOwnershipError(LoaderError):
    """A slot transition (fill, lease, resize, free) was asked by a task that does not hold the
    slot. It is refused before anything changes: an engine bug, never silent data corruption."""


class LoaderClosed(LoaderError):
    """``next()`` on an iterator that ``close()`` (the loader's or its own) has stopped."""


class PluginError(LoaderError):
    """A plugin failed: at registration (validation) or inside one of its hooks.

    Attributes: ``plugin`` (its name: entry-point name, module name or class name) and ``hook``
    (the hook's name, or None when the plugin as a whole was refused).
    """

    def __init__(self, message: str, *, plugin: str | None = None, hook: str | None = None) -> None:
        super().__init__(message)
        self.plugin = plugin
        self.hook = hook


class StateError(ValueError):
    """A state cannot be saved, or cannot be loaded into this loader.

    ``saved`` and ``current`` hold both sides of a mismatch (None when not a mismatch).
    """

    def __init__(self, message: str, saved: Any = None, current: Any = None) -> None:
        super().__init__(message)
        self.saved = saved
        self.current = current


class ConfigError(ValueError):
    """A loader option or ``SHMLOADER_*`` environment variable has a bad value.

    Attributes: ``name`` (argument or variable), ``value``.
    """

    def __init__(self, message: str, *, name: str = "", value: Any = None) -> None:
        super().__init__(message)
        self.name = name
        self.value = value


class PrefetchFactorError(ConfigError, AssertionError):
    """``prefetch_factor`` below 1 with workers: 0 given to the constructor, or a value below 1
    that reached ``iter()`` (set after construction).

    A ConfigError (a ValueError), and an AssertionError, which torch raises at ``iter()``.
    """


class NumWorkersError(ConfigError, AssertionError):
    """A negative ``num_workers``: at construction torch's ValueError, and at ``iter()`` (the
    attribute set since) torch's AssertionError too, which its multi-process iterator raises there.
    """


class DaemonicProcessWorkersError(ConfigError, AssertionError):
    """``num_workers > 0`` reached ``iter()`` in a daemonic process (a DataLoader worker, whose
    dataset makes a loader of its own), which multiprocessing refuses children.

    A ConfigError naming ``num_workers``, raised before anything starts; and an AssertionError,
    which ``Process.start`` raises there under torch ("daemonic processes are not allowed to have
    children").
    """


class TimeoutWithoutWorkersError(ConfigError, AssertionError):
    """A ``timeout`` other than 0 reached ``iter()`` without workers, where nothing waits for a batch.

    A ConfigError naming ``timeout``, and an AssertionError, which torch's single-process iterator
    raises there ("requires timeout == 0").
    """


def describe_exit(exitcode: int | None) -> str:
    """Word an exit code as users read it: ``signal SIGKILL (9)`` or ``exit code 3``."""
    if exitcode is None:
        if _signal.getsignal(_signal.SIGCHLD) is _signal.SIG_IGN:  # engine/exits.py
            return ("an exit status this process cannot learn (it ignores SIGCHLD, so the kernel reaps "
                    "its children and drops their status)")
        return "no exit code (still running)"
    if exitcode < 0:
        return f"signal {signal_name(-exitcode)} ({-exitcode})"
    return f"exit code {exitcode}"


def signal_name(signum: int) -> str:
    """``SIGKILL`` for 9; ``unknown signal`` for a number no signal has."""
    try:
        return _signal.Signals(signum).name
    except ValueError:
        return "unknown signal"


def rebuild_worker_exception(
    exc_type: type[BaseException] | None,
    type_name: str,
    traceback_text: str,
    *,
    worker_id: int,
    pid: int | None,
    task: int | None,
    indices: Sequence[int] | None,
) -> BaseException:
    """Rebuild a worker's exception in the main process, in torch's words plus our facts.

    The message starts as torch's does ("Caught KeyError in DataLoader worker process 2.") so
    users' greps keep working, then names the pid, task and sample indices. The original type is
    kept when it can be built from one message string; otherwise the nearest base class that can
    (numpy's ``_ArrayMemoryError(shape, dtype)`` becomes a ``MemoryError``, so ``except
    MemoryError`` still catches it); a RuntimeError carries the text when none can, and for a
    ``BaseException`` that is no ``Exception`` (``sys.exit()`` in ``worker_init_fn``), which
    would otherwise end the training process.
    """
    where = f"DataLoader worker process {worker_id}"
    facts = f" (pid {pid}" + (f", task {task}, sample indices {format_indices(indices)}" if task is not None else "") + ")"
    return _same_kind(exc_type, f"Caught {type_name} in {where}{facts}.\nOriginal {traceback_text}")


def batch_rebuild_error(exc: BaseException, *, worker_id: int, pid: int | None, task: int,
                        indices: Sequence[int] | None) -> BaseException:
    """A batch that its worker pickled could not be rebuilt in the main process (an object whose
    unpickling fails here): the error of the same kind, naming the worker, pid, task and sample
    indices, to be raised ``from exc`` so the original traceback follows."""
    msg = (f"Could not rebuild the batch of task {task} (sample indices {format_indices(indices)}) from "
           f"DataLoader worker process {worker_id} (pid {pid}) in the main process: "
           f"{type(exc).__name__}: {exc}")
    return _same_kind(type(exc), msg)


def retyped(exc: BaseException, msg: str) -> BaseException:
    """``msg`` in an exception of ``exc``'s type (or its nearest base that takes one string), so
    that an ``except`` written for the original still catches it; raise it ``from exc``."""
    return _same_kind(type(exc), msg)


def _same_kind(exc_type: type[BaseException] | None, msg: str) -> BaseException:
    """``exc_type(msg)``, or its nearest base that can be built from one string; RuntimeError when none."""
    for candidate in _exception_classes(exc_type):
        try:  # KeyError (and its subclasses) quote their argument in str(): keep the text readable
            return candidate(_KeyErrorMessage(msg) if issubclass(candidate, KeyError) else msg)
        except Exception:
            continue
    return RuntimeError(msg)


def _exception_classes(exc_type: type[BaseException] | None) -> list[type[BaseException]]:
    """``exc_type`` then its exception bases, nearest first, short of Exception. Only ``Exception``
    subclasses: a worker's ``SystemExit``, ``KeyboardInterrupt`` or other ``BaseException`` (a
    ``sys.exit()`` in ``worker_init_fn``) rebuilt as itself would end the training process, past
    its ``except Exception``; it becomes a RuntimeError carrying its name and traceback."""
    if exc_type is None or not (isinstance(exc_type, type) and issubclass(exc_type, Exception)):
        return []
    return [c for c in exc_type.__mro__ if issubclass(c, Exception) and c is not Exception]


class _KeyErrorMessage(str):
    """KeyError quotes its argument in str(); this keeps a multi-line message readable (torch does too)."""

    def __repr__(self) -> str:
        return str(self)
