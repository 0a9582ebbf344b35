"""Why a worker could not start, in the words of the limit it hit.

Owns :func:`explain`: an ``OSError`` raised while starting worker ``i`` of ``num_workers`` (a pipe
or a fork refused for lack of descriptors, processes or memory) becomes the same type with the same
errno, whose message names the worker, ``num_workers`` and the limit with its value. Runs in the
main process, when workers start. Promises: any other error is left as it is (None).
"""

from __future__ import annotations

import errno

__all__ = ["explain"]

_LIMITS = {  # errno -> (the resource limit it most likely is, the shell command that shows it)
    errno.EMFILE: ("RLIMIT_NOFILE", "ulimit -n"),
    errno.ENFILE: ("RLIMIT_NOFILE", "ulimit -n"),
    errno.EAGAIN: ("RLIMIT_NPROC", "ulimit -u"),
}


def explain(exc: OSError, worker_id: int, num_workers: int) -> OSError | None:
    """``exc`` reworded when it is a limit that ``num_workers`` ran into; None otherwise."""
    if exc.errno not in _LIMITS and exc.errno != errno.ENOMEM:
        return None
    text = f"could not start worker {worker_id} of num_workers={num_workers}: {exc.strerror}"
    if exc.errno in _LIMITS:
        name, command = _LIMITS[exc.errno]
        text += f" (soft limit {name} = {_soft_limit(name)}; '{command}' shows it)"
    text += ": lower num_workers (or prefetch_factor), or raise the limit"
    return type(exc)(exc.errno, text)


def _soft_limit(name: str) -> str:
    try:
        import resource
    except ImportError:  # not a POSIX system
        return "unknown"
    soft = resource.getrlimit(getattr(resource, name))[0]
    return "unlimited" if soft == resource.RLIM_INFINITY else str(soft)
