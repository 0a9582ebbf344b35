"""Running out of room for a shared-memory segment, in one wording wherever it is found.

Owns nothing: the words and the checks. ``preflight`` (before a ring is made or grows) and
``explain_enospc`` (around ``Segment.create`` and ``Segment.reserve``, in the ring) raise the same
``ShmSpaceError`` — what was asked, the bytes needed and free, the remedies — and a directory no
segment can be made in, a process out of file descriptors, or a segment past the file-size
limit (``ulimit -f``) becomes an ``OSError`` of the same
errno that names the setting or the limit to change (docs/errors.md). ``shm_free_bytes`` is the
one place that reads a directory's free space (tests and the stress script patch it by this name).
"""

from __future__ import annotations

import errno
import os

from shmloader.errors import ShmSpaceError, TooManyOpenFiles
from shmloader.rewording import Rewording
from shmloader.rlimits import soft_limit


def shm_free_bytes(shm_dir: str) -> int | None:
    """Bytes free in ``shm_dir`` (None when it cannot be read)."""
    try:
        st = os.statvfs(shm_dir)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


def shm_free_files(shm_dir: str) -> int | None:
    """Files (inodes) that may still be made in ``shm_dir``; None when it cannot be read or sets no limit."""
    try:
        st = os.statvfs(shm_dir)
    except OSError:
        return None
    return st.f_favail if st.f_files else None


_REMEDIES = ("Remedies: give the container more shared memory (Docker: --shm-size), use fewer workers or a "
             "smaller prefetch_factor, or point SHMLOADER_SHM_DIR (shm_dir=) at a directory with room "
             "(segments there are file-backed).")


def space_error(directory: str, needed_bytes: int, free_bytes: int, what: str) -> ShmSpaceError:
    """The one wording of "the ring does not fit": what was asked, bytes needed and free, remedies."""
    return ShmSpaceError(
        f"{what} needs {needed_bytes} more bytes but {directory} has only {free_bytes} bytes free. {_REMEDIES}",
        needed_bytes=needed_bytes, free_bytes=free_bytes, directory=directory,
    )


_DIRECTORY_ERRNOS = (errno.ENOENT, errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOTDIR)


class explain_enospc(Rewording):
    """Turn running out of space while creating a ``nbytes`` segment into a ShmSpaceError, and a
    directory where no segment can be made (missing, read-only, not ours to write, not a file
    system that takes them) into the same OSError naming the setting that chose it.

    Use around ``Segment.create``; any other OSError passes through unchanged. A class, not a
    generator: see ``shmloader.rewording``.
    """

    __slots__ = ("nbytes", "shm_dir")

    def __init__(self, shm_dir: str, nbytes: int) -> None:
        self.shm_dir = shm_dir
        self.nbytes = nbytes

    def reworded(self, exc: BaseException) -> OSError | ShmSpaceError | None:
        if not isinstance(exc, OSError):
            return None
        shm_dir, nbytes = self.shm_dir, self.nbytes
        if exc.errno in _DIRECTORY_ERRNOS:
            return type(exc)(exc.errno, f"cannot create a shared-memory segment in {shm_dir} ({exc.strerror}): "
                             "that directory is set by SHMLOADER_SHM_DIR or shm_dir= (default /dev/shm) and must "
                             "be a writable tmpfs", exc.filename)
        if exc.errno in (errno.EMFILE, errno.ENFILE):
            return _descriptors_error(exc, shm_dir)
        if exc.errno == errno.EFBIG:
            return _file_size_error(exc, shm_dir, nbytes)
        if exc.errno not in (errno.ENOSPC, errno.ENOMEM, errno.EDQUOT):
            return None
        free = -1 if (free_bytes := shm_free_bytes(shm_dir)) is None else free_bytes
        what = f"a new shared-memory segment of {nbytes} bytes ({exc.strerror})"
        if shm_free_files(shm_dir) == 0:  # out of files, not bytes: saying "needs N, has more" would puzzle
            return ShmSpaceError(
                f"{what} could not be made: {shm_dir} has no free inodes (one per segment) though {free} bytes "
                "are free. Hold fewer batches at once (copy what you keep, e.g. batch.copy()), give the "
                "directory more inodes (tmpfs: mount -o remount,nr_inodes=...), or point SHMLOADER_SHM_DIR "
                "(shm_dir=) at another directory.", needed_bytes=nbytes, free_bytes=free, directory=shm_dir)
        return space_error(shm_dir, nbytes, free, what)


def held_space_error(exc: ShmSpaceError, slots: int, held: int) -> ShmSpaceError:
    """``exc`` (the ring could not add a slot), saying that the batches the caller keeps made it grow."""
    held_hint = (f"The ring has {slots} slots, {held} of them held by batches the caller still holds (each batch "
                 "kept keeps its slot): drop references to old batches, or copy what you keep (e.g. batch.copy()); "
                 "max_slots (SHMLOADER_MAX_SLOTS) bounds the ring with RingExhausted instead. ")
    return ShmSpaceError(str(exc).replace(_REMEDIES, held_hint + _REMEDIES), needed_bytes=exc.needed_bytes,
                         free_bytes=exc.free_bytes, directory=exc.directory)


def _file_size_error(exc: OSError, shm_dir: str, nbytes: int) -> OSError:
    """A segment larger than this process may make a file (``ulimit -f``): the same errno, the
    segment's size, the directory and the limit. Python ignores the SIGXFSZ that comes with it."""
    fsize = soft_limit("RLIMIT_FSIZE")
    return OSError(exc.errno, f"cannot create a shared-memory segment of {nbytes} bytes in {shm_dir}: "
                   f"{exc.strerror} (this process's {fsize.describe()}; every segment is a file there, "
                   f"one slot each). Use smaller batches, or {fsize.remedy()}", exc.filename)


def _descriptors_error(exc: OSError, shm_dir: str) -> TooManyOpenFiles:
    """Out of file descriptors while making a segment: the same errno, and what to do about it
    (torch's advice for its own shared tensors, ``set_sharing_strategy``, does not apply)."""
    nofile = soft_limit("RLIMIT_NOFILE")
    limit = "the system's limit" if exc.errno == errno.ENFILE else f"this process's {nofile.describe()}"
    return TooManyOpenFiles(
        exc.errno, f"cannot create a shared-memory segment in {shm_dir}: too many open files ({limit}). "
        "Each slot keeps one descriptor open, and each batch you hold keeps its slot: hold fewer batches at "
        f"once (copy what you keep, e.g. batch.copy()), or {nofile.remedy()}. (torch's "
        "torch.multiprocessing.set_sharing_strategy('file_system') does not apply: the slots are not torch's "
        "shared tensors.)", exc.filename)
