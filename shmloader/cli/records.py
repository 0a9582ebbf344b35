"""The benchmark's records and the statistics drawn from them: one round, a median with its spread.

Owns what ``python -m shmloader bench`` measured (:class:`Measurement`, :class:`CopyLimitRun`,
:class:`Bandwidth`) and the pure arithmetic over repeated rounds (:class:`Spread`,
:func:`summarize_loaders`, :func:`compare_loaders`, :func:`summarize_copy_limits`). A copy limit
and a ring copy limit are the same record (:class:`CopyLimitRun`), told apart by how many buffers
each process rotated over; callers keep the two in separate sequences. Runs in the benchmark's
main process; no I/O, no clock, no torch.

Promises: every rate is derived from recorded counts and seconds, never estimated; a summary uses
only the rounds that succeeded; a ratio is a ratio of medians, shmloader divided by torch, for the
same workload and ``num_workers`` in the same run; a spread is *wide* (not to be trusted) when
``(max - min) / median`` exceeds :data:`SPREAD_LIMIT`: a loader's over its rounds' batches/s, a
ratio's over its rounds' own ratios (both loaders of a round run back to back, so a machine's
drift cancels in the ratio of the round and shows in its spread only when it is faster than that).
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

__all__ = [
    "SPREAD_LIMIT",
    "SPREAD_RULE",
    "Measurement",
    "CopyLimitRun",
    "Bandwidth",
    "Spread",
    "LoaderSummary",
    "Ratio",
    "CopyLimitSummary",
    "summarize",
    "summarize_loaders",
    "compare_loaders",
    "summarize_copy_limits",
]

SPREAD_LIMIT = 0.25
SPREAD_RULE = f"(max - min) / median of batches/s over the rounds > {SPREAD_LIMIT:.0%}"


class _Timed:
    """A timed run's two derived figures, for a record with ``batches``, ``seconds`` and ``error``."""

    __slots__ = ()
    batches: int
    seconds: float
    error: str | None

    @property
    def ok(self) -> bool:
        return self.error is None and self.seconds > 0

    @property
    def batches_per_s(self) -> float:
        return self.batches / self.seconds if self.ok else 0.0


@dataclass(frozen=True, slots=True)
class Measurement(_Timed):
    """One loader, one workload, one ``num_workers``, one round: ``batches`` timed over ``seconds``.

    ``cpu_s`` is the main process's CPU time (``time.process_time()``, all its threads) over the
    same timed batches; ``round_index`` counts from 0 and ``position`` says whether this loader
    went first (0) or second (1) in its round.
    """

    workload: str
    num_workers: int
    loader: str
    batch_size: int
    batch_bytes: int
    batches: int
    seconds: float
    first_batch_s: float
    leftover_children: int
    error: str | None = None
    cpu_s: float = 0.0
    round_index: int = 0
    position: int = 0


    @property
    def gb_per_s(self) -> float:
        return self.batches * self.batch_bytes / self.seconds / 1e9 if self.ok else 0.0

    @property
    def cpu_s_per_batch(self) -> float:
        return self.cpu_s / self.batches if self.ok else 0.0

    def to_dict(self) -> dict[str, Any]:
        record = asdict(self)
        record["batches_per_s"] = self.batches_per_s
        record["gb_per_s"] = self.gb_per_s
        record["cpu_s_per_batch"] = self.cpu_s_per_batch
        return record


@dataclass(frozen=True, slots=True)
class CopyLimitRun(_Timed):
    """One round of a copy limit: ``processes`` each stacking batches, nothing else.

    ``batches`` in all (over every process) between the first process's start and the last one's
    end, ``seconds`` apart; each process rotated its writes over ``buffers_per_process`` buffers
    (1: the copy limit; more: the ring copy limit) of ``memory``: ``private`` (the copy limit's) or
    ``shared`` (segments of the shared-memory directory, the ring copy limit's, as slots are).
    """

    workload: str
    processes: int
    batch_bytes: int
    batches: int
    seconds: float
    round_index: int = 0
    error: str | None = None
    buffers_per_process: int = 1
    memory: str = "private"


    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "batches_per_s": self.batches_per_s,
                "gb_per_s": self.batches_per_s * self.batch_bytes / 1e9}  # fmt: skip


