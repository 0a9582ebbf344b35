"""Random combinations of options and faults, loader after loader; every batch exactly once.

Each *life* builds a loader with options drawn at random: map-style or ``IterableDataset``,
persistent workers or not, ``in_order``, 1 to ``--workers`` workers, ``prefetch_factor`` 1, 2 or 4, a
start method of ``--methods``, ``dispatch`` (map-style), ``task_seeding``, and how many batches the
caller holds (0 to 3, checked again when let go, the last ones after ``close()``); it runs 1 to 4
epochs, then is closed. Batches change length and size within an epoch (a burst of large ones
amid small ones), so slots grow and then follow the batches down. Faults, all under
``on_worker_death='restart'`` and ``task_timeout_s``:

- map-style only: planted faults (``os._exit``, SIGSEGV, a hang) that fire the first time a worker
  fetches a sample, outside SIGKILL/SIGSEGV/SIGSTOP after delivered batches, and a kill racing the
  epoch's reset (sent from a thread a few milliseconds around ``iter(loader)``); with
  ``--init-fail-rate``, a ``worker_init_fn`` that raises in that share of worker starts (restarts
  included) of the main map-style lives: the worker's first task is answered with the error, which
  the script catches in the place of that batch, as a trainer may, and the worker serves on;
- iterable only: a worker killed in ``__iter__`` (before it reads its stream), in any epoch;
- both: a kill of an idle worker between epochs, and one racing ``close()``; a pass left early
  by a ``break`` before the epoch's full pass; with ``--helper-rate``, a SIGKILL of one of
  multiprocessing's helpers (the resource tracker or, under forkserver, the fork server, which
  takes its workers with it) between epochs and amid an epoch;
- an epoch may be cut (``state_dict`` mid-epoch, ``close()``, a fresh loader with other options that
  ``load_state_dict``s it and finishes the epoch): the fresh loader keeps ``task_seeding`` and, for
  an iterable dataset, the worker count and ``in_order``, as a resume requires (docs/resume.md).

A share of map-style lives (``--extra-share``) also draws the flavour (``shmloader.torch``), a
``collate_fn`` returning dicts, ``batch_size=None`` with samples of varying sizes, a sampler driven
by a generator, ``drop_last``, ``timeout``, ``pin_memory`` and ``worker_init_fn``; their batches must
be a reference loader's, pass for pass. The same share of iterable lives draws the flavour,
``batch_size`` (None: the stream unbatched), ``drop_last`` (per worker, as torch), ``timeout``,
``pin_memory`` and ``worker_init_fn``; their batches, with their type and shape, must be those
torch's in-order delivery gives (stress/_combos_extra.py).

Every epoch's batches are compared by checksum with the batches due: the same sequence where every
piece was in order, the same multiset otherwise, a planted ``worker_init_fn`` failure standing in
the place of one batch (kill_workers.py's rule). A lost, duplicated, reordered or corrupted batch,
any other loader error, more ``worker_init_fn`` failures raised than planted, a ``close()`` slower
than ``--close-limit``, or a process or segment left after a life is a failure. Ends with one
``PASS ...`` line (exit 0) or ``FAIL ...`` line (exit 1).

    python stress/combos.py --seconds 300 --seed 3
    python stress/combos.py --seconds 120 --methods fork,spawn,forkserver
"""

from __future__ import annotations

import argparse
import random
import signal
import tempfile
import time
from collections import Counter, deque
from collections.abc import Callable
from typing import Any

import _combos_data as d
import _combos_extra as x
import _combos_kill as kl
import _common as c
import numpy as np

from shmloader import DataLoader
from shmloader.engine import faults, slot_size

OUTSIDE = (signal.SIGKILL, signal.SIGSEGV, signal.SIGSTOP)
OUTSIDE_WEIGHTS = (0.5, 0.35, 0.15)


