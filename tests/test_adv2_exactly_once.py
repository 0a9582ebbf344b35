"""Exactly-once delivery under faults, with the less-travelled option combinations.

Each batch of ``adv2_datasets.ArmedFaults`` names its samples in its values, so a lost, repeated
or corrupted batch shows. Faults are armed between epochs (persistent workers: epoch 2), fire once
each, and every fault is survived under ``on_worker_death='restart'``: every epoch delivers every
batch once (in order with ``in_order=True``), whatever the fault hit — a task of the current epoch,
one of an abandoned epoch still in flight after a ``break``, or a hung task killed at its
``task_timeout_s`` — and a state saved mid-epoch with batches in flight, after a death, resumes
in a fresh loader to exactly the rest of the epoch.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pytest

import adv2_datasets as ad
from fault_datasets import sample
from shmloader import DataLoader

N = 24


def firsts(batches: Any) -> list[int]:
    """The sample numbers of ``batches``, in delivery order; each batch checked against its samples."""
    out = []
    for b in batches:
        for row in np.asarray(b):
            i = int(row[0]) // 10
            assert np.array_equal(row, sample(i)), f"sample {i} corrupted: {row}"
            out.append(i)
    return out


def assert_once(got: list[int], in_order: bool) -> None:
    assert sorted(got) == list(range(N)), f"lost or repeated: {got}"
    assert got == list(range(N)) or not in_order, f"out of order: {got}"


@pytest.mark.timeout(30)
@pytest.mark.parametrize("in_order", [True, False])
@pytest.mark.parametrize("plan", [{0: "kill"}, {9: "kill", 10: "kill"}, {23: "kill"}, {5: "hang", 14: "kill"}],
                         ids=["first", "two_in_a_row", "last", "hang_and_kill"])
def test_persistent_workers_survive_faults_in_epoch_two(tmp_path: Any, in_order: bool, plan: dict[int, str]) -> None:
    d = str(tmp_path)
    loader: DataLoader[Any] = DataLoader(ad.ArmedFaults(N, d, plan), batch_size=2, num_workers=2,
                                         persistent_workers=True, on_worker_death="restart", in_order=in_order,
                                         task_timeout_s=0.5)
    with loader:
        for epoch in range(3):
            if epoch == 1:
                ad.arm(d)
            assert_once(firsts(loader), in_order)
        assert loader.stats()["worker_restarts"] == len(plan)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("in_order", [True, False])
@pytest.mark.parametrize("taken", [0, 1, 3])
def test_a_death_in_an_abandoned_epochs_task_spoils_no_later_epoch(tmp_path: Any, in_order: bool, taken: int) -> None:
    """``break`` after ``taken`` batches; a task sent ahead, abandoned, kills its worker."""
    d = str(tmp_path)
    ad.arm(d)
    loader: DataLoader[Any] = DataLoader(ad.ArmedFaults(N, d, {2 * (taken + 2): "kill"}, delay_s=0.01), batch_size=2,
                                         num_workers=2, persistent_workers=True, on_worker_death="restart",
                                         in_order=in_order)
    with loader:
        it = iter(loader)
        for _ in range(taken):
            next(it)
        for _epoch in range(2):
            assert_once(firsts(loader), in_order)


CONFIGS: dict[str, dict[str, Any]] = {
    "in_order": {"batch_size": 2},
    "unordered": {"batch_size": 2, "in_order": False},
    "shuffled_drop_last": {"batch_size": 5, "drop_last": True, "shuffle": True, "generator": 3},
    "shuffled_drop_last_unordered": {"batch_size": 5, "drop_last": True, "shuffle": True, "generator": 3,
                                     "in_order": False},
    "batch_sampler_unordered": {"batch_sampler": [[i, (i * 7) % N] for i in range(N)], "in_order": False},
}


@pytest.mark.timeout(30)
@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("taken", [1, 3])
def test_a_state_saved_after_a_death_with_batches_in_flight_resumes_exactly(tmp_path: Any, config: str,
                                                                             taken: int) -> None:
    kw = {**CONFIGS[config], "num_workers": 2, "on_worker_death": "restart"}
    runs = [tmp_path / name for name in ("whole", "saved", "resumed")]
    for run in runs:
        run.mkdir()
    ad.arm(str(runs[1]))  # the saving run's worker dies (sample 7) before or after the save

    def loader(run: Any) -> DataLoader[Any]:
        return DataLoader(ad.ArmedFaults(N, str(run), {7: "kill"}, delay_s=0.005), **kw)

    whole = [np.asarray(b).tolist() for b in loader(runs[0])]
    saving = loader(runs[1])
    it = iter(saving)
    before = [np.asarray(next(it)).tolist() for _ in range(taken)]
    state = json.loads(json.dumps(saving.state_dict()))
    next(it)  # one more, not in the state: the resumed epoch makes it again
    saving.close()
    resumed = loader(runs[2])
    resumed.load_state_dict(state)
    after = [np.asarray(b).tolist() for b in resumed]
    if kw.get("in_order", True):
        assert before + after == whole
    else:
        assert sorted(before + after) == sorted(whole)
