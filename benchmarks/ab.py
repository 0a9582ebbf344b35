"""A/B of shmloader revisions: main-process CPU, workers' CPU and batches/s per batch, interleaved.

    python benchmarks/ab.py 05fabe7 HEAD                       # tiny, num_workers=2, 10,000 batches, 9 rounds
    python benchmarks/ab.py 05fabe7 HEAD --workload image --batches 1000 --rounds 5
    python benchmarks/ab.py 05fabe7 WORKTREE                   # WORKTREE: the checkout as it is, edits included
    python benchmarks/ab.py 60c995e WORKTREE --hotpath         # benchmarks/hotpath.py's figure instead
    python benchmarks/ab.py HEAD TORCH --consumer-us 150       # a 150 µs training step sets the pace; vs torch
    python benchmarks/ab.py HEAD --prefetch-factors 2,4,8      # one revision at several pipeline depths

Each revision is checked out into a temporary git worktree (removed at the end). Every round runs
one child process per revision, the order alternating by round (A B, B A, ...), so a machine that
slowly gets busier weighs on both. A child imports shmloader from its revision only, builds a
``shmloader.DataLoader`` over the bench's cached-sample workload (``--workload``; the batch size of
``python -m shmloader bench``), reads 20 warm-up batches, then times ``--batches`` batches with a
consumer that does nothing: ``time.process_time()`` of the main process, the CPU time of its
worker processes (psutil, 10 ms ticks), and ``time.perf_counter()``. The table gives the median
over the rounds and [min-max]. This is how the figures in docs/performance.md's "measured changes"
table were taken; compare rows of one run only. ``TORCH`` in place of a revision runs
``torch.utils.data.DataLoader`` with the same arguments in the same kind of child (torch's
``default_collate`` makes tensors of the numpy samples, as in the bench).

With ``--consumer-us N`` the consumer spins N µs after each batch, as a training step would, so
the loader is no longer what sets the pace; the main CPU column is then the time spent inside
``next()`` only (the clock calls' own cost subtracted): what the loader costs a training job.

With ``--prefetch-factors 2,4`` every revision runs once per ``prefetch_factor`` in each round (the
rows are labelled ``REV pf=N``); without it the loaders' default (2, torch's).

With ``--main-core`` each child pins its main process to CPU 0 and its workers (through
``worker_init_fn``) to the other CPUs: the main process has a core, and its caches, to itself, as
on a host with cores to spare, while the workers share what is left (on 2 CPUs, one core).

With ``--rusage`` two more columns: the main process's system CPU per batch (part of its CPU
column: the kernel's share, system calls and the sleeps and wake-ups) and its voluntary context
switches per batch (how often it slept), from ``resource.getrusage`` over the timed stretch. The
kernel splits a process's CPU into user and system time by sampling at its clock tick (a few ms),
so time a stretch of thousands of batches for this column.

With ``--hotpath`` each child runs ``benchmarks/hotpath.py`` (of this checkout, on the revision's
package) instead: the main process's Python work per batch without the pipes, whose spread is a
fraction of a µs; its columns are net, raw and harness µs per batch (see that file).
"""

from __future__ import annotations

import argparse
import functools
import importlib
import math
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

WORKTREE = "WORKTREE"
TORCH = "TORCH"  # not a revision: torch.utils.data.DataLoader in the same child, for comparison
WARMUP = 20
_BATCH_SIZE = {"tiny": 64, "image": 64}


