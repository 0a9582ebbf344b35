"""Datasets shared by the tests/test_plug_*.py files."""

from __future__ import annotations

from typing import Any

import shmloader


class Numbers(shmloader.IterableDataset):
    """0..15, sharded over the workers (each worker yields every ``num_workers``-th number)."""

    def __iter__(self) -> Any:
        info = shmloader.get_worker_info()
        step, first = (1, 0) if info is None else (info.num_workers, info.id)
        return iter(range(first, 16, step))
