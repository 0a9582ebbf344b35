"""Parity with torch.utils.data: identical index sequences for equally seeded torch Generators.

Each test runs torch's sampler and ours from generators in the same state, over several passes,
and asserts the sequences are equal; also the global-RNG path (generator=None after
torch.manual_seed), DistributedSampler's partition, random_split and the DataLoader base seed.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:  # the module's names in annotations; at run time the test skips without torch
    import torch
else:
    torch = pytest.importorskip("torch")
from torch.utils import data as tud  # noqa: E402
from tree_run import run_tree  # noqa: E402

from shmloader import _generators as gen  # noqa: E402
from shmloader import datasets as ours_ds  # noqa: E402
from shmloader import samplers as ours  # noqa: E402

EPOCHS = 3


def _generator(seed: int) -> torch.Generator:
    g = torch.Generator()
    g.manual_seed(seed)
    return g


def _epochs(sampler, epochs: int = EPOCHS) -> list[list]:
    return [list(sampler) for _ in range(epochs)]


def _both(make, seed: int = 0):
    """(torch's epochs, ours) for a factory make(module, generator)."""
    return _epochs(make(tud, _generator(seed))), _epochs(make(ours, _generator(seed)))


@pytest.mark.parametrize("n", [1, 7, 100])
def test_sequential_sampler(n):
    assert list(ours.SequentialSampler(range(n))) == list(tud.SequentialSampler(range(n)))


@pytest.mark.parametrize(
    "n, replacement, num_samples",
    [(10, False, None), (10, False, 25), (10, False, 3), (7, True, None), (7, True, 100),
     (5, True, 32), (5, True, 64), (1000, False, None)],
)
def test_random_sampler_with_torch_generator(n, replacement, num_samples):
    expected, got = _both(lambda m, g: m.RandomSampler(range(n), replacement, num_samples, g))
    assert got == expected


@pytest.mark.parametrize("replacement, num_samples", [(False, None), (True, 45), (False, 13)])
def test_random_sampler_global_rng(replacement, num_samples):
    torch.manual_seed(123)
    expected = _epochs(tud.RandomSampler(range(9), replacement, num_samples))
    after_torch = torch.rand(1).item()
    torch.manual_seed(123)
    got = _epochs(ours.RandomSampler(range(9), replacement, num_samples))
    assert got == expected
    assert torch.rand(1).item() == after_torch  # the global RNG advanced identically


def test_random_sampler_partial_pass_consumes_like_torch():
    g_torch, g_ours = _generator(4), _generator(4)
    it_torch = iter(tud.RandomSampler(range(5), True, 100, g_torch))
    it_ours = iter(ours.RandomSampler(range(5), True, 100, g_ours))
    assert [next(it_ours) for _ in range(40)] == [next(it_torch) for _ in range(40)]
    assert g_ours.get_state().equal(g_torch.get_state())


@pytest.mark.parametrize("indices", [[5, 3, 9, 1], list(range(50))])
def test_subset_random_sampler(indices):
    expected, got = _both(lambda m, g: m.SubsetRandomSampler(indices, g), seed=8)
    assert got == expected


def test_subset_random_sampler_global_rng_and_tensor_indices():
    indices = torch.arange(10, 20)
    torch.manual_seed(2)
    expected = [int(i) for i in tud.SubsetRandomSampler(indices)]
    torch.manual_seed(2)
    got = list(ours.SubsetRandomSampler(indices))
    assert got == expected and all(type(i) is int for i in got)


@pytest.mark.parametrize(
    "weights, num_samples, replacement",
    [([0.1, 0.9, 0.4, 0.7, 3.0, 0.6], 5, True), ([0.9, 0.4, 0.05, 0.2, 0.3, 0.1], 5, False),
     ([1.0, 2.0, 3.0], 200, True), ([1.0, 0.0, 2.0, 0.0], 4, False)],
)
def test_weighted_random_sampler(weights, num_samples, replacement):
    expected, got = _both(
        lambda m, g: m.WeightedRandomSampler(weights, num_samples, replacement, g), seed=3
    )
    assert got == expected


def test_weighted_random_sampler_float32_tensor_weights_and_global_rng():
    weights = torch.rand(20, dtype=torch.float32)
    torch.manual_seed(9)
    expected = _epochs(tud.WeightedRandomSampler(weights, 30))
    torch.manual_seed(9)
    assert _epochs(ours.WeightedRandomSampler(weights, 30)) == expected


@pytest.mark.parametrize("batch_size, drop_last", [(1, False), (3, False), (3, True), (16, True)])
def test_batch_sampler_over_random_sampler(batch_size, drop_last):
    expected, got = _both(
        lambda m, g: m.BatchSampler(m.RandomSampler(range(23), generator=g), batch_size, drop_last)
    )
    assert got == expected
    ours_len = len(ours.BatchSampler(range(23), batch_size, drop_last))
    assert ours_len == len(tud.BatchSampler(range(23), batch_size, drop_last))


@pytest.mark.parametrize("n", [1, 3, 10, 16, 17])
@pytest.mark.parametrize("world", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("shuffle", [True, False])
@pytest.mark.parametrize("drop_last", [True, False])
def test_distributed_sampler_partition(n, world, shuffle, drop_last):
    for rank in range(world):
        kwargs = dict(num_replicas=world, rank=rank, shuffle=shuffle, seed=7, drop_last=drop_last)
        theirs = tud.DistributedSampler(range(n), **kwargs)
        mine = ours.DistributedSampler(range(n), **kwargs)
        assert (len(mine), mine.total_size) == (len(theirs), theirs.total_size)
        for epoch in range(EPOCHS):
            theirs.set_epoch(epoch)
            mine.set_epoch(epoch)
            assert list(mine) == list(theirs)


def test_distributed_sampler_drop_last_smaller_than_world():
    kwargs = dict(num_replicas=4, rank=1, drop_last=True)
    assert list(ours.DistributedSampler(range(3), **kwargs)) == list(
        tud.DistributedSampler(range(3), **kwargs)
    )


def test_distributed_sampler_errors_match_torch():
    for module in (tud, ours):
        with pytest.raises(ValueError, match=r"Invalid rank 3, rank should be in the interval \[0, 2\]"):
            module.DistributedSampler(range(4), num_replicas=3, rank=3)


@pytest.mark.parametrize(
    "n, lengths",
    [(10, [3, 7]), (10, [0.3, 0.7]), (11, [0.25, 0.25, 0.25, 0.25]), (100, [0.1] * 10),
     (7, [1.0]), (5, [0.5, 0.5])],
)
def test_random_split(n, lengths):
    theirs = tud.random_split(range(n), lengths, generator=_generator(5))
    mine = ours_ds.random_split(range(n), lengths, generator=_generator(5))
    assert [list(s.indices) for s in mine] == [list(s.indices) for s in theirs]


def test_random_split_default_generator_is_torchs_global():
    torch.manual_seed(31)
    theirs = tud.random_split(range(12), [0.5, 0.5])
    torch.manual_seed(31)
    mine = ours_ds.random_split(range(12), [0.5, 0.5])
    assert [s.indices for s in mine] == [s.indices for s in theirs]


def test_random_split_warning_and_error_match_torch():
    with pytest.warns(UserWarning, match="Length of split at index 1 is 0"):
        ours_ds.random_split(range(2), [0.9, 0.1], generator=_generator(0))
    for module in (tud, ours_ds):
        with pytest.raises(ValueError, match="Sum of input lengths does not equal"):
            module.random_split(range(5), [2, 2])


@pytest.mark.parametrize("seed", [0, 1, 2**40])
def test_draw_base_seed_equals_dataloader_base_seed(seed):
    expected = torch.empty((), dtype=torch.int64).random_(generator=_generator(seed)).item()
    assert gen.draw_base_seed(_generator(seed)) == expected
    torch.manual_seed(seed)
    expected_global = torch.empty((), dtype=torch.int64).random_().item()
    torch.manual_seed(seed)
    assert gen.draw_base_seed(None) == expected_global


def test_new_seed_for_sampler_mirrors_random_sampler():
    torch.manual_seed(77)
    fresh = gen.new_seed_for_sampler(None)
    torch.manual_seed(77)
    expected = list(tud.RandomSampler(range(20)))
    assert isinstance(fresh, torch.Generator)
    assert torch.randperm(20, generator=fresh).tolist() == expected
    g = _generator(1)
    assert gen.new_seed_for_sampler(g) is g


def test_generator_functions_equal_torch_ops():
    assert gen.randperm(30, _generator(1)) == torch.randperm(30, generator=_generator(1)).tolist()
    assert gen.randint(9, 40, _generator(2)) == torch.randint(
        high=9, size=(40,), dtype=torch.int64, generator=_generator(2)
    ).tolist()
    w = [0.5, 1.5, 3.0]
    assert gen.multinomial(w, 10, True, _generator(3)) == torch.multinomial(
        torch.tensor(w, dtype=torch.double), 10, True, generator=_generator(3)
    ).tolist()


def test_torch_samplers_are_ours():
    assert isinstance(tud.SequentialSampler(range(2)), ours.Sampler)
    assert not isinstance(tud.SequentialSampler(range(2)), ours.RandomSampler)


def test_distributed_sampler_reads_initialised_process_group(tmp_path, monkeypatch):
    dist = pytest.importorskip("torch.distributed")
    if not dist.is_available() or dist.is_initialized():
        pytest.skip("needs torch.distributed and no process group yet")
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.delenv("RANK", raising=False)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        sampler = ours.DistributedSampler(range(6), seed=2)
        assert (sampler.num_replicas, sampler.rank) == (1, 0)
        assert list(sampler) == list(tud.DistributedSampler(range(6), seed=2))
    finally:
        dist.destroy_process_group()


def test_an_initialised_process_group_beats_stale_environment_variables(tmp_path, monkeypatch):
    """torch asks the process group only; a RANK/WORLD_SIZE left over from another launcher must not
    give this rank a shard other than torch's."""
    dist = pytest.importorskip("torch.distributed")
    if not dist.is_available() or dist.is_initialized():
        pytest.skip("needs torch.distributed and no process group yet")
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("RANK", "3")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        mine, theirs = ours.DistributedSampler(range(10), seed=1), tud.DistributedSampler(range(10), seed=1)
        assert (mine.num_replicas, mine.rank) == (theirs.num_replicas, theirs.rank) == (1, 0)
        assert list(mine) == list(theirs)
    finally:
        dist.destroy_process_group()


_TORCHRUN_RANK = """
import json, os, sys
import torch.distributed as dist
from torch.utils import data as tud
from shmloader.samplers import DistributedSampler

dist.init_process_group("gloo")
shards = {}
for epoch in range(2):
    mine = DistributedSampler(range(11), seed=3)
    theirs = tud.DistributedSampler(range(11), seed=3)
    mine.set_epoch(epoch)
    theirs.set_epoch(epoch)
    shards[epoch] = [list(mine), list(theirs)]
with open(os.path.join(sys.argv[1], f"rank{os.environ['RANK']}.json"), "w") as f:
    json.dump(shards, f)
dist.destroy_process_group()
"""


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_torchrun_gloo_ranks_get_torchs_disjoint_shards(tmp_path):
    pytest.importorskip("torch.distributed.run")
    script = tmp_path / "rank.py"
    script.write_text(_TORCHRUN_RANK)
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1]), OMP_NUM_THREADS="1")
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
               str(script), str(tmp_path)]
    result = run_tree(command, env=env, timeout=50)
    assert result.returncode == 0, result.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for epoch in ("0", "1"):
        mine = [rank[epoch][0] for rank in ranks]
        assert mine == [rank[epoch][1] for rank in ranks]  # torch's shards, rank by rank
        assert sorted(mine[0] + mine[1]) == sorted(list(range(11)) + [mine[0][0]])  # one pad
    assert ranks[0]["0"][0] != ranks[0]["1"][0]