def build_parser() -> argparse.ArgumentParser:
    """This script's command line (tests/test_docs_commands.py parses the docs' commands with it)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seconds", type=float, default=60.0, help="stop at the first life end after this (60)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--methods", default="fork", help="start methods to draw from, comma-separated (fork)")
    p.add_argument("--workers", type=int, default=2, help="at most this many workers (2)")
    p.add_argument("--samples", type=int, default=384)
    p.add_argument("--batch-size", type=int, default=8, help="batches are 1 to twice this long (8)")
    p.add_argument("--kill-rate", type=float, default=0.15, help="chance of an outside kill after a batch")
    p.add_argument("--fault-rate", type=float, default=0.004, help="chance that a map sample carries a fault")
    p.add_argument("--hang-share", type=float, default=0.1)
    p.add_argument("--event-rate", type=float, default=0.3,
                   help="chance of each of: a kill at the reset, between epochs, during close(); a cut epoch")
    p.add_argument("--iterable-share", type=float, default=0.35)
    p.add_argument("--extra-share", type=float, default=0.2,
                   help="share of lives drawing the other options too (stress/_combos_extra.py)")
    p.add_argument("--die-every", type=int, default=6, help="about one iterable worker in this many dies in __iter__")
    p.add_argument("--task-timeout", type=float, default=0.25)
    p.add_argument("--start-timeout", type=float, default=2.0,
                   help="deadline of a worker's start-up under fork, at least 10 s under spawn/forkserver, "
                         "30 s with torch (the library's floor is 30 s; see kill_workers.py)")
    p.add_argument("--helper-rate", type=float, default=0.0,
                   help="chance per epoch of each of: a SIGKILL of the resource tracker or fork server "
                        "between epochs, and one amid the epoch")
    p.add_argument("--init-fail-rate", type=float, default=0.0,
                   help="chance that a worker start's worker_init_fn raises, in main map-style lives (0: none)")
    p.add_argument("--verbose", action="store_true", help="a line per epoch: its options, time and kills")
    p.add_argument("--close-limit", type=float, default=20.0, help="seconds a close() may take")
    return p


class Run:
    """The whole run: lives, epochs, pieces, faults and tallies."""

    def __init__(self, a: argparse.Namespace, markers: str) -> None:
        self.a, self.markers = a, markers
        self.rng = np.random.default_rng(a.seed)
        self.pick = random.Random(a.seed)
        self.sent: Counter[str] = Counter()
        self.killer = kl.Killer(self.pick, self.sent)
        self.planted: Counter[str] = Counter()
        self.events: Counter[str] = Counter()
        self.lives = self.epochs = self.batches = self.deaths = 0
        self.problems: list[str] = []
        self.pending = -1
        self.slowest_close = 0.0
        self.keep = 0
        self.held: deque[tuple[Any, int]] = deque()
        self.sum: Callable[[Any], int] = c.checksum  # the checksum of a batch, in this life
        self.ref: Any = None  # an extra life's reference loader
        self.helpers: set[int] = set()  # pids of the helpers killed (zombies until CPython reaps them)
        self.init = c.FlakyInit(a.init_fail_rate, a.seed, markers) if a.init_fail_rate > 0 else None
        self.raised: Counter[str] = Counter()  # planted worker_init_fn failures the loader raised
        self.planted_inits = 0  # counted as the run ends

    def chance(self, p: float) -> bool:
        return self.pick.random() < p

    def options(self, iterable: bool) -> dict[str, Any]:
        a = self.a
        extra: dict[str, Any] = {}
        if self.chance(a.extra_share):
            extra = x.draw_stream(self.pick, a.batch_size) if iterable else x.draw(self.pick, a.samples, a.batch_size)
        return extra | dict(num_workers=self.pick.randint(1, a.workers), in_order=self.chance(0.6),
                    persistent_workers=self.chance(0.5), prefetch_factor=self.pick.choice((1, 2, 4)),
                    multiprocessing_context=self.pick.choice(a.methods.split(",")), iterable=iterable,
                    dispatch="round_robin" if iterable or self.chance(0.5) else "least_loaded",
                    task_seeding=self.chance(0.5))

    def build(self, o: dict[str, Any], sampler: c.PlannedBatches) -> DataLoader:
        a = self.a
        x.fit(o)
        common = dict(num_workers=o["num_workers"], in_order=o["in_order"], prefetch_factor=o["prefetch_factor"],
                      persistent_workers=o["persistent_workers"], multiprocessing_context=o["multiprocessing_context"],
                      on_worker_death="restart", max_restarts=1_000_000, task_timeout_s=a.task_timeout,
                      dispatch=o["dispatch"], task_seeding=o["task_seeding"])
        faults.START_TIMEOUT_FLOOR_S = start_deadline(a.start_timeout, o)
        if o.get("stream"):
            return x.build_stream(o, common, a.samples, self.markers, a.die_every)
        if o.get("extra"):
            return x.build(o, common)
        if o["iterable"]:  # a restarted worker dies in __iter__ again one time in die_every: room for a run of them
            return DataLoader(d.SizedStream(a.samples, a.batch_size, self.markers, a.die_every),
                              batch_size=a.batch_size, max_task_attempts=8, **common)
        return DataLoader(d.SizedFaulting(a.samples, self.markers), batch_sampler=sampler,
                          max_task_attempts=2 * a.batch_size + 4, worker_init_fn=self.init, **common)

    def life(self) -> None:
        o = self.options(self.chance(self.a.iterable_share))
        sampler = c.PlannedBatches()
        self.sum, self.ref = c.checksum, None
        if o.get("stream"):
            self.sum = x.typed_checksum
        elif o.get("extra"):
            self.sum, self.ref = x.tree_checksum, x.reference(o)
        self.events.update(x.tally(o))
        self.keep = self.pick.randint(0, 3)  # batches the caller holds; they outlive close() too
        loader = self.build(o, sampler)
        try:
            for _ in range(self.pick.randint(1, 4)):
                loader = self.epoch(loader, o, sampler)
                if self.problems:
                    return
                if self.chance(self.a.event_rate):
                    self.events["between epochs"] += 1
                    self.killer.send(OUTSIDE[:2], OUTSIDE_WEIGHTS[:2])
                if self.a.helper_rate and self.chance(self.a.helper_rate):
                    self.kill_helper(o, "between epochs")
        finally:
            self.close(loader)
            while self.held:
                self.check_held(*self.held.popleft())
        self.lives += 1
        left = c.leftovers(helpers=frozenset(kl.helper_zombies(self.helpers)))
        if left:
            self.problems.append(f"life {self.lives}: left behind after close(): " + ", ".join(left))

    def epoch(self, loader: DataLoader, o: dict[str, Any], sampler: c.PlannedBatches) -> DataLoader:
        """One epoch, perhaps in two pieces; returns the loader that finished it."""
        a = self.a
        if o.get("stream"):
            want = x.stream_pass(o, a.samples, o["num_workers"])
        elif o.get("extra"):
            want = x.next_pass(self.ref)
        elif o["iterable"]:
            plan = d.stream_batches(a.samples, a.batch_size, o["num_workers"])
            want = [d.expected_checksum(b, d.stream_level(b[0], a.batch_size * o["num_workers"])) for b in plan]
        else:
            hang_share = a.hang_share if a.task_timeout > 0 else 0.0  # no deadline: nothing would end a hang
            plan, want, planted = d.plan_map_epoch(self.rng, a.samples, a.batch_size, self.epochs, a.fault_rate,
                                                   hang_share)
            sampler.plan = plan
            self.planted.update(planted)
        started = time.monotonic()
        if self.chance(a.event_rate / 2) and x.may_abandon(o):
            self.abandon(loader, o, want)
            want = x.next_pass(self.ref) if self.ref is not None else want
        cuttable = o["in_order"] or not o["iterable"]  # a stream delivered out of order cannot resume
        cut = self.pick.randint(0, len(want)) if cuttable and self.chance(a.event_rate) else -1
        got: list[int | None] = []  # None: a batch whose task a planted worker_init_fn failure answered
        ordered = o["in_order"]
        self.run_piece(loader, o, got, cut)
        if cut >= 0:
            self.events["cut epochs"] += 1
            state = loader.state_dict()
            self.close(loader)
            kept = ("task_seeding", "num_workers", "in_order") if o["iterable"] else ("task_seeding",)
            o.update({k: v for k, v in self.options(o["iterable"]).items() if k not in x.KEPT} | {k: o[k] for k in kept})  # what a resume must keep
            loader = self.build(o, sampler)
            loader.load_state_dict(state)
            ordered = ordered and o["in_order"]
            self.run_piece(loader, o, got, -1)
        self.compare(want, got, ordered)
        if a.verbose:
            print(f"epoch {self.epochs}: {time.monotonic() - started:.2f} s, cut at {cut}, {o}, "
                  f"deaths {loader.stats()['worker_deaths']}, sent {dict(self.sent)}", flush=True)
        self.epochs += 1
        self.batches += sum(g is not None for g in got)
        return loader

    def abandon(self, loader: DataLoader, o: dict[str, Any], want: list[int]) -> None:
        """Break out of a pass over the epoch after a random number of batches (the loop's own
        ``break``), as a trainer leaving an epoch early; the next ``iter()`` starts it afresh."""
        self.events["abandoned epochs"] += 1
        got: list[int | None] = []
        self.run_piece(loader, o, got, self.pick.randint(0, len(want) - 1))
        if not c.fits(want, got, o["in_order"], whole=False):
            self.problems.append(f"life {self.lives} epoch {self.epochs}: the abandoned pass's {len(got)} batches "
                                 f"are not batches due ({'in order' if o['in_order'] else 'any order'})")

    def run_piece(self, loader: DataLoader, o: dict[str, Any], got: list[int | None], stop_at: int) -> None:
        """Iterate ``loader`` into ``got`` until its epoch ends or ``got`` holds ``stop_at`` batches."""
        if not o["iterable"] and self.chance(self.a.event_rate):
            self.events["kills at the reset"] += 1
            self.killer.send(OUTSIDE[:2], OUTSIDE_WEIGHTS[:2], self.pick.uniform(0.0, 0.004), snapshot_late=True)
        begun = time.monotonic()
        it = iter(loader)
        if self.a.verbose and time.monotonic() - begun > 1.0:
            print(f"  iter() took {time.monotonic() - begun:.1f} s; sent {dict(self.sent)}", flush=True)
        self.pending = -1
        helper_at = -1
        if self.a.helper_rate and self.chance(self.a.helper_rate):
            helper_at = len(got) + self.pick.randint(1, 16)
        if len(got) == stop_at:
            return
        last = time.monotonic()
        for batch in c.planted_as_none(it, self.raised):
            if self.a.verbose and time.monotonic() - last > 1.0:
                print(f"  batch {len(got)} took {time.monotonic() - last:.1f} s; sent {dict(self.sent)}", flush=True)
            checksum = None if batch is None else self.sum(batch)
            got.append(checksum)
            if checksum is not None:
                self.hold(batch, checksum)
            del batch
            if len(got) == helper_at:  # not an iterable life's fork server: its workers' streams would die
                self.kill_helper(o, "amid an epoch", fork_server=not o["iterable"])
            if not o["iterable"]:
                self.maybe_kill(loader)
            if len(got) == stop_at:
                break
            last = time.monotonic()
        self.killer.join()

    def hold(self, batch: Any, checksum: int) -> None:
        """Keep the last ``held`` batches alive, as a training step may; each must still hold its bytes
        when it is let go (its slot was not written again meanwhile)."""
        self.held.append((batch, checksum))
        while len(self.held) > self.keep:
            self.check_held(*self.held.popleft())

    def check_held(self, batch: Any, checksum: int) -> None:
        if self.sum(batch) != checksum:
            self.problems.append(f"life {self.lives}: a batch held by the caller changed under it")

    def maybe_kill(self, loader: DataLoader) -> None:
        deaths = int(loader.stats()["worker_deaths"])
        if self.pending >= 0 and deaths <= self.pending:
            return  # one outside fault at a time: the last one has not been noticed yet
        self.pending = -1
        if self.chance(self.a.kill_rate):
            n = 3 if self.a.task_timeout > 0 else 2
            self.killer.send(OUTSIDE[:n], OUTSIDE_WEIGHTS[:n])
            self.pending = deaths

    def kill_helper(self, o: dict[str, Any], when: str, fork_server: bool = True) -> None:
        """SIGKILL the resource tracker or (under forkserver, ``fork_server``) the fork server, and count it."""
        killed = kl.kill_helper(self.pick, fork_server and o["multiprocessing_context"] == "forkserver")
        if killed is not None:
            self.events[f"{killed[0]} killed {when}"] += 1
            self.helpers.add(killed[1])

    def close(self, loader: DataLoader) -> None:
        self.deaths += int(loader.stats()["worker_deaths"])
        if self.chance(self.a.event_rate):
            self.events["kills during close()"] += 1
            self.killer.send(OUTSIDE, (0.5, 0.4, 0.1), self.pick.uniform(0.0, 0.003))
        started = time.monotonic()
        loader.close()
        took = time.monotonic() - started
        self.killer.join()
        self.slowest_close = max(self.slowest_close, took)
        if took > 1.0:
            print(f"life {self.lives}: close() took {took:.1f} s", flush=True)
        if took > self.a.close_limit:
            self.problems.append(f"life {self.lives}: close() took {took:.1f} s")

    def compare(self, want: list[int], got: list[int | None], ordered: bool) -> None:
        if c.fits(want, got, ordered):
            return
        delivered = Counter(g for g in got if g is not None)
        lost, extra = Counter(want) - delivered, delivered - Counter(want)
        first = next((k for k, (w, g) in enumerate(zip(want, got)) if g not in (None, w)), min(len(want), len(got)))
        self.problems.append(f"life {self.lives} epoch {self.epochs}: {len(got)} batches for {len(want)}, "
                             f"{sum(lost.values())} lost, {sum(extra.values())} duplicated or corrupt, "
                             f"{'in order' if ordered else 'any order'}, first difference at batch {first}")

    def summary(self, elapsed_s: float) -> str:
        def tally(counter: Counter[str]) -> str:
            return ", ".join(f"{k} {v}" for k, v in sorted(counter.items())) or "none"
        return (f"combos: {self.lives} loaders, {self.epochs} epochs, {self.batches} batches exactly once; "
                f"{self.deaths} worker deaths survived; outside {tally(self.sent)}; planted {tally(self.planted)}; "
                f"events {tally(self.events)}; slowest close() {self.slowest_close:.1f} s; "
                f"methods {self.a.methods}, seed {self.a.seed}, {elapsed_s:.1f} s{self.init_tally()}")

    def init_tally(self) -> str:
        if not self.a.init_fail_rate:
            return ""
        return f"; worker_init_fn failures raised {self.raised['init']} of {self.planted_inits} planted"


def count_slot_sizes(events: Counter[str]) -> None:
    """Tally, in ``events``, each slot growth and each drop of the size tasks ask (main process)."""
    grew, end = slot_size.SlotSize.grew_to, slot_size.SlotSize._end_block

    def grew_to(self: slot_size.SlotSize, size: int, needed: int) -> None:
        events["slot growths"] += 1
        grew(self, size, needed)

    def end_block(self: slot_size.SlotSize) -> None:
        before = self.bytes
        end(self)
        events["slot size drops"] += self.bytes < before

    slot_size.SlotSize.grew_to = grew_to  # type: ignore[method-assign]
    slot_size.SlotSize._end_block = end_block  # type: ignore[method-assign]


def start_deadline(asked: float, o: dict[str, Any]) -> float:
    """A life's worker start-up deadline: ``--start-timeout`` under fork. A spawn or forkserver
    worker imports numpy and shmloader as it starts (a torch-flavour one torch too): seconds each
    on a loaded 2-core machine, where 2 s killed every replacement in turn until the epoch timed
    out, so those get at least 10 s (30 s with torch). A hung start is still killed in every life."""
    if o.get("torch"):
        return max(asked, 30.0)
    return asked if o["multiprocessing_context"] == "fork" else max(asked, 10.0)


def main(argv: list[str] | None = None) -> None:
    a = build_parser().parse_args(argv)
    c.ignore_sigpipe()
    faults.START_TIMEOUT_FLOOR_S = a.start_timeout  # read by the main process's fault policy
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="combos_") as markers:
        run = Run(a, markers)
        count_slot_sizes(run.events)
        try:
            while not run.problems and (run.lives == 0 or time.monotonic() - started < a.seconds):
                run.life()
        except Exception as exc:  # any loader error is a failure of the run, reported in one line
            run.problems.append(f"{type(exc).__name__} in life {run.lives} epoch {run.epochs}: "
                                f"{' '.join(str(exc).split())[:600]}")
        left = c.leftovers(helpers=frozenset(kl.helper_zombies(run.helpers)))
        run.planted_inits = c.planted_init_failures(markers)  # before the markers go
    if run.raised["init"] > run.planted_inits:
        run.problems.append(f"{run.raised['init']} worker_init_fn failures raised, more than the "
                            f"{run.planted_inits} planted")
    if left:
        run.problems.append("left behind: " + ", ".join(left))
    text = run.summary(time.monotonic() - started)
    c.verdict(not run.problems, "; ".join(run.problems) + " -- " + text if run.problems else text)


if __name__ == "__main__":
    main()
