"""Time to the first batch, the two loaders alternated in one process.

    python benchmarks/first_batch.py --workload big --rounds 6
    python benchmarks/first_batch.py --workload image --rounds 6
    python benchmarks/first_batch.py --workload tiny --rounds 10 --workers 2

Each round builds a fresh dataset of the bench's workload (``python -m shmloader bench``'s, so its
cached samples are built inside the timing, as the bench times them), then times ``iter(loader)``
to the first batch with its pages touched, for ``shmloader.DataLoader`` and for torch's
``DataLoader`` (``num_workers=0``; or ``--workers``, when the loader is made inside the timing,
as the workers' start is), the order alternating by round; then reads the rest of the
epoch and closes what it made. Prints each loader's times in ms and their median. A single first batch per loader, as the
bench's table has, falls on whichever loader first meets memory the process has not touched yet;
alternating in one process shows what each costs once that is paid.
"""

from __future__ import annotations

import argparse
import functools
import gc
import statistics
import time


def build_parser() -> argparse.ArgumentParser:
    """This script's command line (tests/test_docs_commands.py parses the docs' commands with it)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workload", default="big", choices=("tiny", "image", "big"))
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--batches", type=int, default=10, help="batches per epoch (the first one timed)")
    p.add_argument("--workers", type=int, default=0, choices=range(0, 9), metavar="{0..8}",
                   help="num_workers of both loaders (default 0)")
    return p


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)

    import torch.utils.data as tud

    import shmloader
    from shmloader.cli.workloads import WORKLOADS, touch_batch

    workload = WORKLOADS[args.workload]
    loaders = {"shmloader": shmloader.DataLoader, "torch": tud.DataLoader}
    times: dict[str, list[float]] = {name: [] for name in loaders}
    for r in range(args.rounds):
        for name in (("shmloader", "torch") if r % 2 == 0 else ("torch", "shmloader")):
            make = functools.partial(loaders[name], workload.dataset(args.batches), batch_size=workload.batch_size,
                                     num_workers=args.workers)
            loader = None if args.workers else make()  # without workers, made before the timing (as ever)
            start = time.perf_counter()
            loader = make() if loader is None else loader
            it = iter(loader)
            touch_batch(next(it))
            times[name].append(1e3 * (time.perf_counter() - start))
            for batch in it:
                touch_batch(batch)
            del it
            getattr(loader, "close", lambda: None)()
            del loader
            gc.collect()
    for name, ms in times.items():
        print(f"{name}: first batch {' '.join(f'{t:.1f}' for t in ms)} ms; median {statistics.median(ms):.1f} ms")


if __name__ == "__main__":
    main()
