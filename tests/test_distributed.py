"""Scale-out under torchrun: one shmloader per rank, shards from ``DistributedSampler``.

Launches ``python -m torch.distributed.run --nproc_per_node=2`` (gloo on the CPU) on
tests/torchrun_script.py, then checks what each rank saw against torch's own DistributedSampler:
disjoint shards that cover the dataset under torch's padding rule, and a new order each epoch.
"""

from __future__ import annotations

import json
import os
import socket
import sys
from pathlib import Path

import pytest
from tree_run import run_tree

import shmloader

SCRIPT = Path(__file__).resolve().parent / "torchrun_script.py"
N, WORLD = 21, 2


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_distributed_sampler_reads_torchrun_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WORLD_SIZE", "3")
    monkeypatch.setenv("RANK", "2")
    sampler = shmloader.DistributedSampler(range(10), shuffle=False)
    assert (sampler.num_replicas, sampler.rank, list(sampler)) == (3, 2, [2, 5, 8, 1])
    monkeypatch.setenv("RANK", "3")
    with pytest.raises(ValueError, match=r"Invalid rank 3, rank should be in the interval \[0, 2\]"):
        shmloader.DistributedSampler(range(10))


@pytest.mark.timeout(180)
def test_torchrun_two_ranks_get_disjoint_covering_shards(tmp_path: Path) -> None:
    torch_sampler = pytest.importorskip("torch.utils.data").DistributedSampler
    pytest.importorskip("torch.distributed.run")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=1", f"--nproc_per_node={WORLD}",
           "--master_addr=127.0.0.1", f"--master_port={_free_port()}", str(SCRIPT), str(tmp_path)]
    proc = run_tree(cmd, timeout=170, env=env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(WORLD)]
    assert [(r["rank"], r["sampler_rank"], r["sampler_replicas"]) for r in ranks] == [(0, 0, 2), (1, 1, 2)]
    total = -(-N // WORLD) * WORLD
    for epoch in range(2):
        shards = [r["epochs"][epoch] for r in ranks]
        for rank, shard in enumerate(shards):  # exactly torch's shard: its order, its padding
            theirs = torch_sampler(range(N), num_replicas=WORLD, rank=rank, shuffle=True, seed=3)
            theirs.set_epoch(epoch)
            assert shard == list(theirs)
            assert ranks[1 - rank]["gathered"][rank] == [r["epochs"] for r in ranks][rank]
        merged = shards[0] + shards[1]
        assert len(merged) == total and set(merged) == set(range(N))
        # disjoint but for torch's padding: the head of the shuffled order repeated, total - N of them
        repeated = sorted(i for i in set(merged) if merged.count(i) > 1)
        interleaved = [shards[i % WORLD][i // WORLD] for i in range(total)]
        assert repeated == sorted(interleaved[: total - N]) and len(repeated) == total - N
        assert len(set(shards[0][: N // WORLD]) & set(shards[1][: N // WORLD])) == 0
    assert ranks[0]["epochs"][0] != ranks[0]["epochs"][1]  # set_epoch reshuffles
    assert sorted(ranks[0]["epochs"][0]) != sorted(ranks[0]["epochs"][1])


def test_distributed_sampler_state_resumes_its_epoch_and_refuses_another_shard() -> None:
    from test_resume import Noisy, batches

    def loader(rank: int) -> shmloader.DataLoader:
        sampler = shmloader.DistributedSampler(Noisy(N), num_replicas=WORLD, rank=rank, seed=3)
        return shmloader.DataLoader(Noisy(N), batch_size=2, sampler=sampler, task_seeding=True, generator=1)

    first = loader(0)
    assert isinstance(first.sampler, shmloader.DistributedSampler)
    first.sampler.set_epoch(4)
    it = iter(first)
    before = batches(it, 2)
    state = json.loads(json.dumps(first.state_dict()))
    assert state["objects"]["sampler"] == {"epoch": 4, "seed": 3, "num_replicas": WORLD, "rank": 0}
    again = loader(0)
    again.load_state_dict(state)
    assert isinstance(again.sampler, shmloader.DistributedSampler)
    assert again.sampler.epoch == 4 and before + batches(again) == before + batches(it)
    with pytest.raises(ValueError, match="rank saved 0, this sampler 1"):
        loader(1).load_state_dict(state)
