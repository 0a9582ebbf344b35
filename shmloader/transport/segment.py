"""Shared-memory segments: one file in the shm directory, mapped once per process.

Owns: the naming scheme (``shml_<ownerpid>_<16 random hex digits>``), creation with the space
reserved up front and the owner's lock taken, registration with the standard library's resource
tracker, and attaching without registering.

Runs in both processes: the main process creates and unlinks (the only one that may); workers
attach. Promises:

- ``create`` reserves every byte with ``posix_fallocate``: a full ``/dev/shm`` is an ``OSError``
  at creation in the main process, never a SIGBUS in a worker writing to the slot later. A
  segment made with ``reserve=False`` (a slot growing, issue 16) is sized but not reserved: the
  main process reserves it a part at a time (``reserve``) and names it to a worker — or pins or
  reads it — only once ``reserved`` covers every byte; the same ``OSError`` then comes from
  ``reserve``.
- ``create`` leaves nothing behind when it fails: whatever fails after the file exists (space,
  ``mmap`` at EMFILE/ENOMEM, registration, Ctrl-C), the file is removed and its descriptor closed.
- Names cannot be guessed: 64 random bits per segment (``secrets``), so another local user cannot
  pre-create the next name. A name that is taken anyway is retried with a fresh one, as
  ``multiprocessing.shared_memory`` does, at most ``CREATE_ATTEMPTS`` times; then
  :class:`~shmloader.errors.SegmentCollision` says where, which name, how many attempts.
- A segment created in the default shm directory is registered with the resource tracker, so a
  SIGKILLed trainer leaves no entry behind; ``unlink`` unregisters it. Both go through
  ``tracker.py``, which outlives a tracker killed from outside.
- ``attach`` never registers (Python 3.11's tracker would unlink segments a worker merely used)
  and takes no lock.
- ``close`` unmaps unless views still point into the mapping; then the mapping lives until the
  last view is garbage-collected (the file is already gone after ``unlink``).

The owner's lock (what makes the sweep safe across pid namespaces, issue 15): the creating
process holds ``flock(LOCK_SH)`` on the file from creation until its mapping is closed
(``unlink`` then ``close``), through the descriptor the mapping keeps open. A flock belongs to
the open file description and vanishes when the last descriptor of it closes, which the kernel
does when the owner dies however it dies, in whatever pid namespace it ran. A sweeper (:mod:`shmloader.transport.sweep`) removes a file only
after taking ``LOCK_EX | LOCK_NB`` on it, which succeeds only when no owner holds it.

- A process that forks inherits the descriptors, and with them the lock (the same open file
  description; ``mmap`` keeps a duplicate of the descriptor it maps, so even a worker that closed
  ours would hold it). A forked worker therefore keeps its dead parent's segments locked until
  it exits. We accept that: workers exit when the main process dies (they watch it; on Linux
  also ``PR_SET_PDEATHSIG``), and while such a child lives it maps the parent's segments anyway,
  so their memory could not be freed by removing the files. Spawned and forkserver workers, and
  any ``exec``, inherit nothing: the descriptors are non-inheritable.
- A fresh file is visible before its owner has locked it. A sweeper that wins that race holds
  ``LOCK_EX`` or has already removed the file; the owner, which never waits for the lock, then
  drops the file and tries a fresh name.
- Workers open the file by name with their own descriptor (another open file description),
  take no lock and close the descriptor once mapped: they never prolong the owner's lock.
- Costs one descriptor per segment for its life: the one ``mmap`` keeps, a duplicate of ours
  (the same open file description, so it holds the same lock), which closes with the mapping. Ours
  is closed once every byte is reserved (at ``create``, or when ``reserve`` reserves the last
  part: a growing segment has two until then), so a user who holds many batches holds one descriptor per batch, as torch's tensors do.
  The lock therefore lasts until the mapping is closed, which ``close`` does after ``unlink``,
  or, while views keep the mapping, until the last view goes (the file is already gone). On a
  filesystem without ``flock`` the segment is made unlocked, with one warning: only the pid check
  then protects it from other sweepers.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import mmap
import os
import secrets
import signal
import sys
from collections.abc import Iterator

from shmloader.errors import SegmentCollision
from shmloader.log import logger
from shmloader.transport import tracker

PREFIX = "shml_"
DEFAULT_SHM_DIR = "/dev/shm"
PAGE_BYTES = mmap.PAGESIZE
CREATE_ATTEMPTS = 8  # fresh names tried before SegmentCollision; a random name collides only on purpose
_RANDOM_BYTES = 8  # 64 bits: 16 hex digits per name
_NO_FLOCK = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL)
_warned_unlocked: set[str] = set()


def page_round(nbytes: int) -> int:
    """Round a size up to whole pages (at least one page)."""
    return max(PAGE_BYTES, -(-nbytes // PAGE_BYTES) * PAGE_BYTES)


def _random_part() -> str:
    return secrets.token_hex(_RANDOM_BYTES)


def new_name(owner_pid: int | None = None) -> str:
    """A fresh, unpredictable segment name that carries the owner pid: ``shml_<pid>_<hex>``."""
    pid = os.getpid() if owner_pid is None else owner_pid
    return f"{PREFIX}{pid}_{_random_part()}"


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


def same_file(path: str, fd: int) -> bool:
    """Whether ``path`` still names the file open as ``fd`` (not removed, not replaced)."""
    try:
        st = os.stat(path, follow_symlinks=False)
    except FileNotFoundError:
        return False
    own = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (own.st_dev, own.st_ino)


def _tracked(shm_dir: str) -> bool:
    return os.path.realpath(shm_dir) == os.path.realpath(DEFAULT_SHM_DIR)


class Segment:
    """One mapped shared-memory file. ``buf`` is the writable mapping.

    An owned segment (``create``) holds the owner's lock through the descriptor its mapping keeps
    (``mmap`` duplicates the one it maps: the same open file description, so the same lock), and
    through ``_fd`` as well only while bytes are left to reserve; an attached one (``attach``)
    holds the mapping's descriptor only (``_fd`` is -1).
    """

    __slots__ = ("name", "size_bytes", "path", "buf", "reserved", "_tracked", "_owner", "_fd", "__weakref__")

    def __init__(self, name: str, size_bytes: int, path: str, buf: mmap.mmap, tracked: bool, owner: bool,
                 fd: int = -1, reserved: int | None = None):
        self.name = name
        self.size_bytes = size_bytes
        self.path = path
        self.buf = buf
        self.reserved = size_bytes if reserved is None else reserved  # bytes backed by posix_fallocate
        self._tracked = tracked
        self._owner = owner
        self._fd = fd

    @classmethod
    def create(cls, shm_dir: str, size_bytes: int, *, reserve: bool = True) -> Segment:
        """Create, lock, reserve and map a new segment of at least ``size_bytes`` (page-rounded).

        With ``reserve=False`` the file is only sized (``ftruncate``): nothing may touch the
        mapping until :meth:`reserve` has reserved every byte.

        Raises OSError (ENOSPC from the reservation, EMFILE, ...) or SegmentCollision, and in
        every case leaves no file and no descriptor behind.
        """
        size = page_round(size_bytes)
        name, path, fd = _create_locked(shm_dir)
        buf: mmap.mmap | None = None
        segment: Segment | None = None
        registered = False
        try:
            if reserve:
                os.posix_fallocate(fd, 0, size)
            else:
                os.ftruncate(fd, size)
            buf = mmap.mmap(fd, size)
            tracked = _tracked(shm_dir)
            if tracked:
                _register(name)
                registered = True
            segment = cls(name, size, path, buf, tracked, owner=True, fd=fd, reserved=size if reserve else 0)
            if reserve:
                segment._release()  # the mapping's own descriptor holds the lock from here on
            return segment
        except BaseException:
            if registered:
                _unregister(name)
            # our descriptor, unless the segment has closed it (then -1: never closed twice)
            _abandon(path, fd if segment is None else segment._fd, buf)
            raise

    @classmethod
    def attach(cls, shm_dir: str, name: str, size_bytes: int) -> Segment:
        """Map an existing segment (worker side). Never registers, never locks, keeps no descriptor."""
        path = os.path.join(shm_dir, name)
        fd = os.open(path, os.O_RDWR)
        try:
            buf = mmap.mmap(fd, size_bytes)
        finally:
            os.close(fd)
        return cls(name, size_bytes, path, buf, tracked=False, owner=False)

    def reserve(self, nbytes: int) -> bool:
        """Reserve (``posix_fallocate``) up to ``nbytes`` more of an owned segment, in order; True once
        every byte is reserved. Raises OSError (ENOSPC) as ``create`` does; a failed part is not counted."""
        n = min(nbytes, self.size_bytes - self.reserved)
        if n > 0:
            os.posix_fallocate(self._fd, self.reserved, n)
            self.reserved += n
        if self.reserved < self.size_bytes:
            return False
        self._release()  # reserved: the mapping's own descriptor holds the lock from here on
        return True

    def trim(self, keep_bytes: int) -> bool:
        """Give the directory back every page of an owned segment past its first ``keep_bytes``
        (page-rounded), with ``MADV_REMOVE``: the file keeps its size, the pages read as zeros and
        are no longer reserved (``reserved`` says how many are). Nothing may write past ``reserved``
        again: the ring retires a trimmed segment once its batch is dropped. False, nothing changed,
        where the file system or platform cannot."""
        keep = page_round(keep_bytes)
        if _REMOVE is None or not self._owner or keep >= self.reserved:
            return False
        try:
            self.buf.madvise(_REMOVE, keep, self.size_bytes - keep)
        except (OSError, ValueError):  # EOPNOTSUPP (a file system without hole punching), a closed mapping
            return False
        self.reserved = keep
        return True

    def unlink(self) -> None:
        """Remove the file (owner only); the mapping stays valid for live views, and keeps the lock
        (on a file no longer there) until ``close`` or the last view."""
        if not self._owner:
            raise PermissionError(f"segment {self.name} is attached, not owned: only its owner unlinks it")
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass
        if self._tracked:
            _unregister(self.name)
            self._tracked = False
        self._release()

    def close(self) -> bool:
        """Release the lock and unmap now if nothing views the mapping; False when views keep it alive.

        The owner unlinks first: a file closed but not unlinked is no longer locked.
        """
        self._release()
        try:
            self.buf.close()
            return True
        except BufferError:
            return False

    def _release(self) -> None:
        fd, self._fd = self._fd, -1
        if fd >= 0:
            os.close(fd)


# MADV_POPULATE_WRITE (Linux 5.14): Python has no name for it before 3.13; elsewhere None
_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23 if sys.platform.startswith("linux") else None)
_REMOVE: int | None = getattr(mmap, "MADV_REMOVE", None)  # Linux: punches the pages out of the file


def prefault(buf: mmap.mmap, nbytes: int) -> None:
    """Map the first ``nbytes`` of a fresh mapping for writing in one call, instead of a page fault
    per page as they are first written (a 64 MiB batch into a just-grown slot: 26 ms, not 32;
    issue 16). Only for bytes that are reserved; a no-op where the kernel or platform lacks it."""
    if _POPULATE_WRITE is None or nbytes <= 0:
        return
    try:
        buf.madvise(_POPULATE_WRITE, 0, min(page_round(nbytes), len(buf)))
    except (OSError, ValueError, AttributeError):  # an older kernel (EINVAL), a closed mapping
        pass


def _create_locked(shm_dir: str) -> tuple[str, str, int]:
    """Create a file under a fresh name and take the owner's lock; returns (name, path, fd).

    The one owner of each fresh file until it returns it: on any failure, a Ctrl-C included, the
    file (if the path still names it) and its descriptor go, once."""
    name = ""
    for _ in range(CREATE_ATTEMPTS):
        name = new_name()
        path = os.path.join(shm_dir, name)
        fd = -1
        try:
            with _signals_held():  # a Ctrl-C right after the open would lose the new file's descriptor
                fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
            ours = _lock(shm_dir, fd) and same_file(path, fd)  # not: removed or replaced before the lock
        except FileExistsError:
            continue  # taken (by chance, or by someone who listed the directory): a fresh name
        except BaseException:
            if fd < 0:  # a handler ran before the open's result was stored: find what it made
                fd = _opened(path)
            if fd >= 0:
                _discard(path, fd)
            raise
        if ours:
            return name, path, fd
        _discard(path, fd)  # a sweeper got it first: it goes (if still ours to remove), a fresh name
    raise SegmentCollision(
        f"could not create a shared-memory segment in {shm_dir}: each of {CREATE_ATTEMPTS} attempts "
        f"found its fresh random name taken (or removed before it could be locked); the last was {name}. "
        "Another process is creating or removing files named like ours (shml_<pid>_...) in that "
        "directory. Give this job a directory of its own: SHMLOADER_SHM_DIR (shm_dir=).",
        directory=shm_dir, name=name, attempts=CREATE_ATTEMPTS,
    )


@contextlib.contextmanager
def _signals_held() -> Iterator[None]:
    """Hold every signal for this thread inside: a handler (SIGINT's ``KeyboardInterrupt``) runs as the
    block ends, once what it wraps has stored its result. Python runs a handler as soon as a C call
    returns, which could be between ``os.open`` creating a file and its descriptor reaching a name
    (tests/test_leak_segment_create.py). A no-op where ``pthread_sigmask`` is missing."""
    mask = getattr(signal, "pthread_sigmask", None)
    if mask is None:
        yield
        return
    previous = mask(signal.SIG_BLOCK, signal.valid_signals())
    try:
        yield
    finally:
        mask(signal.SIG_SETMASK, previous)


def _opened(path: str) -> int:
    """This process's descriptor of the file ``path`` names (from /proc/self/fd), else -1. Held signals
    cover this thread only: a Ctrl-C given to another (numpy's BLAS threads) runs its handler here
    right after ``os.open`` returns, losing the descriptor (tests/test_leak_segment_create.py)."""
    try:
        st, names = os.stat(path), os.listdir("/proc/self/fd")
    except OSError:
        return -1
    for name in names:
        with contextlib.suppress(OSError, ValueError):
            fd = int(name)
            held = os.fstat(fd)
            if (held.st_dev, held.st_ino) == (st.st_dev, st.st_ino):
                return fd
    return -1


def _lock(shm_dir: str, fd: int) -> bool:
    """Take the owner's lock on a fresh file without waiting; False when a sweeper holds it (about
    to remove it). A file system without ``flock``: True, with one warning."""
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)  # never waits: a holder of LOCK_EX is removing it
    except BlockingIOError:
        return False
    except OSError as exc:
        if exc.errno not in _NO_FLOCK:
            raise
        _warn_unlocked(shm_dir, exc)
    return True


def _warn_unlocked(shm_dir: str, exc: OSError) -> None:
    if shm_dir not in _warned_unlocked:
        _warned_unlocked.add(shm_dir)
        logger.warning("cannot lock segment files in %s (%s): segments there are made unlocked, so a loader in "
                       "another pid namespace sharing that directory could sweep them; give each its own "
                       "SHMLOADER_SHM_DIR, or set SHMLOADER_SWEEP=0 for those loaders", shm_dir, exc.strerror)


def _abandon(path: str, fd: int, buf: mmap.mmap | None) -> None:
    """A fresh file that ``create`` will not return: it goes while it is still ours (through our
    descriptor; or, once that is closed (``fd`` -1), through the lock the mapping's descriptor
    holds, which keeps sweepers off it), then the mapping."""
    try:
        if fd >= 0:
            _discard(path, fd)
        else:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
    finally:
        if buf is not None:
            buf.close()


def _discard(path: str, fd: int) -> None:
    """Remove our file (if the path still names it) and close its descriptor, in that order."""
    try:
        if same_file(path, fd):
            os.unlink(path)
    finally:
        os.close(fd)


def _register(name: str) -> None:
    tracker.register("/" + name, "shared_memory")


def _unregister(name: str) -> None:
    tracker.unregister("/" + name, "shared_memory")
