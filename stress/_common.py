"""What the stress scripts share: a checkable dataset, a shuffling batch sampler, leak checks, verdicts.

Runs in the script's main process and (the dataset) in its workers; importable by reference from
spawned workers because the script's directory is on their ``sys.path``. Promises: every sample is
a pure function of its index, so a batch's checksum says whether it is exactly the batch due; a
fault encoded in an index fires at most once (a marker file made with ``O_CREAT | O_EXCL``), so a
retried task succeeds; ``verdict`` prints one final ``PASS ...``/``FAIL ...`` line and exits 0/1.
"""

from __future__ import annotations

import ctypes
import faulthandler
import multiprocessing
import os
import random
import signal
import sys
import threading
import zlib
from collections import Counter
from collections.abc import Iterator
from typing import Any

import numpy as np
import psutil

from shmloader import get_worker_info

SAMPLE_LEN = 64
# an index carries (epoch, fault, sample): index = (epoch * len(FAULTS) + fault) * n + sample
FAULTS = ("none", "exit", "segv", "hang")


def sample(i: int) -> np.ndarray:
    """Sample ``i``: distinct, deterministic, a few hundred bytes."""
    return (np.arange(SAMPLE_LEN, dtype=np.int64) * 7919 + i * 104729) % 1000003


def checksum(batch: np.ndarray) -> int:
    return zlib.crc32(np.ascontiguousarray(batch).tobytes())


def expected_checksum(samples: list[int]) -> int:
    return checksum(np.stack([sample(i) for i in samples]))


