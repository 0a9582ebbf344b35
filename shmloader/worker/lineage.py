"""Who this worker process is, and whether the process that started it lives.

Runs in each worker process. Owns the worker's identity (its id and pid, set once as it starts)
and the watch on the main process. Promises: a worker exits when the main process is gone (at
once with ``PR_SET_PDEATHSIG`` where the forking thread lasts as long as its process, else
within ``PARENT_CHECK_S`` of waiting for a task, by ``main.serve``'s poll); Ctrl-C is the
trainer's and SIGTERM stops the worker whatever handler it inherited; and a child that user code
forks inside the worker and that comes back into the worker's code exits before it sends or reads
anything (``leave_if_forked``), so only the worker answers for itself.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
from typing import Any

from shmloader import procstat
from shmloader.transport.messages import Failed

PARENT_CHECK_S = 0.5
_worker: tuple[int, int] | None = None  # (worker id, pid) of this process, set as the worker starts


def start(worker_id: int, parent_pid: int, death_signal: bool) -> None:
    """The worker's first step: note who it is, take its signals, check on the main process."""
    global _worker
    _worker = (worker_id, os.getpid())
    own_signals()
    release_fork_server()
    watch_parent(parent_pid, death_signal)


def release_fork_server() -> None:
    """Close this worker's copy of the fork server's "alive" pipe, so that the fork server ends
    with the main process and this worker with it.

    The fork server exits once every holder of that pipe's write end has exited, and CPython hands
    a copy to each process it forks (and a forked worker inherits the main process's). A worker
    inside a long sample holds it, and the worker dies only with the fork server (the death signal)
    or when its poll sees the main process gone, between tasks: a trainer killed under forkserver
    (SIGTERM at its default action, SIGKILL) left its busy workers, their fork server and, through
    them, the resource tracker and the trainer's segments for as long as the sample took, for good
    with a hung one (tests/test_main_sigterm.py). Nothing of the worker needs it: a worker is a
    daemonic process, which multiprocessing lets start no process of its own."""
    forkserver = sys.modules.get("multiprocessing.forkserver")
    server = getattr(forkserver, "_forkserver", None)
    fd = getattr(server, "_forkserver_alive_fd", None)
    if fd is None:
        return
    server._forkserver_alive_fd = None  # type: ignore[union-attr]
    try:
        os.close(fd)
    except OSError:
        pass


def own_signals() -> None:
    """Ctrl-C is the trainer's to handle (it then stops us): ignored. SIGTERM is how shutdown
    stops a busy worker: its default action, whatever handler a forked worker inherited from the
    trainer (a framework's, which checkpoints or signals the job's other processes: run here it
    did that from a worker, and kept the worker alive until SIGKILL). ``worker_init_fn`` runs
    later, so a dataset may still install its own."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)


def watch_parent(main_pid: int, death_signal: bool) -> None:
    """Exit now if the main process is gone; with ``death_signal``, ask Linux to SIGKILL us the
    moment our parent dies. The poll in ``main.serve`` watches the main process in every case.

    ``PR_SET_PDEATHSIG`` fires when the *thread* that forked us ends, not its process (prctl(2)):
    asked for by a worker started from any other thread, it killed the worker as soon as that
    thread ended (an epoch run in a thread, then the next in the main one). So the caller asks
    for it only where that thread lasts as long as its process: the main thread, or the fork
    server's, which exits when the main process dies.

    The death signal covers a parent that dies after it is asked for, not before: a fork server
    killed while this worker started (tests/test_forkserver_faults.py) left it reparented and
    running, after the main process had seen it dead and shut down. So once it is asked for, the
    parent must still be the main process or a child of it (the fork server); else exit now.
    """
    if death_signal and sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG
        except (OSError, AttributeError):
            pass
        parent = os.getppid()  # 0: reparented to a process outside our pid namespace
        if parent != main_pid and (parent == 0 or procstat.parent_of(parent) not in (main_pid, None)):
            os._exit(0)
    if not alive(main_pid):
        os._exit(0)


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def worker_id() -> int:
    """This worker's id (-1 before ``start``)."""
    return -1 if _worker is None else _worker[0]


def leave_if_forked(msg: Any = None) -> None:
    """Exit at once, sending nothing, in a process that is not the worker itself but a child that
    user code forked inside it and that came back into our code; print why (and the traceback of
    the exception it came back with). The worker goes on: its own reply is the one that counts."""
    if _worker is None or os.getpid() == _worker[1]:  # a system call, some 0.3 µs: once or twice a task
        return
    worker_id, pid = _worker
    text = msg.traceback if isinstance(msg, Failed) else ""
    try:
        sys.stderr.write(f"{text}shmloader: process {os.getpid()}, forked inside DataLoader worker {worker_id} "
                         f"(pid {pid}) by the dataset, collate_fn or worker_init_fn, returned into the worker's own "
                         "code instead of exiting (end a forked child with os._exit); it exits with code 1 and "
                         "answers nothing for the worker.\n")
        sys.stderr.flush()
    except (AttributeError, OSError, ValueError):  # stderr closed or gone
        pass
    os._exit(1)
