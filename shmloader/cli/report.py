"""What the benchmark reports: the header, the text tables and the JSON document.

Owns the shape of ``python -m shmloader bench`` output. Runs in the benchmark's main process.
Promises: the JSON document (:func:`to_json_document`) has the keys ``header``, ``results`` (one
record per loader per round), ``summaries`` (medians and ranges per loader), ``ratios`` (ratios of
medians, shmloader over torch, with each round's rate ratio), ``copy_limit`` (its rounds and
summaries: one buffer per process), ``ring_copy_limit`` (the same, each process rotating over its
share of a loader's ring slots, with the prefetch factor that share assumes) and ``h2d``; a
shmloader summary has ``copy_limit_fraction`` and ``ring_limit_fraction``. The text table labels
each ratio with its direction (a rate ratio: higher is better; a time ratio: lower is better) and
marks with ``!`` every figure whose spread is too wide to trust
(:data:`shmloader.cli.records.SPREAD_RULE`), with a footnote. Neither matplotlib nor torch is
imported here.
"""

from __future__ import annotations

import os
import platform
import sys
from collections.abc import Sequence
from typing import Any

import numpy as np

from shmloader.cli.copylimit import RING_PREFETCH_FACTOR
from shmloader.cli.records import (
    SPREAD_LIMIT,
    SPREAD_RULE,
    Bandwidth,
    CopyLimitRun,
    CopyLimitSummary,
    LoaderSummary,
    Measurement,
    Ratio,
    Spread,
    compare_loaders,
    summarize_copy_limits,
    summarize_loaders,
)

__all__ = [
    "collect_header",
    "format_header",
    "format_results",
    "format_copy_limits",
    "format_bandwidth",
    "format_table",
    "to_json_document",
    "WIDE_MARK",
]

WIDE_MARK = "!"


def collect_header(start_method: str, device: str, extra: dict[str, Any]) -> dict[str, Any]:
    """The facts that a figure depends on: cores, versions, start method, device."""
    return {
        "cpu_count": os.cpu_count(),
        "affinity_cpus": _affinity_cpus(),
        "load_avg_1m": _load_average(),
        "python": platform.python_version(),
        "platform": platform.platform(terse=True),
        "numpy": np.__version__,
        "torch": _module_version("torch"),
        "shmloader": _shmloader_version(),
        "start_method": start_method,
        "device": device,
        **extra,
    }


def _affinity_cpus() -> int | None:
    getter = getattr(os, "sched_getaffinity", None)
    return len(getter(0)) if getter is not None else None


def _load_average() -> float | None:
    """Other work on the machine skews every figure; a reader should see that it was there."""
    return round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None


def _module_version(name: str) -> str | None:
    module = sys.modules.get(name)
    return getattr(module, "__version__", None) if module is not None else None


def _shmloader_version() -> str:
    try:
        from importlib.metadata import version

        return version("shmloader")
    except Exception:  # not installed as a distribution (a source checkout)
        import shmloader

        return str(getattr(shmloader, "__version__", "unknown"))


def format_header(header: dict[str, Any], title: str = "shmloader bench") -> str:
    """The header's facts as text: the basic ones on two lines, then one line per extra key."""
    cpus = f"{header['cpu_count']} (usable: {header['affinity_cpus']})"
    lines = [
        f"{title}: cpus {cpus}, load average {header['load_avg_1m']}, "
        f"start method {header['start_method']}, device {header['device']}",
        f"  python {header['python']}, numpy {header['numpy']}, torch {header['torch']}, "
        f"shmloader {header['shmloader']}, {header['platform']}",
    ]
    for key in sorted(set(header) - _BASIC_HEADER_KEYS):
        lines.append(f"  {key}: {header[key]}")
    return "\n".join(lines)


_BASIC_HEADER_KEYS = {
    "cpu_count", "affinity_cpus", "load_avg_1m", "python", "platform", "numpy", "torch", "shmloader",
    "start_method", "device",
}  # fmt: skip

# Two header lines per column: what it is, then its unit or its direction.
_RESULT_COLUMNS = (
    ("workload", ""), ("workers", ""), ("loader", ""),
    ("batches/s", "(median)"), ("batches/s", "(min-max)"), ("spread", "(max-min)/med"),
    ("GB/s", "(median)"), ("first batch", "(median)"), ("main CPU", "per batch"),
    ("rate ratio (rounds' min-max)", "(higher=better)"), ("first-batch time ratio", "(lower=better)"),
    ("of copy limit", "(rate/limit)"), ("of ring limit", "(rate/limit)"),
)  # fmt: skip