class FaultingDataset:
    """``n`` samples; an index may carry a fault (see ``FAULTS``) that fires once, in a worker."""

    def __init__(self, n: int, marker_dir: str) -> None:
        self.n, self.marker_dir = n, marker_dir

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> np.ndarray:
        i = index % self.n
        code = (index // self.n) % len(FAULTS)
        if code and get_worker_info() is not None and first_time(self.marker_dir, index):
            _fault(FAULTS[code])
        return sample(i)


def first_time(marker_dir: str, key: int | str) -> bool:
    """True once per ``key`` across every process: the first caller makes its marker file."""
    try:
        fd = os.open(os.path.join(marker_dir, str(key)), os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
    except FileExistsError:
        return False
    os.close(fd)
    return True


def _fault(kind: str) -> None:
    if kind == "exit":
        os._exit(3)
    if kind == "segv":
        faulthandler.disable()
        ctypes.string_at(0)
    if kind == "hang":
        threading.Event().wait()


class PlannedBatches:
    """A batch sampler the script plans per epoch: ``plan`` is a list of index batches."""

    def __init__(self) -> None:
        self.plan: list[list[int]] = []

    def __iter__(self) -> Iterator[list[int]]:
        return iter([list(b) for b in self.plan])

    def __len__(self) -> int:
        return len(self.plan)


def plan_epoch(rng: np.random.Generator, n: int, batch_size: int, epoch: int,
               fault_rate: float, hang_share: float) -> tuple[list[list[int]], list[list[int]], dict[str, int]]:
    """Index batches for one epoch (shuffled; some indices carry a fault), the plain sample batches
    they must produce, and how many faults of each kind were planted."""
    order = rng.permutation(n)
    planted = {k: 0 for k in FAULTS[1:]}
    batches, plain = [], []
    for start in range(0, n, batch_size):
        chunk = [int(i) for i in order[start:start + batch_size]]
        coded = []
        for i in chunk:
            code = 0
            if rng.random() < fault_rate:
                code = 3 if rng.random() < hang_share else int(rng.integers(1, 3))
                planted[FAULTS[code]] += 1
            coded.append((epoch * len(FAULTS) + code) * n + i)
        batches.append(coded)
        plain.append(chunk)
    return batches, plain, planted


class PlantedInitFailure(Exception):
    """What ``FlakyInit`` raises: a ``worker_init_fn`` failure the script planted."""


class FlakyInit:
    """A ``worker_init_fn`` that raises ``PlantedInitFailure`` in a share ``rate`` of worker starts
    (each start draws on its own pid), leaving a marker file per failure so the script can count them."""

    def __init__(self, rate: float, seed: int, marker_dir: str) -> None:
        self.rate, self.seed, self.marker_dir = rate, seed, marker_dir

    def __call__(self, worker_id: int) -> None:
        if random.Random(f"{self.seed}-{os.getpid()}").random() >= self.rate:
            return
        first_time(self.marker_dir, f"init-{os.getpid()}")
        raise PlantedInitFailure(f"planted worker_init_fn failure in worker {worker_id} (pid {os.getpid()})")


def planted_init_failures(marker_dir: str) -> int:
    return sum(name.startswith("init-") for name in os.listdir(marker_dir))


def planted_as_none(it: Iterator[Any], raised: Counter[str]) -> Iterator[Any]:
    """The batches of ``it``, with None in the place of each ``PlantedInitFailure`` it raises (the
    batch whose task that failure answered: a trainer may catch it and go on), counted in
    ``raised["init"]``."""
    while True:
        try:
            batch = next(it)
        except StopIteration:
            return
        except PlantedInitFailure:
            raised["init"] += 1
            yield None
            continue
        yield batch


def fits(want: list[int], got: list[int | None], ordered: bool, whole: bool = True) -> bool:
    """Whether ``got`` holds the batches of ``want`` exactly once each (in ``want``'s order where
    ``ordered``), a None standing in the place of a batch whose task a planted ``worker_init_fn``
    failure answered; with ``whole`` false, the batches of a pass left early (``got`` may be short)."""
    if len(got) > len(want) or (whole and len(got) != len(want)):
        return False
    if ordered:
        return all(g is None or g == w for w, g in zip(want, got))
    return not Counter(g for g in got if g is not None) - Counter(want)


def worker_pids() -> list[int]:
    return [p.pid for p in multiprocessing.active_children() if p.pid is not None]


def is_helper(p: psutil.Process, cmd: str) -> bool:
    """Whether ``p`` (command line ``cmd``) is multiprocessing's resource tracker or this process's
    fork server. Known by their modules, not by a bare word: a fork worker keeps this script's
    command line, which may name the start methods (``--methods fork,forkserver``), and a
    forkserver worker the fork server's (it is the server's child, not ours)."""
    return "multiprocessing.resource_tracker" in cmd or (
        "multiprocessing.forkserver" in cmd and p.ppid() == os.getpid())


def leftovers(shm_dir: str = "/dev/shm", helpers: frozenset[int] = frozenset()) -> list[str]:
    """Child processes and segments of ours still present. Multiprocessing's resource tracker and
    forkserver (started once, they live as long as this process) are not leftovers, nor are the
    ``helpers`` pids (such a helper the script killed, a zombie until CPython reaps it)."""
    found = []
    for p in psutil.Process().children(recursive=True):
        if p.pid in helpers:
            continue
        try:
            cmd = " ".join(p.cmdline())
            if is_helper(p, cmd) and p.status() != psutil.STATUS_ZOMBIE:
                continue
            found.append(f"process {p.pid} ({p.status()})")
        except psutil.NoSuchProcess:
            continue
    prefix = f"shml_{os.getpid()}_"
    found += [f"segment {n}" for n in sorted(os.listdir(shm_dir)) if n.startswith(prefix)]
    return found


def rss_bytes(pids: list[int]) -> int:
    total = 0
    for pid in pids:
        try:
            total += psutil.Process(pid).memory_info().rss
        except psutil.NoSuchProcess:
            continue
    return total


def verdict(ok: bool, text: str) -> None:
    """Print the one final line and exit with the matching code."""
    print(("PASS " if ok else "FAIL ") + text, flush=True)
    sys.exit(0 if ok else 1)


def ignore_sigpipe() -> None:
    """SIGPIPE's default action, as command-line tools set it (``| head`` ends them quietly): a
    loader must then survive its workers' deaths all the same (tests/test_sigpipe.py)."""
    if hasattr(signal, "SIGPIPE"):
        signal.signal(signal.SIGPIPE, signal.SIG_DFL)
