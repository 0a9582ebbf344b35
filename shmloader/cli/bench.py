"""``python -m shmloader bench``: shmloader's DataLoader against torch's, side by side, in rounds.

Owns the benchmark's run: which measurements, in which order, how often, and what is printed.
Runs in one main process, which builds each loader, times it and releases it before the next
(:mod:`shmloader.cli.measure`), so no worker process or shared-memory segment outlives its
measurement. ``--train`` hands the command line to the end-to-end training benchmark
(:mod:`shmloader.cli.train`).

A *case* is one workload (:mod:`shmloader.cli.workloads`) with one ``num_workers``. Every round
measures every case once with each loader, shmloader first in even rounds and torch first in odd
ones, so that a slow drift of the machine weighs on both; then, once per workload and round, the
copy limit (:mod:`shmloader.cli.copylimit`) with ``max(--workers)`` processes, one reused buffer
each, and the ring copy limit, the same processes each rotating over its share of a loader's ring
slots. ``--repeat`` rounds in all. The report (:mod:`shmloader.cli.report`) gives, per loader, the
median over the rounds of batches/s, its range and spread (flagged when too wide to trust), GB/s,
time to first batch and main-process CPU per batch; per case, the ratios of medians
shmloader/torch; per shmloader row at ``max(--workers)``, its fraction of each copy limit.
``--json`` adds every round's figures. With ``--device cuda`` batches are moved to the GPU as a
training loop would, and a table of host-to-device copy bandwidth by source buffer is added.

Exit status: 0 when every measurement succeeded, 1 when one failed (it is reported and the rest
still run) or the figure could not be written, 2 for a usage error, a bad ``SHMLOADER_*`` value or a
missing requirement (no CUDA for ``--device cuda``; a ``--plot`` path that cannot be written), each
found before the run.
"""

from __future__ import annotations

import json
import sys
from dataclasses import replace
from typing import Any

from shmloader.cli import plot
from shmloader.cli.copylimit import measure_copy_limit, ring_buffers_per_process
from shmloader.cli.measure import measure, shmloader_loader_class
from shmloader.cli.options import Options, parse_args
from shmloader.cli.progress import Progress
from shmloader.cli.records import Bandwidth, CopyLimitRun, Measurement
from shmloader.cli.report import (
    collect_header,
    format_bandwidth,
    format_copy_limits,
    format_header,
    format_results,
    to_json_document,
)
from shmloader.cli.workloads import Workload, measure_h2d
from shmloader.config import check_environment
from shmloader.errors import ConfigError

__all__ = ["Options", "main", "parse_args", "round_order"]


