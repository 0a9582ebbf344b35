"""Outside signals for stress/combos.py: which of the script's processes are its workers, and a
killer that signals one of them through a pidfd.

Runs in the script's main process (the killer's delayed sends from a thread of it). Promises: a
signal goes only to a process that was one of our workers when it was picked, through a pidfd, so a
reused pid is never signalled; every signal sent is counted by its name. ``kill_helper`` SIGKILLs one of
multiprocessing's helper processes instead (the resource tracker, or the fork server), as an OOM
killer or a job script's ``pkill`` may, and returns once it has died; the loader must go on.
"""

from __future__ import annotations

import os
import random
import select
import signal
import threading
from collections import Counter
from multiprocessing import forkserver, resource_tracker
from typing import Any

import psutil

import _common as c


def live_workers() -> list[int]:
    """Our workers' pids, read with psutil (which reaps nothing, so it may run beside the loader's own
    reaping, from any thread): every descendant but the resource tracker and the forkserver."""
    pids = []
    for p in psutil.Process().children(recursive=True):
        try:
            cmd = " ".join(p.cmdline())
            if c.is_helper(p, cmd):
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


def kill_helper(pick: random.Random, fork_server: bool) -> tuple[str, int] | None:
    """SIGKILL the resource tracker or (``fork_server``: the life's method is forkserver, one of two)
    the fork server, if it runs now; return its name and pid once it (and, for the fork server, each
    worker it had started, which dies with it) has died. It is left unreaped:
    CPython reaps it as it next starts one (``helper_zombies`` says which zombies those are)."""
    server: Any = forkserver._forkserver  # its record is private to CPython
    pids = {"resource tracker": getattr(resource_tracker._resource_tracker, "_pid", None)}
    if fork_server:
        pids["fork server"] = server._forkserver_pid
    name = pick.choice(sorted(pids))
    pid = pids[name]
    if pid is None:
        return None
    fds = []
    try:
        fds.append(os.pidfd_open(pid))
        for child in psutil.Process(pid).children():  # the fork server's workers: they die with it
            try:
                fds.append(os.pidfd_open(child.pid))
            except ProcessLookupError:
                continue
    except (ProcessLookupError, psutil.NoSuchProcess):
        pass
    if not fds:
        return None
    try:
        signal.pidfd_send_signal(fds[0], signal.SIGKILL)
        for fd in fds:
            select.select([fd], [], [], 30)  # readable once it has died
    finally:
        for fd in fds:
            os.close(fd)
    return name, pid


def helper_zombies(killed: set[int]) -> set[int]:
    """Those of the helpers ``killed`` that are still our unreaped children (zombies): CPython reaps a
    dead tracker or fork server only as it next starts one, so a life that starts none after the kill
    leaves it so; they are no leftover of the loader's."""
    zombies = set()
    for pid in killed:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                zombies.add(pid)
        except psutil.NoSuchProcess:
            continue
    return zombies
