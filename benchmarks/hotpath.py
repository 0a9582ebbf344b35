"""The main process's own Python work per batch, without the pipes: a figure steady enough to show
changes of a microsecond, which ``ab.py``'s end-to-end spread (several µs on 2 busy cores) hides.

    python benchmarks/hotpath.py                  # this checkout: tiny, num_workers=2
    python benchmarks/ab.py HEAD WORKTREE --hotpath   # interleaved A/B of revisions, this harness in each

One ``shmloader.DataLoader`` (the bench's cached-sample ``tiny`` workload, ``num_workers=2``) runs
in this process. After a warm-up with its real workers, each task frame the iterator sends is kept
instead of written, and the iterator's wait, instead of polling the pipes, answers it with the
reply frame its worker would have written: the descriptor of a warm-up batch, with the task's
epoch, number and slot. The reply is decoded (``wire.decode``) and processed (``_process``) by the
iterator's own code, so what is timed is its whole per-batch path — dispatch, sampler, ledger and
ring transitions, task encoding, reply decoding, reorder, lease, views, events — without the
system calls (poll, read, write: about 7 µs of kernel time per batch, ``getrusage``) and without
the workers, whose data in the slot is not rewritten. The harness's own work per batch (reading
the task frame, writing the reply) is timed alone and subtracted. Prints, in µs per batch, the
minimum over ``--repeats`` of ``time.process_time()`` over ``--batches`` batches: net, raw, harness.

``--workers N`` runs the loader with N workers (idle after the warm-up) and ``--poll`` adds the
wait's ``poll`` over every reply pipe and sentinel (timeout 0: nothing is waiting), so what grows
with the number of workers is in the figure.

``--evict-mib N`` writes N MiB of other memory between two batches (not timed; each batch is then
timed alone, which adds the clock's own cost to every figure), as workers writing batches through
the shared caches do to a main process that slept while they worked: the same path, run cold.
"""

from __future__ import annotations

import argparse
import pickle
import sys
import time
import warnings
from collections import deque
from typing import Any


def measure(batches: int, repeats: int, evict_mib: int = 0, workers: int = 2,
            poll: bool = False) -> tuple[float, float, float]:
    """(net, raw, harness) µs of main-process CPU per batch; see the module docstring."""
    import numpy as np

    import shmloader
    from shmloader.transport import wire
    from shmloader.transport.messages import Filled

    rng = np.random.default_rng(0)
    samples = [(rng.random(16, dtype=np.float32), np.int64(i)) for i in range(8)]

    class Cached:
        def __len__(self) -> int:
            return 10**8

        def __getitem__(self, i: int) -> tuple:
            return samples[i % len(samples)]

    with warnings.catch_warnings():  # torch's "more workers than CPUs" warning: meant, here
        warnings.simplefilter("ignore", UserWarning)
        loader: shmloader.DataLoader = shmloader.DataLoader(Cached(), batch_size=64, num_workers=workers, persistent_workers=True)
        it: Any = iter(loader)
    template = _warm_up(it, Filled)
    pending: deque[tuple[Any, bytes]] = deque()

    def reply_to(task_frame: bytes) -> bytes:
        epoch, task, _indices, slot_id, *_rest = pickle.loads(memoryview(task_frame)[1:])
        return wire.reply_frame(Filled(epoch, task, slot_id, template.payload, template.nbytes, 0.0, 0.0))

    real_wait = it._wait

    def answered_wait(started: float) -> None:  # _wait without the poll and the read
        if not pending:
            real_wait(started)  # a task sent to a real worker before the switch
            return
        poller, _by_fd = it._poller()
        if poll:
            poller.poll(0)
        it._wait_timeout(started)
        while pending:
            w, frame = pending.popleft()
            it._process(w, wire.decode(reply_to(frame)))

    for w in it._pool.workers:
        w.send_frame = lambda frame, w=w: pending.append((w, frame))
    it._wait = answered_wait
    try:
        if evict_mib:
            junk = np.zeros(evict_mib << 20, np.uint8)
            raw = min(_per_cold_batch(it, batches, junk) for _ in range(repeats))
        else:
            raw = min(_per_batch(it, batches) for _ in range(repeats))
        sample = wire.task_frame(0, 7, list(range(64)), 1, "shml_x", 1 << 20, None)
        harness = min(_per_call(reply_to, sample, batches) for _ in range(repeats))
    finally:
        del it._wait
        loader.close()
    return raw - harness, raw, harness


def _warm_up(it: Any, filled: type) -> Any:
    """Twenty batches through the real workers; returns the last ``Filled`` reply seen."""
    seen: list[Any] = []
    real_process = it._process

    def spy(w: Any, msg: Any) -> None:
        if type(msg) is filled:
            seen.append(msg)
        real_process(w, msg)

    it._process = spy
    for _ in range(20):
        next(it)
    del it._process
    return seen[-1]


def _per_batch(it: Any, batches: int) -> float:
    t0 = time.process_time()
    for _ in range(batches):
        batch = next(it)
    del batch
    return (time.process_time() - t0) / batches * 1e6


def _per_cold_batch(it: Any, batches: int, junk: Any) -> float:
    """Each batch timed alone, after ``junk`` was overwritten (the caches filled with other data)."""
    total = 0.0
    for i in range(batches):
        junk.fill(i & 0xFF)
        t0 = time.process_time()
        batch = next(it)
        total += time.process_time() - t0
        del batch
    return total / batches * 1e6


def _per_call(fn: Any, arg: Any, n: int) -> float:
    t0 = time.process_time()
    for _ in range(n):
        fn(arg)
    return (time.process_time() - t0) / n * 1e6


def build_parser() -> argparse.ArgumentParser:
    """This script's command line (tests/test_docs_commands.py parses the docs' commands with it)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", type=int, default=20_000)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--evict-mib", type=int, default=0, help="MiB written between batches (a cold run)")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--poll", action="store_true", help="include the wait's poll (timeout 0)")
    return parser


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    net, raw, harness = measure(args.batches, args.repeats, args.evict_mib, args.workers, args.poll)
    print(f"{net:.2f} {raw:.2f} {harness:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
