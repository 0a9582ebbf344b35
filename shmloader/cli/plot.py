"""The benchmark's figure: median batches/s per loader, with the range over the rounds as error bars.

Owns ``--plot``: the check of its path (:func:`plot_target`, at parse time) and the figure
(:func:`write_plot`, after the run). Runs in the benchmark's main process and imports matplotlib
(its Agg canvas, no display) only to draw, or to ask which formats it writes when a path's
extension is not one of :data:`CORE_FORMATS`. Promises: one group of bars per (workload,
num_workers) in the order measured, one bar per loader at its median, an error bar from the lowest
to the highest round, a log scale (the workloads' rates differ by orders of magnitude), and ``!``
after the value of a bar whose spread is too wide to trust
(:data:`shmloader.cli.records.SPREAD_RULE`).
"""

from __future__ import annotations

import importlib.util
import os
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

__all__ = ["CORE_FORMATS", "DEFAULT_FORMAT", "matplotlib_installed", "plot_target", "write_plot"]

LOADERS = ("shmloader", "torch")
# Formats every matplotlib the project allows (>= 3.5) writes with its own dependencies; another
# extension is looked up in the installed matplotlib (pgf, gif, avif, ... where it has them).
CORE_FORMATS = frozenset({"png", "pdf", "svg", "svgz", "eps", "ps", "jpg", "jpeg", "tif", "tiff", "raw", "rgba"})
DEFAULT_FORMAT = "png"  # given to a path without an extension (matplotlib's default, made explicit)


def matplotlib_installed() -> bool:
    """Whether matplotlib can be found, without importing it."""
    return importlib.util.find_spec("matplotlib") is not None


def plot_target(path: str) -> str:
    """The file ``--plot path`` will write: ``path``, with ``.png`` added when it has no extension.

    Raises ValueError, saying why, when matplotlib is missing, the path names a directory, its
    directory does not exist or cannot be written, or matplotlib cannot write its format.
    """
    if not matplotlib_installed():
        raise ValueError("drawing the figure needs matplotlib, which is not installed (pip install matplotlib)")
    if path.endswith(os.sep) or os.path.isdir(path):
        raise ValueError("is a directory; name the figure's file, e.g. bench.png")
    root, ext = os.path.splitext(path)
    target = path if ext.strip(".") else f"{root.rstrip('.')}.{DEFAULT_FORMAT}"
    _check_directory(os.path.dirname(os.path.abspath(target)))
    if os.path.exists(target) and not os.access(target, os.W_OK):
        raise ValueError(f"{target} exists and cannot be written by this user")
    fmt = os.path.splitext(target)[1][1:].lower()
    if fmt not in CORE_FORMATS and fmt not in _matplotlib_formats():
        listed = ", ".join(f".{f}" for f in sorted(_matplotlib_formats()))
        raise ValueError(f"matplotlib cannot write '.{fmt}' files; use one of {listed} (none: .{DEFAULT_FORMAT})")
    return target


def _check_directory(directory: str) -> None:
    if not os.path.exists(directory):
        raise ValueError(f"directory {directory} does not exist")
    if not os.path.isdir(directory):
        raise ValueError(f"{directory} is not a directory")
    if not os.access(directory, os.W_OK | os.X_OK):
        raise ValueError(f"directory {directory} cannot be written by this user")


def _matplotlib_formats() -> set[str]:
    from matplotlib.backend_bases import FigureCanvasBase

    return set(FigureCanvasBase.get_supported_filetypes())


def write_plot(results: Sequence[Measurement], path: str, title: str, out: TextIO) -> Any:
    """Grouped bars of median batches/s with min-max error bars, shmloader beside torch.

    Writes the figure to ``path`` (its format from the extension: pass :func:`plot_target`'s
    answer), says so on ``out``, and returns the matplotlib Figure.
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
