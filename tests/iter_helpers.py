"""Reaching a loader's multi-process iterator, for tests that inspect its ring, pool or guard."""

from __future__ import annotations

from shmloader.engine.mp_iterator import MultiProcessIter


def mp_iter(it: object) -> MultiProcessIter:
    """``it`` (``iter(loader)`` or ``loader._iterator``) as the workers' iterator the test relies on."""
    assert isinstance(it, MultiProcessIter), f"expected the workers' iterator, got {it!r}"
    return it