@dataclass(frozen=True, slots=True)
class Bandwidth:
    """Host-to-device copies of ``nbytes`` from one kind of source buffer (``--device`` mode)."""

    workload: str
    source: str
    pinned: bool
    nbytes: int
    copies: int
    seconds: float

    @property
    def gb_per_s(self) -> float:
        return self.copies * self.nbytes / self.seconds / 1e9 if self.seconds > 0 else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "gb_per_s": self.gb_per_s}


@dataclass(frozen=True, slots=True)
class Spread:
    """The median of ``n`` values and their range; ``relative`` is (high - low) / median."""

    median: float
    low: float
    high: float
    n: int

    @property
    def relative(self) -> float | None:
        """None with one value (no spread was measured) or a zero median."""
        if self.n < 2 or self.median == 0:
            return None
        return (self.high - self.low) / self.median

    @property
    def wide(self) -> bool:
        """True when the spread is too wide to trust the median (see :data:`SPREAD_RULE`)."""
        relative = self.relative
        return relative is not None and relative > SPREAD_LIMIT

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "relative": self.relative, "wide": self.wide}


def summarize(values: Sequence[float]) -> Spread | None:
    """Median and range of ``values``; None when there are none."""
    if not values:
        return None
    return Spread(statistics.median(values), min(values), max(values), len(values))


@dataclass(frozen=True, slots=True)
class LoaderSummary:
    """All rounds of one loader on one workload and ``num_workers``; None fields: every round failed."""

    workload: str
    num_workers: int
    loader: str
    rounds: int
    failed_rounds: int
    batches_per_s: Spread | None
    gb_per_s: Spread | None
    first_batch_s: Spread | None
    cpu_s_per_batch: Spread | None
    copy_limit_fraction: float | None = None  # shmloader's median rate over the copy limit's
    ring_limit_fraction: float | None = None  # ... over the ring copy limit's

    @property
    def ok(self) -> bool:
        return self.batches_per_s is not None

    @property
    def wide(self) -> bool:
        return self.batches_per_s is not None and self.batches_per_s.wide

    def to_dict(self) -> dict[str, Any]:
        record: dict[str, Any] = {"workload": self.workload, "num_workers": self.num_workers,
                                  "loader": self.loader, "rounds": self.rounds,
                                  "failed_rounds": self.failed_rounds,
                                  "copy_limit_fraction": self.copy_limit_fraction,
                                  "ring_limit_fraction": self.ring_limit_fraction}  # fmt: skip
        for key in ("batches_per_s", "gb_per_s", "first_batch_s", "cpu_s_per_batch"):
            spread = getattr(self, key)
            record[key] = spread.to_dict() if spread is not None else None
        return record


@dataclass(frozen=True, slots=True)
class Ratio:
    """shmloader over torch for one workload and ``num_workers``: ratios of medians.

    ``batches_per_s_ratio`` is a rate ratio (above 1: shmloader delivers more batches per second);
    ``first_batch_ratio`` is a time ratio (below 1: shmloader's first batch arrives sooner).
    ``round_ratios`` are the rate ratios of each round where both loaders succeeded; ``wide``: their
    spread, (max - min) / median, exceeds :data:`SPREAD_LIMIT`.
    """

    workload: str
    num_workers: int
    batches_per_s_ratio: float
    first_batch_ratio: float
    round_ratios: tuple[float, ...] = ()

    @property
    def round_spread(self) -> Spread | None:
        """Median and range of the rounds' own rate ratios."""
        return summarize(self.round_ratios)

    @property
    def wide(self) -> bool:
        spread = self.round_spread
        return spread is not None and spread.wide

    def to_dict(self) -> dict[str, Any]:
        spread = self.round_spread
        return {**asdict(self), "round_ratios_spread": spread.to_dict() if spread else None,
                "wide": self.wide}  # fmt: skip


@dataclass(frozen=True, slots=True)
class CopyLimitSummary:
    """A copy limit (one or ``buffers_per_process`` buffers) of one workload over its rounds."""

    workload: str
    processes: int
    batch_bytes: int
    rounds: int
    failed_rounds: int
    batches_per_s: Spread | None
    buffers_per_process: int = 1

    def to_dict(self) -> dict[str, Any]:
        spread = self.batches_per_s
        return {"workload": self.workload, "processes": self.processes,
                "batch_bytes": self.batch_bytes, "rounds": self.rounds,
                "failed_rounds": self.failed_rounds, "buffers_per_process": self.buffers_per_process,
                "batches_per_s": spread.to_dict() if spread is not None else None}  # fmt: skip


