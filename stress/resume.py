"""Interrupt and resume every epoch many times, with dying workers; every batch exactly as uninterrupted.

The promise under test (docs/resume.md): ``load_state_dict(state)`` on a fresh loader makes the next
``iter(loader)`` deliver exactly the batches the saved run had not delivered, and later epochs carry
on as one uninterrupted loader would, whatever the number of workers on either side. This script
first runs the epochs once, uninterrupted, with a loader of the same options over the same samples
without faults, and keeps every batch.
Then it runs them again cut into pieces: each piece is a new loader, with a random number of workers
(0, 1 or 2; 1 or 2 with ``--persistent``) and random ``in_order``, that loads the state the piece
before it saved, takes a random number of batches (none at all, sometimes), saves its state and is
closed, as a preempted job is. (``persistent_workers`` is one of the options a resume keeps: a
persistent loader reuses an epoch's base seed for the next, as torch's does, and its state says so.)
Meanwhile workers die: samples planted with a fault (``os._exit``, a SIGSEGV) that fires the first
time a worker fetches them, and SIGKILLs from outside; ``on_worker_death='restart'`` must absorb all
of it. SIGPIPE has its default action, as in a command-line tool.

Samples are a pure function of their index plus an augmentation drawn from numpy's global RNG, and
``task_seeding=True``, so a batch is the same bytes whichever worker makes it, after how many
restarts. Each epoch's batches, concatenated over its pieces, must equal the uninterrupted epoch's:
the same sequence where every piece was in order, the same multiset otherwise. A lost, duplicated,
reordered or corrupted batch, any error from the loader, or a process or segment left after the
pieces is a failure. Ends with one ``PASS ...`` line (exit 0) or ``FAIL ...`` line (exit 1).

    python stress/resume.py --seconds 300
    python stress/resume.py --seconds 120 --method spawn
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import tempfile
import time
from collections import Counter
from typing import Any

import _common as c
import numpy as np

from shmloader import DataLoader, get_worker_info

FAULT_KINDS = ("exit", "segv")


class AugmentedFaulty:
    """``n`` samples: sample ``i`` plus a draw from numpy's global RNG (the augmentation a resume must
    reproduce); about one index in ``fault_every`` faults once, in a worker (a marker file says so)."""

    def __init__(self, n: int, marker_dir: str, fault_every: int) -> None:
        self.n, self.marker_dir, self.fault_every = n, marker_dir, fault_every

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> np.ndarray:
        if self.fault_every and get_worker_info() is not None and (i * 2654435761) % self.fault_every == 0:
            if c.first_time(self.marker_dir, i):
                c._fault(FAULT_KINDS[i % len(FAULT_KINDS)])
        return c.sample(i) + np.random.randint(0, 1000)


def build_parser() -> argparse.ArgumentParser:
    """This script's command line (tests/test_docs_commands.py parses the docs' commands with it)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seconds", type=float, default=60.0, help="stop at the first epoch end after this (60)")
    p.add_argument("--epochs", type=int, default=1_000_000, help="stop after this many epochs")
    p.add_argument("--method", default="fork", choices=("fork", "spawn", "forkserver"))
    p.add_argument("--samples", type=int, default=96)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--fault-every", type=int, default=40, help="about one sample in this many faults once (0: none)")
    p.add_argument("--kill-rate", type=float, default=0.05, help="chance of an outside SIGKILL after a batch")
    p.add_argument("--persistent", action="store_true", help="persistent_workers=True (pieces have 1 or 2 workers)")
    p.add_argument("--seed", type=int, default=0)
    return p