def format_results(results: Sequence[Measurement], copy_limits: Sequence[CopyLimitRun] = (),
                   ring_limits: Sequence[CopyLimitRun] = ()) -> str:  # fmt: skip
    """The main table (one row per loader: medians over the rounds), its footnotes, its problems."""
    ratios = {(r.workload, r.num_workers): r for r in compare_loaders(results)}
    rows = [_summary_row(s, ratios.get((s.workload, s.num_workers)) if s.loader == "shmloader" else None)
            for s in summarize_loaders(results, copy_limits, ring_limits)]  # fmt: skip
    rounds = max((m.round_index + 1 for m in results), default=0)
    notes = _footnotes(rounds, any(WIDE_MARK in cell for row in rows for cell in row),
                       ratios=bool(ratios), limits=bool(copy_limits), rings=bool(ring_limits))  # fmt: skip
    columns, rows = _drop_empty_columns(_RESULT_COLUMNS, rows, first=_FIRST_OPTIONAL_COLUMN)
    return format_table(columns, rows, left=3) + "\n" + notes + _problems(results)


_FIRST_OPTIONAL_COLUMN = 9  # the ratios and the copy limit: empty when torch or the limit is not measured


def _drop_empty_columns(columns: Sequence[tuple[str, ...]], rows: list[tuple[str, ...]],
                        first: int) -> tuple[list[tuple[str, ...]], list[tuple[str, ...]]]:  # fmt: skip
    keep = [i for i in range(len(columns)) if i < first or any(row[i] for row in rows)]
    return [columns[i] for i in keep], [tuple(row[i] for i in keep) for row in rows]


def _summary_row(s: LoaderSummary, ratio: Ratio | None) -> tuple[str, ...]:
    head = (s.workload, str(s.num_workers), s.loader)
    if s.batches_per_s is None or s.gb_per_s is None or s.first_batch_s is None \
            or s.cpu_s_per_batch is None:  # fmt: skip
        return head + ("failed",) + ("-",) * (len(_RESULT_COLUMNS) - 4)
    rate = s.batches_per_s
    failed = f" ({s.failed_rounds} failed)" if s.failed_rounds else ""
    return head + (
        f"{rate.median:,.1f}",
        f"{rate.low:,.1f}-{rate.high:,.1f}" if rate.n > 1 else "-",
        format_spread(rate) + failed,
        f"{s.gb_per_s.median:.3f}",
        format_seconds(s.first_batch_s.median),
        format_seconds(s.cpu_s_per_batch.median),
        _rate_ratio_cell(ratio) if ratio else "",
        f"{ratio.first_batch_ratio:.2f}x" if ratio else "",
        _percent(s.copy_limit_fraction),
        _percent(s.ring_limit_fraction),
    )


def _percent(fraction: float | None) -> str:
    return f"{fraction:.0%}" if fraction is not None else ""


def format_spread(spread: Spread) -> str:
    """``12%``, ``48% !`` when too wide to trust, ``-`` when one round measured no spread."""
    relative = spread.relative
    if relative is None:
        return "-"
    return f"{relative:.0%}" + (f" {WIDE_MARK}" if spread.wide else "")


def _rate_ratio_cell(ratio: Ratio) -> str:
    """``5.43x (5.06-5.67)``: the ratio of medians, then the range of the rounds' own ratios."""
    spread = ratio.round_spread
    text = f"{ratio.batches_per_s_ratio:.2f}x"
    if spread is not None and spread.n > 1:
        text += f" ({spread.low:.2f}-{spread.high:.2f})"
    return text + (f" {WIDE_MARK}" if ratio.wide else "")


def _footnotes(rounds: int, any_wide: bool, ratios: bool, limits: bool, rings: bool = False) -> str:
    lines = [f"Figures are medians of {rounds} round(s), the loaders' order alternating by round."]
    if ratios:
        lines.append("Ratios are shmloader / torch, ratios of medians. rate ratio: batches/s "
                     "(higher=better), in brackets the lowest and highest of the rounds' own ratios; "
                     "first-batch time ratio: seconds to the first batch (lower=better).")  # fmt: skip
    lines.append("main CPU per batch: time.process_time() of the benchmark's own process (all its "
                 "threads, page touching included) over the timed batches.")  # fmt: skip
    if limits:
        lines.append("of copy limit: shmloader's median batches/s over the copy limit's, on rows "
                     "whose workers equal the copy limit's processes (table below).")  # fmt: skip
    if rings:
        lines.append("of ring limit: the same over the ring copy limit's, whose processes rotate "
                     "over their share of a loader's ring slots (table below).")  # fmt: skip
    if rounds == 1:
        lines.append("One round: no spread was measured (use --repeat 3 or more).")
    if any_wide:
        lines.append(f"{WIDE_MARK} spread too wide to trust ({SPREAD_RULE}; for a rate ratio, of "
                     "the rounds' own ratios): rerun on a quieter machine or with a larger --repeat.")  # fmt: skip
    return "\n".join(lines)


def _problems(results: Sequence[Measurement]) -> str:
    lines = [f"  {m.workload}/{m.num_workers}/{m.loader} round {m.round_index + 1}: {m.error}"
             for m in results if m.error]  # fmt: skip
    lines += [f"  {m.workload}/{m.num_workers}/{m.loader} round {m.round_index + 1}: "
              f"{m.leftover_children} child process(es) left after release"
              for m in results if m.leftover_children]  # fmt: skip
    return "\nproblems:\n" + "\n".join(lines) if lines else ""


