"""What stress/combos.py runs over: datasets whose batches vary in size, and the plan of an epoch.

Runs in the script's main process and (the datasets) in its workers. Promises: every sample is a
pure function of its number and its size level, so a batch's checksum says whether it is exactly
the batch due; a map-style index also carries a fault (``_common.FAULTS``) that fires once, in a
worker; batches change size from one stretch of an epoch to the next (small, a burst of large ones,
small again), so slots grow, then follow the batches down.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator

import _common as c
import numpy as np

from shmloader import IterableDataset, get_worker_info

# float64 values per sample at each size level: 512 B .. 256 KiB (a batch of 16 at the top: 4 MiB,
# four times the first 1 MiB slot)
LEVELS = (64, 1024, 8192, 32768)


def sample(i: int, level: int) -> np.ndarray:
    """Sample ``i`` at ``level``: distinct, deterministic."""
    return (np.arange(LEVELS[level], dtype=np.float64) * 7919 + i * 104729) % 1000003


def expected_checksum(samples: list[int], level: int) -> int:
    return c.checksum(np.stack([sample(i, level) for i in samples]))


def encode(n: int, i: int, fault: int, level: int, epoch: int) -> int:
    """A map-style index: sample ``i`` of ``n`` at ``level``, with fault ``fault``, in ``epoch``."""
    return i + n * (fault + len(c.FAULTS) * (level + len(LEVELS) * epoch))


class SizedFaulting:
    """``n`` map-style samples; an index (``encode``) says the sample, its size and a fault that fires
    once, in a worker (a marker file keyed by the whole index says whether it has)."""

    def __init__(self, n: int, marker_dir: str) -> None:
        self.n, self.marker_dir = n, marker_dir

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> np.ndarray:
        i, rest = index % self.n, index // self.n
        fault, level = rest % len(c.FAULTS), (rest // len(c.FAULTS)) % len(LEVELS)
        if fault and get_worker_info() is not None and c.first_time(self.marker_dir, index):
            c._fault(c.FAULTS[fault])
        return sample(i, level)


def stream_level(i: int, per_round: int) -> int:
    """The size level of stream sample ``i``: constant over each round of ``per_round`` samples
    (one batch of each worker), so a worker's batch is one size; a burst of large rounds mid-way."""
    r = i // per_round
    return 3 if r % 7 == 3 else (2 if r % 7 == 4 else r % 2)


_ITERS = 0  # calls of SizedStream.__iter__ in this process


class SizedStream(IterableDataset):
    """``n`` stream samples, worker ``w`` of ``k`` yielding ``w, w + k, ...``; about one ``__iter__``
    call in ``die_every`` in a worker kills it by a signal before it reads anything: a death between
    the epoch's reset and its acknowledgement (or while it starts), which a restart must absorb."""

    def __init__(self, n: int, batch_size: int, marker_dir: str, die_every: int) -> None:
        self.n, self.batch_size, self.marker_dir, self.die_every = n, batch_size, marker_dir, die_every

    def __iter__(self) -> Iterator[np.ndarray]:
        info = get_worker_info()
        w, k = (info.id, info.num_workers) if info is not None else (0, 1)
        if info is not None and self.die_every:
            global _ITERS
            _ITERS += 1
            key = 10**9 + os.getpid() * 1000 + _ITERS  # this call of this process
            if (key * 2654435761) % (self.die_every * 7) < 7 and c.first_time(self.marker_dir, key):
                _die_by_signal()
        return self._gen(w, k)

    def _gen(self, w: int, k: int) -> Iterator[np.ndarray]:
        for i in range(w, self.n, k):
            yield sample(i, stream_level(i, self.batch_size * k))


def _die_by_signal() -> None:
    """A death by signal, never an exit code: two exits in a row while a worker starts (its first
    ``__iter__`` runs then) are rightly taken for a worker that cannot start (docs/reliability.md)."""
    if os.getpid() % 2:
        c._fault("segv")
    os.kill(os.getpid(), signal.SIGKILL)


def stream_batches(n: int, batch_size: int, workers: int, drop_last: bool = False) -> list[list[int]]:
    """The batches of a ``SizedStream`` in torch's in-order delivery: each worker's shard cut into
    batches (``drop_last``: without its short last one, as each of torch's workers drops its own),
    taken round robin, skipping a worker whose shard has ended."""
    k = max(workers, 1)
    shards = [[b for b in _cut(list(range(w, n, k)), batch_size) if len(b) == batch_size or not drop_last]
              for w in range(k)]
    out: list[list[int]] = []
    while any(shards):
        for shard in shards:
            if shard:
                out.append(shard.pop(0))
    return out


def _cut(items: list[int], size: int) -> list[list[int]]:
    return [items[s:s + size] for s in range(0, len(items), size)]


def plan_map_epoch(rng: np.random.Generator, n: int, batch_size: int, epoch: int, fault_rate: float,
                   hang_share: float) -> tuple[list[list[int]], list[int], dict[str, int]]:
    """One map-style epoch: index batches of varying length (1 to 2 x ``batch_size``) and size level
    (a burst of large ones after the first six, small ones around it), the checksum each must
    produce, and the faults planted."""
    order = [int(i) for i in rng.permutation(n)]
    planted = {k: 0 for k in c.FAULTS[1:]}
    batches: list[list[int]] = []
    sums: list[int] = []
    start = 0
    while start < n:
        length = int(rng.integers(1, 2 * batch_size + 1))
        chunk = order[start:start + length]
        start += length
        stretch = len(batches) // 6  # six batches of mixed small sizes, six large ones, then small ones:
        level = int(rng.integers(2, 4)) if stretch == 1 else int(rng.integers(0, 2))  # growth, then decay
        coded = []
        for i in chunk:
            fault = 0
            if rng.random() < fault_rate:
                fault = 3 if rng.random() < hang_share else int(rng.integers(1, 3))
                planted[c.FAULTS[fault]] += 1
            coded.append(encode(n, i, fault, level, epoch))
        batches.append(coded)
        sums.append(expected_checksum(chunk, level))
    return batches, sums, planted
