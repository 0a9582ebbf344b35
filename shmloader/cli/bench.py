"""``python -m shmloader bench``: shmloader's DataLoader against torch's, side by side, in one run.

Owns the benchmark's command line and its measurement loop. Runs in one main process, which
builds each loader, times it, and releases it before the next, so no worker process or shared
memory segment outlives its measurement.

For every workload (see :mod:`shmloader.cli.workloads`) and every ``num_workers``, each loader
reads the same dataset type with the same batch size, ``shuffle=False``, and, with workers,
``persistent_workers=True`` and the chosen start method. One measurement is one epoch:

- *first batch*: seconds from ``iter(loader)`` to the first batch (worker start-up included);
- *warm-up*: the first batch plus ``--warmup - 1`` more, untimed;
- *timed*: ``--batches`` batches, each touched on every page (:func:`touch_batch`).

The report (:mod:`shmloader.cli.report`) gives batches/s, GB/s, time to first batch, and the
ratio shmloader/torch. With ``--device cuda`` batches are moved to the GPU as a training loop
would, and a table of host-to-device copy bandwidth by source buffer is added.

Exit status: 0 when every measurement succeeded, 1 when one failed (it is reported and the rest
still run), 2 for a usage error or a missing requirement (no CUDA for ``--device cuda``).
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from shmloader.cli.report import (
    Bandwidth,
    Measurement,
    Progress,
    collect_header,
    format_bandwidth,
    format_header,
    format_results,
    to_json_document,
    write_plot,
)
from shmloader.cli.workloads import (
    WORKLOADS,
    Workload,
    deliver,
    measure_h2d,
    touch_batch,
)

__all__ = ["Options", "main", "parse_args", "measure", "make_loader", "close_loader"]

START_METHODS = ("fork", "spawn", "forkserver")


class UsageError(Exception):
    """The command line asks for something this machine cannot do; exit status 2."""


@dataclass(frozen=True, slots=True)
class Options:
    """The parsed command line."""

    workloads: tuple[Workload, ...]
    workers: tuple[int, ...]
    batches: int | None  # None: each workload's default
    warmup: int
    json: bool
    loaders: tuple[str, ...]
    start_method: str
    plot: str | None
    device: str
    epoch_bars: bool = False  # a tqdm bar per shmloader epoch, through the Progress observer plugin

    def batches_for(self, workload: Workload) -> int:
        return self.batches if self.batches is not None else workload.default_batches


def parse_args(argv: list[str] | None) -> Options:
    parser = _build_parser()
    ns = parser.parse_args(argv)
    loaders = tuple(
        name for name, skip in (("shmloader", ns.no_shmloader), ("torch", ns.no_torch)) if not skip
    )
    if not loaders:
        parser.error("--no-torch and --no-shmloader together leave nothing to measure")
    return Options(
        workloads=tuple(_parse_workload(parser, name) for name in _split(ns.workloads)),
        workers=tuple(_parse_count(parser, "--workers", text) for text in _split(ns.workers)),
        batches=ns.batches,
        warmup=ns.warmup,
        json=ns.json,
        loaders=loaders,
        start_method=ns.start_method,
        plot=ns.plot,
        device=ns.device,
        epoch_bars=ns.epoch_bars,
    )


def _build_parser() -> argparse.ArgumentParser:
    defaults = ", ".join(f"{w.name} {w.default_batches}" for w in WORKLOADS.values())
    p = argparse.ArgumentParser(
        prog="python -m shmloader bench",
        description="Time shmloader.DataLoader against torch.utils.data.DataLoader in one run.",
    )
    p.add_argument("--workloads", default=",".join(WORKLOADS), help="comma-separated: "
                   f"{', '.join(f'{w.name} ({w.description})' for w in WORKLOADS.values())}")
    p.add_argument("--workers", default="0,2", help="comma-separated num_workers values")
    p.add_argument("--batches", type=_positive_int, default=None,
                   help=f"timed batches per measurement (default per workload: {defaults})")
    p.add_argument("--warmup", type=_positive_int, default=3,
                   help="batches read before the clock starts, the first batch included")
    p.add_argument("--json", action="store_true",
                   help="print a JSON document on stdout; the table goes to stderr")
    p.add_argument("--no-torch", action="store_true", help="measure shmloader only")
    p.add_argument("--epoch-bars", action="store_true",
                   help="show shmloader's own per-epoch progress bar (the Progress observer plugin)")
    p.add_argument("--no-shmloader", action="store_true", help="measure torch only")
    p.add_argument("--start-method", choices=START_METHODS, default="fork",
                   help="multiprocessing_context of both loaders (default: fork)")
    p.add_argument("--plot", metavar="PNG", default=None,
                   help="write grouped bars of batches/s to this file (needs matplotlib)")
    p.add_argument("--device", default="cpu",
                   help="'cuda' (or 'cuda:N'): time batches delivered to the GPU, pinned")
    return p  # fmt: skip


def _split(text: str) -> list[str]:
    return [part.strip() for part in text.split(",") if part.strip()]


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _parse_workload(parser: argparse.ArgumentParser, name: str) -> Workload:
    if name not in WORKLOADS:
        parser.error(f"--workloads: unknown workload {name!r}; choose from {', '.join(WORKLOADS)}")
    return WORKLOADS[name]


def _parse_count(parser: argparse.ArgumentParser, option: str, text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        parser.error(f"{option} must be non-negative integers, got {text!r}")
    return value


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; return the exit status (see the module docstring)."""
    try:
        opts = parse_args(argv)
    except SystemExit as exc:  # argparse: --help (0) or a usage error (2)
        return exc.code if isinstance(exc.code, int) else 2
    try:
        opts = _check_requirements(opts)
        return _run(opts)
    except UsageError as exc:
        print(f"shmloader bench: {exc}", file=sys.stderr)
        return 2


