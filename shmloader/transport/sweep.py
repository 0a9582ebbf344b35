"""Finding and removing the segments of loaders whose process is gone.

Owns: the reading of segment names ``shml_<ownerpid>_<anything>`` in a shared-memory directory,
and the removal of those whose owner is dead. Runs in the main process (the loader sweeps when it
starts) and in ``python -m shmloader doctor --clean``. Promises: only regular files of our naming
scheme, owned by the current user, whose owner pid is not a live process (a zombie counts as
dead) are removed; a file that vanishes or changes meanwhile (another sweeper, the owner's own
close) is skipped, never an error. A live owner's segments are never touched.

Caveat: pids are read in this process's pid namespace. Two containers that share one shm
directory but not their pid namespace can see each other's live owners as dead; give each its own
``SHMLOADER_SHM_DIR`` (or do not sweep) in that setup.
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass

import psutil

from shmloader.transport.segment import DEFAULT_SHM_DIR, PREFIX, owner_pid

__all__ = ["PREFIX", "Leftover", "owner_of", "dead_segments", "sweep_dead_segments", "leftovers"]



@dataclass(frozen=True)
class Leftover:
    """A segment file of ours in the shm directory: its name, owner pid, size and whether it is live."""

    name: str
    owner_pid: int
    size_bytes: int
    owner_alive: bool


def owner_of(name: str) -> int | None:
    """The owner pid encoded in a segment name ``shml_<pid>_...``, or None when not ours."""
    return owner_pid(name)


def _alive(pid: int) -> bool:
    if not psutil.pid_exists(pid):
        return False
    try:
        return bool(psutil.Process(pid).status() != psutil.STATUS_ZOMBIE)
    except psutil.NoSuchProcess:
        return False
    except psutil.Error:
        return True  # cannot tell (e.g. access denied): assume alive, never remove a live segment


def leftovers(shm_dir: str = DEFAULT_SHM_DIR) -> list[Leftover]:
    """Every segment file of ours in ``shm_dir`` owned by this user, sorted by name."""
    try:
        names = os.listdir(shm_dir)
    except (FileNotFoundError, NotADirectoryError, PermissionError):
        return []
    found = []
    uid = os.getuid()
    for name in sorted(names):
        pid = owner_of(name)
        if pid is None:
            continue
        try:
            info = os.lstat(os.path.join(shm_dir, name))
        except FileNotFoundError:
            continue
        if stat.S_ISREG(info.st_mode) and info.st_uid == uid:
            found.append(Leftover(name, pid, info.st_size, _alive(pid)))
    return found


def dead_segments(shm_dir: str = DEFAULT_SHM_DIR) -> list[str]:
    """Names of our segment files in ``shm_dir`` whose owner process is not alive."""
    return [item.name for item in leftovers(shm_dir) if not item.owner_alive]


def sweep_dead_segments(shm_dir: str = DEFAULT_SHM_DIR) -> list[str]:
    """Remove the segments of dead owners; returns the names this call actually removed."""
    removed = []
    for name in dead_segments(shm_dir):
        try:
            os.unlink(os.path.join(shm_dir, name))
        except (FileNotFoundError, PermissionError):
            continue
        removed.append(name)
    return removed
