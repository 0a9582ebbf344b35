"""The command line of ``python -m shmloader bench``: its options, their defaults and their checks.

Owns :class:`Options` (the parsed command line, frozen) and :func:`parse_args`. Runs in the
benchmark's main process. Promises: a bad value exits through argparse with status 2 and a message
that names the option and the value, before anything is measured (``--plot``: matplotlib missing,
a directory that does not exist or cannot be written, a format matplotlib cannot write); nothing
here imports torch or starts a process, nor matplotlib unless a ``--plot`` extension is not one
of :data:`shmloader.cli.plot.CORE_FORMATS`.
``--train`` is listed here for ``--help`` only: :func:`shmloader.cli.bench.main` hands a command
line that holds it to :mod:`shmloader.cli.train` before this parser sees it.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from shmloader.cli.plot import plot_target
from shmloader.cli.records import SPREAD_RULE
from shmloader.cli.workloads import WORKLOADS, Workload
from shmloader.config_fields import TooManyDigits, decimal_int
from shmloader.rlimits import soft_limit

__all__ = ["Options", "parse_args", "START_METHODS", "DEFAULT_REPEAT", "FDS_PER_WORKER", "check_dataset_length",
           "int_at_least", "open_descriptors", "refuse_unstartable_workers", "startable_workers"]

START_METHODS = ("fork", "spawn", "forkserver")
# Five rounds: the median survives two disturbed rounds, and the default run stays under about two
# minutes on 2 cores (docs/performance.md).
DEFAULT_REPEAT = 5
# Descriptors the main process holds per worker with the default prefetch_factor of 2: the task and
# result pipes' ends, the pidfd and the sentinel, and each of the worker's two slots (measured: 8).
FDS_PER_WORKER = 8


@dataclass(frozen=True, slots=True)
class Options:
    """The parsed command line of ``bench`` (without ``--train``)."""

    workloads: tuple[Workload, ...]
    workers: tuple[int, ...]
    batches: int | None  # None: each workload's default
    warmup: int
    json: bool
    loaders: tuple[str, ...]
    start_method: str
    plot: str | None  # the file to write, extension included (cli/plot.py's plot_target)
    device: str
    epoch_bars: bool = False  # a tqdm bar per shmloader epoch, through the Progress observer plugin
    repeat: int = 1  # rounds; each round measures every case once, the loaders' order alternating
    copy_limit: bool = True  # measure the collate copy alone in max(workers) processes

    def batches_for(self, workload: Workload) -> int:
        return self.batches if self.batches is not None else workload.default_batches

    @property
    def copy_limit_processes(self) -> int:
        """Processes of the copy limit: the highest ``num_workers``; 0 when it is not measured."""
        return max(self.workers) if self.copy_limit and "shmloader" in self.loaders else 0


def parse_args(argv: list[str] | None) -> Options:
    parser = _build_parser()
    ns = parser.parse_args(argv)
    loaders = tuple(
        name for name, skip in (("shmloader", ns.no_shmloader), ("torch", ns.no_torch)) if not skip
    )
    if not loaders:
        parser.error("--no-torch and --no-shmloader together leave nothing to measure")
    if not _split(ns.workloads) or not _split(ns.workers):
        parser.error("--workloads and --workers each need at least one value")
    _refuse_repeats(parser, "--workloads", _split(ns.workloads))
    workloads = tuple(_parse_workload(parser, name) for name in _split(ns.workloads))
    workers = tuple(_parse_count(parser, "--workers", text) for text in _split(ns.workers))
    _refuse_repeats(parser, "--workers", workers)
    refuse_unstartable_workers(parser, "--workers", max(workers))
    for workload in workloads:
        batches = ns.batches or workload.default_batches
        check_dataset_length(parser, f"{workload.name}: --batches {batches} + --warmup {ns.warmup}",
                             batches + ns.warmup, workload.batch_size)
    return Options(
        workloads=workloads,
        workers=workers,
        batches=ns.batches,
        warmup=ns.warmup,
        json=ns.json,
        loaders=loaders,
        start_method=ns.start_method,
        plot=_parse_plot(parser, ns.plot),
        device=ns.device,
        epoch_bars=ns.epoch_bars,
        repeat=ns.repeat,
        copy_limit=not ns.no_copy_limit,
    )


def _build_parser() -> argparse.ArgumentParser:
    defaults = ", ".join(f"{w.name} {w.default_batches}" for w in WORKLOADS.values())
    p = argparse.ArgumentParser(
        prog="python -m shmloader bench",
        allow_abbrev=False,  # only the exact --train hands over to the training benchmark (bench.main)
        description="Time shmloader.DataLoader against torch.utils.data.DataLoader in one run, "
                    "in repeated rounds; report medians and spread.",
        epilog="python -m shmloader bench --train --help: the end-to-end training benchmark.",
    )
    p.add_argument("--train", action="store_true",
                   help="run the end-to-end training benchmark instead (its own options: --train --help)")
    p.add_argument("--workloads", default=",".join(WORKLOADS), help="comma-separated: "
                   f"{', '.join(f'{w.name} ({w.description})' for w in WORKLOADS.values())}")
    p.add_argument("--workers", default="0,2", help="comma-separated num_workers values")
    p.add_argument("--batches", type=_positive_int, default=None,
                   help=f"timed batches per measurement (default per workload: {defaults})")
    p.add_argument("--warmup", type=_positive_int, default=3,
                   help="batches read before the clock starts, the first batch included")
    p.add_argument("--repeat", type=_positive_int, default=DEFAULT_REPEAT,
                   help=f"rounds of every measurement, the loaders' order alternating (default "
                        f"{DEFAULT_REPEAT}); the table gives medians, the range, and flags with '!' "
                        f"a spread too wide to trust: {SPREAD_RULE}".replace("%", "%%"))
    p.add_argument("--no-copy-limit", action="store_true",
                   help="skip both copy limits (np.stack(out=) alone in max(--workers) processes, "
                        "into one buffer each and rotating over a ring's share)")
    p.add_argument("--json", action="store_true",
                   help="print a JSON document on stdout; the table goes to stderr")
    p.add_argument("--no-torch", action="store_true", help="measure shmloader only")
    p.add_argument("--epoch-bars", action="store_true",
                   help="show shmloader's own per-epoch progress bar (the Progress observer plugin)")
    p.add_argument("--no-shmloader", action="store_true", help="measure torch only")
    p.add_argument("--start-method", choices=START_METHODS, default="fork",
                   help="multiprocessing_context of both loaders (default: fork)")
    p.add_argument("--plot", metavar="PATH", default=None,
                   help="write grouped bars of median batches/s with min-max error bars (matplotlib; "
                        "the format from the extension: .png, .pdf, .svg, ...; none: .png)")
    p.add_argument("--device", default="cpu",
                   help="'cuda' (or 'cuda:N'): time batches delivered to the GPU, pinned")
    return p  # fmt: skip


def _split(text: str) -> list[str]:
    return [part.strip() for part in text.split(",") if part.strip()]


def int_at_least(minimum: int, maximum: int = sys.maxsize) -> Callable[[str], int]:
    """An argparse type: a decimal integer from ``minimum`` to ``maximum``, refused with what was
    given (every cli command's). Read by the rule of ``SHMLOADER_*`` integers (docs/config.md,
    :func:`~shmloader.config_fields.decimal_int`): ASCII digits, optionally after a '-', as typed,
    since ``int()`` also reads '1_0', '+3', ' 3' and other scripts' digits ('٣' is 3); past
    sys.maxsize no count of batches, steps or processes can run."""

    def parse(text: str) -> int:
        try:
            value = decimal_int(text)
        except TooManyDigits:
            raise argparse.ArgumentTypeError(f"must be at most {maximum}, got {text!r}") from None
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be a decimal integer, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be at least {minimum}, got {value}")
        if value > maximum:
            raise argparse.ArgumentTypeError(f"must be at most {maximum}, got {value}")
        return value

    return parse


def open_descriptors() -> int:
    """Descriptors this process has open now (0 where the system does not list them)."""
    for listing in ("/proc/self/fd", "/dev/fd"):
        try:
            return len(os.listdir(listing))
        except OSError:
            continue
    return 0


def startable_workers() -> int:
    """The most worker processes this process could start now: the room its open-file limit
    (RLIMIT_NOFILE) leaves for :data:`FDS_PER_WORKER` descriptors each, and its process limit
    (RLIMIT_NPROC), as ``shmloader.rlimits`` reads them; sys.maxsize where neither bounds it."""
    most = sys.maxsize
    nofile = soft_limit("RLIMIT_NOFILE").value
    if nofile is not None:
        most = max(0, nofile - open_descriptors()) // FDS_PER_WORKER
    nproc = soft_limit("RLIMIT_NPROC").value
    if nproc is not None:
        most = min(most, nproc)
    return most


def refuse_unstartable_workers(parser: argparse.ArgumentParser, option: str, workers: int) -> None:
    """A usage error when ``workers`` processes could not be started (:func:`startable_workers`):
    refused before any round, rather than a case that fails with EMFILE after the others ran."""
    most = startable_workers()
    if workers > most:
        nofile, nproc = soft_limit("RLIMIT_NOFILE"), soft_limit("RLIMIT_NPROC")
        parser.error(f"{option} {workers}: more worker processes than this process can start (at most {most}: "
                     f"RLIMIT_NOFILE leaves room for {FDS_PER_WORKER} descriptors each, and RLIMIT_NPROC; "
                     f"{nofile.describe()}; {nproc.describe()})")


def check_dataset_length(parser: argparse.ArgumentParser, what: str, batches: int, batch_size: int) -> None:
    """A usage error when ``batches`` batches of ``batch_size`` are more samples than ``len()`` can
    return (sys.maxsize): each round would fail with OverflowError instead."""
    if batches * batch_size > sys.maxsize:
        parser.error(f"{what}: {batches} batches of {batch_size} samples are more than a dataset can hold "
                     f"(len() is at most sys.maxsize = {sys.maxsize})")


_positive_int = int_at_least(1)


def _refuse_repeats(parser: argparse.ArgumentParser, option: str, values: Iterable[object]) -> None:
    """A case given twice (``2`` and ``02`` are one) would be measured twice and pooled as if the
    second were another round."""
    seen: set[object] = set()
    for value in values:
        if value in seen:
            parser.error(f"{option}: {value} is given twice")
        seen.add(value)


def _parse_workload(parser: argparse.ArgumentParser, name: str) -> Workload:
    if name not in WORKLOADS:
        parser.error(f"--workloads: unknown workload {name!r}; choose from {', '.join(WORKLOADS)}")
    return WORKLOADS[name]


def _parse_plot(parser: argparse.ArgumentParser, path: str | None) -> str | None:
    """The file the figure will be written to (checked now, not after the run), or None."""
    if path is None:
        return None
    try:
        return plot_target(path)
    except ValueError as exc:
        parser.error(f"--plot {path!r}: {exc}")
    return None  # pragma: no cover - parser.error exits


def _parse_count(parser: argparse.ArgumentParser, option: str, text: str) -> int:
    try:
        return _non_negative(text)
    except argparse.ArgumentTypeError as exc:
        parser.error(f"{option}: each value {exc}")
    return 0  # pragma: no cover - parser.error exits


_non_negative = int_at_least(0)