def _check_requirements(opts: Options) -> Options:
    """Fail early, with the reason, when a requested loader or the device is unavailable."""
    torch_ok = _torch_available()
    if opts.device != "cpu":
        if not torch_ok:
            raise UsageError(f"--device {opts.device} needs torch, which is not installed")
        import torch

        if not opts.device.startswith("cuda") or not torch.cuda.is_available():
            raise UsageError(f"--device {opts.device}: CUDA is not available on this machine "
                             "(torch.cuda.is_available() is False); run without --device")  # fmt: skip
    if "shmloader" in opts.loaders and _shmloader_loader_class() is None:
        raise UsageError("shmloader.DataLoader is not available in this installation; "
                         "use --no-shmloader to time torch alone")  # fmt: skip
    if "torch" in opts.loaders and not torch_ok:
        print("shmloader bench: torch is not installed; timing shmloader alone", file=sys.stderr)
        opts = _replace_loaders(opts, ("shmloader",))
    return opts


def _replace_loaders(opts: Options, loaders: tuple[str, ...]) -> Options:
    from dataclasses import replace

    return replace(opts, loaders=loaders)


def _torch_available() -> bool:
    try:
        import torch  # noqa: F401
    except ImportError:
        return False
    return True


def _torch_loader_class() -> Any:
    from torch.utils.data import DataLoader

    return DataLoader


def _shmloader_loader_class() -> Any:
    import shmloader

    return getattr(shmloader, "DataLoader", None)


def _run(opts: Options) -> int:
    # Before the run: the load average should show other work, not this benchmark's own.
    header = collect_header(opts.start_method, opts.device, _header_extra(opts))
    results: list[Measurement] = []
    cases = [(w, n, name) for w in opts.workloads for n in opts.workers for name in opts.loaders]
    with Progress(total=len(cases)) as progress:
        for workload, num_workers, name in cases:
            progress.step(f"{workload.name} workers={num_workers} {name}")
            results.append(measure(name, workload, num_workers, opts))
        h2d = _bandwidth_table(opts, progress) if opts.device != "cpu" else []
    _emit(opts, header, results, h2d)
    failed = any(not m.ok or m.leftover_children for m in results)
    return 1 if failed else 0


def _header_extra(opts: Options) -> dict[str, Any]:
    if "shmloader" not in opts.loaders:
        return {}
    extra = {"plugin_hook_cost_us_per_batch": _hook_costs()}
    if opts.device != "cpu":
        import shmloader

        mover = "shmloader.to_device" if hasattr(shmloader, "to_device") else "per-batch .to()"
        extra["shmloader_device_transfer"] = mover
    return extra


def _hook_costs() -> str:
    """Main-process cost of the observer hooks per batch (built-in stats, plus 1 and 4 observers)."""
    from shmloader.events import hook_cost_ns

    costs = {n: hook_cost_ns(n, calls=2_000, repeats=10) / 1000 for n in (0, 1, 4)}
    return ", ".join(f"{cost:.1f} ({n} extra observers)" for n, cost in costs.items())


