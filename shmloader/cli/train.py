"""``python -m shmloader bench --train``: the same training step fed three ways, in images per second.

Owns the training benchmark's command line, its rounds and its report. Runs in one main process
(the feeds' loaders start their own workers and are closed before the next feed). The feeds, the
model and the step are in :mod:`shmloader.cli.trainstep`: torch's DataLoader, shmloader's torch
flavour through ``shmloader.to_device``, and the ceiling (batches already on the device).

One measurement is one feed for one epoch of ``warmup + steps`` steps: the warm-up steps (worker
start-up, the first batches, lazy device set-up) are untimed; then ``steps`` steps are timed, the
clock stopping after the device has finished (``torch.cuda.synchronize``). Each of ``--repeat``
rounds measures every feed once, the order rotating by round. The report gives, per feed, the
median images/s over the rounds, its range and spread (flagged ``!`` as in ``bench``), and the
median as a fraction of the ceiling's median.

Device: ``cuda`` when available, else ``cpu`` (``--device`` to choose). Defaults are sized for the
device (ResNet-18 size work on CUDA, small and quick on a CPU); ``--quick`` shrinks everything to
a seconds-long smoke run. Exit status: 0 when every measurement succeeded, 1 when one failed (it is
reported, the others still run), 2 for a usage error or a missing requirement.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
from dataclasses import asdict, dataclass
from typing import Any

from shmloader.cli.measure import close_loader, count_children
from shmloader.cli.options import START_METHODS, check_dataset_length, int_at_least, refuse_unstartable_workers
from shmloader.cli.records import SPREAD_RULE, Spread, summarize
from shmloader.cli.report import (
    collect_header,
    format_header,
    format_spread,
    format_table,
)

__all__ = ["TrainOptions", "TrainRun", "FeedSummary", "parse_args", "main", "summarize_feeds", "format_train"]

_LABELS = {
    "torch": "torch DataLoader + .to(device)",
    "shmloader": "shmloader.torch.DataLoader + to_device",
    "ceiling": "ceiling: batches already on the device",
}
# (batch size, image size, timed steps, warm-up steps, workers, rounds)
_SIZES = {"cuda": (256, 224, 50, 10, 8, 3), "cpu": (32, 64, 15, 3, 2, 3), "quick": (8, 32, 3, 1, 1, 1)}


@dataclass(frozen=True, slots=True)
class TrainOptions:
    """The parsed command line of ``bench --train``, defaults resolved for the device."""

    device: str
    model: str
    batch_size: int
    image_size: int
    steps: int
    warmup: int
    workers: int
    repeat: int
    start_method: str
    json: bool


@dataclass(frozen=True, slots=True)
class TrainRun:
    """One feed in one round: ``steps`` steps of ``batch_size`` images timed over ``seconds``."""

    feed: str
    round_index: int
    batch_size: int
    steps: int
    seconds: float
    leftover_children: int = 0
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and self.seconds > 0

    @property
    def images_per_s(self) -> float:
        return self.steps * self.batch_size / self.seconds if self.ok else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "images_per_s": self.images_per_s}


def parse_args(argv: list[str]) -> TrainOptions:
    """Parse, then fill every size not given from the device's defaults (or ``--quick``'s)."""
    parser = _build_parser()
    ns = parser.parse_args(argv)
    device = ns.device if ns.device != "auto" else _default_device()
    sizes = _SIZES["quick" if ns.quick else ("cuda" if device.startswith("cuda") else "cpu")]
    given = (ns.batch_size, ns.image_size, ns.steps, ns.warmup, ns.workers, ns.repeat)
    batch_size, image_size, steps, warmup, workers, repeat = (
        value if value is not None else default for value, default in zip(given, sizes))
    if ns.workers is None:
        workers = min(workers, os.cpu_count() or 1)
    refuse_unstartable_workers(parser, "--workers", workers)
    check_dataset_length(parser, f"--steps {steps} + --warmup {warmup} (--batch-size {batch_size})",
                         steps + warmup, batch_size)
    model = ns.model if ns.model != "auto" or not ns.quick else "small"
    return TrainOptions(device, model, batch_size, image_size, steps, warmup, workers, repeat,
                        ns.start_method, ns.json)  # fmt: skip


def _build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m shmloader bench --train",
        description="One training step fed by torch's DataLoader, by shmloader (to_device), and by "
                    "batches already on the device (the ceiling): images/s and fraction of the ceiling.",
    )
    sizes = ", ".join(f"{k}: batch {v[0]}, image {v[1]}, steps {v[2]}, warmup {v[3]}, workers {v[4]}, "
                      f"repeat {v[5]}" for k, v in _SIZES.items())
    p.add_argument("--device", default="auto", help="cuda, cuda:N or cpu (default: cuda when available)")
    p.add_argument("--model", choices=("auto", "resnet18", "small"), default="auto",
                   help="auto: torchvision's ResNet-18 when it imports, else a small CNN of ours")
    p.add_argument("--batch-size", type=_positive, help="images per batch")
    p.add_argument("--image-size", type=_positive, help="image height and width (uint8, 3 channels)")
    p.add_argument("--steps", type=_positive, help="timed training steps per measurement")
    p.add_argument("--warmup", type=_positive, help="untimed steps before the clock starts")
    p.add_argument("--workers", type=_non_negative, help="num_workers of both loaders")
    p.add_argument("--repeat", type=_positive, help="rounds of every feed, the order rotating by round")
    p.add_argument("--quick", action="store_true", help="tiny sizes and the small CNN: a smoke run")
    p.add_argument("--start-method", choices=START_METHODS, default="fork",
                   help="multiprocessing_context of both loaders (default: fork)")
    p.add_argument("--json", action="store_true", help="print a JSON document on stdout; the table goes to stderr")
    p.epilog = f"Defaults by device: {sizes}."
    return p  # fmt: skip


_positive = int_at_least(1)
_non_negative = int_at_least(0)


def _default_device() -> str:
    try:
        import torch
    except ImportError:
        return "cpu"
    return "cuda" if torch.cuda.is_available() else "cpu"


def main(argv: list[str]) -> int:
    """Run the training benchmark; return the exit status (see the module docstring)."""
    try:
        opts = parse_args(argv)
    except SystemExit as exc:  # argparse: --help (0) or a usage error (2)
        return exc.code if isinstance(exc.code, int) else 2
    problem = _requirement_problem(opts)
    if problem:
        print(f"shmloader bench --train: {problem}", file=sys.stderr)
        return 2
    from shmloader.cli.trainstep import load_model

    try:
        model, model_text = load_model(opts.model)
    except ImportError as exc:
        print(f"shmloader bench --train: {exc}", file=sys.stderr)
        return 2
    header = _header(opts, model_text)
    runs = _run(opts, model)
    _emit(opts, header, runs)
    return 0 if all(r.ok and not r.leftover_children for r in runs) else 1


def _requirement_problem(opts: TrainOptions) -> str | None:
    try:
        import torch
    except ImportError:
        return "needs torch, which is not installed (pip install shmloader[torch])"
    try:
        device = torch.device(opts.device)
    except RuntimeError as exc:
        return f"--device {opts.device!r}: {exc}"
    if device.type == "cuda" and not torch.cuda.is_available():
        return f"--device {opts.device}: CUDA is not available on this machine (torch.cuda.is_available() is False)"
    if device.type not in ("cuda", "cpu"):
        return f"--device {opts.device}: only cuda and cpu are supported"
    return None


def _header(opts: TrainOptions, model_text: str) -> dict[str, Any]:
    # Before the run: the load average should show other work, not this benchmark's own.
    extra = {"model": model_text, "batch_size": opts.batch_size,
             "image": f"uint8[{opts.image_size},{opts.image_size},3]", "steps": opts.steps,
             "warmup": opts.warmup, "num_workers": opts.workers, "repeat": opts.repeat,
             "pin_memory": opts.device.startswith("cuda")}  # fmt: skip
    return collect_header(opts.start_method, opts.device, extra)


def _run(opts: TrainOptions, model: Any) -> list[TrainRun]:
    import torch

    from shmloader.cli.trainstep import FEEDS, make_step

    device = torch.device(opts.device)
    step = make_step(model, device)
    runs = []
    for r in range(opts.repeat):
        for feed in FEEDS[r % len(FEEDS):] + FEEDS[: r % len(FEEDS)]:
            print(f"round {r + 1}/{opts.repeat}: {_LABELS[feed]}", file=sys.stderr, flush=True)
            runs.append(_measure(feed, r, opts, step, device))
    return runs


def _measure(feed: str, round_index: int, opts: TrainOptions, step: Any, device: Any) -> TrainRun:
    """One feed, one epoch of ``warmup + steps`` steps; raises no Exception (a KeyboardInterrupt
    goes on up once the loader is closed)."""
    from shmloader.cli.trainstep import SyntheticImages, open_feed

    dataset = SyntheticImages((opts.warmup + opts.steps) * opts.batch_size, opts.image_size)
    loader = batches = error = None
    seconds = 0.0
    try:
        batches, loader = open_feed(feed, dataset, opts.batch_size, opts.workers, opts.start_method, device)
        seconds = _time_steps(batches, step, opts, device)
    except Exception as exc:  # reported in the table; the other measurements still run
        error = f"{type(exc).__name__}: {exc}"
    except BaseException:  # Ctrl-C: close the loader (workers, segments) before it goes up
        close_loader(loader)
        raise
    batches = None  # the iterator holds the loader's workers: drop it before closing
    close_loader(loader)
    del loader
    gc.collect()
    return TrainRun(feed, round_index, opts.batch_size, opts.steps, seconds, count_children(), error)


def _time_steps(batches: Any, step: Any, opts: TrainOptions, device: Any) -> float:
    import torch

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    for _ in range(opts.warmup):
        step(*next(batches))
    sync()
    start = time.perf_counter()
    for _ in range(opts.steps):
        step(*next(batches))
    sync()
    return time.perf_counter() - start


@dataclass(frozen=True, slots=True)
class FeedSummary:
    """One feed over its rounds: images/s median and range, and the median over the ceiling's."""

    feed: str
    rounds: int
    failed_rounds: int
    images_per_s: Spread | None
    fraction_of_ceiling: float | None

    def to_dict(self) -> dict[str, Any]:
        return {"feed": self.feed, "label": _LABELS[self.feed], "rounds": self.rounds,
                "failed_rounds": self.failed_rounds,
                "images_per_s": self.images_per_s.to_dict() if self.images_per_s else None,
                "fraction_of_ceiling": self.fraction_of_ceiling}  # fmt: skip


