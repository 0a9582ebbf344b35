"""``loader.stats()`` and the observers count the batches the caller got, after resumes and across
epochs, with workers or without.

Before this test, resuming an iterable dataset's epoch reported each batch its fast-forward made
again and dropped to ``shmloader_batch_ready``: ``stats()["batches"]`` (and a progress bar) counted
batches the caller never got. A map-style resume, which skips delivered tasks without making them,
was already right.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from plug_helpers import Numbers

import shmloader


class Heard:
    """Counts the batches it hears of."""

    def __init__(self) -> None:
        self.batches = 0

    def shmloader_batch_ready(self) -> None:
        self.batches += 1


@pytest.mark.timeout(60)
@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("kind", ["map", "iterable"])
def test_a_resumed_epoch_counts_only_the_batches_handed_out(num_workers: int, kind: str) -> None:
    def make(plugins: list[Any]) -> shmloader.DataLoader:
        dataset = Numbers() if kind == "iterable" else np.arange(16)
        return shmloader.DataLoader(dataset, batch_size=2, num_workers=num_workers, plugins=plugins)

    with make([]) as first:
        it = iter(first)
        for _ in range(3):
            next(it)
        state = it.state_dict()
    heard = Heard()
    with make([heard]) as resumed:
        resumed.load_state_dict(state)
        rest = list(resumed)
        stats = resumed.stats()
    assert len(rest) == 5
    assert heard.batches == 5
    assert (stats["batches"], stats["epochs"]) == (5, 1)


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("num_workers", "persistent", "starts"), [(0, False, 0), (2, False, 6), (2, True, 2)])
def test_counts_across_epochs_match_what_was_handed_out(num_workers: int, persistent: bool, starts: int) -> None:
    data = np.arange(16, dtype=np.int64)
    loader: shmloader.DataLoader[Any]
    with shmloader.DataLoader(data, batch_size=2, num_workers=num_workers, persistent_workers=persistent) as loader:
        got = [b for _ in range(3) for b in loader]
        stats = loader.stats()
    assert (stats["batches"], stats["epochs"], stats["worker_starts"]) == (24, 3, starts)
    assert stats["bytes"] == (0 if num_workers == 0 else sum(b.nbytes for b in got))
    assert sum(w["batches"] for w in stats["workers"].values()) == 24
    assert set(stats["workers"]) == ({-1} if num_workers == 0 else {0, 1})
