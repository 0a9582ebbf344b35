"""DataPipes given as the dataset of ``shmloader.torch.DataLoader``, handled as torch's DataLoader handles them.

Owns what torch's loader does for an ``IterDataPipe`` or ``MapDataPipe`` and nothing else: at
construction it wraps the pipe for serialization and sets its shufflers from ``shuffle=``
(:func:`adopt`); each epoch it draws a shared seed from the loader's generator (broadcast from
rank 0 when torch.distributed is initialised), seeds the pipe's shufflers with it, and shards the
pipe — in the main process without workers, in each worker by torch's own
``_sharding_worker_init_fn`` over ``num_workers * world_size`` instances — (:func:`epoch_plan`);
persistent workers re-seed their copy from the seed each epoch's ``Reset`` carries. Runs in the main
process, and (the init and re-seed functions) in workers. Promises: a pipe gives the samples, order
and random draws of torch's loader; any other dataset is left untouched.
"""

from __future__ import annotations

import dataclasses
import functools
import weakref
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch.utils.data import IterDataPipe, MapDataPipe
from torch.utils.data.dataloader import _get_distributed_settings, _sharding_worker_init_fn
from torch.utils.data.datapipes.datapipe import (
    _IterDataPipeSerializationWrapper,
    _MapDataPipeSerializationWrapper,
)
from torch.utils.data.graph import traverse_dps
from torch.utils.data.graph_settings import (
    _is_shuffle_datapipe,
    apply_random_seed,
    apply_sharding,
    apply_shuffle_settings,
    get_all_graph_pipes,
)

from shmloader._generators import draw_base_seed
from shmloader.warning_origin import TORCH_LOADER_MODULE, warn

if TYPE_CHECKING:
    from collections.abc import Callable

    from shmloader.engine.plan import Plan
    from shmloader.worker.main import WorkerSpec

__all__ = ["adopt", "epoch_plan", "iterator_made", "reseed"]

# one gloo group per loader for the seed's broadcast (torch makes one per iterator): every rank
# makes it at the same point, its loader's first epoch
_groups: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()
# torch.utils.data.graph_settings.apply_shuffle_settings's words
_NO_SHUFFLER = ("`shuffle=True` was set, but the datapipe does not contain a `Shuffler`. Adding one at the end. "
                "Be aware that the default buffer size might not be sufficient for your task.")


def adopt(dataset: Any, shuffle: bool | None) -> tuple[Any, bool | None]:
    """The dataset the loader keeps, and the ``shuffle`` its checks see.

    A pipe is wrapped as torch wraps it; an ``IterDataPipe``'s shufflers are switched on or off by
    an explicit ``shuffle`` (torch's "expected unspecified shuffle option" is not raised for it).
    ``shuffle=True`` on a pipe with no shuffler adds one, with torch's warning named as torch's
    loader names it (its module, shmloader/warning_origin.py), not by torch's helper's caller here.
    """
    if isinstance(dataset, IterDataPipe):
        if shuffle and not _has_shuffler(dataset):
            warn(_NO_SHUFFLER, stacklevel=1, torch_module=TORCH_LOADER_MODULE)
            dataset = dataset.shuffle()  # what apply_shuffle_settings adds, then switches on
        if shuffle is not None:
            dataset = apply_shuffle_settings(dataset, shuffle=shuffle)
        return _IterDataPipeSerializationWrapper(dataset), None
    if isinstance(dataset, MapDataPipe):
        return _MapDataPipeSerializationWrapper(dataset), shuffle
    return dataset, shuffle


def _has_shuffler(dataset: IterDataPipe) -> bool:
    """Whether ``apply_shuffle_settings`` finds a shuffler in the pipe's graph (torch's own test)."""
    return any(_is_shuffle_datapipe(pipe) for pipe in get_all_graph_pipes(traverse_dps(dataset)))


def epoch_plan(loader: Any, plan: Plan) -> Plan:
    """``plan`` for one epoch of ``loader``: the pipe seeded and sharded as torch's iterator does."""
    dataset = loader.dataset
    if not isinstance(dataset, (IterDataPipe, MapDataPipe)):
        return plan
    world_size, rank = _get_distributed_settings()
    seed = None
    if isinstance(dataset, IterDataPipe):
        seed = _shared_seed(loader)
        reseed(dataset, seed)
    if plan.num_workers == 0:
        apply_sharding(dataset, world_size, rank)
        return plan
    make = functools.partial(_worker_spec, plan.worker_spec, seed, world_size, rank)
    return dataclasses.replace(plan, worker_spec=make, reset_seed=seed)


def iterator_made(loader: Any) -> None:
    """After a new iterator with workers drew its base seed: torch's then resets itself, which
    draws one more shared seed and seeds the main process's copy of an ``IterDataPipe`` with it
    (its workers keep the first), so the loader's generator advances as torch's does."""
    if loader.num_workers > 0 and isinstance(loader.dataset, IterDataPipe):
        reseed(loader.dataset, _shared_seed(loader))


def reseed(dataset: Any, seed: int) -> None:
    """Seed the pipe's shufflers from ``seed`` (torch: ``apply_random_seed`` with a shared generator)."""
    apply_random_seed(dataset, torch.Generator().manual_seed(seed))


def _shared_seed(loader: Any) -> int:
    """torch's ``_share_dist_seed``: one draw from the loader's generator, rank 0's for every rank."""
    seed = draw_base_seed(loader._generator_source)
    if not (dist.is_available() and dist.is_initialized()):
        return seed
    group: Any = _groups.get(loader)  # a ProcessGroup (newer torch types new_group as a union with -100)
    if group is None:
        group = _groups[loader] = dist.new_group(backend="gloo")
    shared = torch.tensor(seed, dtype=torch.int64)
    dist.broadcast(shared, src=0, group=group)
    return int(shared.item())


def _worker_spec(make: Callable[[int], WorkerSpec], seed: int | None, world_size: int, rank: int,
                 base_seed: int) -> WorkerSpec:
    spec = make(base_seed)
    spec.worker_init_fn = functools.partial(_worker_init, spec.worker_init_fn, seed, world_size, rank)
    spec.reseed = reseed if seed is not None else None
    return spec


def _worker_init(init_fn: Callable[[int], None] | None, seed: int | None, world_size: int, rank: int,
                 worker_id: int) -> None:
    """In a worker, before the user's ``worker_init_fn``: seed its copy of the pipe, then shard it."""
    info = torch.utils.data.get_worker_info()
    if seed is not None and info is not None:
        reseed(info.dataset, seed)
    _sharding_worker_init_fn(init_fn, world_size, rank, worker_id)
