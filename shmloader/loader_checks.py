"""torch's argument checks for DataLoader: the same order, error types and messages.

Pure functions of the arguments, used by ``loader.DataLoader.__init__`` and its setters. Runs in
the main process. Promises: every bad argument raises torch's exception type with torch's message
(which names the option and its value); nothing here has side effects except warnings.
"""

from __future__ import annotations

import math
import multiprocessing
import numbers
import operator
import os
import sys
from collections.abc import Iterable
from multiprocessing.context import BaseContext
from typing import Any

from shmloader.errors import (
    ConfigError,
    DaemonicProcessWorkersError,
    NumWorkersError,
    PrefetchFactorError,
    TimeoutWithoutWorkersError,
)
from shmloader.samplers import check_positive_int
from shmloader.warning_origin import warn


def check_counts(num_workers: Any, timeout: Any, prefetch_factor: Any, persistent_workers: Any) -> int:
    """Check the counts as torch does; returns ``num_workers`` as a plain int. Like torch, any
    integer-like value is taken (``np.int64(2)`` from a config array, ``True``); what no
    ``operator.index`` takes is refused by name rather than by a failure deep inside."""
    num_workers = _worker_count(num_workers)
    if _below_zero("timeout", timeout):
        raise ValueError("timeout option should be non-negative")
    if num_workers == 0 and prefetch_factor is not None:
        raise ValueError("prefetch_factor option could only be specified in multiprocessing."
                         "let num_workers > 0 to enable multiprocessing, otherwise set prefetch_factor to None.")
    if prefetch_factor is not None and _below_zero("prefetch_factor", prefetch_factor):
        raise ValueError("prefetch_factor option should be non-negative")
    if prefetch_factor is not None:  # torch fails on these only when it iterates: said here, at once
        try:
            operator.index(prefetch_factor)
        except TypeError:
            raise TypeError(f"prefetch_factor should be an integer, but got prefetch_factor={prefetch_factor!r}") from None
        if prefetch_factor == 0:  # no task would ever be sent: the first next() would wait forever
            # a ValueError like construction's other refusals, and torch's AssertionError at iter()
            raise PrefetchFactorError("prefetch_factor must be greater than 0 for MultiProcessingDataLoaderIter "
                                      f"(got prefetch_factor={prefetch_factor!r})",
                                      name="prefetch_factor", value=prefetch_factor)
    if persistent_workers and num_workers == 0:
        raise ValueError("persistent_workers option needs num_workers > 0")
    return num_workers


def _below_zero(name: str, value: Any) -> bool:
    """``value < 0``, as torch compares it; what cannot be compared (a str, None, a complex) raises
    torch's TypeError, naming the option instead of "'<' not supported between ..."."""
    try:
        return bool(value < 0)
    except TypeError:
        raise TypeError(f"{name} should be a non-negative number, but got {name}={value!r}") from None


def _worker_count(num_workers: Any, at_iter: bool = False) -> int:
    try:
        num_workers = operator.index(num_workers)
    except TypeError:
        raise TypeError(f"num_workers should be a non-negative integer, but got num_workers={num_workers!r}") from None
    if num_workers < 0:
        if at_iter:  # set since construction: torch's iterator asserts it
            raise NumWorkersError(f"num_workers={num_workers} reached iter(loader): num_workers option should be "
                                  "non-negative; use num_workers=0 to disable multiprocessing.",
                                  name="num_workers", value=num_workers)
        # torch's type and message, to the letter
        raise ValueError("num_workers option should be non-negative; use num_workers=0 to disable multiprocessing.")
    if num_workers > sys.maxsize:  # else a bare OverflowError from inside iter(), or a fork bomb
        raise OverflowError(f"num_workers={num_workers} is more worker processes than any system can start "
                            f"(at most sys.maxsize={sys.maxsize}; the usable CPUs are a sensible maximum)")
    return num_workers


def check_may_start_workers(num_workers: int) -> None:
    """Workers can start from this process: not a daemonic one (a worker of another loader), which
    multiprocessing refuses children with a bare AssertionError that names no option."""
    if num_workers > 0 and multiprocessing.current_process().daemon:
        me = multiprocessing.current_process()
        raise DaemonicProcessWorkersError(
            f"num_workers={num_workers} reached iter(loader) in process {me.name!r} (pid {os.getpid()}), which "
            "is daemonic (a DataLoader worker, or another process started with daemon=True), and daemonic "
            "processes are not allowed to have children: a loader made inside a worker (in a dataset's "
            "__getitem__, or worker_init_fn) needs num_workers=0",
            name="num_workers", value=num_workers)


