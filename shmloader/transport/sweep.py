"""Finding and removing the segments of loaders whose process is gone.

Owns: the reading of segment names ``shml_<ownerpid>_<anything>`` in a shared-memory directory,
and the removal of those whose owner is provably gone. Runs in the main process (the loader sweeps
when it starts, unless ``sweep=False`` / ``SHMLOADER_SWEEP=0``) and in ``python -m shmloader
doctor --clean``.

Promises: a file is removed only when all of these hold, checked in this order:

1. it is a regular file of our naming scheme owned by the current user (never followed through a
   symlink, never opened if it is a FIFO or a device, so a stranger's file cannot make the sweep
   block, raise or remove something else);
2. its owner pid is not a live process here (a zombie counts as dead);
3. this process can take ``flock(LOCK_EX | LOCK_NB)`` on it, and the name still names the file it
   locked. The owner holds ``LOCK_SH`` from the segment's creation to its unlink
   (:mod:`shmloader.transport.segment`), and the kernel drops that lock when the owner dies, in
   any pid namespace: a lock we can take proves that no live process owns the file.

Condition 3 is the proof, and it holds across pid namespaces: a live loader in another container
that shares this shm directory looks dead by its pid, but its lock keeps its segments. Condition 2
is kept as a second, conservative filter: a file whose pid is alive here is never even opened, so
files without a lock (written by hand, or by an older shmloader) of a live pid stay, as before.
The price is that a dead owner whose pid number is reused by a live process here is not swept
until that process exits (the resource tracker has usually unlinked its segments already).

A file that vanishes or changes meanwhile (another sweeper, the owner's own close) is skipped,
never an error. ``leftovers`` reports an owner as alive when either its pid is alive here or its
lock is held.
"""

from __future__ import annotations

import fcntl
import os
import stat
from dataclasses import dataclass

import psutil

from shmloader.transport.segment import DEFAULT_SHM_DIR, PREFIX, owner_pid, same_file

__all__ = ["PREFIX", "Leftover", "dead_segments", "leftovers", "sweep_dead_segments", "sweep_segments_of"]


@dataclass(frozen=True)
class Leftover:
    """A segment file of ours in the shm directory: its name, owner pid, size and whether it is live."""

    name: str
    owner_pid: int
    size_bytes: int
    owner_alive: bool


def _alive(pid: int) -> bool:
    if not psutil.pid_exists(pid):
        return False
    try:
        return bool(psutil.Process(pid).status() != psutil.STATUS_ZOMBIE)
    except psutil.NoSuchProcess:
        return False
    except psutil.Error:
        return True  # cannot tell (e.g. access denied): assume alive, never remove a live segment


def _open_ours(path: str) -> int | None:
    """A read-only descriptor of ``path`` if it is a regular file of this user, else None.

    O_NOFOLLOW: a symlink is never followed; O_NONBLOCK: a FIFO put there cannot block the open.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:  # gone, a symlink (ELOOP), not readable
        return None
    info = os.fstat(fd)
    if stat.S_ISREG(info.st_mode) and info.st_uid == os.getuid():
        return fd
    os.close(fd)
    return None


def _unlocked(fd: int) -> bool:
    """Take LOCK_EX without waiting; True (lock held until fd closes) when no owner holds the file."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False  # the owner's LOCK_SH: alive, wherever it runs
    except OSError:
        return False  # no flock here (see segment.py): cannot prove anything, keep the file
    return True


def _lock_held(path: str) -> bool:
    """Whether some process holds a lock on the file at ``path`` (probed, nothing removed)."""
    fd = _open_ours(path)
    if fd is None:
        return False
    try:
        return not _unlocked(fd)
    finally:
        os.close(fd)  # releases the probe's own lock, if it got one


def _remove_if_unowned(path: str) -> bool:
    """Remove ``path`` if no process holds its lock and it is still the file we locked."""
    fd = _open_ours(path)
    if fd is None:
        return False
    try:
        if not _unlocked(fd) or not same_file(path, fd):
            return False
        try:
            os.unlink(path)
        except (FileNotFoundError, PermissionError):
            return False
        return True
    finally:
        os.close(fd)


def leftovers(shm_dir: str = DEFAULT_SHM_DIR) -> list[Leftover]:
    """Every segment file of ours in ``shm_dir`` owned by this user, sorted by name."""
    try:
        names = os.listdir(shm_dir)
    except (FileNotFoundError, NotADirectoryError, PermissionError):
        return []
    found = []
    uid = os.getuid()
    for name in sorted(names):
        pid = owner_pid(name)
        if pid is None:
            continue
        path = os.path.join(shm_dir, name)
        try:
            info = os.lstat(path)
        except FileNotFoundError:
            continue
        if stat.S_ISREG(info.st_mode) and info.st_uid == uid:
            found.append(Leftover(name, pid, info.st_size, _alive(pid) or _lock_held(path)))
    return found


def dead_segments(shm_dir: str = DEFAULT_SHM_DIR) -> list[str]:
    """Names of our segment files in ``shm_dir`` whose owner is gone: pid dead here and no lock held."""
    return [item.name for item in leftovers(shm_dir) if not item.owner_alive]


def sweep_dead_segments(shm_dir: str = DEFAULT_SHM_DIR) -> list[str]:
    """Remove the segments of gone owners; returns the names this call actually removed.

    The lock is taken again at removal: an owner that appeared since the listing keeps its file.
    """
    return [name for name in dead_segments(shm_dir) if _remove_if_unowned(os.path.join(shm_dir, name))]


def sweep_segments_of(shm_dir: str, pids: set[int]) -> list[str]:
    """Remove the segments named for ``pids``, processes this one started and has reaped (one killed
    between a segment's creation and its unlink leaves the name); returns the names removed.

    The same proof as :func:`sweep_dead_segments`: a file is removed only if its lock can be taken.
    """
    return [item.name for item in leftovers(shm_dir)
            if item.owner_pid in pids and _remove_if_unowned(os.path.join(shm_dir, item.name))]  # fmt: skip
