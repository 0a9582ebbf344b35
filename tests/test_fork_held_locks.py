"""A process forked by other code while another thread of the parent held a loader's registry of
live iterators (``LiveIterators``: taken for a moment by ``iter(loader)`` and ``loader.close()``)
could never ``iter()`` or ``close()`` that loader: its copy of the lock stayed held by a thread
that does not exist in the child, so the child hung for good. torch's DataLoader has no such lock:
its loader works in the child. The registry now gives a forked child a lock of its own.

Likewise an iterator's step lock (``StepGuard``), held by a thread inside ``next()`` at the fork:
the child's ``next()`` on its copy of a ``num_workers=0`` iterator hung for good. That copy stopped
half-way through the parent thread's step (the sampler read, the batch not handed out), so it now
raises a ``LoaderError`` that says so, where torch's copy would go on from a torn state; closing it,
and a new ``iter(loader)``, work in the child.
"""

from __future__ import annotations

import os
import threading
import traceback
from typing import Any

import numpy as np
import pytest
from process_helpers import child_exit_code

import shmloader

CHILD_S = 30.0


def _hold(lock: Any, held: threading.Event, release: threading.Event) -> None:
    with lock:
        held.set()
        release.wait(CHILD_S)


def _forked_while_held(lock: Any, in_child: Any) -> int | None:
    """Fork while another thread holds ``lock``; the child's exit code: ``in_child()``'s (1 if it
    raised, its traceback on stderr), None if it hung."""
    held, release = threading.Event(), threading.Event()
    holder = threading.Thread(target=_hold, args=(lock, held, release))
    holder.start()
    try:
        assert held.wait(CHILD_S)
        pid = os.fork()  # as other code forks: another thread holds the lock at this moment
        if pid == 0:  # pragma: no cover - the child
            code = 1
            try:
                code = in_child()
            except BaseException:
                traceback.print_exc()  # to the test's captured stderr
            finally:
                os._exit(code)
    finally:
        release.set()
        holder.join()
    return child_exit_code(pid, CHILD_S)


def _in_child(loader: Any) -> int:
    got = [b[0].tolist() for b in loader]
    loader.close()
    return 0 if got == [[0, 1], [2, 3], [4, 5], [6, 7]] else 2


@pytest.mark.timeout(90)
@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_child_forked_while_the_registry_is_locked_uses_the_loader(num_workers: int) -> None:
    context = {"multiprocessing_context": "fork"} if num_workers else {}
    loader: Any = shmloader.DataLoader(shmloader.ArrayDataset(np.arange(8)), batch_size=2, num_workers=num_workers,
                                       **context)
    code = _forked_while_held(loader._live._lock, lambda: _in_child(loader))
    assert code == 0, "the forked child could not iterate and close the loader"
    assert [b[0].tolist() for b in loader] == [[0, 1], [2, 3], [4, 5], [6, 7]]  # the parent's is intact
    loader.close()


def _step_torn_copy(loader: Any, it: Any) -> int:
    try:
        next(it)
    except shmloader.LoaderError as exc:
        words = str(exc)
        if not ("forked" in words and str(os.getppid()) in words and "iter(loader)" in words):
            return 3  # the error does not say what happened, nor what to do
    else:
        return 4  # a step from a copy torn half-way
    it.close()
    return _in_child(loader)  # a new iterator here is whole


@pytest.mark.timeout(90)
def test_a_child_forked_inside_a_step_says_its_copy_is_torn_and_makes_a_new_one() -> None:
    loader: Any = shmloader.DataLoader(shmloader.ArrayDataset(np.arange(8)), batch_size=2)
    it = iter(loader)
    assert next(it)[0].tolist() == [0, 1]
    code = _forked_while_held(it._guard._lock, lambda: _step_torn_copy(loader, it))
    assert code == 0, {None: "the child hung", 3: "an error that does not say why", 4: "no error"}.get(code, code)
    assert [b[0].tolist() for b in it] == [[2, 3], [4, 5], [6, 7]]  # the parent's own goes on
    loader.close()


class _Member:
    renewed = 0


def _renew(member: _Member) -> None:
    member.renewed += 1


@pytest.mark.timeout(60)
def test_renewed_in_child_renews_each_live_member_once_in_the_child_only() -> None:
    """``owner.renewed_in_child``, which the registries, step guards and retry timers share: each
    member alive at a fork is renewed once in the child, a member gone is not kept, the parent's
    are untouched."""
    from shmloader import owner

    members = owner.renewed_in_child(_renew)
    kept, dropped = _Member(), _Member()
    members.update((kept, dropped))
    del dropped  # the set holds no member alive
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        os._exit(0 if kept.renewed == 1 and len(members) == 1 else 1)
    assert child_exit_code(pid, CHILD_S) == 0
    assert kept.renewed == 0 and len(members) == 1
