"""``python -m shmloader doctor``: checks of the machine against what a loader will need.

Owns: the checks (the configuration, in :mod:`shmloader.cli.doctor_config`: a bad ``SHMLOADER_*``
value is a problem, loader option or not (``SHMLOADER_PIN_BACKEND``,
``SHMLOADER_DISABLE_PLUGIN_AUTOLOAD``), parsed by the library's own code, an unknown
``SHMLOADER_*`` name a warning; shared-memory directory size and free bytes against the ring a
configuration needs, its page size (a tmpfs's ``huge=``), RLIMIT_MEMLOCK for page locking, start methods, CPUs, torch/cupy/CUDA,
segments left by dead owners) and their findings, each with a remedy. Runs in the CLI process only; torch and cupy are
imported lazily and guarded, so a broken install is a finding, not a crash. Promises: every
finding states the measurement it rests on; ``--clean`` removes only dead owners' segments (see
:mod:`shmloader.transport.sweep`); the exit code is 0 when no finding is a problem, 1 otherwise.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import multiprocessing
import os
from collections.abc import Mapping
from dataclasses import asdict, dataclass

import psutil

from shmloader.cli.doctor_config import check_configuration
from shmloader.cli.findings import INFO, OK, PROBLEM, WARNING, Finding
from shmloader.cli.options import int_at_least
from shmloader.config import Config
from shmloader.config_fields import parse_size, probe_dir
from shmloader.rlimits import soft_limit
from shmloader.transport.preflight import CONSUMER_SLOTS, ring_slots
from shmloader.transport.sweep import leftovers, sweep_dead_segments

__all__ = ["Finding", "RingPlan", "plan_ring", "run_checks", "format_findings", "add_arguments", "run"]

GUESS_SLOT_BYTES = 64 * 1024**2
_GUESS_MAX_WORKERS = 8
_MEMORY_FILESYSTEMS = ("tmpfs", "ramfs", "hugetlbfs")


# What plan_ring may have to guess -> (its words, the doctor option that gives it).
_GUESSABLE = {"workers": ("workers", "--workers"), "slot_bytes": ("slot size", "--slot-bytes")}


@dataclass(frozen=True)
class RingPlan:
    """The ring a configuration needs: ``transport.preflight.ring_slots`` slots of ``slot_bytes``.

    ``guessed_parts``: which of ``workers`` and ``slot_bytes`` neither an option nor the
    configuration gave (:func:`plan_ring` guessed them); :meth:`describe` names those alone."""

    workers: int
    prefetch_factor: int
    slot_bytes: int
    guessed_parts: tuple[str, ...] = ()

    @property
    def guessed(self) -> bool:
        return bool(self.guessed_parts)

    @property
    def slots(self) -> int:
        return ring_slots(self.workers, self.prefetch_factor)

    @property
    def ring_bytes(self) -> int:
        return self.slots * self.slot_bytes

    def describe(self) -> str:
        text = (f"{self.workers} workers x prefetch {self.prefetch_factor} + {CONSUMER_SLOTS} = "
                f"{self.slots} slots x {format_bytes(self.slot_bytes)} = {format_bytes(self.ring_bytes)}")
        if not self.guessed:
            return text
        words = ", ".join(_GUESSABLE[part][0] for part in self.guessed_parts)
        return text + f" (guessed: {words}; pass {'/'.join(_GUESSABLE[part][1] for part in self.guessed_parts)})"


def format_bytes(n: float) -> str:
    """``1.5 GiB``-style text for a byte count."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"  # pragma: no cover - loop always returns