class Run:
    """One stress run: the reference epochs, the pieces, the kills and the tallies."""

    def __init__(self, args: argparse.Namespace, marker_dir: str) -> None:
        self.args = args
        self.dataset = AugmentedFaulty(args.samples, marker_dir, args.fault_every)
        self.pick = random.Random(args.seed)
        self.state: dict[str, Any] | None = None
        self.uninterrupted: DataLoader | None = None
        self.pieces = self.kills = self.batches = 0
        self.workers_seen: Counter[int] = Counter()

    def loader(self, num_workers: int, in_order: bool, dataset: AugmentedFaulty | None = None) -> DataLoader:
        extra: dict[str, Any] = {}
        if num_workers:
            extra = dict(multiprocessing_context=self.args.method, persistent_workers=self.args.persistent,
                         on_worker_death="restart", max_restarts=1_000_000, max_task_attempts=self.args.batch_size + 4)
        return DataLoader(dataset or self.dataset, batch_size=self.args.batch_size, shuffle=True,
                          generator=self.args.seed, task_seeding=True, num_workers=num_workers, in_order=in_order,
                          **extra)

    def reference(self) -> list[bytes]:
        """The next uninterrupted epoch, from one loader of the same options over samples without faults."""
        if self.uninterrupted is None:
            clean = AugmentedFaulty(self.args.samples, "", 0)
            self.uninterrupted = self.loader(1 if self.args.persistent else 0, True, clean)
        return [batch.tobytes() for batch in self.uninterrupted]

    def epoch(self) -> tuple[list[bytes], bool]:
        """One epoch in pieces; its batches, and whether every piece delivered in order."""
        got: list[bytes] = []
        ordered = True
        while True:
            done, in_order = self.piece(got)
            ordered = ordered and in_order
            if done:
                return got, ordered

    def piece(self, got: list[bytes]) -> tuple[bool, bool]:
        """A fresh loader resumes from the saved state, delivers up to a random number of batches,
        saves and is closed. True when the epoch ended in this piece."""
        num_workers = self.pick.choice((1, 2) if self.args.persistent else (0, 1, 2))
        in_order = self.pick.random() < 0.6
        loader = self.loader(num_workers, in_order)
        self.workers_seen[num_workers] += 1
        self.pieces += 1
        try:
            if self.state is not None:
                loader.load_state_dict(self.state)
            it = iter(loader)
            take = self.pick.choice((0, 1, 2, 3, 5, 8, 1000))
            done = False
            for _ in range(take):
                try:
                    batch = next(it)
                except StopIteration:
                    done = True
                    break
                got.append(batch.tobytes())
                del batch
                self.maybe_kill()
            self.state = loader.state_dict()
        finally:
            loader.close()
        return done, in_order

    def maybe_kill(self) -> None:
        pids = c.worker_pids()
        if pids and self.pick.random() < self.args.kill_rate:
            try:
                os.kill(self.pick.choice(pids), signal.SIGKILL)
                self.kills += 1
            except ProcessLookupError:
                pass


def compare(epoch: int, want: list[bytes], got: list[bytes], ordered: bool) -> str | None:
    """What is wrong with an epoch's batches, or None."""
    if Counter(got) != Counter(want):
        lost = sum((Counter(want) - Counter(got)).values())
        extra = sum((Counter(got) - Counter(want)).values())
        return f"epoch {epoch}: {len(got)} batches for {len(want)}: {lost} lost or changed, {extra} duplicated or changed"
    if ordered and got != want:
        first = next(i for i, (g, w) in enumerate(zip(got, want)) if g != w)
        return f"epoch {epoch}: every piece was in order, yet batch {first} is not the one due"
    return None


def main(argv: list[str] | None = None) -> None:
    a = build_parser().parse_args(argv)
    c.ignore_sigpipe()  # a worker's death must not kill this process through a task write
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="shml_resume_") as marker_dir:
        run = Run(a, marker_dir)
        problems: list[str] = []
        epochs = 0
        try:
            while epochs < a.epochs and (epochs == 0 or time.monotonic() - started < a.seconds):
                want = run.reference()
                got, ordered = run.epoch()
                run.batches += len(got)
                problem = compare(epochs, want, got, ordered)
                if problem:
                    problems.append(problem)
                    break
                epochs += 1
        except Exception as exc:
            problems.append(f"{type(exc).__name__} in epoch {epochs}: {' '.join(str(exc).split())[:400]}")
        finally:
            if run.uninterrupted is not None:
                run.uninterrupted.close()
        faults = len(os.listdir(marker_dir))
        left = c.leftovers()
    if left:
        problems.append("left behind: " + ", ".join(left))
    seen = "/".join(str(run.workers_seen[n]) for n in (0, 1, 2)) + (", persistent" if a.persistent else "")
    figures = (f"{epochs} epochs in {run.pieces} pieces (0/1/2 workers: {seen}), {run.batches} batches as "
               f"uninterrupted; {run.kills} outside SIGKILLs and {faults} planted faults survived; {a.method}, "
               f"seed {a.seed}, {time.monotonic() - started:.1f} s")
    c.verdict(not problems, "resume: " + ("; ".join(problems) + " -- " if problems else "") + figures)


if __name__ == "__main__":
    main()
