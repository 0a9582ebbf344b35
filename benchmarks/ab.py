"""A/B of shmloader revisions: main-process CPU, workers' CPU and batches/s per batch, interleaved.

    python benchmarks/ab.py 05fabe7 HEAD                       # tiny, num_workers=2, 10,000 batches, 9 rounds
    python benchmarks/ab.py 05fabe7 HEAD --workload image --batches 1000 --rounds 5
    python benchmarks/ab.py 05fabe7 WORKTREE                   # WORKTREE: the checkout as it is, edits included
    python benchmarks/ab.py 60c995e WORKTREE --hotpath         # benchmarks/hotpath.py's figure instead

Each revision is checked out into a temporary git worktree (removed at the end). Every round runs
one child process per revision, the order alternating by round (A B, B A, ...), so a machine that
slowly gets busier weighs on both. A child imports shmloader from its revision only, builds a
``shmloader.DataLoader`` over the bench's cached-sample workload (``--workload``; the batch size of
``python -m shmloader bench``), reads 20 warm-up batches, then times ``--batches`` batches with a
consumer that does nothing: ``time.process_time()`` of the main process, the CPU time of its
worker processes (psutil, 10 ms ticks), and ``time.perf_counter()``. The table gives the median
over the rounds and [min-max]. This is how the figures in docs/performance.md's "measured changes"
table were taken; compare rows of one run only.

With ``--hotpath`` each child runs ``benchmarks/hotpath.py`` (of this checkout, on the revision's
package) instead: the main process's Python work per batch without the pipes, whose spread is a
fraction of a µs; its columns are net, raw and harness µs per batch (see that file).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

WORKTREE = "WORKTREE"
WARMUP = 20
_BATCH_SIZE = {"tiny": 64, "image": 64}


def _child(workload: str, num_workers: int, batches: int) -> None:
    """Runs in the child: one loader, one timed stretch; prints main-CPU, rate, workers-CPU."""
    import numpy as np
    import psutil

    import shmloader

    rng = np.random.default_rng(0)
    if workload == "tiny":
        samples = [(rng.random(16, dtype=np.float32), np.int64(i)) for i in range(8)]
    else:
        samples = [(rng.integers(0, 255, (224, 224, 3), dtype=np.uint8), np.int64(i)) for i in range(8)]

    class Cached:
        def __len__(self) -> int:
            return 10**8

        def __getitem__(self, i: int) -> tuple:
            return samples[i % len(samples)]

    loader = shmloader.DataLoader(Cached(), batch_size=_BATCH_SIZE[workload], num_workers=num_workers,
                                  persistent_workers=num_workers > 0)
    it = iter(loader)
    for _ in range(WARMUP):
        next(it)
    kids = psutil.Process().children()

    def workers_cpu() -> float:
        return sum(sum(k.cpu_times()[:2]) for k in kids)

    k0, c0, t0 = workers_cpu(), time.process_time(), time.perf_counter()
    for _ in range(batches):
        batch = next(it)
    c1, t1, k1 = time.process_time(), time.perf_counter(), workers_cpu()
    del batch, it
    if hasattr(loader, "close"):
        loader.close()
    print(f"{(c1 - c0) / batches * 1e6:.2f} {batches / (t1 - t0):.1f} {(k1 - k0) / batches * 1e6:.2f}")


def _checkout(repo: Path, rev: str, into: Path) -> Path:
    if rev == WORKTREE:
        return repo
    path = into / rev.replace("/", "_")
    subprocess.run(["git", "-C", str(repo), "worktree", "add", "--detach", "-q", str(path), rev], check=True)
    return path


def _run_child(tree: Path, args: argparse.Namespace) -> tuple[float, float, float]:
    env = dict(os.environ, PYTHONPATH=str(tree))
    if args.hotpath:
        cmd = [sys.executable, str(Path(__file__).with_name("hotpath.py")), "--batches", str(args.batches)]
    else:
        cmd = [sys.executable, __file__, "--child", args.workload, str(args.workers), str(args.batches)]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=tempfile.gettempdir(), timeout=600)
    if out.returncode:
        raise RuntimeError(f"child for {tree} failed:\n{out.stderr[-2000:]}")
    cpu, rate, workers = map(float, out.stdout.split())
    return cpu, rate, workers


def _fmt(values: list[float], unit: str = "") -> str:
    return f"{statistics.median(values):,.1f}{unit} [{min(values):,.1f}-{max(values):,.1f}]"


def main(argv: list[str]) -> int:
    if argv[:1] == ["--child"]:
        _child(argv[1], int(argv[2]), int(argv[3]))
        return 0
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("revisions", nargs="+", help=f"git revisions, or {WORKTREE} for the checkout as it is")
    parser.add_argument("--workload", choices=sorted(_BATCH_SIZE), default="tiny")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--batches", type=int, default=10_000)
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--hotpath", action="store_true", help="time benchmarks/hotpath.py (tiny, 2 workers)")
    args = parser.parse_args(argv)
    repo = Path(__file__).resolve().parent.parent
    results: dict[str, list[tuple[float, float, float]]] = {rev: [] for rev in args.revisions}
    with tempfile.TemporaryDirectory(prefix="shmloader-ab-") as tmp:
        trees = {rev: _checkout(repo, rev, Path(tmp)) for rev in args.revisions}
        try:
            for r in range(args.rounds):
                order = args.revisions if r % 2 == 0 else args.revisions[::-1]
                for rev in order:
                    results[rev].append(_run_child(trees[rev], args))
        finally:
            for rev, tree in trees.items():
                if tree != repo:
                    subprocess.run(["git", "-C", str(repo), "worktree", "remove", "--force", str(tree)], check=False)
    what = "hotpath.py: tiny, num_workers=2" if args.hotpath else f"{args.workload}, num_workers={args.workers}"
    print(f"{what}, {args.batches} batches, {args.rounds} rounds, {os.cpu_count()} CPUs, python {sys.version.split()[0]}")
    if args.hotpath:
        print("revision | main CPU per batch, net (us) | raw (us) | harness (us)")
    else:
        print("revision | main CPU per batch (us) | batches/s | workers' CPU per batch (us)")
    for rev, rows in results.items():
        cpu, rate, workers = ([row[i] for row in rows] for i in range(3))
        print(f"{rev} | {_fmt(cpu)} | {_fmt(rate)} | {_fmt(workers)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
