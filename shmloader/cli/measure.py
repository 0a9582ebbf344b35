"""One measurement of ``python -m shmloader bench``: build a loader, time one epoch, release it.

Owns how a loader is built for a workload (the same torch DataLoader arguments for both loaders),
what is timed and how the loader is released. Runs in the benchmark's main process.

One measurement is one epoch of exactly ``warmup + batches`` batches:

- *first batch*: seconds from ``iter(loader)`` to the first batch (worker start-up included);
- *warm-up*: the first batch plus ``warmup - 1`` more, untimed;
- *timed*: ``batches`` batches, each touched on every page (:func:`touch_batch`); the wall-clock
  seconds (``time.perf_counter``) and the main process's CPU seconds (``time.process_time``: every
  thread of this process, the consumer's page touching included, worker processes not) over them.

Promises: :func:`measure` raises no Exception (a failure becomes the record's ``error``); when it
returns, the loader is closed, dropped and garbage-collected, and the child processes still alive
are counted in the record. A KeyboardInterrupt (Ctrl-C) goes on up once the loader is closed.
"""

from __future__ import annotations

import gc
import signal
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from shmloader.cli.interrupt import shielded
from shmloader.cli.options import Options
from shmloader.cli.records import Measurement
from shmloader.cli.workloads import Workload, deliver, touch_batch

__all__ = ["Epoch", "measure", "make_loader", "close_loader", "count_children"]


@dataclass(frozen=True, slots=True)
class Epoch:
    """What :func:`time_epoch` timed: the first batch, then the timed batches' wall and CPU time."""

    first_batch_s: float = 0.0
    seconds: float = 0.0
    cpu_s: float = 0.0


def measure(name: str, workload: Workload, num_workers: int, opts: Options,
            round_index: int = 0, position: int = 0) -> Measurement:  # fmt: skip
    """Build loader ``name`` for ``workload``, time one epoch, release it; never raises."""
    batches = opts.batches_for(workload)
    loader = error = None
    epoch = Epoch()
    try:
        loader = make_loader(name, workload, num_workers, opts)
        epoch = time_epoch(deliver(name, loader, opts.device), opts, batches)
    except Exception as exc:  # reported in the table; the other measurements still run
        error = _describe(exc)
    except BaseException:  # Ctrl-C: close the loader (workers, segments) before it goes up
        _close_reporting(loader)
        raise
    # After the except block, so that no traceback still holds the iterator and its workers.
    close_error = _close_reporting(loader)
    del loader
    gc.collect()
    return Measurement(workload.name, num_workers, name, workload.batch_size,
                       workload.batch_bytes, batches, epoch.seconds, epoch.first_batch_s,
                       leftover_children=count_children(), error=error or close_error,
                       cpu_s=epoch.cpu_s, round_index=round_index, position=position)  # fmt: skip


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def _close_reporting(loader: Any) -> str | None:
    try:
        close_loader(loader)
    except Exception as exc:
        return f"close() failed: {_describe(exc)}"
    return None


def make_loader(name: str, workload: Workload, num_workers: int, opts: Options) -> Any:
    """The same arguments for both loaders (torch's DataLoader signature), but for the
    ``worker_init_fn`` that keeps Ctrl-C away from torch's workers (:func:`torch_worker_ignores_ctrl_c`)."""
    loader_class = torch_loader_class() if name == "torch" else shmloader_loader_class()
    kwargs: dict[str, Any] = {
        "batch_size": workload.batch_size,
        "shuffle": False,
        "num_workers": num_workers,
        "pin_memory": opts.device != "cpu",
    }
    if num_workers > 0:
        kwargs["persistent_workers"] = True
        kwargs["multiprocessing_context"] = opts.start_method
        if name == "torch":
            kwargs["worker_init_fn"] = torch_worker_ignores_ctrl_c
    total = opts.warmup + opts.batches_for(workload)
    if name == "shmloader" and opts.epoch_bars:
        from shmloader.builtin.progress import Progress

        desc = f"{workload.name} workers={num_workers}"
        kwargs["plugins"] = [Progress(total=total, desc=desc, leave=False)]
    return loader_class(workload.dataset(total), **kwargs)


def torch_worker_ignores_ctrl_c(worker_id: int) -> None:
    """torch's workers, which Ctrl-C reaches with the whole process group, ignore it: the main
    process ends them as it drops their loader. A KeyboardInterrupt raised in one while it holds
    the lock of its ``done_event`` (every batch) left it and the main process waiting on that lock
    forever (shmloader.cli.interrupt). Forked ones inherit the command line's handler, which does
    nothing there; started ones (spawn, forkserver) get Python's own, hence this."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def torch_loader_class() -> Any:
    from torch.utils.data import DataLoader

    return DataLoader


def shmloader_loader_class() -> Any:
    """``shmloader.DataLoader`` (looked up on each call, so a test may stand another in)."""
    import shmloader

    return getattr(shmloader, "DataLoader", None)


def close_loader(loader: Any) -> None:
    """``loader.close()`` where it exists; torch's loader is released by dropping it instead.
    A Ctrl-C meanwhile is held back until the loader is closed (:func:`shmloader.cli.interrupt.shielded`)."""
    close = getattr(loader, "close", None)
    if callable(close):
        with shielded():
            close()


def time_epoch(source: Iterable[Any], opts: Options, batches: int) -> Epoch:
    """Read one epoch of ``warmup + batches`` batches from ``source``; time the last ``batches``."""
    sync = _synchronizer(opts.device)
    start = time.perf_counter()
    it = iter(source)
    touch_batch(next(it))
    sync()
    first_batch_s = time.perf_counter() - start
    for _ in range(opts.warmup - 1):
        touch_batch(next(it))
    sync()
    cpu_start = time.process_time()
    start = time.perf_counter()
    for _ in range(batches):
        touch_batch(next(it))
    sync()
    seconds = time.perf_counter() - start
    cpu_s = time.process_time() - cpu_start
    if next(it, None) is not None:
        raise RuntimeError("the loader yielded more batches than len(dataset) / batch_size")
    return Epoch(first_batch_s, seconds, cpu_s)


def _synchronizer(device: str) -> Callable[[], None]:
    if device == "cpu":
        return lambda: None
    import torch

    return lambda: torch.cuda.synchronize(device)


def count_children() -> int:
    """Child processes still alive, not counting multiprocessing's own helpers."""
    import psutil

    helpers = ("resource_tracker", "forkserver", "semaphore_tracker")
    count = 0
    for child in psutil.Process().children(recursive=True):
        try:
            cmdline = " ".join(child.cmdline())
            alive = child.status() != psutil.STATUS_ZOMBIE
        except psutil.Error:  # exited meanwhile
            continue
        if alive and not any(h in cmdline for h in helpers):
            count += 1
    return count
