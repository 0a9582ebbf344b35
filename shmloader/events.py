"""Loader events: the one object the iterators report to, relaying each event to the observers.

Owns ``Events``: the iterators call ``worker_started / worker_died / worker_restarted /
batch_ready / epoch_end`` on it, and it calls the matching ``shmloader_*`` hook of every observer
plugin — the built-in stats observer (:mod:`shmloader.builtin.stats`, behind ``loader.stats()``)
among them, registered like any other. Runs in the main process. Promises: every event reaches
every observer in pluggy's order; an exception inside an observer becomes a
:class:`~shmloader.plugins.PluginError` naming the plugin and the hook. ``batch_ready`` is on the
hot path: each observer is called from a flat list built from pluggy's implementations (pluggy's
order and argument selection, without its per-call bookkeeping); the cost is in docs/plugins.md.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NoReturn

from shmloader.builtin.stats import Stats, WorkerStats
from shmloader.plugins import Plugins, build_plugin_manager

__all__ = ["Events", "Stats", "WorkerStats", "hook_cost_ns"]

_BATCH_READY_ARGS = ("task", "worker_id", "nbytes", "fetch_s", "collate_s", "wait_s", "ready", "in_flight",
                     "slots")


def _flat_calls(caller: Any) -> list[tuple[Callable[..., Any], tuple[int, ...] | None]] | None:
    """pluggy's implementations of a hook as (function, argument positions) in pluggy's call order.

    pluggy's own call costs about 2 µs per batch over the observers themselves (see
    docs/plugins.md); this list is what pluggy's ``_multicall`` does for plain implementations,
    minus the bookkeeping. ``None`` (use pluggy's call) when a wrapper is registered.
    """
    impls = caller.get_hookimpls()
    if any(impl.hookwrapper or impl.wrapper for impl in impls):
        return None
    calls = []
    for impl in reversed(impls):
        names = tuple(impl.argnames)
        picks = None if names == _BATCH_READY_ARGS else tuple(_BATCH_READY_ARGS.index(n) for n in names)
        calls.append((impl.function, picks))
    return calls


class Events:
    """Relays loader events to the observer hooks of one loader's plugins."""

    def __init__(self, plugins: Plugins | None = None) -> None:
        self.plugins = plugins if plugins is not None else build_plugin_manager(entry_points=False)
        self.stats: Stats = self.plugins.stats
        self._generation = -1
        self._flat: list[tuple[Callable[..., Any], tuple[int, ...] | None]] | None = None

    def _raise(self, hook: str, exc: Exception) -> NoReturn:
        raise self.plugins.error(hook, exc) from exc

    def worker_started(self, worker_id: int, pid: int | None) -> None:
        try:
            self.plugins.hook.shmloader_worker_started(worker_id=worker_id, pid=pid)
        except Exception as exc:
            self._raise("shmloader_worker_started", exc)

    def worker_died(self, worker_id: int, pid: int | None, exitcode: int | None, tasks: dict) -> None:
        try:
            self.plugins.hook.shmloader_worker_died(worker_id=worker_id, pid=pid, exitcode=exitcode,
                                                    tasks=tasks)
        except Exception as exc:
            self._raise("shmloader_worker_died", exc)

    def worker_restarted(self, worker_id: int, pid: int | None, old_pid: int | None) -> None:
        try:
            self.plugins.hook.shmloader_worker_restarted(worker_id=worker_id, pid=pid, old_pid=old_pid)
        except Exception as exc:
            self._raise("shmloader_worker_restarted", exc)

    def batch_ready(self, task: int, worker_id: int, nbytes: int, fetch_s: float, collate_s: float,
                    wait_s: float, ready: int = 0, in_flight: int = 0, slots: int = 0) -> None:
        """The per-batch event: each observer called in pluggy's order, through a flat call list."""
        args = (task, worker_id, nbytes, fetch_s, collate_s, wait_s, ready, in_flight, slots)
        if self._generation != self.plugins.generation:
            self._flat = _flat_calls(self.plugins.hook.shmloader_batch_ready)
            self._generation = self.plugins.generation
        try:
            if self._flat is None:  # a wrapper is registered: pluggy's own call handles it
                self.plugins.hook.shmloader_batch_ready(**dict(zip(_BATCH_READY_ARGS, args)))
                return
            first: Exception | None = None
            for fn, picks in self._flat:  # every observer sees the batch, the built-in stats included
                try:
                    if picks is None:
                        fn(*args)
                    else:
                        fn(*[args[i] for i in picks])
                except Exception as exc:
                    first = first or exc
            if first is not None:
                try:
                    raise first
                finally:
                    del first  # else its traceback holds this frame, which holds it: a cycle only the collector frees
        except Exception as exc:
            self._raise("shmloader_batch_ready", exc)

    def epoch_end(self) -> None:
        """An epoch ended. Observers get the loader's epoch count (from 0): an iterator's own
        number restarts at 0 for each non-persistent iterator; the loader's does not."""
        index = self.stats.count_epoch()
        try:
            self.plugins.hook.shmloader_epoch_end(epoch=index, stats=self.stats.summary())
        except Exception as exc:
            self._raise("shmloader_epoch_end", exc)



def hook_cost_ns(observers: int = 0, calls: int = 5_000, repeats: int = 40) -> float:
    """Nanoseconds one ``batch_ready`` event costs: built-in stats plus ``observers`` no-op observers.

    The per-batch price of the plugin system in the main process, for the benchmark and
    docs/plugins.md: the minimum over ``repeats`` runs of ``calls`` events (the minimum is the
    figure least disturbed by other processes on the machine).
    """
    import time  # noqa: PLC0415

    class _NoOp:
        def shmloader_batch_ready(self, nbytes: int) -> None:
            pass

    events = Events(build_plugin_manager([_NoOp() for _ in range(observers)], entry_points=False))
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter_ns()
        for i in range(calls):
            events.batch_ready(i, 0, 4096, 1e-3, 1e-3, 1e-4, 1, 2, 4)
        best = min(best, (time.perf_counter_ns() - t0) / calls)
    return best