def _child(workload: str, num_workers: int, batches: int, consumer_us: float = 0.0,
           which: str = "shmloader", prefetch_factor: int = 0, main_core: bool = False) -> None:
    """Runs in the child: one loader, one timed stretch; prints main-CPU, rate, workers-CPU.

    With ``consumer_us`` the consumer spins that long after each batch (a training step that sets
    the pace) and the main CPU printed is the part spent inside ``next()`` only. ``which``:
    ``shmloader`` (the revision on PYTHONPATH) or ``torch`` (torch's DataLoader, same arguments)."""
    import numpy as np
    import psutil

    rng = np.random.default_rng(0)
    samples: list[tuple[Any, Any]]
    if workload == "tiny":
        samples = [(rng.random(16, dtype=np.float32), np.int64(i)) for i in range(8)]
    else:
        samples = [(rng.integers(0, 255, (224, 224, 3), dtype=np.uint8), np.int64(i)) for i in range(8)]

    class Cached:
        def __len__(self) -> int:
            return 10**8

        def __getitem__(self, i: int) -> tuple:
            return samples[i % len(samples)]

    source: Any = importlib.import_module("torch.utils.data" if which == "torch" else "shmloader")
    depth: dict[str, Any] = {"prefetch_factor": prefetch_factor} if prefetch_factor else {}
    if main_core:
        others = frozenset(os.sched_getaffinity(0) - {0})
        os.sched_setaffinity(0, {0})
        depth["worker_init_fn"] = functools.partial(_to_cores, others)
    loader = source.DataLoader(Cached(), batch_size=_BATCH_SIZE[workload], num_workers=num_workers,
                               persistent_workers=num_workers > 0, **depth)
    it = iter(loader)
    for _ in range(WARMUP):
        next(it)
    kids = psutil.Process().children()

    def workers_cpu() -> float:
        return sum(sum(k.cpu_times()[:2]) for k in kids)

    if consumer_us:
        r0 = resource.getrusage(resource.RUSAGE_SELF)
        cpu, rate, workers = _paced(it, batches, consumer_us / 1e6, workers_cpu)
        r1 = resource.getrusage(resource.RUSAGE_SELF)
    else:  # psutil's reads of the workers' CPU outside the main process's own window
        k0 = workers_cpu()
        r0, c0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.process_time(), time.perf_counter()
        for _ in range(batches):
            batch = next(it)
        c1, t1, r1 = time.process_time(), time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF)
        k1 = workers_cpu()
        del batch
        cpu, rate, workers = (c1 - c0) / batches, batches / (t1 - t0), (k1 - k0) / batches
    sys_cpu, sleeps = (r1.ru_stime - r0.ru_stime) / batches, (r1.ru_nvcsw - r0.ru_nvcsw) / batches
    del it
    if hasattr(loader, "close"):
        loader.close()
    print(f"{cpu * 1e6:.2f} {rate:.1f} {workers * 1e6:.2f} {sys_cpu * 1e6:.2f} {sleeps:.3f}")


def _to_cores(cores: frozenset[int], _worker_id: int) -> None:
    """``--main-core``: a worker runs on the CPUs the main process gave up (all but CPU 0)."""
    os.sched_setaffinity(0, cores)


def _paced(it: Any, batches: int, consumer_s: float, workers_cpu: Any) -> tuple[float, float, float]:
    """(main CPU inside next() per batch, batches/s, workers' CPU per batch) with a consumer that
    spins ``consumer_s`` per batch; the cost of the clock calls around next() is subtracted."""
    from floor import clock_cost  # benchmarks/floor.py, beside this script

    clock = min(clock_cost(10_000) for _ in range(5))
    pt, pc = time.process_time, time.perf_counter
    inside = 0.0
    k0, t0 = workers_cpu(), pc()
    for _ in range(batches):
        c0 = pt()
        batch = next(it)
        inside += pt() - c0
        end = pc() + consumer_s
        while pc() < end:
            pass
        del batch
    t1, k1 = pc(), workers_cpu()
    return inside / batches - clock, batches / (t1 - t0), (k1 - k0) / batches




def _checkout(repo: Path, rev: str, into: Path) -> Path:
    if rev in (WORKTREE, TORCH):
        return repo
    path = into / rev.replace("/", "_")
    subprocess.run(["git", "-C", str(repo), "worktree", "add", "--detach", "-q", str(path), rev], check=True)
    return path


def _run_child(tree: Path, args: argparse.Namespace, which: str, prefetch_factor: int = 0) -> tuple[float, ...]:
    env = dict(os.environ, PYTHONPATH=str(tree))
    if args.hotpath:
        cmd = [sys.executable, str(Path(__file__).with_name("hotpath.py")), "--batches", str(args.batches)]
    else:
        cmd = [sys.executable, __file__, "--child", args.workload, str(args.workers), str(args.batches),
               str(args.consumer_us), which, str(prefetch_factor), str(int(args.main_core))]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=tempfile.gettempdir(), timeout=600,
                         check=False)
    if out.returncode:
        raise RuntimeError(f"child for {tree} failed:\n{out.stderr[-2000:]}")
    figures = [float(v) for v in out.stdout.split()]
    return (*figures, math.nan, math.nan)[:5]  # hotpath.py prints three


def _fmt(values: list[float], unit: str = "", digits: int = 1) -> str:
    return f"{statistics.median(values):,.{digits}f}{unit} [{min(values):,.{digits}f}-{max(values):,.{digits}f}]"


