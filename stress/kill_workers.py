"""Kill workers at random for many epochs; every batch must still arrive exactly once, in order.

Runs a loader with ``on_worker_death='restart'`` and ``task_timeout_s`` over a shuffled dataset whose
samples are a pure function of their index, for many epochs (persistent workers), and hurts its
workers two ways:

- from outside, after a delivered batch and with probability ``--kill-rate``, the script sends a
  random live worker SIGKILL, SIGSEGV or SIGSTOP (a hang: the task deadline must kill it);
- from inside, some sample indices carry a fault that fires the first time a worker fetches them:
  ``os._exit(3)``, a real SIGSEGV (NULL dereference) or a hang (blocks forever);
- with ``--init-fail-every N``, the ``worker_init_fn`` of about one worker start in N (restarts
  included) raises: that worker's first task is answered with the error, which the script catches
  as a trainer may, and the worker serves on (the batch is the only one not delivered).

Every delivered batch is compared by checksum with the batch due; a lost, duplicated, reordered or
corrupted batch, any error from the loader, or a process or segment left after ``close()`` is a
failure. Ends with one ``PASS ...`` line (exit 0) or ``FAIL ...`` line (exit 1). Bound it with
``--seconds`` (stop at the first epoch end after that) and ``--kills`` (stop once that many worker
deaths were survived; with ``--seconds`` also given, not reaching it in time is a failure).

    python stress/kill_workers.py --seconds 600            # ten minutes
    python stress/kill_workers.py --kills 1000 --seconds 900 --method spawn
    python stress/kill_workers.py --seconds 120 --task-timeout 0   # no deadline: no hangs, no SIGSTOP

With ``--task-timeout 0`` the loader has no task deadline, so its wait sleeps on the due batch's
worker alone (docs/performance.md, "Sleeping on the due batch's worker"); nothing could end a hang
then, so none is planted or sent: deaths only.
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import tempfile
import time
from collections import Counter

import _common as c
import numpy as np

from shmloader import DataLoader
from shmloader.engine import faults

EXTERNAL = (signal.SIGKILL, signal.SIGSEGV, signal.SIGSTOP)
EXTERNAL_WEIGHTS = (0.5, 0.35, 0.15)  # a SIGSTOP costs a whole task deadline: fewer of those
# The poison rule (a task whose workers died max_task_attempts times in a row) is right to stop a
# task that this script itself kills that often: every planted fault of its batch (one per sample
# at most, each firing once) plus outside kills that keep landing on it. This run tests delivery
# under deaths, not that rule (tests/test_faults.py does): its tasks get room for all their planted
# faults and this many outside kills in a row. (With the default 3, a batch with two planted faults
# and one outside kill on it ended a 120 s fork run in PoisonTask.)
OUTSIDE_IN_A_ROW = 4


def build_parser() -> argparse.ArgumentParser:
    """This script's command line (tests/test_docs_commands.py parses the docs' commands with it)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seconds", type=float, default=60.0, help="stop at the first epoch end after this (60)")
    p.add_argument("--kills", type=int, default=0, help="stop once this many deaths were survived (0: no target)")
    p.add_argument("--method", default="fork", choices=("fork", "spawn", "forkserver"))
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--samples", type=int, default=512)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--kill-rate", type=float, default=0.3, help="chance of an outside kill after a batch")
    p.add_argument("--fault-rate", type=float, default=0.004, help="chance that a sample carries a fault")
    p.add_argument("--hang-share", type=float, default=0.1, help="share of inside faults that are hangs")
    p.add_argument("--task-timeout", type=float, default=0.25, help="task_timeout_s: how soon a hang is killed")
    p.add_argument("--start-timeout", type=float, default=2.0,
                   help="deadline of a worker's start-up (the library's floor is 30 s; a worker stopped while "
                        "starting would cost that much)")
    p.add_argument("--init-fail-every", type=int, default=0,
                   help="about one worker start in this many has its worker_init_fn raise (0: none)")
    p.add_argument("--seed", type=int, default=0)
    return p


