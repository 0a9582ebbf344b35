"""Unit tests of shmloader.samplers and shmloader._generators (numpy paths; torch paths in parity)."""

from __future__ import annotations

import sys
from collections import Counter

import numpy as np
import pytest

from shmloader import _generators as gen
from shmloader.errors import StateError
from shmloader.samplers import (
    BatchSampler,
    DistributedSampler,
    RandomSampler,
    Sampler,
    SequentialSampler,
    SubsetRandomSampler,
    WeightedRandomSampler,
)


@pytest.fixture
def no_torch(monkeypatch):
    """Make the code under test see torch as not imported (and not importable)."""
    monkeypatch.setitem(sys.modules, "torch", None)
    monkeypatch.setitem(sys.modules, "torch.distributed", None)


@pytest.fixture
def no_dist_env(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.delenv("RANK", raising=False)


def _all_python_ints(values) -> bool:
    return all(type(v) is int for v in values)


# --- _generators ---------------------------------------------------------------------------


@pytest.mark.parametrize("bad", ["seed", 1.5, True, object()])
def test_resolve_generator_rejects_other_types(bad):
    with pytest.raises(TypeError, match="generator must be None, an int seed"):
        gen.resolve_generator(bad)


def test_resolve_generator_turns_int_into_numpy_and_keeps_generators():
    rng = gen.resolve_generator(3)
    assert isinstance(rng, np.random.Generator)
    existing = np.random.default_rng(0)
    assert gen.resolve_generator(existing) is existing
    assert gen.resolve_generator(None) is None


def test_uses_torch(no_torch):
    assert not gen.uses_torch(None)
    assert not gen.uses_torch(np.random.default_rng(0))
    assert not gen.uses_torch(5)


def test_randperm_numpy_and_int_seed():
    perm = gen.randperm(20, 7)
    assert sorted(perm) == list(range(20)) and _all_python_ints(perm)
    assert perm == gen.randperm(20, 7)
    assert perm == np.random.default_rng(7).permutation(20).tolist()
    assert gen.randperm(0, 1) == []


def test_randperm_none_without_torch_is_fresh(no_torch):
    draws = {tuple(gen.randperm(30)) for _ in range(3)}
    assert len(draws) > 1


def test_randint_range_size_and_type():
    values = gen.randint(5, 200, np.random.default_rng(0))
    assert len(values) == 200 and set(values) == set(range(5))
    assert _all_python_ints(values)
    assert gen.randint(5, 0, 1) == []


def test_multinomial_with_replacement_follows_weights():
    draws = gen.multinomial([0.0, 1.0, 3.0], 4000, True, np.random.default_rng(0))
    counts = Counter(draws)
    assert counts[0] == 0
    assert 2.5 < counts[2] / counts[1] < 3.5
    assert _all_python_ints(draws)


def test_multinomial_without_replacement_is_distinct_and_takes_zeros_last():
    draws = gen.multinomial([0.0, 2.0, 0.0, 1.0], 4, False, np.random.default_rng(1))
    assert sorted(draws) == [0, 1, 2, 3]
    assert set(draws[:2]) == {1, 3}
    assert draws[2:] == [0, 2]  # zero weights in index order, once the positives are used up


def test_multinomial_without_replacement_prefers_heavy_weights():
    firsts = Counter(
        gen.multinomial([1.0, 9.0], 1, False, np.random.default_rng(s))[0] for s in range(300)
    )
    assert firsts[1] > 220


@pytest.mark.parametrize(
    "weights, n, replacement, message",
    [
        ([1.0, -1.0], 1, True, "probability tensor contains either `inf`, `nan` or element < 0"),
        ([1.0, float("nan")], 1, True, "probability tensor contains either"),
        ([1.0, float("inf")], 1, True, "probability tensor contains either"),
        ([0.0, 0.0], 1, True, r"invalid multinomial distribution \(sum of probabilities <= 0\)"),
        ([1.0, 1.0], 3, False, "cannot sample n_sample > prob_dist.size"),
        ([1.0], 0, True, "cannot sample n_sample <= 0 samples"),
        ([], 1, True, "empty probability distribution"),
        ([[1.0]], 1, True, "prob_dist must be 1 or 2 dim"),
    ],
)
def test_multinomial_numpy_errors_match_torch(weights, n, replacement, message):
    with pytest.raises(RuntimeError, match=message):
        gen.multinomial(weights, n, replacement, 0)


def test_draw_base_seed_numpy_is_63_bit_and_reproducible():
    seed = gen.draw_base_seed(np.random.default_rng(0))
    assert type(seed) is int and 0 <= seed < 2**63
    assert seed == gen.draw_base_seed(np.random.default_rng(0))
    assert seed == gen.draw_base_seed(0)


def test_draw_base_seed_none_without_torch_is_fresh(no_torch):
    seeds = {gen.draw_base_seed(None) for _ in range(3)}
    assert len(seeds) > 1 and all(0 <= s < 2**63 for s in seeds)


def test_new_seed_for_sampler(no_torch):
    given = np.random.default_rng(0)
    assert gen.new_seed_for_sampler(given) is given
    assert isinstance(gen.new_seed_for_sampler(4), np.random.Generator)
    assert isinstance(gen.new_seed_for_sampler(None), np.random.Generator)


# --- samplers ------------------------------------------------------------------------------


def test_sampler_base_iter_raises():
    with pytest.raises(NotImplementedError):
        iter(Sampler())


def test_sequential_sampler_follows_current_length():
    data = [0, 0, 0]
    sampler = SequentialSampler(data)
    assert list(sampler) == [0, 1, 2] and len(sampler) == 3
    data.append(0)
    assert list(sampler) == [0, 1, 2, 3]


def test_random_sampler_is_a_permutation_and_epochs_differ():
    sampler = RandomSampler(range(50), generator=np.random.default_rng(0))
    first, second = list(sampler), list(sampler)
    assert sorted(first) == list(range(50)) == sorted(second)
    assert first != second and _all_python_ints(first)
    assert len(sampler) == 50


def test_random_sampler_int_seed_advances_across_epochs_but_replays_from_new_sampler():
    a = RandomSampler(range(30), generator=11)
    b = RandomSampler(range(30), generator=11)
    first = list(a)
    assert first == list(b)
    assert list(a) != first
    assert a.generator == 11  # kept as given


def test_random_sampler_num_samples_without_replacement_repeats_whole_permutations():
    out = list(RandomSampler(range(4), num_samples=10, generator=1))
    assert len(out) == 10
    assert sorted(out[:4]) == sorted(out[4:8]) == [0, 1, 2, 3]
    assert len(set(out[8:])) == 2


@pytest.mark.parametrize("num_samples", [1, 31, 32, 33, 100])
def test_random_sampler_with_replacement_length_and_range(num_samples):
    out = list(RandomSampler(range(3), True, num_samples, generator=2))
    assert len(out) == num_samples and set(out) <= {0, 1, 2}


def test_random_sampler_none_without_torch(no_torch):
    out = list(RandomSampler(range(10)))
    assert sorted(out) == list(range(10))


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        ({"replacement": 1}, TypeError, "replacement should be a boolean value, but got replacement=1"),
        ({"num_samples": 0}, ValueError, "num_samples should be a positive integer value, but got num_samples=0"),
        ({"num_samples": 2.0}, ValueError, "but got num_samples=2.0"),
        ({"generator": "x"}, TypeError, "generator must be None"),
    ],
)
def test_random_sampler_validation(kwargs, error, message):
    with pytest.raises(error, match=message):
        RandomSampler(range(3), **kwargs)


