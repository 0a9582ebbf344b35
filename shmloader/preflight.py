"""Pre-flight: will the ring fit in the shared-memory directory?

Runs in the main process before a ring is created or its slots grow. Promises a clear
``ShmSpaceError`` (bytes needed, bytes free, remedies) instead of a worker's SIGBUS later.
"""

from __future__ import annotations

from .errors import ShmSpaceError
from .faults import shm_free_bytes
from .ring import Ring


def check_ring_fits(ring: Ring, slot_bytes: int, slots: int, *, num_workers: int, prefetch_factor: int) -> None:
    """Raise ShmSpaceError unless ``slots`` slots of ``slot_bytes`` fit beside what the ring holds."""
    free = shm_free_bytes(ring.shm_dir)
    if free is None:
        return
    needed = slots * slot_bytes - ring.total_bytes
    if needed <= free:
        return
    raise ShmSpaceError(
        f"the slot ring needs {needed} more bytes ({slots} slots of {slot_bytes} bytes: num_workers="
        f"{num_workers} x prefetch_factor={prefetch_factor} + 2 held by the consumer) but {ring.shm_dir} has "
        f"only {free} bytes free. Remedies: give the container more shared memory (Docker: --shm-size), "
        "use fewer workers or a smaller prefetch_factor, or point SHMLOADER_SHM_DIR at a directory with "
        "room (segments there are file-backed).",
        needed_bytes=needed, free_bytes=free, directory=ring.shm_dir,
    )