def format_copy_limits(runs: Sequence[CopyLimitRun], ring_runs: Sequence[CopyLimitRun] = ()) -> str:
    """The copy limits' table: per workload, a row for the copy limit then one for the ring copy
    limit (each with its buffers per process), medians over the rounds; then their failures."""
    columns = (("workload", ""), ("limit", ""), ("processes", ""), ("buffers", "per process"),
               ("batches/s", "(median)"), ("batches/s", "(min-max)"), ("spread", "(max-min)/med"),
               ("GB/s", "(median)"))  # fmt: skip
    labelled = [("copy", s) for s in summarize_copy_limits(runs)] + \
        [("ring", s) for s in summarize_copy_limits(ring_runs)]  # fmt: skip
    workloads = dict.fromkeys(s.workload for _, s in labelled)  # in the order first measured
    rows = [_limit_row(label, s) for w in workloads for label, s in labelled if s.workload == w]
    errors = [f"  {r.workload} {label} limit round {r.round_index + 1}: {r.error}"
              for label, group in (("copy", runs), ("ring", ring_runs)) for r in group if r.error]  # fmt: skip
    title = ("copy limit: np.stack(samples, out=buffer) into buffers of the batch's shape, in N "
             "processes doing nothing else (no IPC, no consumer):\n"
             "  copy: one reused buffer per process (cache-resident when a batch fits the cache);\n"
             f"  ring: each rotates over ceil(ring_slots(N, prefetch_factor={RING_PREFETCH_FACTOR}) / N) "
             "buffers, its share of the slots a loader of N workers writes through,\n"
             "        in segments of the shared-memory directory, as slots are (copy: private memory).")  # fmt: skip
    return title + "\n" + format_table(columns, rows, left=2) + (
        "\nproblems:\n" + "\n".join(errors) if errors else "")


def _limit_row(label: str, s: CopyLimitSummary) -> tuple[str, ...]:
    head = (s.workload, label, str(s.processes), str(s.buffers_per_process))
    rate = s.batches_per_s
    if rate is None:
        return head + ("failed", "-", "-", "-")
    return head + (f"{rate.median:,.1f}", f"{rate.low:,.1f}-{rate.high:,.1f}" if rate.n > 1 else "-",
                   format_spread(rate), f"{rate.median * s.batch_bytes / 1e9:.3f}")  # fmt: skip


def format_bandwidth(h2d: Sequence[Bandwidth]) -> str:
    columns = (("workload", ""), ("bytes", ""), ("source", ""), ("pinned", ""), ("copies", ""),
               ("GB/s", ""))  # fmt: skip
    rows = [(b.workload, f"{b.nbytes:,}", b.source, "yes" if b.pinned else "no", str(b.copies),
             f"{b.gb_per_s:.2f}") for b in h2d]  # fmt: skip
    return "host-to-device copies:\n" + format_table(columns, rows, left=3)


def format_seconds(seconds: float) -> str:
    """``12 us``, ``3.4 ms`` or ``1.25 s``."""
    if seconds < 1e-3:
        return f"{seconds * 1e6:.0f} us"
    return f"{seconds * 1e3:.1f} ms" if seconds < 1 else f"{seconds:.2f} s"


def format_table(columns: Sequence[tuple[str, ...]], rows: Sequence[Sequence[str]], left: int) -> str:
    """Aligned text: ``columns`` hold each column's header lines; the first ``left`` are left-aligned."""
    header_lines = [tuple(col[k] for col in columns) for k in range(len(columns[0]))]
    header_lines = [line for line in header_lines if any(line)]
    every = [*header_lines, *(tuple(r) for r in rows)]
    widths = [max(len(row[i]) for row in every) for i in range(len(columns))]
    lines = []
    for n, row in enumerate(every):
        cells = [cell.ljust(w) if i < left else cell.rjust(w) for i, (cell, w) in
                 enumerate(zip(row, widths))]  # fmt: skip
        lines.append("  ".join(cells).rstrip())
        if n == len(header_lines) - 1:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def to_json_document(header: dict[str, Any], results: Sequence[Measurement],
                     copy_limits: Sequence[CopyLimitRun] = (), h2d: Sequence[Bandwidth] = (),
                     ring_limits: Sequence[CopyLimitRun] = ()) -> dict[str, Any]:  # fmt: skip
    """Everything measured: every round's record, and the summaries and ratios drawn from them."""
    return {
        "header": {**header, "spread_rule": SPREAD_RULE, "spread_limit": SPREAD_LIMIT},
        "results": [m.to_dict() for m in results],
        "summaries": [s.to_dict() for s in summarize_loaders(results, copy_limits, ring_limits)],
        "ratios": [r.to_dict() for r in compare_loaders(results)],
        "copy_limit": _limit_document(copy_limits),
        "ring_copy_limit": {"prefetch_factor": RING_PREFETCH_FACTOR, **_limit_document(ring_limits)},
        "h2d": [b.to_dict() for b in h2d],
    }


def _limit_document(runs: Sequence[CopyLimitRun]) -> dict[str, Any]:
    return {"runs": [r.to_dict() for r in runs],
            "summaries": [s.to_dict() for s in summarize_copy_limits(runs)]}  # fmt: skip
