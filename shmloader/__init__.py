"""shmloader: a drop-in torch DataLoader whose workers collate into shared-memory slots.

``import shmloader`` never imports torch. ``shmloader.DataLoader`` is numpy-native;
``shmloader.torch.DataLoader`` returns what torch's DataLoader returns.
"""

from __future__ import annotations

from .collate import default_collate, default_convert
from .datasets import (
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
from .errors import (
    ConfigError,
    DescriptorError,
    LoaderError,
    PoisonTask,
    RestartBudgetExceeded,
    RingExhausted,
    ShmSpaceError,
    WorkerDied,
    WorkerHung,
    WorkerTimeout,
)
from .loader import DataLoader
from .samplers import (
    BatchSampler,
    DistributedSampler,
    RandomSampler,
    Sampler,
    SequentialSampler,
    SubsetRandomSampler,
    WeightedRandomSampler,
)
from .worker_info import WorkerInfo, get_worker_info

__version__ = "0.1.0"

__all__ = [
    "ArrayDataset", "BatchSampler", "ChainDataset", "ConcatDataset", "ConfigError", "DataLoader", "Dataset",
    "DescriptorError", "DistributedSampler", "IterableDataset", "LoaderError", "PoisonTask", "RandomSampler",
    "RestartBudgetExceeded", "RingExhausted", "Sampler", "SequentialSampler", "ShmSpaceError", "StackDataset",
    "Subset", "SubsetRandomSampler", "TensorDataset", "WeightedRandomSampler", "WorkerDied", "WorkerHung",
    "WorkerInfo", "WorkerTimeout", "default_collate", "default_convert", "get_worker_info", "random_split",
    "__version__",
]
