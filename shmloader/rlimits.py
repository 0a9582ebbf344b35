"""This process's soft resource limits, read and put in words in one place.

Owns :func:`soft_limit` (one limit, read now) and :class:`SoftLimit`: its value and the one
wording every message that names a limit uses — ``soft limit RLIMIT_NOFILE = 1024; 'ulimit -n'
shows it`` and ``raise the limit (...)`` — for a worker that cannot start (``engine.start_limits``),
a refused page lock (``gpu.mlock``, ``cli.doctor``), a segment made without a free descriptor
or past the file-size limit (``transport.shm_space``) and the bench's bound on workers (``cli.options.startable_workers``).
Promises: reading never raises (a platform without the ``resource`` module or without that limit
gives a limit that is not known) and changes no limit; importing this module imports nothing else.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

__all__ = ["LimitName", "SoftLimit", "soft_limit"]

LimitName = Literal["RLIMIT_NOFILE", "RLIMIT_NPROC", "RLIMIT_MEMLOCK", "RLIMIT_FSIZE"]

# limit -> (the shell command that shows it, the ways to raise it)
_WORDS: dict[LimitName, tuple[str, str]] = {
    "RLIMIT_NOFILE": ("ulimit -n", "ulimit -n, resource.setrlimit(resource.RLIMIT_NOFILE, ...)"),
    "RLIMIT_NPROC": ("ulimit -u", "ulimit -u, resource.setrlimit(resource.RLIMIT_NPROC, ...)"),
    "RLIMIT_MEMLOCK": ("ulimit -l", "ulimit -l unlimited, memlock in limits.conf, docker --ulimit memlock=-1"),
    "RLIMIT_FSIZE": ("ulimit -f", "ulimit -f unlimited, fsize in limits.conf, resource.setrlimit(resource.RLIMIT_FSIZE, ...)"),
}
_IN_BYTES = frozenset({"RLIMIT_MEMLOCK", "RLIMIT_FSIZE"})


@dataclass(frozen=True, slots=True)
class SoftLimit:
    """One soft limit as read: ``value`` is None when it is unlimited or not ``known`` here."""

    name: LimitName
    value: int | None
    known: bool = True

    @property
    def unlimited(self) -> bool:
        return self.known and self.value is None

    def text(self, unit: Callable[[int], str] | None = None) -> str:
        """The value: "unknown", "unlimited", or the number as ``unit`` writes it (by default a
        count, or "N bytes" for a limit in bytes)."""
        if not self.known:
            return "unknown"
        if self.value is None:
            return "unlimited"
        if unit is not None:
            return unit(self.value)
        return f"{self.value} bytes" if self.name in _IN_BYTES else str(self.value)

    def describe(self, unit: Callable[[int], str] | None = None) -> str:
        """``soft limit NAME = VALUE; 'ulimit -x' shows it``."""
        return f"soft limit {self.name} = {self.text(unit)}; '{_WORDS[self.name][0]}' shows it"

    def remedy(self) -> str:
        """``raise the limit (the ways to)``."""
        return f"raise the limit ({_WORDS[self.name][1]})"


def soft_limit(name: LimitName) -> SoftLimit:
    """The soft limit ``name`` of this process now (not known where it cannot be read)."""
    try:
        import resource

        soft = resource.getrlimit(getattr(resource, name))[0]
    except (ImportError, AttributeError, OSError, ValueError):  # no such limit on this platform
        return SoftLimit(name, None, known=False)
    return SoftLimit(name, None if soft == resource.RLIM_INFINITY else soft)
