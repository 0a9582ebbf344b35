"""``num_workers=0`` with ``pin_memory=True``: a batch whose pinning copy raises is handed out as
its error, and counts as handed out, like a batch whose fetch or collate raises (docs/resume.md,
"A batch that failed"): a state saved after it resumes after it, with no batch made twice.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

import shmloader

pytestmark = pytest.mark.timeout(60)

N, BATCH = 10, 2


class Stream(shmloader.IterableDataset):
    """Items 0..N-1: an iterable dataset, whose resume makes again and drops what was handed out."""

    def __iter__(self) -> Iterator[int]:
        return iter(range(N))


class FailSecond:
    """A pin copy that raises for the second batch it is given, and returns the others as they are."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, batch: Any) -> Any:
        self.calls += 1
        if self.calls == 2:
            raise RuntimeError("pinning failed")
        return batch


def _pinning_loader(dataset: Any, monkeypatch: pytest.MonkeyPatch) -> shmloader.DataLoader:
    from shmloader.gpu import pinning

    monkeypatch.setattr(pinning, "accelerator_available", lambda: True)  # torch's copy pins (CPU: faked)
    monkeypatch.setattr(pinning, "warn_if_unpinned", lambda loader: None)
    monkeypatch.setattr(pinning, "pin_copy", FailSecond())
    return shmloader.DataLoader(dataset, batch_size=BATCH, pin_memory=True)


@pytest.mark.parametrize("dataset", [Stream(), list(range(N))], ids=["iterable", "map-style"])
def test_a_batch_whose_pinning_failed_counts_as_handed_out(dataset: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    loader = _pinning_loader(dataset, monkeypatch)
    it = iter(loader)
    got: list[Any] = [next(it).tolist()]
    with pytest.raises(RuntimeError, match="pinning failed"):
        next(it)
    got.append(next(it).tolist())
    state = json.loads(json.dumps(loader.state_dict()))
    assert got == [[0, 1], [4, 5]]
    assert state["yielded"] == 3 and state["delivered"] == [[0, 3]]
    resumed: shmloader.DataLoader[Any] = shmloader.DataLoader(dataset, batch_size=BATCH)
    resumed.load_state_dict(state)
    assert [np.asarray(b).tolist() for b in resumed] == [[6, 7], [8, 9]]  # [4, 5] not made twice
