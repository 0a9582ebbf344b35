"""A Ctrl-C retry timer (``redeliver.interrupt_main_later``) alive in the parent at a fork.

The timer's thread does not exist in a forked child, but its ``Event`` does, with its lock as
the thread left it: the thread holds that lock for a moment at the start and end of each wait and
as it fires, so a fork then (a worker started under fork, or any ``os.fork()``) left the lock held
in the child, where nothing would release it. ``cancel()`` there (``cli.interrupt`` cancels every
retry it started as it ends) then blocked forever. Holding the lock in the test is that moment,
made certain. The child's copy of a timer is cancelled at the fork: its interrupt was the
parent's, and no thread in the child would deliver it.
"""

from __future__ import annotations

import os

import pytest
from process_helpers import child_exit_code

from shmloader.redeliver import interrupt_main_later

pytestmark = pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")

EXIT_S = 10.0  # how long a child that does not hang takes at most


def _fork_holding_the_timers_lock(timer: object) -> int:
    """A child, forked while the timer's lock is held, that cancels the timer and exits 0."""
    with timer.finished._cond:  # type: ignore[attr-defined]  # as the timer's thread holds it in a wait
        pid = os.fork()
        if pid == 0:  # the child: never returns into pytest
            code = 3
            try:
                timer.cancel()  # type: ignore[attr-defined]
                code = 0 if timer.finished.is_set() else 2  # type: ignore[attr-defined]
            finally:
                os._exit(code)
    return pid


@pytest.mark.timeout(60)
def test_cancel_in_a_child_forked_while_the_timer_held_its_lock_returns() -> None:
    timer = interrupt_main_later(3600.0)
    try:
        pid = _fork_holding_the_timers_lock(timer)
    finally:
        timer.cancel()
    assert child_exit_code(pid, EXIT_S) == 0, "the forked child's timer.cancel() blocked on the lock held at the fork"


@pytest.mark.timeout(60)
def test_a_timer_cancelled_at_a_fork_stays_alive_in_the_parent() -> None:
    """The hook changes the child's copy only: the parent's retry still fires there, or is cancelled."""
    timer = interrupt_main_later(3600.0)
    try:
        assert child_exit_code(_fork_holding_the_timers_lock(timer), EXIT_S) == 0
        assert timer.is_alive() and not timer.finished.is_set()
    finally:
        timer.cancel()
    timer.join(10.0)
    assert not timer.is_alive()
