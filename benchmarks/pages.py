"""What page size costs the one copy a worker must make: a batch stacked into private memory and
into a shared-memory segment, interleaved in one process.

    python benchmarks/pages.py                       # the bench's big batch: 16 x float32[1024,1024]
    python benchmarks/pages.py --workload image --rounds 21

Three destinations of the batch's shape, each written once before the clock starts, then
``--rounds`` rounds of ``--batches`` ``np.stack(samples, out=...)`` into each in turn:

- *private, huge pages*: ``np.empty``, which numpy backs with 2 MiB pages where the kernel allows
  (it calls ``madvise(MADV_HUGEPAGE)`` on large allocations): the bench's one-buffer copy limit;
- *private, 4 KiB pages*: the same with numpy's advice switched off;
- *shared*: a segment of the shared-memory directory (``SHMLOADER_SHM_DIR``, default /dev/shm),
  as a slot is and as the bench's ring copy limit's buffers are. A tmpfs backs it with 4 KiB pages
  unless it is mounted with ``huge=within_size`` or ``huge=always``.

Prints the median ms per batch of each (and the lowest), the directory's ``huge=`` mount option,
and the shared segment's huge pages (``ShmemPmdMapped`` in /proc/meminfo while it is mapped).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Any


def _mount_option(path: str) -> str:
    """The ``huge=`` option of the mount that holds ``path`` (``never`` when not given)."""
    best, option = "", "never"
    with open("/proc/mounts") as mounts:
        for line in mounts:
            fields = line.split()
            if path.startswith(fields[1]) and len(fields[1]) >= len(best):  # the last mount on a path is on top
                best = fields[1]
                option = next((o[5:] for o in fields[3].split(",") if o.startswith("huge=")), "never")
    return option


def _meminfo_kib(key: str) -> int:
    with open("/proc/meminfo") as info:
        return next((int(line.split()[1]) for line in info if line.startswith(key + ":")), 0)


def build_parser() -> argparse.ArgumentParser:
    """This script's command line (tests/test_docs_commands.py parses the docs' commands with it)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workload", choices=["image", "big"], default="big")
    parser.add_argument("--rounds", type=int, default=11)
    parser.add_argument("--batches", type=int, default=5)
    return parser


def main(argv: list[str]) -> int:
    import numpy as np

    from shmloader.cli.workloads import WORKLOADS
    from shmloader.config import resolve_config
    from shmloader.transport.segment import Segment

    args = build_parser().parse_args(argv)
    workload = WORKLOADS[args.workload]
    (field,) = [f for f in workload.fields if f.nbytes * workload.batch_size >= 1 << 20]  # the large field
    dataset = workload.dataset(1)
    samples = [dataset[i] for i in range(workload.batch_size)]
    column = [s[workload.fields.index(field)] if len(workload.fields) > 1 else s for s in samples]
    shape = (workload.batch_size, *field.shape)
    shm_dir = resolve_config({}).shm_dir

    try:  # numpy's own switch for its huge-page advice (private; numpy.core before numpy 2)
        from numpy._core.multiarray import _set_madvise_hugepage  # type: ignore[attr-defined]
    except ImportError:
        from numpy.core.multiarray import _set_madvise_hugepage  # type: ignore[attr-defined,no-redef]

    huge = np.empty(shape, field.dtype)
    _set_madvise_hugepage(False)
    small = np.empty(shape, field.dtype)
    _set_madvise_hugepage(True)
    before = _meminfo_kib("ShmemPmdMapped")
    segment = Segment.create(shm_dir, int(np.prod(shape)) * np.dtype(field.dtype).itemsize)
    segment.unlink()  # the mapping stays; nothing is left in the directory
    shared: np.ndarray[Any, Any] = np.ndarray(shape, field.dtype, buffer=segment.buf)  # annotated: older numpy's stubs ask
    targets: dict[str, Any] = {"private, huge pages": huge, "private, 4 KiB pages": small, "shared": shared}
    times: dict[str, list[float]] = {name: [] for name in targets}
    for out in targets.values():
        np.stack(column, out=out)  # every page faulted in before the clock starts
    shared_huge_kib = _meminfo_kib("ShmemPmdMapped") - before
    for r in range(args.rounds):
        order = list(targets) if r % 2 == 0 else list(reversed(targets))
        for name in order:
            t0 = time.perf_counter()
            for _ in range(args.batches):
                np.stack(column, out=targets[name])
            times[name].append((time.perf_counter() - t0) / args.batches * 1e3)
    print(f"{args.workload}: {shape} {np.dtype(field.dtype).name}, {args.rounds} rounds x {args.batches} batches; "
          f"{shm_dir} mounted huge={_mount_option(shm_dir)}, the shared segment's huge pages: "
          f"{shared_huge_kib // 1024} MiB")
    for name, values in times.items():
        print(f"{name}: {statistics.median(values):.2f} ms per batch (lowest {min(values):.2f})")
    del shared
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
