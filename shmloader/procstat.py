"""A process's state and parent as Linux shows them in ``/proc/<pid>/stat``.

Owns nothing. Promises: never raises; None where the file cannot be read (another OS, the process
gone). The fields are read after the process's name, which may hold spaces and ")".
"""

from __future__ import annotations

__all__ = ["parent_of", "state_and_parent", "state_of"]


def _fields(pid: int) -> list[bytes] | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except (OSError, TypeError):
        return None
    fields = stat[stat.rfind(b")") + 2:].split()
    return fields if len(fields) >= 2 else None


def state_and_parent(pid: int) -> tuple[bytes, int] | None:
    """The state letter and parent pid of ``pid``, read at one moment (one read of the file)."""
    fields = _fields(pid)
    try:
        return None if fields is None else (fields[0], int(fields[1]))
    except ValueError:
        return None


def state_of(pid: int) -> bytes | None:
    """The state letter of ``pid`` (``b"R"``, ``b"S"``, ``b"T"`` stopped, ``b"Z"`` zombie...)."""
    fields = _fields(pid)
    return None if fields is None else fields[0]


def parent_of(pid: int) -> int | None:
    """The parent pid of ``pid`` (0: a parent outside this pid namespace)."""
    both = state_and_parent(pid)
    return None if both is None else both[1]
