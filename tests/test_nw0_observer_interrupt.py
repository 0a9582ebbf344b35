"""``num_workers=0``: a Ctrl-C (or SystemExit) that lands in an observer's ``batch_ready`` (a
progress bar writing to the terminal) is not the batch's error either: the batch was not handed
out, so the next ``next()`` hands it out and a state saved at the interrupt has it undelivered,
as for an interrupt in the fetch or collate (docs/resume.md, "An interrupted batch").
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pytest

import shmloader

pytestmark = pytest.mark.timeout(60)

N, BATCH, TRIP = 8, 2, 1  # the batch (task 1: samples 2, 3) whose report is interrupted once


class InterruptOnce:
    """An observer that raises ``kind`` the first time it hears of task ``TRIP``."""

    def __init__(self, kind: type[BaseException]) -> None:
        self.kind: type[BaseException] | None = kind
        self.heard: list[int] = []

    def shmloader_batch_ready(self, task: int) -> None:
        self.heard.append(task)
        if task == TRIP and self.kind is not None:
            kind, self.kind = self.kind, None
            raise kind()


@pytest.mark.parametrize("kind", [KeyboardInterrupt, SystemExit], ids=lambda k: k.__name__)
def test_an_interrupt_in_an_observer_loses_no_batch(kind: type[BaseException]) -> None:
    observer = InterruptOnce(kind)
    loader: shmloader.DataLoader[Any] = shmloader.DataLoader(list(range(N)), batch_size=BATCH, plugins=[observer])
    it = iter(loader)
    got = [next(it).tolist()]
    with pytest.raises(kind):
        next(it)
    at_interrupt = json.loads(json.dumps(loader.state_dict()))
    got += [b.tolist() for b in it]
    assert got == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert at_interrupt["delivered"] == [[0, 1]] and at_interrupt["yielded"] == 1
    resumed: shmloader.DataLoader[Any] = shmloader.DataLoader(list(range(N)), batch_size=BATCH)
    resumed.load_state_dict(at_interrupt)
    assert [np.asarray(b).tolist() for b in resumed] == got[1:]
    assert observer.heard == [0, 1, 1, 2, 3]  # the interrupted report is made again, with its batch
