"""The worker's pipes to the main process, and whether user code has taken them away.

Owns the identity (device, inode) of the task pipe's, the reply pipe's and the nudge pipe's
descriptors, read as the worker starts, before any user code (the dataset's unpickling,
``worker_init_fn``). Runs in each worker. Why: a dataset, ``collate_fn`` or
``worker_init_fn`` that closes descriptors it did not open (``os.closerange``, a daemonising
library) made the worker take its closed pipe for the main process's end and exit with code 0,
saying nothing; one that then opened files onto those numbers had the worker write its reply
into the dataset's own file (tests/test_adv3_ext_fds.py). Promises: ``check`` ends the worker
with ``LOST_PIPE_EXIT`` and one line on stderr naming the worker, its pid and the descriptor, as
soon as either descriptor no longer names its pipe. Before each reply only the reply pipe is
checked (one ``fstat``, about 2 µs): a reply written onto a reused number is what would corrupt a
file of the user's; a task pipe taken away is met by the read (``check`` when it fails or is quiet).
"""

from __future__ import annotations

import os

LOST_PIPE_EXIT = 70  # sysexits' EX_SOFTWARE; faults.hints explains it in the main process's WorkerDied


def _identity(fd: int) -> tuple[int, int] | None:
    try:
        st = os.fstat(fd)
    except OSError:
        return None
    return st.st_dev, st.st_ino


class PipeWatch:
    """The identities of the worker's pipes, compared with what their descriptors name now."""

    def __init__(self, worker_id: int, tasks_fd: int, results_fd: int, nudge_fd: int = -1) -> None:
        self.worker_id = worker_id
        self._pipes = {"task": (tasks_fd, _identity(tasks_fd)), "reply": (results_fd, _identity(results_fd))}
        self._nudge = (nudge_fd, _identity(nudge_fd)) if nudge_fd >= 0 else None

    def nudge(self) -> None:
        """Wake the main process's wait for the reply just sent, which it must act on at once (a
        ``TooSmall``: the slot grows while the due batch is awaited), where that wait sleeps on
        another worker's pipe (``WorkerPool.nudged``): one byte on the pool's nudge pipe, never
        blocking. Skipped when the pipe is full (a wake-up waits already) or no longer names the
        pipe (user code took it away: nothing is written into its file; the reply is then read at
        the main process's next wait, a batch later)."""
        if self._nudge is None:
            return
        fd, identity = self._nudge
        if _identity(fd) != identity:
            return
        try:
            os.write(fd, b"\0")
        except OSError:  # BlockingIOError: full (the write end is non-blocking: WorkerPool)
            pass

    def lost(self, names: tuple[str, ...] = ("task", "reply")) -> str | None:
        """What happened to the first of ``names``' pipes whose descriptor no longer names it, or None."""
        for name in names:
            fd, identity = self._pipes[name]
            now = _identity(fd)
            if now != identity:
                return f"descriptor {fd}, its {name} pipe, was " + ("closed" if now is None else "replaced by another file")
        return None

    def check_reply(self) -> None:
        """Before a reply: ``check`` of the reply pipe alone (its identity compared inline)."""
        fd, identity = self._pipes["reply"]
        try:
            st = os.fstat(fd)
        except OSError:
            self.check(("reply",))
            return
        if (st.st_dev, st.st_ino) != identity:
            self.check(("reply",))

    def check(self, names: tuple[str, ...] = ("task", "reply")) -> None:
        """Exit now, with ``LOST_PIPE_EXIT`` and a line on stderr, if one of ``names``' pipes was taken away."""
        what = self.lost(names)
        if what is None:
            return
        line = (f"shmloader: DataLoader worker {self.worker_id} (pid {os.getpid()}): {what} by the dataset, "
                "collate_fn or worker_init_fn (a descriptor they did not open); the worker cannot reach the main "
                f"process and exits with code {LOST_PIPE_EXIT}.\n")
        try:  # to descriptor 2 itself: a sys.stderr that wraps another descriptor may be among those closed
            os.write(2, line.encode(errors="replace"))
        except OSError:  # stderr closed too
            pass
        os._exit(LOST_PIPE_EXIT)
