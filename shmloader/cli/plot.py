"""The benchmark's figure: median batches/s per loader, with the range over the rounds as error bars.

Owns ``--plot``. Runs in the benchmark's main process and imports matplotlib (its Agg canvas, no
display) only when called. Promises: one group of bars per (workload, num_workers) in the order
measured, one bar per loader at its median, an error bar from the lowest to the highest round, a
log scale (the workloads' rates differ by orders of magnitude), and ``!`` after the value of a bar
whose spread is too wide to trust (:data:`shmloader.cli.records.SPREAD_RULE`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, TextIO

import numpy as np

from shmloader.cli.records import (
    SPREAD_LIMIT,
    LoaderSummary,
    Measurement,
    summarize_loaders,
)
from shmloader.cli.report import WIDE_MARK

__all__ = ["write_plot"]

LOADERS = ("shmloader", "torch")


def write_plot(results: Sequence[Measurement], path: str, title: str, out: TextIO) -> Any:
    """Grouped bars of median batches/s with min-max error bars, shmloader beside torch.

    Writes the PNG to ``path``, says so on ``out``, and returns the matplotlib Figure.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    summaries = {(s.workload, s.num_workers, s.loader): s for s in summarize_loaders(results)}
    groups = list(dict.fromkeys((w, n) for w, n, _ in summaries))
    loaders = [name for name in LOADERS if any(key[2] == name for key in summaries)]
    fig = Figure(figsize=(max(6.0, 1.3 * len(groups) + 2), 4.8))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    width = 0.8 / max(1, len(loaders))
    positions = np.arange(len(groups))
    for k, name in enumerate(loaders):
        picked = [summaries.get((w, n, name)) for w, n in groups]
        _draw_loader(ax, positions + (k - (len(loaders) - 1) / 2) * width, width, picked, name)
    ax.set_xticks(positions, [f"{w}\nworkers={n}" for w, n in groups])
    ax.set_yscale("log")
    ax.set_ylabel("batches/s (log scale): median, min-max")
    rounds = max((m.round_index + 1 for m in results), default=0)
    ax.set_title(f"{title}\nmedian of {rounds} round(s); {WIDE_MARK}: (max-min)/median > "
                 f"{SPREAD_LIMIT:.0%}", fontsize=10)  # fmt: skip
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    print(f"plot written to {path}", file=out)
    return fig


def _draw_loader(ax: Any, x: np.ndarray, width: float, picked: list[LoaderSummary | None],
                 name: str) -> None:  # fmt: skip
    spreads = [s.batches_per_s if s is not None else None for s in picked]
    heights = [sp.median if sp else np.nan for sp in spreads]
    below = [sp.median - sp.low if sp else 0.0 for sp in spreads]
    above = [sp.high - sp.median if sp else 0.0 for sp in spreads]
    bars = ax.bar(x, heights, width, label=name, yerr=[below, above], capsize=3,
                  error_kw={"elinewidth": 1})  # fmt: skip
    labels = [f"{sp.median:.0f}" + (WIDE_MARK if sp.wide else "") if sp else "" for sp in spreads]
    ax.bar_label(bars, labels=labels, fontsize=8, padding=2)
