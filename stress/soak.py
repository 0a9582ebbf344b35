"""Soak: many epochs of a persistent loader; memory and shared-memory use must stay flat.

Runs ``--epochs`` epochs (or until ``--seconds``) of a loader with persistent workers over a dataset
of ~64 KiB samples, keeping the last couple of batches alive as a training step would. After the
warm-up epochs it records, with psutil, the RSS of the main process and of the workers and the bytes
and number of our segments in the shm directory; at the end each must be within a tolerance of that
baseline (RSS: ``--rss-slack-mib``; shm: not one byte more). Then ``close()`` must leave no process
and no segment. The shuffle order is drawn from ``--seed`` (default 0, printed with the figures).
Ends with one ``PASS ...`` line (exit 0) or ``FAIL ...`` line (exit 1).

    python stress/soak.py --seconds 3600 --epochs 1000000    # an hour
"""

from __future__ import annotations

import argparse
import collections
import os
import time
from typing import Any

import _common as c
import numpy as np

from shmloader import DataLoader

MIB = 1 << 20


class BigSamples:
    """``n`` samples of ``floats`` float64 values each, a pure function of the index."""

    def __init__(self, n: int, floats: int) -> None:
        self.n, self.floats = n, floats

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, object]:
        return {"x": np.full(self.floats, float(i)), "label": i, "name": f"sample-{i}"}


def build_parser() -> argparse.ArgumentParser:
    """This script's command line (tests/test_docs_commands.py parses the docs' commands with it)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--epochs", type=int, default=30)
    p.add_argument("--seconds", type=float, default=120.0, help="stop at the first epoch end after this")
    p.add_argument("--warmup", type=int, default=3, help="epochs before the baseline is taken")
    p.add_argument("--method", default="fork", choices=("fork", "spawn", "forkserver"))
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--samples", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--floats", type=int, default=8192, help="float64 values per sample (8192 = 64 KiB)")
    p.add_argument("--rss-slack-mib", type=float, default=24.0, help="allowed RSS growth per process group")
    p.add_argument("--seed", type=int, default=0, help="the shuffle's seed (the loader's generator=)")
    return p


def make_loader(a: argparse.Namespace) -> DataLoader:
    """The loader under soak: shuffled by ``--seed``, persistent workers (when it has any)."""
    extra: dict[str, Any] = {}
    if a.workers:
        extra = dict(multiprocessing_context=a.method, persistent_workers=True)
    return DataLoader(BigSamples(a.samples, a.floats), batch_size=a.batch_size, shuffle=True, generator=a.seed,
                      num_workers=a.workers, **extra)


def settings(a: argparse.Namespace) -> str:
    """What the figures depend on, printed with them."""
    return f"{a.workers} workers, {a.method}, seed {a.seed}"


def shm_usage(shm_dir: str) -> tuple[int, int]:
    prefix = f"shml_{os.getpid()}_"
    sizes = [os.stat(os.path.join(shm_dir, n)).st_size for n in os.listdir(shm_dir) if n.startswith(prefix)]
    return sum(sizes), len(sizes)


def measure(shm_dir: str) -> dict[str, float]:
    shm_bytes, segments = shm_usage(shm_dir)
    return {"main_mib": c.rss_bytes([os.getpid()]) / MIB, "workers_mib": c.rss_bytes(c.worker_pids()) / MIB,
            "shm_bytes": shm_bytes, "segments": segments}


def run_epoch(loader: DataLoader, n: int) -> int:
    held: collections.deque = collections.deque(maxlen=2)  # a training step keeps a batch or two alive
    count = 0
    for batch in loader:
        labels = batch["label"]
        if not np.array_equal(batch["x"][:, 0], labels.astype(np.float64)):
            raise AssertionError(f"batch {count}: content does not match its labels")
        held.append(batch)
        count += len(labels)
    if count != n:
        raise AssertionError(f"an epoch delivered {count} samples instead of {n}")
    return count


def main(argv: list[str] | None = None) -> None:
    a = build_parser().parse_args(argv)
    shm_dir = os.environ.get("SHMLOADER_SHM_DIR", "/dev/shm")
    loader = make_loader(a)
    started = time.monotonic()
    base: dict[str, float] = {}
    last: dict[str, float] = {}
    epochs = batches = 0
    try:
        while epochs < a.epochs and (epochs <= a.warmup or time.monotonic() - started < a.seconds):
            run_epoch(loader, a.samples)
            epochs += 1
            batches += len(loader)
            last = measure(shm_dir)
            if epochs == a.warmup:
                base = dict(last)
    except Exception as exc:
        loader.close()
        c.verdict(False, f"soak: {type(exc).__name__} in epoch {epochs}: {' '.join(str(exc).split())}")
    loader.close()
    elapsed = time.monotonic() - started
    if not base:
        c.verdict(False, f"soak: only {epochs} epochs, fewer than --warmup {a.warmup}; nothing to compare")
    growth = {k: last[k] - base[k] for k in base}
    figures = (f"{epochs} epochs, {batches} batches in {elapsed:.1f} s; main RSS {base['main_mib']:.1f} -> "
               f"{last['main_mib']:.1f} MiB, workers RSS {base['workers_mib']:.1f} -> {last['workers_mib']:.1f} MiB, "
               f"shm {int(base['shm_bytes'])} -> {int(last['shm_bytes'])} bytes in {int(last['segments'])} segments; "
               + settings(a))
    problems = [f"{k} grew by {growth[k]:.1f} MiB" for k in ("main_mib", "workers_mib") if growth[k] > a.rss_slack_mib]
    if growth["shm_bytes"] > 0:
        problems.append(f"shm use grew by {int(growth['shm_bytes'])} bytes")
    left = c.leftovers(shm_dir)
    if left:
        problems.append("left behind after close(): " + ", ".join(left))
    c.verdict(not problems, "soak: " + ("; ".join(problems) + " -- " if problems else "") + figures)


if __name__ == "__main__":
    main()