def check_prefetch_at_iter(prefetch_factor: Any, num_workers: Any) -> int:
    """The tasks per worker an iterator with ``num_workers`` workers may use (0 without workers).

    ``prefetch_factor`` is checked again here, as torch's iterator does, since the attribute (or
    ``num_workers``, leaving it None) can be set after construction; a value no task could be sent
    with would make the first ``next()`` wait forever. None or a non-integer raises TypeError, as
    torch does; 0 or below PrefetchFactorError (a ConfigError and torch's AssertionError). A
    ``num_workers`` set since construction is checked as the constructor checks it.
    """
    if not _worker_count(num_workers, at_iter=True):
        return 0
    hint = f"prefetch_factor={prefetch_factor!r} cannot be used with num_workers={num_workers}"
    try:
        count = operator.index(prefetch_factor)
    except TypeError:
        raise TypeError(f"{hint}: it must be an integer > 0 (it defaults to 2 only when the loader is "
                        "constructed with num_workers > 0)") from None
    if count <= 0:
        raise PrefetchFactorError(f"{hint}: prefetch_factor must be greater than 0 for multi-process loading",
                                  name="prefetch_factor", value=prefetch_factor)
    return count


def check_timeout_at_iter(timeout: Any, num_workers: int) -> float:
    """The seconds an iterator waits for a batch (0: forever), checked when it is made, as torch's
    iterators check it, but before any worker starts: without workers any value but 0 raises
    TimeoutWithoutWorkersError (torch's AssertionError); with workers what is not a number raises
    TypeError, and an infinite one (or one too long to count in milliseconds) OverflowError (as torch's
    first wait would), each naming it.
    NaN waits forever, as in torch. An integer comes back as an int, so messages word it as torch's do."""
    if not num_workers:
        if timeout != 0:
            raise TimeoutWithoutWorkersError(
                f"timeout={timeout!r} needs num_workers > 0: without workers each batch is loaded in this "
                "process and no wait is bounded (torch: _SingleProcessDataLoaderIter requires timeout == 0); "
                "pass timeout=0 or num_workers > 0", name="timeout", value=timeout)
        return 0.0
    try:
        if isinstance(timeout, (str, bytes)):
            raise TypeError
        seconds = float(timeout)
    except (TypeError, ValueError):
        raise TypeError(f"timeout={timeout!r} is not a number of seconds (0 waits forever)") from None
    if math.isinf(seconds * 1000):  # the wait counts milliseconds: 1e308 s is finite, not its ms
        raise OverflowError(f"timeout={timeout!r} cannot bound a wait (too long to count in milliseconds): "
                            "pass timeout=0 to wait forever")
    if isinstance(timeout, numbers.Integral) and not isinstance(timeout, bool):
        return int(timeout)  # kept an int: messages then read "after 1 seconds", as torch's (not "1.0")
    return seconds


def check_worker_init_fn(worker_init_fn: Any, num_workers: int) -> None:
    """Each worker calls ``worker_init_fn(worker_id)`` first: one that cannot be called raises
    torch's TypeError here, naming it, before any worker starts rather than from each worker."""
    if num_workers and worker_init_fn is not None and not callable(worker_init_fn):
        raise TypeError(f"worker_init_fn={worker_init_fn!r} is not callable: each worker calls it with its "
                        "worker id (pass a function, or None)")


def check_max_slots(max_slots: int, num_workers: int, prefetch_factor: int | None, source: str) -> None:
    """``max_slots`` (0: no limit) must hold the pipeline, ``num_workers * prefetch_factor`` tasks, and
    the batch the caller holds while asking for the next: with fewer the first ``next()`` could only
    raise ``RingExhausted``, blaming batches nobody holds."""
    if not max_slots or not num_workers:
        return
    needed = num_workers * (prefetch_factor or 2) + 1
    if max_slots < needed:
        name = "SHMLOADER_MAX_SLOTS" if source == "environment" else "max_slots"
        raise ConfigError(f"{name}={max_slots} is below the {needed} slots {num_workers} workers with "
                          f"prefetch_factor={prefetch_factor} need ({num_workers} x {prefetch_factor} tasks in "
                          "flight, plus the batch being used): raise it, or lower num_workers or "
                          "prefetch_factor (0 = no limit)", name=name, value=max_slots)


