"""shmloader: a drop-in torch DataLoader whose workers collate into shared-memory slots.

``import shmloader`` never imports torch. ``shmloader.DataLoader`` is numpy-native;
``shmloader.torch.DataLoader`` returns what torch's DataLoader returns.
"""

from __future__ import annotations

from shmloader.collate import default_collate, default_convert
from shmloader.datasets import (
    ArrayDataset,
    ChainDataset,
    ConcatDataset,
    Dataset,
    IterableDataset,
    StackDataset,
    Subset,
    TensorDataset,
    random_split,
)
from shmloader.errors import (
    ConfigError,
    DescriptorError,
    LoaderClosed,
    LoaderError,
    PluginError,
    PoisonTask,
    RestartBudgetExceeded,
    RingExhausted,
    ShmSpaceError,
    StateError,
    TooManyOpenFiles,
    WorkerDied,
    WorkerHung,
    WorkerTimeout,
)
from shmloader.gpu.prefetch import to_device
from shmloader.hookspecs import hookimpl
from shmloader.loader import DataLoader
from shmloader.samplers import (
    BatchSampler,
    DistributedSampler,
    RandomSampler,
    Sampler,
    SequentialSampler,
    SubsetRandomSampler,
    WeightedRandomSampler,
)
from shmloader.warning_types import ShmloaderWarning
from shmloader.worker_info import WorkerInfo, get_worker_info

__version__ = "0.1.0"

__all__ = [
    "ArrayDataset", "BatchSampler", "ChainDataset", "ConcatDataset", "ConfigError", "DataLoader", "Dataset",
    "DescriptorError", "DistributedSampler", "IterableDataset", "LoaderClosed", "LoaderError", "PluginError", "PoisonTask", "RandomSampler",
    "RestartBudgetExceeded", "RingExhausted", "Sampler", "SequentialSampler", "ShmSpaceError", "ShmloaderWarning", "StackDataset", "StateError",
    "Subset", "SubsetRandomSampler", "TensorDataset", "TooManyOpenFiles", "WeightedRandomSampler", "WorkerDied", "WorkerHung",
    "WorkerInfo", "WorkerTimeout", "default_collate", "default_convert", "get_worker_info", "hookimpl", "random_split",
    "to_device", "__version__",
]
