"""What a process forked from this one does with our workers, at the fork itself.

Owns the at-fork hook (registered on import, through ``owner.at_fork_in_child``, with the
collector held: nothing runs before it) that, in the child: freezes every object inherited, when
the child is one of our workers (``freeze_inherited``: its collector never finalizes the parent's
batches, leases, rings); and, in any child, drops the parent's workers from multiprocessing's list
of its children (``disown_inherited``), so that a child forked by other code never signals them.
Runs in the forked child only; the parent's state is never touched. ``engine.workers`` imports it.
"""

from __future__ import annotations

import gc
from multiprocessing import process as mp_process

from shmloader import owner
from shmloader.engine.reaping import live_workers

__all__ = ["after_fork_in_child", "disown_inherited", "freeze_inherited"]


def after_fork_in_child() -> None:
    freeze_inherited()
    disown_inherited()


def freeze_inherited() -> None:
    """In a process just forked, before any of its Python code runs: if it is one of our workers,
    freeze every object it inherited, so that its collector never visits (and never finalizes)
    the parent's garbage. The parent's own permanent generation is never touched."""
    if owner.started_by_us():  # the forking thread was in owner.our_fork(): see workers.WorkerPool._launch
        gc.freeze()


def disown_inherited() -> None:
    """In any process just forked: drop the parent's workers from multiprocessing's list of this
    process's children (``multiprocessing.process._children``, inherited whole).

    A child forked by other code (``os.fork()`` in a library) that exits normally runs
    ``multiprocessing.util._exit_function``, which SIGTERMs every daemonic child on that list — our
    parent's live workers — and then fails to join them ("can only join a child process"). Only
    our workers leave the list, and only this process's copy of it: the parent's bookkeeping and
    other code's processes are untouched. In a process that multiprocessing starts (one of our
    workers included), ``Process._bootstrap`` empties the list afterwards anyway.
    """
    children = getattr(mp_process, "_children", None)
    if isinstance(children, set):  # a private name of CPython's: if it ever changes, do nothing
        children.difference_update(live_workers)
    live_workers.clear()  # this process started none of them


owner.at_fork_in_child(after_fork_in_child)  # with the collector held: nothing can run before the freeze
