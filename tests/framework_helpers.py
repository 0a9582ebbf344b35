"""Shared pieces of the framework tests (test_torch_subclass, test_lightning, test_accelerate and the
scripts they launch): a dataset whose samples say which process made them, and the check that a
tensor is a view of a shmloader slot (a mapping of a ``/dev/shm/shml_*`` segment)."""

from __future__ import annotations

import os
from typing import Any

import torch
from torch.utils.data import Dataset

import shmloader


class Indexed(Dataset):
    """``n`` samples: the index, the pid of the process that read it, whether that process was a
    shmloader worker (``shmloader.get_worker_info()``), and a small float tensor."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, Any]:
        return {"index": int(i), "pid": os.getpid(), "shm_worker": shmloader.get_worker_info() is not None,
                "x": torch.full((2,), float(i))}


def mapped_file(tensor: torch.Tensor) -> str | None:
    """The file mapped at ``tensor``'s storage in this process (from /proc/self/maps), or None."""
    address = tensor.untyped_storage().data_ptr()
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split(maxsplit=5)
            low, high = (int(part, 16) for part in fields[0].split("-"))
            if low <= address < high:
                return fields[5].strip() if len(fields) == 6 else None
    return None


def in_shmloader_slot(tensor: torch.Tensor) -> bool:
    """True when ``tensor`` is a view of a shmloader segment (``shml_<pid>_...``)."""
    path = mapped_file(tensor)
    return path is not None and os.path.basename(path).startswith("shml_")


def batch_record(batch: dict[str, Any]) -> dict[str, Any]:
    """What a test keeps of one batch of :class:`Indexed`: JSON-friendly facts only."""
    return {"index": batch["index"].tolist(), "pids": sorted(set(batch["pid"].tolist())),
            "shm_worker": bool(batch["shm_worker"].all()), "in_slot": in_shmloader_slot(batch["x"])}
