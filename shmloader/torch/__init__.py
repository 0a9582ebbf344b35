"""``shmloader.torch``: the loader configured to return exactly what torch's DataLoader returns.

``from shmloader.torch import DataLoader`` is the one-import migration: numpy samples and Python
numbers become tensors with torch's dtypes (zero-copy views of the slot wherever possible).
Importing this module imports torch.
"""

from __future__ import annotations

import torch as _torch  # noqa: F401  (this module is the torch flavour)

from shmloader.collate import torch_default_collate as default_collate
from shmloader.collate import torch_default_convert as default_convert
from shmloader.loader import DataLoader as _NumpyDataLoader


class DataLoader(_NumpyDataLoader):  # type: ignore[type-arg]
    """shmloader's DataLoader returning torch tensors as torch's ``default_collate`` does."""

    _to_torch = True


__all__ = ["DataLoader", "default_collate", "default_convert"]
