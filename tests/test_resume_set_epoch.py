"""``set_epoch`` called between ``load_state_dict`` and the resumed epoch's ``iter()``.

The state restores an epoch-keyed sampler's epoch (a DistributedSampler's, shmloader's or torch's)
and the tasks of that epoch already delivered, which the resumed epoch skips. A training loop that
then calls ``set_epoch`` with another epoch changes the order those skipped tasks index into: the
epoch silently lost some batches and repeated others. It is refused, naming the sampler and both
epochs; ``set_epoch`` with the saved epoch (what a loop resuming at the right epoch does) is fine."""

from __future__ import annotations

import json
from typing import Any

import pytest
from ownership_datasets import Indices as Indexed

import shmloader
from shmloader.errors import StateError


def _loader(sampler: Any, workers: int) -> shmloader.DataLoader[Any]:
    return shmloader.DataLoader(Indexed(23), batch_size=2, sampler=sampler, num_workers=workers)


def _samplers() -> list[Any]:
    made = [shmloader.DistributedSampler(Indexed(23), num_replicas=2, rank=1, shuffle=True, seed=3)]
    try:
        from torch.utils.data import DistributedSampler as TorchDistributed
    except ImportError:
        return made
    # Indexed is map-style without torch's Dataset base, which torch's stubs ask for
    theirs: TorchDistributed[int] = TorchDistributed(
        Indexed(23), num_replicas=2, rank=1, shuffle=True, seed=3)  # type: ignore[arg-type]
    return [*made, theirs]


def _state_after_two_batches(sampler: Any, workers: int) -> tuple[dict[str, Any], list[int]]:
    sampler.set_epoch(4)
    loader = _loader(sampler, workers)
    with loader:
        it = iter(loader)
        firsts = [int(next(it)[0][0]) for _ in range(2)]
        state = json.loads(json.dumps(loader.state_dict()))
        rest = [int(b[0][0]) for b in it]
    return state, firsts + rest


@pytest.mark.timeout(60)
@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("which", [0, 1], ids=["shmloader", "torch"])
def test_set_epoch_to_another_epoch_after_loading_is_refused(workers: int, which: int) -> None:
    samplers = _samplers()
    if which >= len(samplers):
        pytest.skip("needs torch")
    state, whole = _state_after_two_batches(samplers[which], workers)
    fresh = _samplers()[which]
    loader = _loader(fresh, workers)
    with loader:
        loader.load_state_dict(state)
        fresh.set_epoch(5)
        with pytest.raises(StateError, match=r"at epoch 5, .*saved epoch 4 part-way.*set_epoch\(4\)"):
            iter(loader)
        fresh.set_epoch(4)  # the loop resuming at the saved epoch
        assert [int(b[0][0]) for b in loader] == whole[2:]


@pytest.mark.timeout(60)
def test_set_epoch_after_loading_a_state_saved_between_epochs_starts_that_epoch() -> None:
    sampler = _samplers()[0]
    sampler.set_epoch(4)
    loader: shmloader.DataLoader[Any] = shmloader.DataLoader(Indexed(23), batch_size=2, sampler=sampler, num_workers=2,
                                                             persistent_workers=True)  # fmt: skip
    with loader:
        list(loader)
        state = json.loads(json.dumps(loader.state_dict()))  # epoch 4 done: a seed to reuse, none in progress
    fresh = _samplers()[0]
    reference = _samplers()[0]
    reference.set_epoch(5)
    loader = _loader(fresh, 2)
    with loader:
        loader.load_state_dict(state)
        fresh.set_epoch(5)  # the next epoch: a new order, nothing to skip
        assert [int(i) for b in loader for i in b[:, 0]] == list(reference)