class Run:
    """One stress run: the loader, the plan, the injections and the tallies."""

    def __init__(self, args: argparse.Namespace, marker_dir: str) -> None:
        self.args = args
        init = c.FlakyInit(1 / args.init_fail_every, args.seed, marker_dir) if args.init_fail_every > 0 else None
        self.rng = np.random.default_rng(args.seed)
        self.pick = random.Random(args.seed)
        self.sampler = c.PlannedBatches()
        self.loader: DataLoader = DataLoader(c.FaultingDataset(args.samples, marker_dir), batch_sampler=self.sampler,
                                 num_workers=args.workers, multiprocessing_context=args.method,
                                 persistent_workers=True, on_worker_death="restart", max_restarts=1_000_000,
                                 max_task_attempts=args.batch_size + OUTSIDE_IN_A_ROW,
                                 task_timeout_s=args.task_timeout, worker_init_fn=init)
        self.injected: Counter[str] = Counter()
        self.planted: Counter[str] = Counter()
        self.pending_deaths = -1  # deaths count that an outside kill is waiting to see exceeded
        self.batches = self.epochs = self.planted_inits = 0
        self.raised: Counter[str] = Counter()  # planted worker_init_fn failures the loader raised
        self.problems: list[str] = []

    def deaths(self) -> int:
        return int(self.loader.stats()["worker_deaths"])

    def epoch(self) -> None:
        a = self.args
        hang_share = a.hang_share if a.task_timeout > 0 else 0.0  # no deadline: nothing would end a hang
        plan, plain, planted = c.plan_epoch(self.rng, a.samples, a.batch_size, self.epochs, a.fault_rate,
                                            hang_share)
        self.planted.update(planted)
        self.sampler.plan = plan
        want = [c.expected_checksum(b) for b in plain]
        got: list[int | None] = []  # None: the batch whose task a planted worker_init_fn failure answered
        for batch in c.planted_as_none(iter(self.loader), self.raised):
            got.append(None if batch is None else c.checksum(batch))
            del batch  # give the slot back before hurting a worker
            self.maybe_kill()
        self.compare(want, got)
        self.batches += sum(g is not None for g in got)
        self.epochs += 1

    def maybe_kill(self) -> None:
        if self.pending_deaths >= 0 and self.deaths() <= self.pending_deaths:
            return  # one outside fault at a time: the last one has not been noticed yet
        self.pending_deaths = -1
        pids = c.worker_pids()
        if not pids or self.pick.random() >= self.args.kill_rate:
            return
        n = len(EXTERNAL) if self.args.task_timeout > 0 else len(EXTERNAL) - 1  # SIGSTOP: a hang
        sig = self.pick.choices(EXTERNAL[:n], EXTERNAL_WEIGHTS[:n])[0]
        before = self.deaths()
        try:
            os.kill(self.pick.choice(pids), sig)
        except ProcessLookupError:
            return
        self.injected[signal.Signals(sig).name] += 1
        self.pending_deaths = before

    def compare(self, want: list[int], got: list[int | None]) -> None:
        if c.fits(want, got, ordered=True):
            return
        delivered = Counter(g for g in got if g is not None)
        lost, extra = Counter(want) - delivered, delivered - Counter(want)
        first = next((k for k, (w, g) in enumerate(zip(want, got)) if g not in (None, w)), min(len(want), len(got)))
        self.problems.append(f"epoch {self.epochs}: {len(got)} batches for {len(want)}, {sum(lost.values())} lost, "
                             f"{sum(extra.values())} duplicated or corrupt, first difference at batch {first}")

    def summary(self, elapsed_s: float) -> str:
        a = self.args
        inside = ", ".join(f"{k} {v}" for k, v in sorted(self.planted.items()))
        outside = ", ".join(f"{k} {v}" for k, v in sorted(self.injected.items()))
        return (f"kill_workers: survived {self.deaths()} worker deaths ({self.loader.stats()['worker_restarts']} "
                f"restarts) over {self.epochs} epochs, {self.batches} batches delivered exactly once in order, "
                f"0 lost, 0 duplicated; outside {outside or 'none'}; planted {inside}; {a.workers} workers, "
                f"{a.method}, seed {a.seed}, {elapsed_s:.1f} s{self.init_tally()}")

    def init_tally(self) -> str:
        if not self.args.init_fail_every:
            return ""
        return f"; worker_init_fn failures raised {self.raised['init']} of {self.planted_inits} planted"


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    faults.START_TIMEOUT_FLOOR_S = args.start_timeout  # read by the main process's fault policy
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="kill_workers_") as markers:
        run = Run(args, markers)
        try:
            while not run.problems:
                run.epoch()
                if args.kills and run.deaths() >= args.kills:
                    break
                if time.monotonic() - started >= args.seconds:
                    break
        except Exception as exc:  # any loader error is a failure of the run, reported in one line
            run.loader.close()
            c.verdict(False, f"kill_workers: {type(exc).__name__} after {run.batches} batches and "
                             f"{run.deaths()} deaths: {' '.join(str(exc).split())}")
        run.loader.close()
        run.planted_inits = c.planted_init_failures(markers)  # before the markers go
        if run.raised["init"] > run.planted_inits:
            run.problems.append(f"{run.raised['init']} worker_init_fn failures raised, more than the "
                                f"{run.planted_inits} planted")
    elapsed = time.monotonic() - started
    left = c.leftovers()
    if run.problems:
        c.verdict(False, "kill_workers: " + "; ".join(run.problems))
    if left:
        c.verdict(False, "kill_workers: left behind after close(): " + ", ".join(left))
    if args.kills and run.deaths() < args.kills:
        c.verdict(False, f"kill_workers: only {run.deaths()} of {args.kills} deaths in {elapsed:.1f} s")
    c.verdict(True, run.summary(elapsed))


if __name__ == "__main__":
    main()
