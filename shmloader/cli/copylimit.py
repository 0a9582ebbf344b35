"""The copy limits: how fast N processes can do a loader worker's one necessary copy and nothing else.

Owns the measurements behind the benchmark's *of copy limit* and *of ring limit* columns. A
shmloader worker must write each batch once (collation); here ``processes`` processes each stack
the workload's samples into buffers of the batch's shape (``np.stack(samples, out=buffer)`` per
field) in a loop: no dataset call, no IPC, no consumer. Their aggregate batches/s bounds what any
loader with that many workers can deliver on this machine; shmloader's rate divided by it says how
much of the machine's copy throughput reaches the training loop.

The *copy limit* reuses one buffer of private memory per process, which stays cache-resident when
a batch fits the last-level cache and which numpy asks the kernel to back with 2 MiB pages, so it
is a flattering bound. The *ring copy limit* rotates each process's writes over
:func:`ring_buffers_per_process` buffers, the share of a loader's ring slots
(:func:`shmloader.transport.preflight.ring_slots` at :data:`RING_PREFETCH_FACTOR`) that one of its
workers must write through while the consumer holds the batches before them, and places them
where slots live: segments of the shared-memory directory (``shared=True``; 4 KiB pages unless that
tmpfs is mounted with huge pages). Both are one function, :func:`measure_copy_limit`,
parametrised by ``buffers`` and ``shared``.

Runs in the benchmark's main process, which starts the processes with the benchmark's start
method, and in those processes (:func:`_stack_process`, module level so that spawn can import it).
Promises: every buffer is allocated and written once before the barrier (a shared one is unlinked
as soon as it is mapped, and the main process removes, once the processes are reaped, any segment
that a process killed in between left behind: none outlives the run); all processes start their
clocks after one barrier, and the run is timed from the earliest start to the latest end
(``time.perf_counter`` is CLOCK_MONOTONIC on Linux, one clock for every process);
:func:`measure_copy_limit` raises no Exception and leaves no process behind (each is joined, or
killed after :data:`_JOIN_TIMEOUT_S`, or at once when one fails or the main process gets a
KeyboardInterrupt, which then goes on up once they are joined; the processes ignore SIGINT,
Ctrl-C being the main process's to act on).
"""

from __future__ import annotations

import math
import multiprocessing
import signal
import time
from multiprocessing.connection import Connection
from typing import Any

import numpy as np

from shmloader.cli.interrupt import shielded
from shmloader.cli.records import CopyLimitRun
from shmloader.cli.workloads import Workload
from shmloader.config import resolve_config
from shmloader.transport.alloc import align_up
from shmloader.transport.preflight import ring_slots
from shmloader.transport.segment import Segment
from shmloader.transport.sweep import sweep_segments_of

__all__ = ["RING_PREFETCH_FACTOR", "measure_copy_limit", "ring_buffers_per_process"]

# torch's default prefetch_factor, which both of the benchmark's loaders run with.
RING_PREFETCH_FACTOR = 2

_JOIN_TIMEOUT_S = 300.0
_BARRIER_TIMEOUT_S = 120.0


def ring_buffers_per_process(processes: int) -> int:
    """Buffers each of ``processes`` workers rotates through: its share of the loader's ring slots."""
    workers = max(processes, 1)
    return math.ceil(ring_slots(workers, RING_PREFETCH_FACTOR) / workers)


def measure_copy_limit(workload: Workload, processes: int, batches: int, start_method: str,
                       round_index: int = 0, buffers: int = 1, shared: bool = False,
                       shm_dir: str | None = None) -> CopyLimitRun:  # fmt: skip
    """``batches`` batches stacked by ``processes`` processes (the count rounded up to share evenly).

    Each process rotates its writes over ``buffers`` buffers of the batch's shape: 1 for the copy
    limit, :func:`ring_buffers_per_process` for the ring copy limit; ``shared``: in segments of
    ``shm_dir`` (default: a loader's, ``SHMLOADER_SHM_DIR`` or /dev/shm), as slots are, rather
    than in private memory.
    """
    memory = "shared" if shared else "private"
    per_process = math.ceil(batches / processes)
    total = per_process * processes
    try:
        where = (shm_dir or resolve_config({}).shm_dir) if shared else None
        spans = _run_processes(workload, processes, per_process, start_method, buffers, where)
    except Exception as exc:  # reported with the copy limit; the benchmark goes on
        return CopyLimitRun(workload.name, processes, workload.batch_bytes, total, 0.0, round_index,
                            error=f"{type(exc).__name__}: {exc}", buffers_per_process=buffers,
                            memory=memory)  # fmt: skip
    seconds = max(end for _, end in spans) - min(start for start, _ in spans)
    return CopyLimitRun(workload.name, processes, workload.batch_bytes, total, seconds, round_index,
                        buffers_per_process=buffers, memory=memory)  # fmt: skip