def build_parser() -> argparse.ArgumentParser:
    """This script's command line (tests/test_docs_commands.py parses the docs' commands with it)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("revisions", nargs="+", help=f"git revisions, {WORKTREE} for the checkout as it is, "
                        f"{TORCH} for torch.utils.data.DataLoader")
    parser.add_argument("--workload", choices=sorted(_BATCH_SIZE), default="tiny")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--batches", type=int, default=10_000)
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--hotpath", action="store_true", help="time benchmarks/hotpath.py (tiny, 2 workers)")
    parser.add_argument("--consumer-us", type=float, default=0.0,
                        help="the consumer spins this long per batch; main CPU is then what next() takes")
    parser.add_argument("--prefetch-factors", default="", help="comma-separated prefetch_factor values: each "
                        "revision runs at each (default: the loaders' own, 2)")
    parser.add_argument("--rusage", action="store_true", help="two more columns: the main process's system "
                        "CPU and its sleeps (voluntary context switches) per batch")
    parser.add_argument("--main-core", action="store_true", help="the main process on CPU 0, its workers on "
                        "the others (a core to itself, as on a host with cores to spare)")
    return parser


def checked_depths(parser: argparse.ArgumentParser, args: argparse.Namespace, cpus: set[int]) -> list[int]:
    """The prefetch_factor values to run (``[0]``: the loaders' default), once the options that do not
    go together, or that ``cpus`` (the CPUs this process may use) cannot serve, are refused."""
    if args.main_core and (args.hotpath or not cpus - {0} or 0 not in cpus):
        parser.error("--main-core needs CPU 0 and another CPU to run on, and is not for --hotpath")
    if args.rusage and args.hotpath:
        parser.error("--rusage is for the loaders' run, not for --hotpath")
    if args.hotpath and TORCH in args.revisions:
        parser.error(f"--hotpath times shmloader's iterator: {TORCH} has none")
    try:
        depths = [int(v) for v in args.prefetch_factors.split(",") if v] or [0]
    except ValueError:
        parser.error(f"--prefetch-factors takes integers separated by commas, got {args.prefetch_factors!r}")
    if min(depths) < (1 if args.prefetch_factors else 0) or (args.hotpath and depths != [0]):
        parser.error("--prefetch-factors takes integers >= 1, and not with --hotpath")
    return depths


def main(argv: list[str]) -> int:
    if argv[:1] == ["--child"]:
        _child(argv[1], int(argv[2]), int(argv[3]), float(argv[4]), argv[5], int(argv[6]), argv[7] == "1")
        return 0
    parser = build_parser()
    args = parser.parse_args(argv)
    depths = checked_depths(parser, args, os.sched_getaffinity(0))
    repo = Path(__file__).resolve().parent.parent
    variants = [(rev, pf) for rev in args.revisions for pf in depths]
    results: dict[tuple[str, int], list[tuple[float, ...]]] = {v: [] for v in variants}
    with tempfile.TemporaryDirectory(prefix="shmloader-ab-") as tmp:
        trees = {rev: _checkout(repo, rev, Path(tmp)) for rev in args.revisions}
        try:
            for r in range(args.rounds):
                for rev, pf in (variants if r % 2 == 0 else variants[::-1]):
                    which = "torch" if rev == TORCH else "shmloader"
                    results[rev, pf].append(_run_child(trees[rev], args, which, pf))
        finally:
            for rev, tree in trees.items():
                if tree != repo:
                    subprocess.run(["git", "-C", str(repo), "worktree", "remove", "--force", str(tree)], check=False)
    what = "hotpath.py: tiny, num_workers=2" if args.hotpath else f"{args.workload}, num_workers={args.workers}"
    if args.main_core:
        what += ", main process on CPU 0, workers on the others"
    if args.consumer_us and not args.hotpath:
        what += f", consumer {args.consumer_us:g} us per batch (main CPU: inside next())"
    print(f"{what}, {args.batches} batches, {args.rounds} rounds, {os.cpu_count()} CPUs, python {sys.version.split()[0]}")
    if args.hotpath:
        print("revision | main CPU per batch, net (us) | raw (us) | harness (us)")
    else:
        print("revision | main CPU per batch (us) | batches/s | workers' CPU per batch (us)"
              + (" | main system CPU per batch (us) | main sleeps per batch" if args.rusage else ""))
    columns = 5 if args.rusage else 3
    for (rev, pf), rows in results.items():
        label = f"{rev} pf={pf}" if pf else rev
        print(" | ".join([label, *(_fmt([row[i] for row in rows], digits=2 if i == 4 else 1) for i in range(columns))]))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