def test_random_sampler_empty_dataset_is_torchs_error():
    with pytest.raises(ValueError, match="but got num_samples=0"):
        RandomSampler([])


def test_subset_random_sampler_yields_python_scalars_of_its_indices():
    indices = np.array([10, 20, 30, 40])
    sampler = SubsetRandomSampler(indices, generator=3)
    out = list(sampler)
    assert sorted(out) == [10, 20, 30, 40] and _all_python_ints(out)
    assert len(sampler) == 4
    assert sorted(SubsetRandomSampler(["a", "b"], generator=0)) == ["a", "b"]


def test_weighted_random_sampler_numpy():
    sampler = WeightedRandomSampler([0.0, 1.0, 0.0, 1.0], 50, generator=0)
    out = list(sampler)
    assert len(out) == 50 and set(out) == {1, 3} and len(sampler) == 50
    assert sampler.weights.dtype == np.float64
    no_rep = list(WeightedRandomSampler([1, 2, 3], 3, replacement=False, generator=0))
    assert sorted(no_rep) == [0, 1, 2]


def test_weighted_random_sampler_weights_edited_in_place_apply_next_pass():
    sampler = WeightedRandomSampler([1.0, 0.0], 20, generator=0)
    assert set(sampler) == {0}
    sampler.weights[:] = [0.0, 1.0]
    assert set(sampler) == {1}


@pytest.mark.parametrize(
    "args, kwargs, message",
    [
        (([1.0], 0), {}, "num_samples should be a positive integer value, but got num_samples=0"),
        (([1.0], True), {}, "but got num_samples=True"),
        (([1.0], 1), {"replacement": 0}, "replacement should be a boolean value, but got replacement=0"),
        (([[1.0, 2.0]], 1), {}, r"weights should be a 1d sequence but given weights have shape \(1, 2\)"),
    ],
)
def test_weighted_random_sampler_validation(args, kwargs, message):
    with pytest.raises(ValueError, match=message):
        WeightedRandomSampler(*args, **kwargs)


