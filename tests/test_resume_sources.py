"""What an epoch's start draws and what the saved state keeps of it (shmloader/epoch_book.py).

A resumed epoch must draw exactly what the saved one drew: from a sampler that draws its order
eagerly at ``iter()`` (bucketing, DistributedSampler-like) as from one that draws at its first
item; from the generators' state at the epoch's start, not at save time.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from test_resume import Noisy, batches, quiet

import shmloader
from shmloader._generators import draw_base_seed

torch = pytest.importorskip("torch")

N, BATCH = 23, 3


class EagerBuckets:
    """A batch sampler that draws its whole permutation when ``iter()`` is called on it, from its
    ``generator`` (torch's global RNG when None), as bucketing samplers do."""

    def __init__(self, generator: Any = None) -> None:
        self.generator = generator

    def __iter__(self) -> Iterator[list[int]]:
        perm = torch.randperm(N, generator=self.generator).tolist()
        return iter([perm[i:i + BATCH] for i in range(0, N, BATCH)])

    def __len__(self) -> int:
        return -(-N // BATCH)


def _eager_loader(workers: int, global_rng: bool) -> shmloader.DataLoader:
    sampler = EagerBuckets(None if global_rng else torch.Generator().manual_seed(5))
    extra = {"multiprocessing_context": "fork"} if workers else {}
    return shmloader.DataLoader(Noisy(), batch_sampler=sampler, num_workers=workers, task_seeding=True,
                                generator=torch.Generator().manual_seed(1), **extra)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("global_rng", [False, True])
@pytest.mark.parametrize("workers", [0, 2])
def test_a_sampler_that_draws_at_iter_resumes_its_order(workers: int, global_rng: bool) -> None:
    with quiet():
        torch.manual_seed(0)
        loader = _eager_loader(0, global_rng)
        reference = [batches(loader), batches(loader)]
        torch.manual_seed(0)
        loader = _eager_loader(workers, global_rng)
        it = iter(loader)
        before = batches(it, 3)
        state = json.loads(json.dumps(loader.state_dict()))
        loader.close()
        del it
        torch.manual_seed(123)  # the resuming process's global RNG: the state, not it, makes the order
        resumed = _eager_loader(workers, global_rng)
        resumed.load_state_dict(state)
        after = [batches(resumed), batches(resumed)]
        resumed.close()
    assert before + after[0] == reference[0]
    if not global_rng:  # an explicit generator goes on into the next epoch as if never interrupted
        assert after[1] == reference[1]
    assert sorted(row[0] for batch in reference[0] for row in batch) == list(range(N))


class LiveOffsetSampler(shmloader.Sampler):
    """Each pass starts 5 further on; ``state_dict()`` returns its own dict, which the pass changes."""

    def __init__(self) -> None:
        self.state = {"offset": 0}

    def __iter__(self) -> Iterator[int]:
        start = self.state["offset"]
        self.state["offset"] += 5
        return iter([(start + i) % N for i in range(N)])

    def __len__(self) -> int:
        return N

    def state_dict(self) -> dict[str, int]:
        return self.state  # not a copy: the loader must take one

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.state = dict(state)


def test_a_state_dict_that_changes_later_is_saved_as_it_was_at_the_epochs_start() -> None:
    def make() -> shmloader.DataLoader:
        return shmloader.DataLoader(Noisy(), batch_size=BATCH, sampler=LiveOffsetSampler(), task_seeding=True,
                                    generator=7)

    reference = batches(make())
    loader = make()
    it = iter(loader)
    before = batches(it, 2)
    state = loader.state_dict()
    assert state["objects"]["sampler"] == {"offset": 0}
    assert isinstance(loader.sampler, LiveOffsetSampler)
    assert state["objects"]["sampler"] is not loader.sampler.state
    resumed = make()
    resumed.load_state_dict(json.loads(json.dumps(state)))
    assert before + batches(resumed) == reference


class Uncopyable(Noisy):
    """A dataset whose state_dict() holds something deepcopy refuses."""

    def state_dict(self) -> dict[str, Any]:
        return {"lock": __import__("threading").Lock()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


def test_a_state_dict_that_cannot_be_copied_is_named_when_saving() -> None:
    loader: shmloader.DataLoader[Any] = shmloader.DataLoader(Uncopyable(), batch_size=BATCH, generator=7)
    it = iter(loader)
    assert len(batches(it, 2)) == 2  # iterating is not affected: only saving needs the copy
    with pytest.raises(shmloader.state.StateError, match=r"dataset's state_dict\(\) \(.*Uncopyable\) .*copied"):
        loader.state_dict()


class Augmented(shmloader.Dataset):
    """A draw from the process's numpy RNG per sample: a worker's comes from its seed."""

    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int) -> int:
        return int(np.random.randint(1 << 30))


def test_an_int_seed_is_one_stream_that_advances_every_epoch() -> None:
    loader: shmloader.DataLoader[Any] = shmloader.DataLoader(Noisy(), batch_size=BATCH, shuffle=True, generator=7)
    seeds = []
    for _ in range(3):
        it = iter(loader)
        next(it)
        seeds.append(loader.state_dict()["base_seed"])
        batches(it)
    stream = np.random.default_rng(7)  # the int seeds one stream, once
    assert seeds == [draw_base_seed(stream) for _ in range(3)]
    assert loader.generator == 7  # what was passed, as torch keeps it


@pytest.mark.timeout(60)
def test_an_int_seed_gives_workers_new_seeds_every_epoch() -> None:
    loader: shmloader.DataLoader[Any] = shmloader.DataLoader(Augmented(), batch_size=8, generator=7, num_workers=1,
                                                             multiprocessing_context="fork")
    first, second = batches(loader), batches(loader)
    loader.close()
    assert first != second  # without task seeding, augmentation follows the worker's per-epoch seed


def _draw_between_iter_and_next(make: Any, workers: int) -> tuple[list[int], float]:
    """torch seeded; iter(); a draw of the caller's own from the global RNG; the first batch."""
    torch.manual_seed(0)
    loader = make(list(range(10)), batch_size=10, shuffle=True, num_workers=workers,
                  **({"multiprocessing_context": "fork"} if workers else {}))
    it = iter(loader)
    mine = torch.rand(1).item()  # model init, a warm-up step: anything between iter() and next()
    order = np.asarray(next(it)).tolist()
    assert batches(it) == []  # the epoch ends, and torch's workers with it
    return order, mine


@pytest.mark.timeout(60)
@pytest.mark.parametrize("workers", [0, 2])
def test_the_samplers_first_draw_is_where_torchs_loader_makes_it(workers: int) -> None:
    """torch draws a RandomSampler's seed at the first next() without workers, at iter() with them."""
    with quiet():
        assert (_draw_between_iter_and_next(shmloader.DataLoader, workers)
                == _draw_between_iter_and_next(torch.utils.data.DataLoader, workers))


def _global_rng_loader(workers: int = 0) -> shmloader.DataLoader:
    return shmloader.DataLoader(Noisy(), batch_size=BATCH, shuffle=True, task_seeding=True,  # generator=None
                                num_workers=workers, multiprocessing_context="fork" if workers else None)


def _resumed(state: dict[str, Any], workers: int = 0) -> list[Any]:
    torch.manual_seed(99)  # the resuming process's own global RNG: the state, not it, makes the order
    resumed = _global_rng_loader(workers)
    resumed.load_state_dict(json.loads(json.dumps(state)))
    try:
        return batches(resumed)
    finally:
        resumed.close()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("resumed_workers", [0, 2])
@pytest.mark.parametrize("save_after", [1, 3])
def test_a_draw_between_iter_and_the_first_batch_still_resumes_exactly(save_after: int, resumed_workers: int) -> None:
    """Saved without workers (the first draw at the first next()), resumed with or without them
    (with workers the first draw is at iter(): it must see the same state)."""
    def run(limit: int | None) -> tuple[list[Any], dict[str, Any]]:
        torch.manual_seed(0)
        loader = _global_rng_loader()
        it = iter(loader)
        torch.rand(3)  # the caller's own draw, before the sampler's (num_workers=0: at the first next())
        return batches(it, limit), loader.state_dict()

    reference, _ = run(None)
    before, state = run(save_after)
    with quiet():
        assert before + _resumed(state, resumed_workers) == reference


def test_a_state_saved_before_the_first_batch_resumes_the_whole_epoch() -> None:
    torch.manual_seed(0)
    loader = _global_rng_loader()
    it = iter(loader)
    state = loader.state_dict()
    reference = batches(it)  # nothing drew from the global RNG between iter() and the first next()
    assert _resumed(state) == reference


@pytest.mark.timeout(60)
@pytest.mark.parametrize("resumed_workers", [0, 2])
def test_a_state_saved_before_the_first_batch_advances_the_restored_global_rng(resumed_workers: int) -> None:
    """The saved epoch's first draw (without workers: at its first next()) was still to come, so
    the caller's RNG checkpoint taken with the state does not hold it; uninterrupted, that draw
    advances the global RNG. The resumed draw advances the restored RNG the same way, so the
    following epochs, whose seeds come from it, are the uninterrupted ones too."""
    torch.manual_seed(0)
    loader = _global_rng_loader()
    batches(loader)
    it = iter(loader)
    state, rng = json.loads(json.dumps(loader.state_dict())), torch.get_rng_state()
    reference = [batches(it), batches(loader)]
    torch.manual_seed(99)
    resumed = _global_rng_loader(resumed_workers)
    resumed.load_state_dict(state)
    torch.set_rng_state(rng)  # the caller restores its own RNG from the same checkpoint
    try:
        with quiet():
            assert [batches(resumed), batches(resumed)] == reference
    finally:
        resumed.close()


class Curriculum(shmloader.Dataset):
    """A curriculum: level L holds 10 * (L + 1) samples, and the level is the dataset's state."""

    def __init__(self) -> None:
        self.level = 0

    def __len__(self) -> int:
        return 10 * (self.level + 1)

    def __getitem__(self, i: int) -> int:
        return i

    def state_dict(self) -> dict[str, int]:
        return {"level": self.level}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.level = state["level"]


def test_a_dataset_whose_length_follows_its_state_resumes() -> None:
    """The saved length is compared with the length the loaded state gives, not the fresh one's."""
    loader: shmloader.DataLoader[Any] = shmloader.DataLoader(Curriculum(), batch_size=4, shuffle=True, generator=1)
    loader.dataset.level = 2
    it = iter(loader)
    batches(it, 3)
    state = json.loads(json.dumps(loader.state_dict()))
    rest = batches(it)
    resumed: shmloader.DataLoader[Any] = shmloader.DataLoader(Curriculum(), batch_size=4, shuffle=True, generator=1)
    resumed.load_state_dict(state)
    assert resumed.dataset.level == 2 and batches(resumed) == rest
    state["objects"]["dataset"]["level"] = 1  # a length that still differs once loaded: refused, undone
    fresh: shmloader.DataLoader[Any] = shmloader.DataLoader(Curriculum(), batch_size=4, shuffle=True, generator=1)
    with pytest.raises(shmloader.state.StateError, match="dataset_len: saved 30, this loader 20"):
        fresh.load_state_dict(state)
    assert fresh.dataset.level == 0
