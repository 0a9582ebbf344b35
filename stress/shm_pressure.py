"""Shared-memory pressure: a small shm budget must give a clear ShmSpaceError, never a SIGBUS.

The budget is a small directory given to the loader through ``SHMLOADER_SHM_DIR``: a tmpfs of
``--budget-mib`` mounted for the run when this process may mount one (root in a container), or the
directory ``--dir`` if given; otherwise a plain temporary directory whose free space is *reported* as
the budget (``shmloader.transport.shm_space.shm_free_bytes`` patched: the pre-flight checks are exercised, the
kernel's ENOSPC is not). Scenarios:

1. ``preflight``: ``slot_bytes`` so large that the ring cannot fit: ShmSpaceError before any worker
   starts, naming the bytes needed and free and the remedies;
2. ``growth``: batches grow mid-epoch past what the budget can hold: ShmSpaceError when the ring
   would grow, and the batches before it were delivered intact;
3. ``filled``: another process fills the directory while the loader runs: the slots already made
   are reserved (``posix_fallocate``), so the epoch completes, with no SIGBUS, as long as the ring
   need not grow;
4. ``held``: the caller keeps every batch (``list(loader)``) of ``--held`` batches of 64 bytes, with
   two workers: each held batch must cost about its own pages, not a whole slot, so all of them
   fit (before held slots were trimmed, 7be46e3, 13 fitted in 16 MiB).

Every scenario must also leave no process and no segment. Ends with one ``PASS ...`` line (exit 0)
or ``FAIL ...`` line (exit 1).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import subprocess
import tempfile
from collections.abc import Callable, Iterator

import _common as c
import numpy as np

from shmloader import DataLoader, ShmSpaceError
from shmloader.transport import shm_space

MIB = 1 << 20


class Growing:
    """``n`` samples; sample ``i`` holds ``base + (i // 4) * step`` float64 values: batches of 4 grow."""

    def __init__(self, n: int, base: int, step: int) -> None:
        self.n, self.base, self.step = n, base, step

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> np.ndarray:
        return np.full(self.base + (i // 4) * self.step, float(i))


@contextlib.contextmanager
def budget_dir(args: argparse.Namespace) -> Iterator[tuple[str, str]]:
    """A directory of about ``--budget-mib`` and how the budget is enforced."""
    if args.dir:
        yield args.dir, "given directory"
        return
    with tempfile.TemporaryDirectory(prefix="shm_pressure_") as path:
        mounted = os.geteuid() == 0 and subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={args.budget_mib}m", "tmpfs", path],
            capture_output=True).returncode == 0
        if not mounted:
            budget = args.budget_mib * MIB
            real = shm_space.shm_free_bytes
            shm_space.shm_free_bytes = lambda d: budget - _used(d) if d == path else real(d)  # type: ignore
        try:
            yield path, (f"tmpfs of {args.budget_mib} MiB" if mounted else f"reported budget of {args.budget_mib} MiB")
        finally:
            if mounted:
                subprocess.run(["umount", path], check=False)
            else:
                shm_space.shm_free_bytes = real  # type: ignore[assignment]


def _used(path: str) -> int:
    """Bytes the directory's files take (their allocated blocks: a trimmed segment keeps its size)."""
    return sum(os.stat(os.path.join(path, n)).st_blocks * 512 for n in os.listdir(path))


def preflight(path: str, a: argparse.Namespace) -> str:
    loader: DataLoader = DataLoader(Growing(64, 16, 0), batch_size=4, num_workers=2, slot_bytes=a.budget_mib * MIB)
    try:
        iter(loader)
    except ShmSpaceError as exc:
        assert exc.free_bytes is not None and exc.needed_bytes is not None, str(exc)
        assert exc.free_bytes < exc.needed_bytes and exc.directory == path, str(exc)
        assert "--shm-size" in str(exc) and "SHMLOADER_SHM_DIR" in str(exc), str(exc)
        assert not c.worker_pids(), "workers were started before the pre-flight failed"
        return f"preflight: needed {exc.needed_bytes}, free {exc.free_bytes}"
    raise AssertionError("no ShmSpaceError for a ring larger than the budget")


def growth(path: str, a: argparse.Namespace) -> str:
    step = a.budget_mib * MIB // 8 // 4 // 64  # batch k needs k/64 of the budget
    loader: DataLoader = DataLoader(Growing(64, 16, step), batch_size=4, num_workers=2)
    got = 0
    try:
        for batch in loader:
            assert np.array_equal(batch[:, 0], np.arange(got * 4, got * 4 + 4, dtype=np.float64))
            got += 1
    except ShmSpaceError as exc:
        assert got > 0, "failed before the first batch: the scenario did not grow"
        return f"growth: {got} batches intact, then ShmSpaceError (needed {exc.needed_bytes}, free {exc.free_bytes})"
    raise AssertionError(f"all {got} growing batches fit in the budget: raise --budget-mib's pressure")


def filled(path: str, a: argparse.Namespace) -> str:
    loader: DataLoader = DataLoader(Growing(64, 1024, 0), batch_size=4, num_workers=2)
    it = iter(loader)
    got = [b[:, 0].tolist() for _, b in zip(range(4), it)]  # the ring reaches its steady size
    filler = os.path.join(path, "filler")
    with open(filler, "wb") as f:  # another tenant takes the rest of the directory
        try:
            while True:
                f.write(b"\0" * MIB)
                f.flush()
        except OSError:
            pass
    try:
        got += [b[:, 0].tolist() for b in it]
    finally:
        os.unlink(filler)
    assert got == [[float(i) for i in range(k, k + 4)] for k in range(0, 64, 4)]
    return f"filled: {len(got)} batches intact, 12 of them after the directory filled up"


def held(path: str, a: argparse.Namespace) -> str:
    loader: DataLoader = DataLoader(Growing(4 * a.held, 2, 0), batch_size=4, num_workers=2)  # 4 x 2 float64
    kept: list[np.ndarray] = []
    peak = 0
    try:
        for batch in loader:
            kept.append(batch)
            peak = max(peak, _used(path))
    except ShmSpaceError as exc:
        raise AssertionError(f"only {len(kept)} of {a.held} held batches of 64 bytes fit, then ShmSpaceError "
                             f"(needed {exc.needed_bytes}, free {exc.free_bytes})") from exc
    finally:
        loader.close()
    assert all(np.array_equal(b[:, 0], np.arange(4 * k, 4 * k + 4, dtype=np.float64)) for k, b in enumerate(kept))
    # a reported budget is not enforced by the kernel: what the held batches took must fit it all the same
    assert peak <= a.budget_mib * MIB, f"{len(kept)} held batches of 64 bytes took {peak} bytes of the directory"
    return f"held: {len(kept)} batches of 64 bytes held and intact, at most {peak} bytes of the directory in use"


SCENARIOS: dict[str, Callable[[str, argparse.Namespace], str]] = {
    "preflight": preflight, "growth": growth, "filled": filled, "held": held}


def build_parser() -> argparse.ArgumentParser:
    """This script's command line (tests/test_docs_commands.py parses the docs' commands with it)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--budget-mib", type=int, default=16)
    p.add_argument("--dir", default="", help="use this (small) directory instead of a new tmpfs")
    p.add_argument("--held", type=int, default=200, help="batches the held scenario keeps")
    p.add_argument("--only", choices=sorted(SCENARIOS), action="append", help="run only these scenarios")
    return p


def main(argv: list[str] | None = None) -> None:
    a = build_parser().parse_args(argv)
    results, problems = [], []
    with budget_dir(a) as (path, how):
        os.environ["SHMLOADER_SHM_DIR"] = path
        for name in a.only or list(SCENARIOS):
            try:
                results.append(SCENARIOS[name](path, a))
            except Exception as exc:  # a wrong error, or none: the scenario failed
                problems.append(f"{name}: {type(exc).__name__}: {' '.join(str(exc).split())[:400]}")
            left = c.leftovers(path) + c.leftovers()
            if left:
                problems.append(f"{name} left behind: " + ", ".join(left))
    text = "; ".join(problems + results) + f" ({how})"
    c.verdict(not problems, "shm_pressure: " + text)


if __name__ == "__main__":
    main()
