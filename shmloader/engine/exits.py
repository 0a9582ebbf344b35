"""Seeing a worker process exit: a pidfd, which no other process can hold open.

Owns one descriptor per worker started under fork or spawn: a pidfd (``os.pidfd_open``, Linux
5.3), readable the moment the process itself exits. Runs in the main process. Promises: a
worker's exit is seen at once (the wait polls ``exit_fd``) and its joins end as soon as it has
exited, whatever processes it started; a signal to a worker goes to that process and to no
other (``send_signal``); without a pidfd (another OS, an older kernel, a sandbox that refuses it),
and under forkserver, multiprocessing's sentinel and ``os.kill`` as before.

Why: under fork and spawn multiprocessing's sentinel is a pipe whose write end the worker holds
for its life, and the pipe reads as closed only once every process holding that end has exited.
A process the worker forks (``worker_init_fn`` or the dataset starting a helper with a bare fork,
as some C libraries do) inherits it: while that helper lived, a dead worker looked alive, the
main process waited for its batch until the helper exited (for ever, for a helper that never
does), and each join at shutdown waited out its whole timeout (tests/test_procs_helpers.py).
Under forkserver the sentinel is the fork server's report of the exit, which no worker's child
holds, and the worker is the fork server's child, not ours, so its pid could be reaped and reused
before a pidfd was opened: the sentinel stays.

A trainer that ignores SIGCHLD (``signal(SIGCHLD, SIG_IGN)``, a server's way to avoid zombies)
has the kernel reap its children as they exit, status and all: multiprocessing then never learns
that a worker exited (its exit code stays None), and shutdown sent the finished worker SIGTERM,
SIGCONT and SIGKILL by pid — a pid the kernel is free to give to any new process, another job's
included — then warned that it "did not exit within 5 s of SIGKILL". The pidfd still says the
worker exited (``exited``), and a signal sent through it reaches no other process
(tests/test_procs_sigchld.py).
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
from typing import Any

from shmloader import procstat

_pidfd_open = getattr(os, "pidfd_open", None)


def open_pidfd(process: Any) -> int:
    """A pidfd of ``process``, just started and not yet joined (so its pid cannot have been reused:
    it is our child, and only a join reaps it); -1 where the system has none."""
    if _pidfd_open is None or not process.pid:
        return -1
    try:
        return int(_pidfd_open(process.pid))
    except OSError:  # ENOSYS (kernel before 5.3), EPERM (seccomp), EMFILE: the sentinel will do
        return -1


def join(process: Any, pidfd: int, timeout_s: float | None) -> None:
    """``process.join(timeout_s)``, over as soon as the process has exited (its pidfd is readable),
    where multiprocessing's own join waits for its sentinel, which the worker's children may hold."""
    if pidfd >= 0 and process.exitcode is None:
        ms = None if timeout_s is None else max(0, int(timeout_s * 1000))
        # exited: the join reaps it at once; else it stays running
        timeout_s = None if _readable(pidfd, ms) else 0.0
    process.join(timeout_s)


def exited(pidfd: int) -> bool:
    """Whether the process of ``pidfd`` has exited (False without a pidfd: ask multiprocessing)."""
    return pidfd >= 0 and _readable(pidfd, 0)


def _readable(pidfd: int, ms: int | None) -> bool:
    """Whether the pidfd says its process exited, waiting up to ``ms`` (None: as long as it takes)."""
    poller = select.poll()
    poller.register(pidfd, select.POLLIN)
    return bool(poller.poll(ms))


def send_signal(process: Any, pidfd: int, sig: int) -> None:
    """Send ``sig`` to the worker, never to a process that took its pid after it was reaped: through
    its pidfd where it has one, else by pid only while multiprocessing has no exit code for it (as
    its own ``terminate`` and ``kill`` do). Nothing happens once it has exited."""
    try:
        if pidfd >= 0:
            signal.pidfd_send_signal(pidfd, sig)
        elif process.pid and process.exitcode is None:
            os.kill(process.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def stopped(process: Any) -> bool:
    """Whether the worker is stopped by a signal (SIGSTOP, SIGTSTP: state ``T`` in
    ``/proc/<pid>/stat``), and so can act on nothing until continued; False where that cannot be
    read (another OS, the process gone). Read only while the worker has not been joined, so its
    pid is still its own."""
    return process.pid is not None and procstat.state_of(process.pid) == b"T"


def fork_server() -> int:
    """The pid of the fork server that started the worker just started under forkserver (0 if unknown)."""
    from multiprocessing import forkserver

    return getattr(forkserver._forkserver, "_forkserver_pid", None) or 0


SERVER_DYING_S = 1.0  # how long a fork server still shown running is given to end (fork_server_gone)


def fork_server_gone(pid: int) -> bool:
    """Whether the fork server ``pid`` (a child of this process, which only CPython reaps) has died:
    no such process, a zombie, or no longer our child. Under forkserver a worker's exit status comes
    from its fork server: once that is gone, multiprocessing reports exit code 255 for each of its
    workers, whatever became of them (they die with it: ``PR_SET_PDEATHSIG``).

    A dying server closes its workers' status pipes a moment before it is a zombie, so a worker's
    255 can be read while the server still shows as running: then it is given up to
    ``SERVER_DYING_S`` to end (a pidfd, readable once it has exited) before it is judged alive; only
    a worker that really exited with 255 under a live server waits that long."""
    if pid <= 0:
        return False
    if _server_gone_now(pid):
        return True
    if _pidfd_open is None:
        return False
    try:
        fd = _pidfd_open(pid)
    except OSError:  # gone meanwhile, and reaped
        return True
    try:
        select.select([fd], [], [], SERVER_DYING_S)
    finally:
        os.close(fd)
    return _server_gone_now(pid)


def _server_gone_now(pid: int) -> bool:
    both = procstat.state_and_parent(pid)
    return both is None or both[0] == b"Z" or both[1] != os.getpid()


def own_fork_server() -> None:
    """Before a start under forkserver: forget multiprocessing's fork server if another process
    started it. A process forked from the one that started it inherits its record (pid, socket,
    "alive" pipe), and CPython's next start waits on that pid as if it were its child: it raised
    ``ChildProcessError`` from deep inside, so no forkserver loader could start there. Forgotten
    (our copy of its "alive" pipe closed: the parent's server ends with the parent), the start
    makes a fork server of this process's own. Nothing where the server is ours, alive or not
    (CPython reaps and replaces a dead one of ours itself)."""
    from multiprocessing import forkserver

    server: Any = forkserver._forkserver  # its record is private to CPython: read as it stands in 3.10-3.13
    with server._lock:
        pid = server._forkserver_pid
        if pid is None:
            return
        try:  # the test CPython's start makes, without reaping: a child of ours, dead or alive, is ours
            os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
            return
        except ChildProcessError:
            pass
        alive_fd = server._forkserver_alive_fd
        server._forkserver_address = server._forkserver_alive_fd = server._forkserver_pid = None
        if alive_fd is not None:
            with contextlib.suppress(OSError):
                os.close(alive_fd)


def close(pidfd: int) -> None:
    if pidfd >= 0:
        os.close(pidfd)