class UsageError(Exception):
    """The command line asks for something this machine cannot do; exit status 2."""


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark (or, with ``--train``, the training benchmark); return the exit status."""
    args = list(sys.argv[1:] if argv is None else argv)
    if "--train" in args:
        from shmloader.cli import train

        return train.main([a for a in args if a != "--train"])
    try:
        opts = parse_args(args)
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
    try:  # a bad SHMLOADER_* value would fail every measurement: say so once, before any
        check_environment()
    except ConfigError as exc:
        raise UsageError(str(exc)) from None
    torch_ok = _torch_available()
    if opts.device != "cpu":
        if not torch_ok:
            raise UsageError(f"--device {opts.device} needs torch, which is not installed")
        if _device_type(opts.device) == "cpu":
            return _check_requirements(replace(opts, device="cpu"))
        import torch

        if not torch.cuda.is_available():
            raise UsageError(f"--device {opts.device}: CUDA is not available on this machine "
                             "(torch.cuda.is_available() is False); run without --device")  # fmt: skip
    if "shmloader" in opts.loaders and shmloader_loader_class() is None:
        raise UsageError("shmloader.DataLoader is not available in this installation; "
                         "use --no-shmloader to time torch alone")  # fmt: skip
    if "torch" in opts.loaders and not torch_ok:
        print("shmloader bench: torch is not installed; timing shmloader alone", file=sys.stderr)
        opts = replace(opts, loaders=("shmloader",))
    return opts


def _device_type(device: str) -> str:
    """``cpu`` or ``cuda``, as torch parses ``device``; a UsageError naming it for anything else."""
    import torch

    try:
        kind = torch.device(device).type
    except (RuntimeError, ValueError) as exc:
        raise UsageError(f"--device {device!r} is not a device torch knows ({exc}); "
                         "use cpu, cuda or cuda:N") from None
    if kind not in ("cpu", "cuda"):
        raise UsageError(f"--device {device!r}: only cpu and cuda are supported, not {kind}")
    return kind


def _torch_available() -> bool:
    try:
        import torch  # noqa: F401
    except ImportError:
        return False
    return True


def round_order(loaders: tuple[str, ...], round_index: int) -> tuple[str, ...]:
    """The loaders in the order round ``round_index`` measures them: reversed in odd rounds."""
    return loaders if round_index % 2 == 0 else loaders[::-1]


def _run(opts: Options) -> int:
    # Before the run: the load average should show other work, not this benchmark's own.
    header = collect_header(opts.start_method, opts.device, _header_extra(opts))
    results: list[Measurement] = []
    limits: list[CopyLimitRun] = []
    rings: list[CopyLimitRun] = []
    limit_steps = 2 if opts.copy_limit_processes > 0 else 0
    per_round = len(opts.workloads) * (len(opts.workers) * len(opts.loaders) + limit_steps)
    with Progress(total=per_round * opts.repeat) as progress:
        for r in range(opts.repeat):
            _run_round(opts, r, progress, results, limits, rings)
        h2d = _bandwidth_table(opts, progress) if opts.device != "cpu" else []
    plotted = _emit(opts, header, results, limits, rings, h2d)
    failed = any(not m.ok or m.leftover_children for m in results) or any(not c.ok for c in limits + rings)
    return 1 if failed or not plotted else 0


def _run_round(opts: Options, r: int, progress: Progress, results: list[Measurement],
               limits: list[CopyLimitRun], rings: list[CopyLimitRun]) -> None:  # fmt: skip
    """Round ``r``: every case with each loader (in :func:`round_order`), then each workload's copy
    limit (one buffer per process) and ring copy limit (:func:`ring_buffers_per_process` buffers)."""
    step = f"round {r + 1}/{opts.repeat}:"
    for workload in opts.workloads:
        for num_workers in opts.workers:
            for position, name in enumerate(round_order(opts.loaders, r)):
                progress.step(f"{step} {workload.name} workers={num_workers} {name}")
                results.append(measure(name, workload, num_workers, opts, r, position))
        if opts.copy_limit_processes > 0:
            _run_limits(opts, workload, r, progress, limits, rings)


def _run_limits(opts: Options, workload: Workload, r: int, progress: Progress,
                limits: list[CopyLimitRun], rings: list[CopyLimitRun]) -> None:  # fmt: skip
    """One workload's copy limit (appended to ``limits``), then its ring copy limit (to ``rings``):
    the same processes and batches, one buffer of private memory per process against a ring's
    share of buffers in the shared-memory directory, where slots live."""
    processes = opts.copy_limit_processes
    for name, buffers, runs in (("copy limit", 1, limits),
                                ("ring copy limit", ring_buffers_per_process(processes), rings)):  # fmt: skip
        progress.step(f"round {r + 1}/{opts.repeat}: {workload.name} {name}")
        runs.append(measure_copy_limit(workload, processes, opts.batches_for(workload), opts.start_method, r,
                                       buffers=buffers, shared=runs is rings))  # fmt: skip


def _header_extra(opts: Options) -> dict[str, Any]:
    extra: dict[str, Any] = {
        "repeat": opts.repeat,
        "round_order": "even rounds: " + " then ".join(round_order(opts.loaders, 0))
                       + "; odd rounds: the reverse",
        "copy_limit_processes": opts.copy_limit_processes,
        "ring_copy_limit_buffers_per_process":
            ring_buffers_per_process(opts.copy_limit_processes) if opts.copy_limit_processes else 0,
    }  # fmt: skip
    if "torch" in opts.loaders and _torch_available():
        import torch

        # torch collates on its intra-op thread pool where there are no workers; on a busy machine
        # that pool decides its rate (docs/performance.md, "Why torch's num_workers=0 rate swings").
        extra["torch_intra_op_threads"] = torch.get_num_threads()
    if "shmloader" not in opts.loaders:
        return extra
    extra["plugin_hook_cost_us_per_batch"] = _hook_costs()
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


def _emit(opts: Options, header: dict[str, Any], results: list[Measurement], limits: list[CopyLimitRun],
          rings: list[CopyLimitRun], h2d: list[Bandwidth]) -> bool:  # fmt: skip
    """Print the tables, then the JSON document (``--json``), then draw the figure (``--plot``):
    a figure that cannot be written costs the figure alone. False when it could not be written."""
    human = sys.stderr if opts.json else sys.stdout
    text = format_header(header) + "\n\n" + format_results(results, limits, rings)
    if limits or rings:
        text += "\n\n" + format_copy_limits(limits, rings)
    if h2d:
        text += "\n\n" + format_bandwidth(h2d)
    print(text, file=human)
    if opts.json:
        json.dump(to_json_document(header, results, limits, h2d, rings), sys.stdout, indent=2)
        print(file=sys.stdout, flush=True)
    if not opts.plot:
        return True
    title = f"shmloader vs torch, {header['affinity_cpus']} cpus, {opts.start_method}"
    try:
        plot.write_plot(results, opts.plot, title, out=human)
    except (OSError, ValueError, RuntimeError) as exc:  # the path was checked up front; the disk may still fail
        print(f"shmloader bench: --plot: could not write {opts.plot}: {exc}", file=sys.stderr)
        return False
    return True


def _bandwidth_table(opts: Options, progress: Progress) -> list[Bandwidth]:
    rows: list[Bandwidth] = []
    for workload in opts.workloads:
        progress.note(f"host-to-device copies: {workload.name}")
        rows += measure_h2d(workload, opts.device, use_shmloader="shmloader" in opts.loaders)
    return rows


if __name__ == "__main__":
    sys.exit(main())