def summarize_feeds(runs: list[TrainRun]) -> list[FeedSummary]:
    """One summary per feed, in the order first measured; only successful rounds count."""
    feeds = list(dict.fromkeys(r.feed for r in runs))
    spreads = {f: summarize([r.images_per_s for r in runs if r.feed == f and r.ok]) for f in feeds}
    ceiling = spreads.get("ceiling")
    summaries = []
    for feed in feeds:
        spread, count = spreads[feed], sum(r.feed == feed for r in runs)
        failed = sum(r.feed == feed and not r.ok for r in runs)
        fraction = spread.median / ceiling.median if spread and ceiling else None
        summaries.append(FeedSummary(feed, count, failed, spread, fraction))
    return summaries


def format_train(runs: list[TrainRun]) -> str:
    """The table: one row per feed, medians over the rounds, then footnotes and problems."""
    columns = (("feed", ""), ("img/s", "(median)"), ("img/s", "(min-max)"),
               ("spread", "(max-min)/med"), ("of ceiling", "(median/median)"))  # fmt: skip
    rows = []
    for s in summarize_feeds(runs):
        spread, fraction = s.images_per_s, s.fraction_of_ceiling
        if spread is None:
            rows.append((_LABELS[s.feed], "failed", "-", "-", "-"))
            continue
        rows.append((_LABELS[s.feed], f"{spread.median:,.1f}",
                     f"{spread.low:,.1f}-{spread.high:,.1f}" if spread.n > 1 else "-",
                     format_spread(spread), f"{fraction:.1%}" if fraction is not None else "-"))  # fmt: skip
    rounds = max((r.round_index + 1 for r in runs), default=0)
    notes = [f"Medians of {rounds} round(s), the feeds' order rotating by round; "
             f"! marks a spread too wide to trust ({SPREAD_RULE.replace('batches/s', 'img/s')})."]  # fmt: skip
    problems = [f"  {r.feed} round {r.round_index + 1}: {r.error}" for r in runs if r.error]
    problems += [f"  {r.feed} round {r.round_index + 1}: {r.leftover_children} child process(es) left"
                 for r in runs if r.leftover_children]  # fmt: skip
    text = format_table(columns, rows, left=1) + "\n" + "\n".join(notes)
    return text + ("\nproblems:\n" + "\n".join(problems) if problems else "")


def _emit(opts: TrainOptions, header: dict[str, Any], runs: list[TrainRun]) -> None:
    human = sys.stderr if opts.json else sys.stdout
    print(format_header(header, "shmloader bench --train") + "\n\n" + format_train(runs), file=human)
    if opts.json:
        doc = {"header": {**header, "spread_rule": SPREAD_RULE}, "results": [r.to_dict() for r in runs],
               "summaries": [f.to_dict() for f in summarize_feeds(runs)]}  # fmt: skip
        json.dump(doc, sys.stdout, indent=2)
        print(file=sys.stdout)

