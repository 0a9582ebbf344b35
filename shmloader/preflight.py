"""Pre-flight: will the ring fit in the shared-memory directory?

Runs in the main process before a ring is created or its slots grow. Promises a clear
``ShmSpaceError`` (bytes needed, bytes free, remedies) instead of a worker's SIGBUS later: up
front by comparing the ring's size with the directory's free space (:func:`check_ring_fits`), and
at creation by turning the ``ENOSPC`` of reserving a segment's pages into the same error
(:func:`explain_enospc`; segments reserve every page with ``posix_fallocate``, so a full directory
fails there, in the main process, and never in a worker writing the slot).
"""

from __future__ import annotations

import contextlib
import errno
from collections.abc import Iterator
from typing import TYPE_CHECKING

from . import faults
from .errors import ShmSpaceError

if TYPE_CHECKING:  # ring.py may import this module: no import cycle at run time
    from .ring import Ring

__all__ = ["check_ring_fits", "explain_enospc", "space_error"]

_REMEDIES = ("Remedies: give the container more shared memory (Docker: --shm-size), use fewer workers or a "
             "smaller prefetch_factor, or point SHMLOADER_SHM_DIR (shm_dir=) at a directory with room "
             "(segments there are file-backed).")


def space_error(directory: str, needed_bytes: int, free_bytes: int, what: str) -> ShmSpaceError:
    """The one wording of "the ring does not fit": what was asked, bytes needed and free, remedies."""
    return ShmSpaceError(
        f"{what} needs {needed_bytes} more bytes but {directory} has only {free_bytes} bytes free. {_REMEDIES}",
        needed_bytes=needed_bytes, free_bytes=free_bytes, directory=directory,
    )


def check_ring_fits(ring: Ring, slot_bytes: int, slots: int, *, num_workers: int, prefetch_factor: int) -> None:
    """Raise ShmSpaceError unless ``slots`` slots of ``slot_bytes`` fit beside what the ring holds.

    A slot already that large is reused; every other one needs a new segment, and the segment it
    replaces frees its pages only once no process maps it (workers unmap it when told), so its
    bytes are not counted as coming back.
    """
    free = faults.shm_free_bytes(ring.shm_dir)
    if free is None:
        return
    reused = min(slots, sum(1 for s in ring.slots if s.size_bytes >= slot_bytes))
    needed = (slots - reused) * slot_bytes
    if needed <= free:
        return
    raise space_error(ring.shm_dir, needed, free,
                      f"the slot ring ({slots} slots of {slot_bytes} bytes: num_workers={num_workers} x "
                      f"prefetch_factor={prefetch_factor} + 2 held by the consumer)")


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
        free = faults.shm_free_bytes(shm_dir)
        raise space_error(shm_dir, nbytes, -1 if free is None else free,
                          f"a new shared-memory segment of {nbytes} bytes ({exc.strerror})") from exc
