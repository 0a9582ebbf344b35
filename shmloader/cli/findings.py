"""What ``python -m shmloader doctor`` reports: one :class:`Finding` per check, and its statuses.

Owns the finding record and the four statuses. Runs in the CLI process. Promises: a finding is
plain data (``dataclasses.asdict`` gives its JSON); only ``problem`` makes doctor exit 1.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Finding", "INFO", "OK", "PROBLEM", "WARNING"]

OK, INFO, WARNING, PROBLEM = "ok", "info", "warning", "problem"


@dataclass(frozen=True)
class Finding:
    """One check's outcome: ``status`` is ok, info, warning or problem; ``remedy`` what to change."""

    check: str
    status: str
    message: str
    remedy: str = ""
