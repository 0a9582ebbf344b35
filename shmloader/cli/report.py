"""What the benchmark reports: measurement records, the header, the tables, JSON and the plot.

Owns the shape of ``python -m shmloader bench`` output. Runs in the benchmark's main process.
Promises: the JSON document (:func:`to_json_document`) has the keys ``header``, ``results``,
``ratios`` and ``h2d``; every rate is derived from the recorded counts and seconds, never
estimated; a ratio is shmloader divided by torch for the same workload and ``num_workers`` in the
same run; matplotlib is imported only by :func:`write_plot`, and torch never.
"""

from __future__ import annotations

import os
import platform
import sys
from dataclasses import asdict, dataclass
from types import TracebackType
from typing import Any, TextIO

import numpy as np

__all__ = [
    "Measurement",
    "Bandwidth",
    "Ratio",
    "Progress",
    "collect_header",
    "compute_ratios",
    "format_header",
    "format_results",
    "format_bandwidth",
    "to_json_document",
    "write_plot",
]

LOADERS = ("shmloader", "torch")


@dataclass(frozen=True, slots=True)
class Measurement:
    """One loader on one workload with one ``num_workers``: ``batches`` timed over ``seconds``."""

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

    @property
    def ok(self) -> bool:
        return self.error is None and self.seconds > 0

    @property
    def batches_per_s(self) -> float:
        return self.batches / self.seconds if self.ok else 0.0

    @property
    def gb_per_s(self) -> float:
        return self.batches * self.batch_bytes / self.seconds / 1e9 if self.ok else 0.0

    def to_dict(self) -> dict[str, Any]:
        record = asdict(self)
        record["batches_per_s"] = self.batches_per_s
        record["gb_per_s"] = self.gb_per_s
        return record


@dataclass(frozen=True, slots=True)
class Ratio:
    """shmloader over torch for one workload and ``num_workers``."""

    workload: str
    num_workers: int
    batches_per_s_ratio: float  # > 1: shmloader delivers more batches per second
    first_batch_ratio: float  # < 1: shmloader's first batch arrives sooner


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


def compute_ratios(results: list[Measurement]) -> list[Ratio]:
    """One ratio per (workload, num_workers) where both loaders succeeded."""
    by_key = {(m.workload, m.num_workers, m.loader): m for m in results if m.ok}
    ratios = []
    for m in results:
        if m.loader != "shmloader" or not m.ok:
            continue
        other = by_key.get((m.workload, m.num_workers, "torch"))
        if other is None:
            continue
        ratios.append(
            Ratio(
                m.workload,
                m.num_workers,
                batches_per_s_ratio=m.batches_per_s / other.batches_per_s,
                first_batch_ratio=m.first_batch_s / other.first_batch_s,
            )
        )
    return ratios


def to_json_document(
    header: dict[str, Any], results: list[Measurement], h2d: list[Bandwidth]
) -> dict[str, Any]:
    return {
        "header": header,
        "results": [m.to_dict() for m in results],
        "ratios": [asdict(r) for r in compute_ratios(results)],
        "h2d": [b.to_dict() for b in h2d],
    }


