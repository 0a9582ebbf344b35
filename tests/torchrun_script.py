"""One training process of ``torchrun --nproc_per_node=2``: one shmloader DataLoader per rank.

Run by tests/test_distributed.py. Joins the gloo process group, builds a ``DistributedSampler``
that reads its rank and world size from torchrun's environment, iterates two epochs with
``num_workers=2`` (calling ``set_epoch`` before each), and writes the sample indices it saw per
epoch to ``<out_dir>/rank<RANK>.json``.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import numpy as np
import torch.distributed as dist

import shmloader

N = 21  # odd: torch's padding rule repeats one index


class Indices(shmloader.Dataset):
    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int) -> np.int64:
        return np.int64(i)


def main(out_dir: str) -> None:
    dist.init_process_group("gloo")
    sampler = shmloader.DistributedSampler(Indices(), shuffle=True, seed=3)  # rank, world size: from env
    loader: shmloader.DataLoader[Any] = shmloader.DataLoader(Indices(), batch_size=4, sampler=sampler, num_workers=2,
                                                             multiprocessing_context="fork")
    seen = []
    for epoch in range(2):
        sampler.set_epoch(epoch)
        seen.append([int(i) for batch in loader for i in np.asarray(batch).tolist()])
    loader.close()
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, seen)  # the group works: every rank sees every shard
    result = {"rank": dist.get_rank(), "world_size": dist.get_world_size(), "sampler_rank": sampler.rank,
              "sampler_replicas": sampler.num_replicas, "epochs": seen, "gathered": everyone}
    with open(os.path.join(out_dir, f"rank{dist.get_rank()}.json"), "w", encoding="utf-8") as f:
        json.dump(result, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
