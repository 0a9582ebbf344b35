"""What the suite's leak guard (conftest.py) finds left behind: our child processes (live, or
exited and never joined) and our ``shml_`` segments in the shared-memory directory.

Owns the judgement, not the fixtures. Promises: a process is judged only after it has had
``exit_wait_s`` to exit, so one that was told to stop and is still on its way out (a slow exit on
a loaded machine) is not a leak, and the bound only costs time when something really is left; a
zombie is a leak only when it is our own child, which nobody but this process can reap (a
grandchild's zombie is its parent's to reap: a worker's helper, or a forkserver worker the fork
server has not reaped yet); segments are listed last, once the processes that could still act on
them are gone. multiprocessing's shared helpers (process_helpers.shared_helper) are not leaks.
"""

from __future__ import annotations

import gc
import os

import psutil
from process_helpers import shared_helper

from shmloader.transport.sweep import leftovers

SHM_DIR = "/dev/shm"
EXIT_WAIT_S = 20.0  # bounds the wait for a process on its way out; only a real leak waits it out


def our_segments() -> set[str]:
    """The names of the segments this process owns in the shared-memory directory."""
    prefix = f"shml_{os.getpid()}_"
    try:
        return {n for n in os.listdir(SHM_DIR) if n.startswith(prefix)}
    except FileNotFoundError:
        return set()


def all_segments() -> set[str]:
    """The names of every ``shml_`` file in the shared-memory directory, whoever owns it."""
    return {item.name for item in leftovers(SHM_DIR)}


def dead_owners_since(before: set[str]) -> list[str]:
    """Segments not in ``before`` whose owner is gone (pid dead, lock free): made during the session
    by a process that died without unlinking them, a child of ours (named for its own pid, which
    ``our_segments`` does not see) or one of its children. The sweep would remove them for a
    loader; the suite fails on them instead."""
    return sorted(item.name for item in leftovers(SHM_DIR) if item.name not in before and not item.owner_alive)


def stray_processes() -> list[psutil.Process]:
    """Our descendants, the shared helpers aside (a zombie, whose command line is gone, included)."""
    strays = []
    for p in psutil.Process().children(recursive=True):
        try:
            cmd = " ".join(p.cmdline())
        except (psutil.NoSuchProcess, psutil.ZombieProcess):
            cmd = ""
        except psutil.AccessDenied:
            continue
        try:
            if not shared_helper(p, cmd):
                strays.append(p)
        except psutil.NoSuchProcess:
            continue
    return strays


def _described(procs: list[psutil.Process]) -> list[str]:
    described = []
    for p in procs:
        try:
            described.append(f"pid {p.pid} ({p.status()}): {' '.join(p.cmdline())[:120]}")
        except psutil.ZombieProcess:
            described.append(f"pid {p.pid} (zombie)")
        except psutil.NoSuchProcess:
            continue
    return described


def _unjoined_children() -> list[int]:
    """The pids of our own children that exited and were never joined (before any wait reaps them)."""
    zombies = []
    for p in psutil.Process().children():
        try:
            if p.status() == psutil.STATUS_ZOMBIE:
                zombies.append(p.pid)
        except psutil.NoSuchProcess:
            continue
    return zombies


def leaks(exit_wait_s: float = EXIT_WAIT_S) -> list[str]:
    """One line per thing left behind: unjoined children, processes still alive (or unreaped by
    their parent) after ``exit_wait_s``, then segments."""
    gc.collect()
    found = [f"zombie child pid {pid} (exited, never joined)" for pid in _unjoined_children()]
    strays = stray_processes()
    if strays:
        # a process told to stop may need a moment to exit: wait for it, bounded, then judge
        psutil.wait_procs(strays, timeout=exit_wait_s)
    found += [f"child process {s}" for s in _described(stray_processes())]
    found += [f"shared-memory segment {n}" for n in sorted(our_segments())]
    return found
