"""Rewording an error as it leaves a block, without a reference cycle through its traceback.

Owns :class:`Rewording`, the base of the context managers that raise, in place of an error their
block raised, one that says more (``shm_space.explain_enospc``, ``start_limits.limits_named``).
Runs in any process. Promises: the new error is chained to the old (``raise new from old``); an
error that is not reworded goes on as it is, traceback and all; and once the caller drops the new
error, the frames both passed through are freed at once, without the cyclic collector.

Why not a ``contextlib.contextmanager`` generator: from Python 3.12 a generator's frame that a new
error leaves keeps the ``__exit__`` frame that threw the old one into it (its ``f_back``), which
holds the old error, whose traceback holds the generator's frame (CPython issue gh-129280). That
cycle kept every frame of the failed step and their locals until a collection: an ``iter(loader)``
that ran out of descriptors under spawn left its workers' stop-flag semaphores, names in /dev/shm,
for as long as the collector did not run (tests/test_reworded_error_cycles.py,
tests/test_iter_fd_limit.py).
"""

from __future__ import annotations

from types import TracebackType


class Rewording:
    """A context manager whose block's error ``exc`` is raised as ``self.reworded(exc)`` (from
    ``exc``) where that is not None; subclasses say how."""

    __slots__ = ()

    def __enter__(self) -> None:
        return None

    def __exit__(self, typ: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if exc is None:
            return
        new = self.reworded(exc)
        if new is None:
            return
        try:
            raise new from exc
        finally:
            del new  # else its traceback holds this frame, which holds it

    def reworded(self, exc: BaseException) -> BaseException | None:
        """The error to raise in place of ``exc``; None: ``exc`` goes on as it is."""
        raise NotImplementedError