def check_sampling(is_iterable: bool, batch_size: Any, shuffle: Any, sampler: Any, batch_sampler: Any,
                   drop_last: bool) -> tuple[Any, bool, bool]:
    if is_iterable:
        if shuffle not in {False, None}:
            raise ValueError(f"DataLoader with IterableDataset: expected unspecified shuffle option, "
                             f"but got shuffle={shuffle}")
        if sampler is not None:
            raise ValueError(f"DataLoader with IterableDataset: expected unspecified sampler option, "
                             f"but got sampler={sampler}")
        if batch_sampler is not None:
            raise ValueError("DataLoader with IterableDataset: expected unspecified batch_sampler option, "
                             f"but got batch_sampler={batch_sampler}")
    else:
        shuffle = bool(shuffle)
    _check_iterable("sampler", sampler)
    _check_iterable("batch_sampler", batch_sampler)
    if sampler is not None and shuffle:
        raise ValueError("sampler option is mutually exclusive with shuffle")
    if batch_sampler is not None:
        if batch_size != 1 or shuffle or sampler is not None or drop_last:
            raise ValueError("batch_sampler option is mutually exclusive with batch_size, shuffle, "
                             "sampler, and drop_last")
    elif batch_size is None:
        if drop_last:
            raise ValueError("batch_size=None option disables auto-batching and is mutually exclusive "
                             "with drop_last")
    else:
        check_positive_int("batch_size", batch_size)
        if batch_size > sys.maxsize:  # torch: a ValueError from itertools.islice at the first next()
            raise ValueError(f"batch_size={batch_size} is more samples than a batch can hold "
                             f"(at most sys.maxsize={sys.maxsize})")
    return batch_size, bool(shuffle), drop_last


def _check_iterable(name: str, value: Any) -> None:
    """A sampler the loader could never iterate: torch's TypeError ("'int' object is not
    iterable"), raised when the loader is built rather than at the first ``next()``, naming it. Judged
    by its type alone: iterating it here could draw from its random generator."""
    if value is not None and not (hasattr(type(value), "__iter__") or hasattr(type(value), "__getitem__")):
        raise TypeError(f"{name}={value!r:.80} is not iterable: pass a Sampler or an iterable of "
                        f"{'indices' if name == 'sampler' else 'lists of indices'}")


def resolve_context(context: str | BaseContext | None, num_workers: int) -> BaseContext | None:
    """torch's checks of ``multiprocessing_context``; a start-method name becomes its context."""
    if context is not None:
        if num_workers == 0:
            raise ValueError("multiprocessing_context can only be used with multi-process loading "
                             f"(num_workers > 0), but got num_workers={num_workers}")
        if isinstance(context, str):
            valid = multiprocessing.get_all_start_methods()
            if context not in valid:
                raise ValueError(f"multiprocessing_context option should specify a valid start method in "
                                 f"{valid!r}, but got multiprocessing_context={context!r}")
            context = multiprocessing.get_context(context)
        if not isinstance(context, BaseContext):
            raise TypeError("multiprocessing_context option should be a valid context object or a string "
                            f"specifying the start method, but got multiprocessing_context={context}")
    return context


def warn_worker_number(num_workers: int, torch_module: str | None = None) -> None:
    """torch's warning when more workers are asked for than this process may use CPUs, named (as
    torch's, stacklevel 2 there) by the frame that called ``check_worker_number_rationality``:
    ``torch_module`` when that is the loader's own (shmloader/warning_origin.py)."""
    if not num_workers:
        return
    try:
        suggest: int | None = len(os.sched_getaffinity(0))
        checked = True
    except AttributeError:
        suggest, checked = os.cpu_count(), False
    if suggest is None or num_workers > suggest:
        hint = (f"Our suggested max number of worker in current system is {suggest}"
                f"{'' if checked else ' (`cpuset` is not taken into account)'}, which is smaller than what "
                "this DataLoader is going to create." if suggest is not None else
                "DataLoader is not able to compute a suggested max number of worker in current system.")
        warn(f"This DataLoader will create {num_workers} worker processes in total. {hint} "
             "Please be aware that excessive worker creation might get DataLoader running slow or "
             "even freeze, lower the worker number to avoid potential slowness/freeze if necessary.",
             stacklevel=3, torch_module=torch_module)


def plugin_list(plugins: Any) -> list[Any]:
    """``plugins=`` as a list: None is none; one plugin object not in a list is refused by name."""
    if plugins is None:
        return []
    if isinstance(plugins, (str, bytes)) or not isinstance(plugins, Iterable):
        raise TypeError(f"plugins= takes a list of plugins, got {type(plugins).__name__} {plugins!r:.80}: "
                        "for one plugin, pass plugins=[plugin]")
    return list(plugins)