@pytest.mark.parametrize(
    "drop_last, expected",
    [(False, [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9]]), (True, [[0, 1, 2], [3, 4, 5], [6, 7, 8]])],
)
def test_batch_sampler(drop_last, expected):
    sampler = BatchSampler(SequentialSampler(range(10)), 3, drop_last)
    assert list(sampler) == expected
    assert len(sampler) == len(expected)


def test_batch_sampler_accepts_plain_iterables():
    assert list(BatchSampler(range(4), 2, False)) == [[0, 1], [2, 3]]


@pytest.mark.parametrize(
    "batch_size, drop_last, message",
    [
        (0, False, "batch_size should be a positive integer value, but got batch_size=0"),
        (True, False, "but got batch_size=True"),
        (2.0, False, "but got batch_size=2.0"),
        (2, None, "drop_last should be a boolean value, but got drop_last=None"),
    ],
)
def test_batch_sampler_validation(batch_size, drop_last, message):
    with pytest.raises(ValueError, match=message):
        BatchSampler(range(3), batch_size, drop_last)


# --- DistributedSampler --------------------------------------------------------------------


def _shards(n, world, **kwargs):
    return [list(DistributedSampler(range(n), world, rank, **kwargs)) for rank in range(world)]


def test_distributed_sampler_pads_by_repeating_head():
    shards = _shards(10, 4, shuffle=False)
    assert shards == [[0, 4, 8], [1, 5, 9], [2, 6, 0], [3, 7, 1]]
    assert len(DistributedSampler(range(10), 4, 0)) == 3


def test_distributed_sampler_pads_more_than_dataset_length():
    assert _shards(2, 5, shuffle=False) == [[0], [1], [0], [1], [0]]


def test_distributed_sampler_drop_last_cuts_tail():
    shards = _shards(10, 4, shuffle=False, drop_last=True)
    assert shards == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert DistributedSampler(range(10), 4, 1, drop_last=True).total_size == 8


def test_distributed_sampler_shuffle_is_disjoint_and_epoch_dependent():
    shards = _shards(12, 3, seed=5)
    flat = [i for shard in shards for i in shard]
    assert sorted(flat) == list(range(12))
    sampler = DistributedSampler(range(12), 3, 0, seed=5)
    assert list(sampler) == shards[0]
    sampler.set_epoch(1)
    assert sampler.epoch == 1 and list(sampler) != shards[0]
    assert _all_python_ints(sampler)


def test_distributed_sampler_numpy_without_torch(no_torch):
    sampler = DistributedSampler(range(8), 2, 0, seed=3)
    assert list(sampler) == np.random.default_rng(3).permutation(8).tolist()[0::2]


def test_distributed_sampler_reads_torchrun_env(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "3")
    monkeypatch.setenv("RANK", "2")
    sampler = DistributedSampler(range(9), shuffle=False)
    assert (sampler.num_replicas, sampler.rank) == (3, 2)
    assert list(sampler) == [2, 5, 8]


def test_distributed_sampler_explicit_arguments_beat_env(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "3")
    monkeypatch.setenv("RANK", "2")
    sampler = DistributedSampler(range(4), num_replicas=2, rank=0, shuffle=False)
    assert list(sampler) == [0, 2]


def test_distributed_sampler_bad_env_names_variable(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "four")
    with pytest.raises(ValueError, match="WORLD_SIZE must be an int, got 'four'"):
        DistributedSampler(range(4), rank=0)


def test_distributed_sampler_without_any_source_names_both_variables(no_dist_env, no_torch):
    with pytest.raises(RuntimeError, match="WORLD_SIZE and RANK"):
        DistributedSampler(range(4))


@pytest.mark.parametrize("rank", [-1, 2])
def test_distributed_sampler_invalid_rank(rank):
    with pytest.raises(ValueError, match=rf"Invalid rank {rank}, rank should be in the interval \[0, 1\]"):
        DistributedSampler(range(4), 2, rank)


_SHARD = {"seed": 3, "num_replicas": 2, "rank": 0}


@pytest.mark.parametrize("state, field", [
    ({**_SHARD}, "epoch"),
    ({**_SHARD, "epoch": "x"}, "epoch"),
    ({**_SHARD, "epoch": None}, "epoch"),
    ({**_SHARD, "epoch": -1}, "epoch"),
    ({**_SHARD, "epoch": True}, "epoch"),
    ({"epoch": 4, "num_replicas": 2, "rank": 0}, "seed"),
    (5, "mapping"),
])
def test_distributed_sampler_refuses_a_malformed_state_by_name(state, field):
    sampler = DistributedSampler(range(8), 2, 0, seed=3)
    with pytest.raises(StateError, match=rf"DistributedSampler state.*\b{field}\b"):
        sampler.load_state_dict(state)
    assert sampler.epoch == 0
