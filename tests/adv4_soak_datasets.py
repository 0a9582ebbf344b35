"""Hooks of tests/test_adv4_soak_*.py, importable by reference from workers."""

from __future__ import annotations

import threading


def hang_in_init(worker_id: int) -> None:
    """A ``worker_init_fn`` that never returns: every start-up of every worker hangs."""
    threading.Event().wait()

