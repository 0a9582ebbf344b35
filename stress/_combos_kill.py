"""Outside signals for stress/combos.py: which of the script's processes are its workers, and a
killer that signals one of them through a pidfd.

Runs in the script's main process (the killer's delayed sends from a thread of it). Promises: a
signal goes only to a process that was one of our workers when it was picked, through a pidfd, so a
reused pid is never signalled; every signal sent is counted by its name.
"""

from __future__ import annotations

import os
import random
import signal
import threading
from collections import Counter

import psutil


def live_workers() -> list[int]:
    """Our workers' pids, read with psutil (which reaps nothing, so it may run beside the loader's own
    reaping, from any thread): every descendant but the resource tracker and the forkserver."""
    pids = []
    for p in psutil.Process().children(recursive=True):
        try:
            cmd = " ".join(p.cmdline())
            if "resource_tracker" in cmd or ("forkserver" in cmd and p.ppid() == os.getpid()):
                continue
        except psutil.Error:
            continue
        pids.append(p.pid)
    return sorted(pids)


def _pidfd(choice: float) -> int | None:
    """A pidfd of the worker at ``choice`` (0 to 1) of those alive now, or None when there is none."""
    pids = live_workers()
    if not pids:
        return None
    try:
        return os.pidfd_open(pids[int(choice * len(pids))])
    except ProcessLookupError:
        return None


class Killer:
    """Signals one of a snapshot of worker pids, through pidfds (never a reused pid), now or from a
    thread after a short random delay; counts what it sent."""

    def __init__(self, pick: random.Random, counts: Counter[str]) -> None:
        self.pick, self.counts = pick, counts
        self.thread: threading.Thread | None = None

    def send(self, sigs: tuple[signal.Signals, ...], weights: tuple[float, ...], delay_s: float = -1.0,
             snapshot_late: bool = False) -> None:
        """Signal a worker now (``delay_s`` < 0) or after ``delay_s`` from a thread, picking among the
        workers alive now or, with ``snapshot_late``, among those alive when the delay is over."""
        self.join()
        sig = self.pick.choices(sigs, weights)[0]
        choice = self.pick.random()
        fd = None if snapshot_late else _pidfd(choice)
        if delay_s < 0:
            self._fire(fd, choice, sig, 0.0)
        elif snapshot_late or fd is not None:
            self.thread = threading.Thread(target=self._fire, args=(fd, choice, sig, delay_s), daemon=True)
            self.thread.start()

    def _fire(self, fd: int | None, choice: float, sig: signal.Signals, delay_s: float) -> None:
        if delay_s:
            threading.Event().wait(delay_s)
        fd = _pidfd(choice) if fd is None else fd
        if fd is None:
            return
        try:
            signal.pidfd_send_signal(fd, sig)
            self.counts[sig.name] += 1
        except ProcessLookupError:
            pass
        finally:
            os.close(fd)

    def join(self) -> None:
        if self.thread is not None:
            self.thread.join(10)
            self.thread = None
