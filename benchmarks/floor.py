"""The kernel's share of the main process's CPU per batch: the same pipes, nothing else.

    python benchmarks/floor.py                 # 2 workers, 2 tasks each in flight, 40 µs of work per task
    python benchmarks/floor.py --work-us 600   # workers slower than the main process (image-like)

A main process and ``--workers`` forked workers speak over one pipe each way, as a loader's do:
the main process keeps ``--prefetch`` tasks per worker in flight, sends task t to worker
t % workers (a 40-byte frame, one ``os.write``), and waits for task t's reply with one
``select.poll`` over the reply pipes, reading whatever is there with one ``os.read``. A worker
reads its task, spins for ``--work-us`` microseconds (the fetch and collate it stands for) and
writes a 100-byte reply. No pickling, no slots, no Python objects beyond the loop's own. The main
process's ``time.process_time()`` per task is then what the system calls, sleeps and wake-ups of
this exchange cost it on this machine: a floor under shmloader's figure for the same shape of
exchange (docs/performance.md). Also printed: the one-to-one ping-pong (write, sleep in poll, be
woken, read) of one process pair, the price of one sleep and wake-up; and the CPU of sending one
120-byte frame to a process that keeps reading, with ``Connection.send_bytes`` and with
``shmloader.transport.wire.write_frame`` (the same bytes in one ``os.write``); and the CPU of one
write to a reader asleep in ``poll`` against one to a reader that is awake: what waking an idle
worker costs the process that sends it a task.
"""

from __future__ import annotations

import argparse
import os
import select
import sys
import time
from collections.abc import Callable

TASK = b"t" * 40
REPLY = b"r" * 100


def _worker(task_r: int, reply_w: int, work_s: float) -> None:
    while True:
        if not os.read(task_r, len(TASK)):
            os._exit(0)
        end = time.perf_counter() + work_s
        while time.perf_counter() < end:
            pass
        os.write(reply_w, REPLY)


def _fork_peer(body: Callable[[int, int], None]) -> tuple[int, int, int]:
    """A forked process running ``body(task_r, reply_w)``; returns (pid, task_w, reply_r)."""
    task_r, task_w = os.pipe()
    reply_r, reply_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(task_w)
        os.close(reply_r)
        body(task_r, reply_w)
        os._exit(0)
    os.close(task_r)
    os.close(reply_w)
    return pid, task_w, reply_r


def _start(n: int, work_s: float) -> tuple[list[int], list[int], list[int]]:
    pids, task_ws, reply_rs = [], [], []
    for _ in range(n):
        pid, task_w, reply_r = _fork_peer(lambda task_r, reply_w: _worker(task_r, reply_w, work_s))
        pids.append(pid)
        task_ws.append(task_w)
        reply_rs.append(reply_r)
    return pids, task_ws, reply_rs


def exchange(workers: int, prefetch: int, work_us: float, tasks: int) -> tuple[float, float]:
    """(main CPU µs per task, tasks per second) for the pipe exchange alone."""
    pids, task_ws, reply_rs = _start(workers, work_us / 1e6)
    poller = select.poll()
    for fd in reply_rs:
        poller.register(fd, select.POLLIN)
    worker_of = {fd: i for i, fd in enumerate(reply_rs)}
    arrived = [0] * workers  # replies read from each worker so far (each worker replies in order)
    sent = 0
    for t in range(min(tasks, workers * prefetch)):
        os.write(task_ws[t % workers], TASK)
        sent += 1
    c0, w0 = time.process_time(), time.perf_counter()
    for due in range(tasks):
        w, nth = due % workers, due // workers
        while arrived[w] <= nth:
            for fd, _ev in poller.poll():
                arrived[worker_of[fd]] += len(os.read(fd, 1 << 16)) // len(REPLY)
        if sent < tasks:
            os.write(task_ws[sent % workers], TASK)
            sent += 1
    cpu, wall = time.process_time() - c0, time.perf_counter() - w0
    for fd in task_ws:
        os.close(fd)
    for pid in pids:
        os.waitpid(pid, 0)
    return cpu / tasks * 1e6, tasks / wall


def ping_pong(rounds: int) -> float:
    """Main CPU µs per round trip: write, sleep in poll, be woken by the reply, read."""
    pids, task_ws, reply_rs = _start(1, 0.0)
    poller = select.poll()
    poller.register(reply_rs[0], select.POLLIN)
    c0 = time.process_time()
    for _ in range(rounds):
        os.write(task_ws[0], TASK)
        poller.poll()
        os.read(reply_rs[0], len(REPLY))
    cpu = time.process_time() - c0
    os.close(task_ws[0])
    os.waitpid(pids[0], 0)
    return cpu / rounds * 1e6


