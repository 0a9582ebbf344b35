"""A state saved inside an observer's hook resumes where the caller stands, exactly once.

``shmloader_batch_ready``: the batch being reported is handed out (even when an observer raises),
so a state saved there counts it, delivered and yielded, with workers or without. Before this
test the record counted it only partly: ``num_workers=0`` added the task to the delivered set
after the report and every iterator counted it yielded only once ``next()`` returned, so a resume
made that batch again (map-style without workers; iterable datasets, fast-forwarded by the
yielded count, with workers too).

``shmloader_epoch_end``: the epoch is over, so a state saved there is the next epoch's start.
Before, the record was marked finished only after the observers had run (and never when one of
them raised), so that state resumed the ended epoch again: an epoch with no batch.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from plug_helpers import Numbers

import shmloader
from shmloader.errors import PluginError


class SaveAt:
    """Saves ``it.state_dict()`` when task ``task`` is reported; or the loader's at an epoch's end."""

    def __init__(self, task: int = -1) -> None:
        self.task = task
        self.it: Any = None
        self.loader: Any = None
        self.saved: dict[str, Any] | None = None

    def shmloader_batch_ready(self, task: int) -> None:
        if task == self.task and self.saved is None:
            self.saved = self.it.state_dict()

    def shmloader_epoch_end(self, epoch: int) -> None:
        if self.task < 0 and epoch == 0:
            self.saved = self.loader.state_dict()


def _values(batches: list[Any]) -> list[int]:
    return sorted(int(x) for b in batches for x in np.asarray(b).ravel())


@pytest.mark.timeout(60)
@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("kind", ["map", "iterable"])
def test_a_state_saved_in_batch_ready_counts_that_batch_and_resumes_exactly_once(num_workers: int,
                                                                                kind: str) -> None:
    def make(plugins: list[Any]) -> shmloader.DataLoader:
        dataset = Numbers() if kind == "iterable" else np.arange(16)
        return shmloader.DataLoader(dataset, batch_size=2, num_workers=num_workers, plugins=plugins)

    hook = SaveAt(task=1)
    with make([hook]) as loader:
        it = hook.it = iter(loader)
        handed_out = [next(it), next(it)]  # tasks 0 and 1: the save was made as task 1 was reported
        after_two = it.state_dict()
    assert hook.saved is not None
    assert (hook.saved["delivered"], hook.saved["yielded"]) == ([[0, 2]], 2)
    assert hook.saved == after_two
    with make([]) as resumed:
        resumed.load_state_dict(hook.saved)
        rest = list(resumed)
    assert _values(handed_out + rest) == list(range(16))


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("num_workers", "persistent"), [(0, False), (2, False), (2, True)])
def test_a_state_saved_in_epoch_end_starts_the_next_epoch(num_workers: int, persistent: bool) -> None:
    def make(plugins: list[Any]) -> shmloader.DataLoader:
        return shmloader.DataLoader(np.arange(8), batch_size=2, shuffle=True, generator=7, plugins=plugins,
                                    num_workers=num_workers, persistent_workers=persistent)

    hook = SaveAt()
    with make([hook]) as loader:
        hook.loader = loader
        list(loader)
        between = loader.state_dict()
        second = [b.tolist() for b in loader]
    assert hook.saved is not None
    assert hook.saved["in_progress"] is False
    assert hook.saved == between
    with make([]) as resumed:
        resumed.load_state_dict(hook.saved)
        assert [b.tolist() for b in resumed] == second


class FailsAtEpochEnd:
    def shmloader_epoch_end(self) -> None:
        raise KeyError("boom")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("num_workers", [0, 2])
def test_an_epoch_whose_end_observer_raised_is_still_over(num_workers: int) -> None:
    loader: shmloader.DataLoader[Any]
    with shmloader.DataLoader(np.arange(8), batch_size=2, num_workers=num_workers,
                              plugins=[FailsAtEpochEnd()]) as loader:
        it = iter(loader)
        assert len([next(it) for _ in range(4)]) == 4
        with pytest.raises(PluginError, match="shmloader_epoch_end"):
            next(it)
        state = loader.state_dict()
    assert (state["epoch"], state["in_progress"]) == (1, False)
