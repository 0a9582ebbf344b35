"""A loader's second epoch, whole and saved part-way, for the resume tests that compare the two."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import shmloader


def second_epoch_and_saved(make: Callable[[], shmloader.DataLoader],
                           taken: int) -> tuple[list[Any], list[Any], dict[str, Any]]:
    """The second epoch of a fresh ``make()`` loader uninterrupted; the first ``taken`` batches of
    another one's second epoch; and that loader's state saved right after them."""
    uninterrupted = make()
    second = [[b.tolist() for b in uninterrupted] for _ in range(2)][1]
    saving = make()
    list(saving)
    it = iter(saving)
    before = [next(it).tolist() for _ in range(taken)]
    return second, before, saving.state_dict()