def format_header(header: dict[str, Any]) -> str:
    cpus = f"{header['cpu_count']} (usable: {header['affinity_cpus']})"
    lines = [
        f"shmloader bench: cpus {cpus}, load average {header['load_avg_1m']}, "
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


def format_results(results: list[Measurement]) -> str:
    """The main table; the shmloader row carries the ratios against torch."""
    ratios = {(r.workload, r.num_workers): r for r in compute_ratios(results)}
    columns = ("workload", "workers", "loader", "batches", "batches/s", "GB/s", "first batch",
               "vs torch (rate)", "vs torch (first)")  # fmt: skip
    rows: list[tuple[str, ...]] = [columns]
    for m in results:
        ratio = ratios.get((m.workload, m.num_workers)) if m.loader == "shmloader" else None
        rows.append(_result_row(m, ratio))
    table = _format_rows(rows)
    errors = [f"  {m.workload}/{m.num_workers}/{m.loader}: {m.error}" for m in results if m.error]
    leftovers = [m for m in results if m.leftover_children]
    if leftovers:
        errors += [f"  {m.workload}/{m.num_workers}/{m.loader}: {m.leftover_children} child "
                   "process(es) left after release" for m in leftovers]  # fmt: skip
    return table + ("\nproblems:\n" + "\n".join(errors) if errors else "")


def _result_row(m: Measurement, ratio: Ratio | None) -> tuple[str, ...]:
    if not m.ok:
        return (m.workload, str(m.num_workers), m.loader, "-", "failed", "-", "-", "-", "-")
    return (
        m.workload,
        str(m.num_workers),
        m.loader,
        str(m.batches),
        f"{m.batches_per_s:,.1f}",
        f"{m.gb_per_s:.3f}",
        _format_seconds(m.first_batch_s),
        f"{ratio.batches_per_s_ratio:.2f}x" if ratio else "",
        f"{ratio.first_batch_ratio:.2f}x" if ratio else "",
    )


def format_bandwidth(h2d: list[Bandwidth]) -> str:
    rows: list[tuple[str, ...]] = [("workload", "bytes", "source", "pinned", "copies", "GB/s")]
    for b in h2d:
        rows.append((b.workload, f"{b.nbytes:,}", b.source, "yes" if b.pinned else "no",
                     str(b.copies), f"{b.gb_per_s:.2f}"))  # fmt: skip
    return "host-to-device copies:\n" + _format_rows(rows)


def _format_seconds(seconds: float) -> str:
    return f"{seconds * 1e3:.1f} ms" if seconds < 1 else f"{seconds:.2f} s"


def _format_rows(rows: list[tuple[str, ...]]) -> str:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = []
    for n, row in enumerate(rows):
        cells = [cell.ljust(w) if i < 3 else cell.rjust(w) for i, (cell, w) in
                 enumerate(zip(row, widths))]  # fmt: skip
        lines.append("  ".join(cells).rstrip())
        if n == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def write_plot(results: list[Measurement], path: str, title: str, out: TextIO) -> None:
    """Grouped bars of batches/s, shmloader vs torch, per workload and num_workers (log scale)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    groups = sorted({(m.workload, m.num_workers) for m in results}, key=_group_order(results))
    loaders = [name for name in LOADERS if any(m.loader == name for m in results)]
    rates = {(m.workload, m.num_workers, m.loader): m.batches_per_s for m in results if m.ok}
    fig = Figure(figsize=(max(6.0, 1.2 * len(groups) + 2), 4.5))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    width = 0.8 / max(1, len(loaders))
    positions = np.arange(len(groups))
    for k, name in enumerate(loaders):
        heights = [rates.get((w, n, name), np.nan) for w, n in groups]
        bars = ax.bar(positions + (k - (len(loaders) - 1) / 2) * width, heights, width, label=name)
        ax.bar_label(bars, fmt="%.0f", fontsize=8)
    ax.set_xticks(positions, [f"{w}\nworkers={n}" for w, n in groups])
    ax.set_yscale("log")
    ax.set_ylabel("batches/s (log scale)")
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    print(f"plot written to {path}", file=out)


def _group_order(results: list[Measurement]) -> Any:
    first_seen: dict[str, int] = {}
    for m in results:
        first_seen.setdefault(m.workload, len(first_seen))
    return lambda key: (first_seen[key[0]], key[1])


class Progress:
    """A progress indicator on stderr, one step per measurement: tqdm if installed, else a line.

    It advances only between measurements, so it costs nothing inside a timed loop.
    """

    def __init__(self, total: int, stream: TextIO | None = None) -> None:
        self._total = total
        self._done = 0
        self._stream = stream if stream is not None else sys.stderr
        self._bar: Any = None
        try:
            from tqdm import tqdm
        except ImportError:
            return
        self._bar = tqdm(total=total, file=self._stream, unit="case", leave=False)

    def step(self, description: str) -> None:
        """Mark the previous step done and announce the next one."""
        if self._bar is not None:
            self._bar.update(self._done - self._bar.n)
            self._bar.set_description_str(description)
        else:
            self._stream.write(f"[{self._done + 1}/{self._total}] {description}\n")
            self._stream.flush()
        self._done += 1

    def note(self, description: str) -> None:
        """Announce extra work that is not one of the counted steps."""
        if self._bar is not None:
            self._bar.update(self._done - self._bar.n)
            self._bar.set_description_str(description)
        else:
            self._stream.write(f"{description}\n")
            self._stream.flush()

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:  # fmt: skip
        if self._bar is not None:
            self._bar.update(self._done - self._bar.n)
            self._bar.close()