def usable_cpus() -> int:
    """CPUs this process may run on (affinity), or the CPU count where affinity is unknown."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def plan_ring(config: Config, workers: int | None, prefetch: int | None, slot_bytes: int | None) -> RingPlan:
    """The ring to check: options given > the configuration > a guess (usable CPUs, 64 MiB slots)."""
    guessed: list[str] = []
    if workers is None:
        workers = config.num_workers
        if workers == 0:
            workers = min(usable_cpus(), _GUESS_MAX_WORKERS)
            guessed.append("workers")
    if prefetch is None:
        prefetch = config.prefetch_factor or 2
    if slot_bytes is None:
        slot_bytes = config.slot_bytes
    if slot_bytes == 0:  # sized from the first batch, which doctor cannot see
        slot_bytes = GUESS_SLOT_BYTES
        guessed.append("slot_bytes")
    return RingPlan(workers, prefetch, slot_bytes, tuple(guessed))


# -- the checks ------------------------------------------------------------------------------------


def _filesystem_of(path: str) -> str:
    real = os.path.realpath(path)
    best, fstype = "", "unknown"
    for part in psutil.disk_partitions(all=True):
        mount = part.mountpoint
        inside = real == mount or real.startswith(mount.rstrip("/") + "/")
        if inside and len(mount) > len(best):
            best, fstype = mount, part.fstype
    return fstype


def check_shm_dir(shm_dir: str, plan: RingPlan) -> list[Finding]:
    """The shm directory exists, is writable, memory-backed and has room for the ring."""
    name = "shm dir"
    if not os.path.isdir(shm_dir):
        return [Finding(name, PROBLEM, f"{shm_dir} is not a directory",
                        "set SHMLOADER_SHM_DIR to a tmpfs directory, e.g. /dev/shm")]
    problem = probe_dir(shm_dir)  # a file made and removed: os.access says yes to root even for /proc
    if problem:
        return [Finding(name, PROBLEM, f"{shm_dir} is not writable by this user ({problem})",
                        "set SHMLOADER_SHM_DIR to a directory you can write")]
    vfs = os.statvfs(shm_dir)
    total, free = vfs.f_blocks * vfs.f_frsize, vfs.f_bavail * vfs.f_frsize
    fstype = _filesystem_of(shm_dir)
    text = (f"{shm_dir} ({fstype}): {format_bytes(free)} free of {format_bytes(total)}; "
            f"the ring needs {format_bytes(plan.ring_bytes)}")
    found = []
    if plan.ring_bytes > free:
        found.append(Finding(name, PROBLEM, text,
                             "enlarge it (docker: --shm-size; kubernetes: an emptyDir with medium: Memory), "
                             "point SHMLOADER_SHM_DIR at a larger tmpfs, or lower num_workers, "
                             "prefetch_factor or slot_bytes"))
    elif plan.ring_bytes > free // 2:
        found.append(Finding(name, WARNING, text + " (over half the free space)",
                             "a ring that grows (batches kept by the user) may not fit; enlarge the directory"))
    else:
        found.append(Finding(name, OK, text))
    if fstype not in _MEMORY_FILESYSTEMS and fstype != "unknown":
        found.append(Finding(name, WARNING, f"{shm_dir} is on {fstype}, not a memory filesystem",
                             "segments there may be written back to disk; use a tmpfs such as /dev/shm"))
    return found


def _tmpfs_huge_option(path: str, mounts_file: str = "/proc/mounts") -> str | None:
    """The ``huge=`` option of the tmpfs that holds ``path`` (``never`` when not given); None when
    ``path`` is not on a tmpfs or the mount table cannot be read."""
    real, best, option = os.path.realpath(path), "", None
    try:
        with open(mounts_file) as mounts:
            for line in mounts:
                _dev, mount, fstype, options, *_ = line.split()
                inside = real == mount or real.startswith(mount.rstrip("/") + "/")
                if inside and len(mount) >= len(best):  # the deepest mount; of two on one path, the later (on top)
                    best = mount
                    option = None if fstype != "tmpfs" else next(
                        (o.removeprefix("huge=") for o in options.split(",") if o.startswith("huge=")), "never")
    except OSError:
        return None
    return option


def check_huge_pages(shm_dir: str, mounts_file: str = "/proc/mounts") -> Finding:
    """Whether the shm directory gives large slots 2 MiB pages (fewer TLB misses per batch copy)."""
    option = _tmpfs_huge_option(shm_dir, mounts_file)
    if option is None:
        return Finding("huge pages", INFO, f"{shm_dir} is not on a tmpfs (or /proc/mounts is unreadable): "
                                           "page size not checked")  # fmt: skip
    if option in ("always", "within_size"):
        return Finding("huge pages", OK, f"{shm_dir} is mounted huge={option}: slots of 2 MiB and more "
                                         "get 2 MiB pages")  # fmt: skip
    return Finding("huge pages", INFO,
                   f"{shm_dir} is mounted huge={option}: slots get 4 KiB pages; 'mount -o remount,huge=within_size "
                   f"{shm_dir}' (root) would give slots of 2 MiB and more 2 MiB pages: measure before and after "
                   "(benchmarks/pages.py, bench; docs/performance.md, 'Huge pages')")  # fmt: skip


def check_memlock(plan: RingPlan, pin_memory: bool) -> Finding:
    """RLIMIT_MEMLOCK against the ring, for page locking (mlock) of the slots."""
    limit = soft_limit("RLIMIT_MEMLOCK")
    if limit.value is None:
        return Finding("memlock", OK if limit.unlimited else INFO, limit.describe())
    text = f"{limit.describe(format_bytes)}; the ring is {format_bytes(plan.ring_bytes)}"
    if limit.value >= plan.ring_bytes:
        return Finding("memlock", OK, text)
    return Finding("memlock", WARNING if pin_memory else INFO,
                   text + ": mlock can lock only part of the ring", limit.remedy() + " if you pin without CUDA")


def check_start_methods(config: Config) -> Finding:
    """Which start methods exist here, and whether the configured one is among them."""
    methods = multiprocessing.get_all_start_methods()
    default = multiprocessing.get_start_method(allow_none=True) or methods[0]
    text = f"available: {', '.join(methods)} (default {default})"
    chosen = config.multiprocessing_context
    if isinstance(chosen, str) and chosen not in methods:
        return Finding("start methods", PROBLEM, f"{text}; configured {chosen!r} is not available",
                       "set SHMLOADER_START_METHOD to one of " + ", ".join(methods))
    return Finding("start methods", OK, text + (f"; configured {chosen}" if chosen else ""))


def check_cpus(plan: RingPlan) -> Finding:
    """CPU count and affinity against the number of workers."""
    count, usable = os.cpu_count() or 1, usable_cpus()
    text = f"{count} CPUs, {usable} usable by this process (affinity); {plan.workers} workers planned"
    if plan.workers > usable:
        return Finding("cpus", WARNING, text + ": workers will compete for CPUs",
                       f"use num_workers <= {usable} unless loading waits on I/O")
    return Finding("cpus", OK, text)


def _probe(module: str) -> tuple[object | None, str]:
    if importlib.util.find_spec(module) is None:
        return None, "not installed"
    try:
        return importlib.import_module(module), ""
    except Exception as exc:  # a broken install is a finding, not a crash
        return None, f"fails to import: {type(exc).__name__}: {exc}"


def _cuda_devices(torch: object | None, cupy: object | None) -> int:
    try:
        if torch is not None and torch.cuda.is_available():  # type: ignore[attr-defined]
            return int(torch.cuda.device_count())  # type: ignore[attr-defined]
        if cupy is not None:
            return int(cupy.cuda.runtime.getDeviceCount())  # type: ignore[attr-defined]
    except Exception:
        return 0
    return 0


def check_accelerators(pin_memory: bool) -> list[Finding]:
    """torch and cupy (version or why not), and how many CUDA devices they see."""
    torch, torch_note = _probe("torch")
    cupy, cupy_note = _probe("cupy")
    found = [
        Finding("torch", INFO if torch is None else OK,
                torch_note or f"torch {getattr(torch, '__version__', '?')}"),
        Finding("cupy", INFO if cupy is None else OK,
                cupy_note or f"cupy {getattr(cupy, '__version__', '?')}"),
    ]
    devices = _cuda_devices(torch, cupy)
    if devices:
        found.append(Finding("cuda", OK, f"{devices} CUDA device(s)"))
    elif pin_memory:
        found.append(Finding("cuda", WARNING, "no CUDA device: pin_memory=True will return unpinned batches",
                             "unset SHMLOADER_PIN_MEMORY on machines without a GPU"))
    else:
        found.append(Finding("cuda", INFO, "no CUDA device"))
    return found


def check_leftovers(shm_dir: str, clean: bool) -> list[Finding]:
    """Segments of dead owners (removed with ``clean``) and of live loaders."""
    items = leftovers(shm_dir)
    dead = [i for i in items if not i.owner_alive]
    live = [i for i in items if i.owner_alive]
    found = []
    if dead:
        held = format_bytes(sum(i.size_bytes for i in dead))
        pids = ", ".join(sorted({str(i.owner_pid) for i in dead}))
        names = ", ".join(i.name for i in dead)
        if clean:
            removed = sweep_dead_segments(shm_dir)
            found.append(Finding("leftovers", OK, f"removed {len(removed)} segment(s) of dead owners "
                                 f"(pids {pids}, {held}): {', '.join(removed)}"))
        else:
            found.append(Finding("leftovers", PROBLEM, f"{len(dead)} segment(s) of dead owners "
                                 f"(pids {pids}) hold {held}: {names}",
                                 "run 'python -m shmloader doctor --clean' to remove them"))
    if live:
        pids = ", ".join(sorted({str(i.owner_pid) for i in live}))
        found.append(Finding("leftovers", INFO, f"{len(live)} segment(s) of running loaders (pids {pids}) "
                             f"hold {format_bytes(sum(i.size_bytes for i in live))}"))
    if not items:
        found.append(Finding("leftovers", OK, f"no segments of ours in {shm_dir}"))
    return found


def run_checks(environ: Mapping[str, str], workers: int | None = None, prefetch: int | None = None,
               slot_bytes: int | None = None, clean: bool = False) -> tuple[RingPlan, list[Finding]]:
    """Every check, in the order printed; returns the ring plan checked and the findings."""
    config, found = check_configuration(environ)
    plan = plan_ring(config, workers, prefetch, slot_bytes)
    found += check_shm_dir(config.shm_dir, plan)
    found.append(check_huge_pages(config.shm_dir))
    found.append(check_memlock(plan, config.pin_memory))
    found.append(check_start_methods(config))
    found.append(check_cpus(plan))
    found += check_accelerators(config.pin_memory)
    found += check_leftovers(config.shm_dir, clean)
    return plan, found


def format_findings(plan: RingPlan, findings: list[Finding]) -> str:
    """The text report: the ring plan, one line per finding (+ its remedy), then a summary."""
    lines = [f"ring plan: {plan.describe()}"]
    for item in findings:
        lines.append(f"[{item.status}]".ljust(10) + f"{item.check:<14}{item.message}")
        if item.remedy and item.status in (WARNING, PROBLEM):
            lines.append(" " * 24 + f"remedy: {item.remedy}")
    problems = sum(f.status == PROBLEM for f in findings)
    warnings = sum(f.status == WARNING for f in findings)
    lines.append(f"{problems} problem(s), {warnings} warning(s)")
    return "\n".join(lines)


# -- command line ----------------------------------------------------------------------------------


def _size(text: str) -> int:
    try:
        return parse_size(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size (e.g. 4096, 64MiB, 1GiB)") from None


_positive = int_at_least(1)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``doctor``."""
    parser.add_argument("--workers", type=_positive, help="workers to plan the ring for (default: config, else usable CPUs up to 8)")
    parser.add_argument("--prefetch-factor", type=_positive, help="tasks outstanding per worker (default: config, else 2)")
    parser.add_argument("--slot-bytes", type=_size, help="bytes per slot, e.g. 64MiB (default: config, else 64MiB)")
    parser.add_argument("--clean", action="store_true", help="remove segments whose owner process is dead")
    parser.add_argument("--json", action="store_true", help="print the findings as JSON")


def run(args: argparse.Namespace, environ: Mapping[str, str] | None = None) -> int:
    """Run the checks and print them; 0 when nothing is a problem, 1 otherwise."""
    plan, found = run_checks(os.environ if environ is None else environ, args.workers,
                             args.prefetch_factor, args.slot_bytes, args.clean)
    if args.json:
        ring = {**asdict(plan), "guessed": plan.guessed, "slots": plan.slots, "ring_bytes": plan.ring_bytes}
        body = {"ring": ring,
                "findings": [asdict(f) for f in found]}
        print(json.dumps(body, indent=2))
    else:
        print(format_findings(plan, found))
    return 1 if any(f.status == PROBLEM for f in found) else 0