def _run_processes(workload: Workload, processes: int, per_process: int, start_method: str, buffers: int,
                   shm_dir: str | None) -> list[tuple[float, float]]:  # fmt: skip
    ctx: Any = multiprocessing.get_context(start_method)
    barrier = ctx.Barrier(processes)
    pipes = [ctx.Pipe(duplex=False) for _ in range(processes)]
    procs = [ctx.Process(target=_stack_process, args=(workload, per_process, buffers, barrier, send, shm_dir),
                         name=f"shmloader-copy-limit-{k}", daemon=True)
             for k, (_, send) in enumerate(pipes)]  # fmt: skip
    try:
        for proc in procs:
            proc.start()
        for _, send in pipes:
            send.close()  # the children hold their ends; EOF then means a child died
        return [_receive(recv, proc) for (recv, _), proc in zip(pipes, procs)]
    except BaseException:  # a process failed, or Ctrl-C: the others' results are no use, stop them now
        with shielded():
            _kill(procs)
        raise
    finally:
        with shielded():  # a Ctrl-C now waits until every process is joined
            _reap(procs)
            for recv, _ in pipes:
                recv.close()
            if shm_dir is not None:  # a process killed between a segment's creation and its unlink
                sweep_segments_of(shm_dir, {proc.pid for proc in procs if proc.pid is not None})


def _receive(recv: Connection, proc: Any) -> tuple[float, float]:
    if not recv.poll(_JOIN_TIMEOUT_S):
        raise TimeoutError(f"copy-limit process {proc.name} sent nothing in {_JOIN_TIMEOUT_S:.0f} s")
    try:
        start, end = recv.recv()
    except EOFError:
        proc.join(5.0)
        raise RuntimeError(f"copy-limit process {proc.name} exited with code {proc.exitcode} "
                           "before reporting") from None  # fmt: skip
    return float(start), float(end)


def _reap(procs: list[Any]) -> None:
    for proc in procs:
        if proc.pid is None:  # never started
            continue
        proc.join(_JOIN_TIMEOUT_S)
        if proc.is_alive():
            proc.kill()
            proc.join()


def _kill(procs: list[Any]) -> None:
    for proc in procs:
        if proc.pid is not None and proc.is_alive():
            proc.kill()


def _stack_process(*args: Any) -> None:
    """A copy-limit process's entry: Ctrl-C is the main process's to act on (it kills this
    process), so SIGINT is ignored here; then :func:`_stack_loop`."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _stack_loop(*args)


def _stack_loop(workload: Workload, batches: int, buffers: int, barrier: Any, send: Connection,
                shm_dir: str | None = None) -> None:  # fmt: skip
    """In a copy-limit process: stack ``batches`` batches after the barrier, batch ``k`` into
    buffer ``k % buffers`` (private memory, or segments of ``shm_dir``); send (start, end)."""
    dataset = workload.dataset(1)
    samples = [dataset[i] for i in range(workload.batch_size)]
    columns = [[s[k] for s in samples] for k in range(len(workload.fields))] if len(workload.fields) > 1 \
        else [samples]  # fmt: skip
    ring = [_batch_buffer(workload) if shm_dir is None else _shared_batch_buffer(workload, shm_dir)
            for _ in range(buffers)]  # fmt: skip
    for batch in ring:
        _stack_once(columns, batch)  # every buffer's pages are faulted in before the clock starts
    barrier.wait(_BARRIER_TIMEOUT_S)
    start = time.perf_counter()
    for k in range(batches):
        _stack_once(columns, ring[k % buffers])
    send.send((start, time.perf_counter()))
    send.close()


def _batch_buffer(workload: Workload) -> list[np.ndarray]:
    """One batch's destination: an array of the batch's shape per field."""
    return [np.empty((workload.batch_size, *f.shape), dtype=f.dtype) for f in workload.fields]


def _shared_batch_buffer(workload: Workload, shm_dir: str) -> list[np.ndarray]:
    """One batch's destination in a segment of ``shm_dir``, laid out as a slot's arrays are (each at
    a 64-byte boundary). The segment is unlinked at once: its mapping lives as long as the arrays."""
    sizes = [workload.batch_size * f.nbytes for f in workload.fields]
    segment = Segment.create(shm_dir, sum(align_up(n) for n in sizes))
    segment.unlink()
    arrays: list[np.ndarray] = []
    offset = 0
    for f, n in zip(workload.fields, sizes):
        arrays.append(np.ndarray((workload.batch_size, *f.shape), dtype=f.dtype, buffer=segment.buf, offset=offset))
        offset += align_up(n)
    return arrays


def _stack_once(columns: list[list[Any]], buffers: list[np.ndarray]) -> None:
    for column, buffer in zip(columns, buffers):
        np.stack(column, out=buffer)