def _emit(opts: Options, header: dict[str, Any], results: list[Measurement],
          h2d: list[Bandwidth]) -> None:  # fmt: skip
    human = sys.stderr if opts.json else sys.stdout
    text = format_header(header) + "\n\n" + format_results(results)
    if h2d:
        text += "\n\n" + format_bandwidth(h2d)
    print(text, file=human)
    if opts.plot:
        title = f"shmloader vs torch, {header['affinity_cpus']} cpus, {opts.start_method}"
        write_plot(results, opts.plot, title, out=human)
    if opts.json:
        json.dump(to_json_document(header, results, h2d), sys.stdout, indent=2)
        print(file=sys.stdout)


# --- one measurement ---------------------------------------------------------------------------


def measure(name: str, workload: Workload, num_workers: int, opts: Options) -> Measurement:
    """Build loader ``name`` for ``workload``, time one epoch, release it; never raises."""
    batches = opts.batches_for(workload)
    loader = error = None
    first_batch_s = seconds = 0.0
    try:
        loader = make_loader(name, workload, num_workers, opts)
        first_batch_s, seconds = _time_epoch(deliver(name, loader, opts.device), opts, batches)
    except Exception as exc:  # reported in the table; the other measurements still run
        error = _describe(exc)
    # After the except block, so that no traceback still holds the iterator and its workers.
    close_error = _close_reporting(loader)
    del loader
    gc.collect()
    return Measurement(workload.name, num_workers, name, workload.batch_size,
                       workload.batch_bytes, batches, seconds, first_batch_s,
                       leftover_children=_count_children(), error=error or close_error)  # fmt: skip


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def _close_reporting(loader: Any) -> str | None:
    try:
        close_loader(loader)
    except Exception as exc:
        return f"close() failed: {_describe(exc)}"
    return None


def make_loader(name: str, workload: Workload, num_workers: int, opts: Options) -> Any:
    """The same arguments for both loaders: torch's DataLoader signature."""
    loader_class = _torch_loader_class() if name == "torch" else _shmloader_loader_class()
    kwargs: dict[str, Any] = {
        "batch_size": workload.batch_size,
        "shuffle": False,
        "num_workers": num_workers,
        "pin_memory": opts.device != "cpu",
    }
    if num_workers > 0:
        kwargs["persistent_workers"] = True
        kwargs["multiprocessing_context"] = opts.start_method
    dataset = workload.dataset(opts.warmup + opts.batches_for(workload))
    if name == "shmloader" and opts.epoch_bars:
        from shmloader.builtin.progress import Progress

        total = opts.warmup + opts.batches_for(workload)
        kwargs["plugins"] = [Progress(total=total, desc=f"{workload.name} workers={num_workers}", leave=False)]
    return loader_class(dataset, **kwargs)


def close_loader(loader: Any) -> None:
    """``loader.close()`` where it exists; torch's loader is released by dropping it instead."""
    close = getattr(loader, "close", None)
    if callable(close):
        close()


def _time_epoch(source: Iterable[Any], opts: Options, batches: int) -> tuple[float, float]:
    sync = _synchronizer(opts.device)
    start = time.perf_counter()
    it = iter(source)
    touch_batch(next(it))
    sync()
    first_batch_s = time.perf_counter() - start
    for _ in range(opts.warmup - 1):
        touch_batch(next(it))
    sync()
    start = time.perf_counter()
    for _ in range(batches):
        touch_batch(next(it))
    sync()
    seconds = time.perf_counter() - start
    if next(it, None) is not None:
        raise RuntimeError("the loader yielded more batches than len(dataset) / batch_size")
    return first_batch_s, seconds


def _synchronizer(device: str) -> Callable[[], None]:
    if device == "cpu":
        return lambda: None
    import torch

    return lambda: torch.cuda.synchronize(device)


def _count_children() -> int:
    """Child processes still alive, not counting multiprocessing's own helpers."""
    import psutil

    helpers = ("resource_tracker", "forkserver", "semaphore_tracker")
    count = 0
    for child in psutil.Process().children(recursive=True):
        try:
            cmdline = " ".join(child.cmdline())
        except psutil.Error:  # exited meanwhile
            continue
        if child.status() != psutil.STATUS_ZOMBIE and not any(h in cmdline for h in helpers):
            count += 1
    return count


# --- device mode -------------------------------------------------------------------------------


def _bandwidth_table(opts: Options, progress: Progress) -> list[Bandwidth]:
    rows: list[Bandwidth] = []
    for workload in opts.workloads:
        progress.note(f"host-to-device copies: {workload.name}")
        rows += measure_h2d(workload, opts.device, use_shmloader="shmloader" in opts.loaders)
    return rows


if __name__ == "__main__":
    sys.exit(main())