def _spread_of(items: Iterable[Any], value: Callable[[Any], float]) -> Spread | None:
    return summarize([value(item) for item in items])


def summarize_loaders(results: Sequence[Measurement], copy_limits: Sequence[CopyLimitRun] = (),
                      ring_limits: Sequence[CopyLimitRun] = ()) -> list[LoaderSummary]:  # fmt: skip
    """One summary per (workload, num_workers, loader), in the order first measured.

    A shmloader summary carries its fraction of the copy limit, and of the ring copy limit, when
    that limit was measured for its workload with exactly ``num_workers`` processes.
    """
    limits = {s.workload: s for s in summarize_copy_limits(copy_limits)}
    rings = {s.workload: s for s in summarize_copy_limits(ring_limits)}
    groups: dict[tuple[str, int, str], list[Measurement]] = {}
    for m in results:
        groups.setdefault((m.workload, m.num_workers, m.loader), []).append(m)
    summaries = []
    for (workload, num_workers, loader), rounds in groups.items():
        ok = [m for m in rounds if m.ok]
        rate = _spread_of(ok, lambda m: m.batches_per_s)
        shm = loader == "shmloader"
        summaries.append(LoaderSummary(
            workload, num_workers, loader, len(rounds), len(rounds) - len(ok),
            batches_per_s=rate,
            gb_per_s=_spread_of(ok, lambda m: m.gb_per_s),
            first_batch_s=_spread_of(ok, lambda m: m.first_batch_s),
            cpu_s_per_batch=_spread_of(ok, lambda m: m.cpu_s_per_batch),
            copy_limit_fraction=_fraction_of(rate, limits.get(workload) if shm else None, num_workers),
            ring_limit_fraction=_fraction_of(rate, rings.get(workload) if shm else None, num_workers),
        ))  # fmt: skip
    return summaries


def _fraction_of(rate: Spread | None, limit: CopyLimitSummary | None, num_workers: int) -> float | None:
    if rate is None or limit is None or limit.batches_per_s is None or limit.processes != num_workers:
        return None
    return rate.median / limit.batches_per_s.median


def summarize_copy_limits(runs: Sequence[CopyLimitRun]) -> list[CopyLimitSummary]:
    """One summary per (workload, buffers per process), in the order first measured."""
    groups: dict[tuple[str, int], list[CopyLimitRun]] = {}
    for run in runs:
        groups.setdefault((run.workload, run.buffers_per_process), []).append(run)
    summaries = []
    for (workload, buffers), rounds in groups.items():
        ok = [r for r in rounds if r.ok]
        summaries.append(CopyLimitSummary(
            workload, rounds[0].processes, rounds[0].batch_bytes, len(rounds), len(rounds) - len(ok),
            _spread_of(ok, lambda r: r.batches_per_s), buffers,
        ))  # fmt: skip
    return summaries


def compare_loaders(results: Sequence[Measurement]) -> list[Ratio]:
    """One ratio per (workload, num_workers) where both loaders succeeded in at least one round."""
    summaries = {(s.workload, s.num_workers, s.loader): s for s in summarize_loaders(results)}
    ratios = []
    for (workload, num_workers, loader), shm in summaries.items():
        torch = summaries.get((workload, num_workers, "torch"))
        if loader != "shmloader" or torch is None:
            continue
        shm_rate, torch_rate = shm.batches_per_s, torch.batches_per_s
        shm_first, torch_first = shm.first_batch_s, torch.first_batch_s
        if shm_rate is None or torch_rate is None or shm_first is None or torch_first is None:
            continue  # every round of one of them failed: nothing to divide
        ratios.append(Ratio(
            workload, num_workers,
            batches_per_s_ratio=shm_rate.median / torch_rate.median,
            first_batch_ratio=shm_first.median / torch_first.median,
            round_ratios=_round_ratios(results, workload, num_workers),
        ))  # fmt: skip
    return ratios


def _round_ratios(results: Sequence[Measurement], workload: str, num_workers: int) -> tuple[float, ...]:
    rates: dict[tuple[int, str], float] = {
        (m.round_index, m.loader): m.batches_per_s
        for m in results
        if m.ok and m.workload == workload and m.num_workers == num_workers
    }
    rounds = sorted({r for r, _ in rates})
    return tuple(rates[(r, "shmloader")] / rates[(r, "torch")] for r in rounds
                 if (r, "shmloader") in rates and (r, "torch") in rates)  # fmt: skip
