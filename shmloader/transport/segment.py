"""Shared-memory segments: one file in the shm directory, mapped once per process.

Owns: the naming scheme (``shml_<ownerpid>_<token>_<serial>``, so a sweeper can tell a dead owner's
leftovers), creation with the space reserved up front, registration with the standard library's
resource tracker, and attaching without registering.

Runs in both processes: the main process creates and unlinks (the only one that may); workers
attach. Promises:

- ``create`` reserves every byte with ``posix_fallocate``: a full ``/dev/shm`` is an ``OSError``
  at creation in the main process, never a SIGBUS in a worker writing to the slot later.
- A segment created in the default shm directory is registered with the resource tracker, so a
  SIGKILLed trainer leaves no entry behind; ``unlink`` unregisters it.
- ``attach`` never registers (Python 3.11's tracker would unlink segments a worker merely used).
- ``close`` unmaps unless views still point into the mapping; then the mapping lives until the
  last view is garbage-collected (the file is already gone after ``unlink``).
"""

from __future__ import annotations

import contextlib
import errno
import itertools
import mmap
import os
import secrets
from collections.abc import Iterator

from shmloader.errors import ShmSpaceError

PREFIX = "shml_"
DEFAULT_SHM_DIR = "/dev/shm"
PAGE_BYTES = mmap.PAGESIZE

_serial = itertools.count()
_token = secrets.token_hex(3)


def page_round(nbytes: int) -> int:
    """Round a size up to whole pages (at least one page)."""
    return max(PAGE_BYTES, -(-nbytes // PAGE_BYTES) * PAGE_BYTES)


def new_name(owner_pid: int | None = None) -> str:
    """A fresh segment name that carries the owner pid."""
    pid = os.getpid() if owner_pid is None else owner_pid
    return f"{PREFIX}{pid}_{_token}_{next(_serial)}"


_MAX_PID = (1 << 31) - 1  # a pid_t: a larger number in a name is not a pid (and would overflow psutil)


def owner_pid(name: str) -> int | None:
    """The owner pid encoded in a segment name ``shml_<pid>_...``, or None if the name is not ours.

    Any file may sit in the shm directory: only ASCII digits of a plausible pid count, so a
    stranger's file can never make the sweeper raise.
    """
    if not name.startswith(PREFIX):
        return None
    pid_text, sep, _rest = name[len(PREFIX):].partition("_")
    if not sep or not (pid_text.isascii() and pid_text.isdigit()):
        return None
    pid = int(pid_text)
    return pid if 0 < pid <= _MAX_PID else None


def _tracked(shm_dir: str) -> bool:
    return os.path.realpath(shm_dir) == os.path.realpath(DEFAULT_SHM_DIR)


class Segment:
    """One mapped shared-memory file. ``buf`` is the writable mapping."""

    __slots__ = ("name", "size_bytes", "path", "buf", "_tracked", "_owner", "__weakref__")

    def __init__(self, name: str, size_bytes: int, path: str, buf: mmap.mmap, tracked: bool, owner: bool):
        self.name = name
        self.size_bytes = size_bytes
        self.path = path
        self.buf = buf
        self._tracked = tracked
        self._owner = owner

    @classmethod
    def create(cls, shm_dir: str, size_bytes: int) -> Segment:
        """Create, reserve and map a new segment of at least ``size_bytes`` (page-rounded)."""
        size = page_round(size_bytes)
        name = new_name()
        path = os.path.join(shm_dir, name)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            try:
                os.posix_fallocate(fd, 0, size)
            except OSError:
                os.unlink(path)
                raise
            buf = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        tracked = _tracked(shm_dir)
        if tracked:
            _register(name)
        return cls(name, size, path, buf, tracked, owner=True)

    @classmethod
    def attach(cls, shm_dir: str, name: str, size_bytes: int) -> Segment:
        """Map an existing segment (worker side). Never registers with the resource tracker."""
        path = os.path.join(shm_dir, name)
        fd = os.open(path, os.O_RDWR)
        try:
            buf = mmap.mmap(fd, size_bytes)
        finally:
            os.close(fd)
        return cls(name, size_bytes, path, buf, tracked=False, owner=False)

    def unlink(self) -> None:
        """Remove the file (owner only); the mapping stays valid for live views."""
        if not self._owner:
            raise PermissionError(f"segment {self.name} is attached, not owned: only its owner unlinks it")
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass
        if self._tracked:
            _unregister(self.name)
            self._tracked = False

    def close(self) -> bool:
        """Unmap now if nothing views the mapping; returns False when views keep it alive."""
        try:
            self.buf.close()
            return True
        except BufferError:
            return False


# -- out of space: one wording, whether found up front (preflight) or at creation -----------------
def shm_free_bytes(shm_dir: str) -> int | None:
    """Bytes free in ``shm_dir`` (None when it cannot be read)."""
    try:
        st = os.statvfs(shm_dir)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


_REMEDIES = ("Remedies: give the container more shared memory (Docker: --shm-size), use fewer workers or a "
             "smaller prefetch_factor, or point SHMLOADER_SHM_DIR (shm_dir=) at a directory with room "
             "(segments there are file-backed).")


def space_error(directory: str, needed_bytes: int, free_bytes: int, what: str) -> ShmSpaceError:
    """The one wording of "the ring does not fit": what was asked, bytes needed and free, remedies."""
    return ShmSpaceError(
        f"{what} needs {needed_bytes} more bytes but {directory} has only {free_bytes} bytes free. {_REMEDIES}",
        needed_bytes=needed_bytes, free_bytes=free_bytes, directory=directory,
    )


@contextlib.contextmanager
def explain_enospc(shm_dir: str, nbytes: int) -> Iterator[None]:
    """Turn running out of space while creating a ``nbytes`` segment into a ShmSpaceError.

    Use around ``Segment.create``; any other OSError passes through unchanged.
    """
    try:
        yield
    except OSError as exc:
        if exc.errno not in (errno.ENOSPC, errno.ENOMEM, errno.EDQUOT):
            raise
        free = shm_free_bytes(shm_dir)
        raise space_error(shm_dir, nbytes, -1 if free is None else free,
                          f"a new shared-memory segment of {nbytes} bytes ({exc.strerror})") from exc


def _register(name: str) -> None:
    from multiprocessing import resource_tracker

    resource_tracker.register("/" + name, "shared_memory")


def _unregister(name: str) -> None:
    from multiprocessing import resource_tracker

    resource_tracker.unregister("/" + name, "shared_memory")
