"""Worker identity and seeding, as torch does them.

Owns the process-global ``WorkerInfo`` (set once in each worker, ``None`` in the main process) and
the seeding rules. Promises, matching ``torch.utils.data._utils.worker``:

- ``seed = base_seed + worker_id`` seeds ``random`` and, when it is imported, torch;
- numpy's global RNG is seeded from ``_generate_state(base_seed, worker_id)``, torch's own
  SeedSequence-style hash of (worker_id, base_seed), so no two workers share a stream and a job
  migrated from torch sees the very same numpy draws;
- with per-task seeding, every RNG is reseeded before each task from (base_seed, epoch, task), so
  a batch does not depend on which worker made it, nor on num_workers, nor on retries.
"""

from __future__ import annotations

import random
import sys
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = ["WorkerInfo", "get_worker_info"]


@dataclass(frozen=True, slots=True)
class WorkerInfo:
    """What a worker knows about itself (``get_worker_info()`` inside a worker): torch's fields, in
    torch's order and repr. ``rng`` (torch's thread workers' RNG container) is always None and
    ``worker_method`` always ``"multiprocessing"``: shmloader's workers are processes."""

    id: int
    num_workers: int
    seed: int
    dataset: Any
    rng: Any = None
    worker_method: str | None = "multiprocessing"


_worker_info: WorkerInfo | None = None


def get_worker_info() -> WorkerInfo | None:
    """This worker's ``WorkerInfo``; ``None`` in the main process (as in torch)."""
    return _worker_info


def set_worker_info(info: WorkerInfo) -> None:
    """Set this worker's info; also torch's, so datasets written for torch shard themselves too."""
    global _worker_info
    _worker_info = info
    torch = sys.modules.get("torch")
    if torch is not None:
        from torch.utils.data._utils import worker as torch_worker

        torch_worker._worker_info = torch_worker.WorkerInfo(
            id=info.id, num_workers=info.num_workers, seed=info.seed, dataset=info.dataset
        )


_MASK32 = 0xFFFFFFFF


def generate_state(base_seed: int, worker_id: int) -> list[int]:
    """torch's ``_generate_state``: four uint32 words for numpy's legacy seeding."""
    init_a, mult_a, init_b, mult_b = 0x43B0D7E5, 0x931E8875, 0x8B51F9DD, 0x58F38DED
    mix_l, mix_r, xshift = 0xCA01F9DD, 0x4973F715, 16
    entropy = [worker_id, base_seed & _MASK32, base_seed >> 32, 0]
    pool = [0] * 4
    hash_a = init_a

    def hash_(value: int) -> int:
        nonlocal hash_a
        value = (value ^ hash_a) & _MASK32
        hash_a = (hash_a * mult_a) & _MASK32
        value = (value * hash_a) & _MASK32
        return (value ^ (value >> xshift)) & _MASK32

    def mix(x: int, y: int) -> int:
        result = ((mix_l * x) & _MASK32) - ((mix_r * y) & _MASK32)
        result &= _MASK32
        return (result ^ (result >> xshift)) & _MASK32

    for i in range(4):
        pool[i] = hash_(entropy[i])
    for i_src in range(4):
        for i_dst in range(4):
            if i_src != i_dst:
                pool[i_dst] = mix(pool[i_dst], hash_(pool[i_src]))
    hash_b = init_b
    state = []
    for i_dst in range(4):
        data_val = pool[i_dst]
        data_val = (data_val ^ hash_b) & _MASK32
        hash_b = (hash_b * mult_b) & _MASK32
        data_val = (data_val * hash_b) & _MASK32
        data_val = (data_val ^ (data_val >> xshift)) & _MASK32
        state.append(data_val)
    return state


def seed_worker(base_seed: int, worker_id: int) -> int:
    """Seed random, numpy and (if imported) torch as torch seeds a worker; returns the seed."""
    seed = base_seed + worker_id
    seed_rngs(seed, generate_state(base_seed, worker_id))
    return seed


def task_seed(base_seed: int, epoch: int, task: int) -> int:
    """The 63-bit seed of one task under per-task seeding."""
    words = np.random.SeedSequence([base_seed & _MASK32, base_seed >> 32, epoch, task]).generate_state(2)
    return int((int(words[0]) << 31) ^ int(words[1])) & ((1 << 63) - 1)


def seed_task(seed: int) -> None:
    """Reseed random, numpy and (if imported) torch before a task runs."""
    seed_rngs(seed, generate_state(seed, 0))


def seed_rngs(seed: int, numpy_state: list[int], *, cuda: bool = True) -> None:
    """The one place RNGs are seeded: ``random`` and torch with ``seed``, numpy's global RNG with
    ``numpy_state``. ``cuda=False`` leaves CUDA's generators alone (the main process seeding a
    task with ``num_workers=0`` must not reseed the caller's GPU streams)."""
    random.seed(seed)
    np.random.seed(numpy_state)
    torch = sys.modules.get("torch")
    if torch is not None:
        if cuda:
            torch.manual_seed(seed)
        else:
            torch.default_generator.manual_seed(seed)