def clock_cost(n: int = 20_000) -> float:
    """CPU seconds that one pair of ``time.process_time()`` calls adds to what it brackets."""
    total = 0.0
    for _ in range(n):
        c0 = time.process_time()
        total += time.process_time() - c0
    return total / n


def wake_write(rounds: int, gap_us: float = 50.0) -> tuple[float, float]:
    """(waking, plain) µs of the writer's CPU per 40-byte ``os.write``: to a reader asleep in
    ``poll`` (it must be woken), and to a reader that spins on a non-blocking read (nobody to wake).

    Between two writes to the sleeping reader the writer waits for its acknowledgement and then
    spins ``gap_us``, so that the reader is back asleep: the case of a task sent to an idle worker,
    which is every task when the training step, not the loader, sets the pace (docs/performance.md).
    """
    results = []
    for sleeping in (True, False):
        pid, task_w, ack_r = _fork_peer(lambda task_r, ack_w: _reader(task_r, ack_w, sleeping))
        clock, total = clock_cost(), 0.0
        for _ in range(rounds):
            c0 = time.process_time()
            os.write(task_w, TASK)
            total += time.process_time() - c0
            if sleeping:
                os.read(ack_r, 1)
                end = time.perf_counter() + gap_us / 1e6
                while time.perf_counter() < end:
                    pass
        os.close(task_w)
        os.waitpid(pid, 0)
        os.close(ack_r)
        results.append(max(total / rounds - clock, 0.0) * 1e6)
    return results[0], results[1]


def _reader(task_r: int, ack_w: int, sleeping: bool) -> None:
    """``wake_write``'s reader: sleeps in ``poll`` and acknowledges each frame, or spins."""
    if not sleeping:
        os.set_blocking(task_r, False)
    poller = select.poll()
    poller.register(task_r, select.POLLIN)
    while True:
        if sleeping:
            poller.poll()
        try:
            data = os.read(task_r, 1 << 16)
        except BlockingIOError:
            continue
        if not data:
            os._exit(0)
        if sleeping:
            os.write(ack_w, b"a")


def frame_write(frames: int) -> tuple[float, float]:
    """(send_bytes, write_frame) µs of CPU per 120-byte frame, a reader process draining the pipe."""
    from multiprocessing import Pipe

    from shmloader.transport.wire import write_frame

    recv, send = Pipe(duplex=False)
    pid = os.fork()
    if pid == 0:
        send.close()
        while os.read(recv.fileno(), 1 << 20):
            pass
        os._exit(0)
    recv.close()
    payload = b"x" * 120
    fd = send.fileno()
    best = [float("inf"), float("inf")]
    for _ in range(3):
        for i, write in enumerate((send.send_bytes, lambda p: write_frame(fd, p))):
            c0 = time.process_time()
            for _ in range(frames):
                write(payload)
            best[i] = min(best[i], (time.process_time() - c0) / frames * 1e6)
    send.close()
    os.waitpid(pid, 0)
    return best[0], best[1]


def build_parser() -> argparse.ArgumentParser:
    """This script's command line (tests/test_docs_commands.py parses the docs' commands with it)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--prefetch", type=int, default=2)
    parser.add_argument("--work-us", type=float, default=40.0)
    parser.add_argument("--tasks", type=int, default=20_000)
    return parser


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    cpu, rate = exchange(args.workers, args.prefetch, args.work_us, args.tasks)
    pp = ping_pong(args.tasks)
    send_bytes, write_frame = frame_write(args.tasks)
    waking, plain = wake_write(min(args.tasks, 5_000))
    print(f"{os.cpu_count()} CPUs, python {sys.version.split()[0]}: workers={args.workers} prefetch={args.prefetch} "
          f"work={args.work_us:g} us: main CPU {cpu:.1f} us per task, {rate:,.0f} tasks/s; "
          f"ping-pong {pp:.1f} us of CPU per round trip; one frame: Connection.send_bytes {send_bytes:.2f} us, "
          f"wire.write_frame {write_frame:.2f} us; one write to a reader asleep in poll {waking:.2f} us, "
          f"to a reader awake {plain:.2f} us")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
