"""``shmloader.torch``: the loader configured to return exactly what torch's DataLoader returns.

``from shmloader.torch import DataLoader`` is the one-import migration: numpy samples and Python
numbers become tensors with torch's dtypes (zero-copy views of the slot wherever possible). The
class is a subclass of ``torch.utils.data.DataLoader`` (shmloader/torch/loader.py), so Lightning
and accelerate recognise it; ``shmloader.torch.accelerate`` keeps accelerate's wrapper on
shmloader's workers (docs/frameworks.md).
Importing this module imports torch; without torch it raises ModuleNotFoundError saying how to
install it (``pip install 'shmloader[torch]'``), while ``import shmloader`` still works.
"""

from __future__ import annotations

try:
    import torch as _torch  # noqa: F401  (this module is the torch flavour)
except ModuleNotFoundError as _exc:  # torch itself is missing, not one of its own dependencies
    if _exc.name != "torch":
        raise
    raise ModuleNotFoundError(
        "shmloader.torch needs torch, which is not installed: pip install 'shmloader[torch]' "
        "(or install torch as its docs say for your platform). Without torch, use the numpy "
        "flavour: from shmloader import DataLoader.",
        name="torch",
    ) from None

from shmloader.collate import torch_default_collate as default_collate
from shmloader.collate import torch_default_convert as default_convert
from shmloader.torch.loader import DataLoader, init_kwargs

__all__ = ["DataLoader", "default_collate", "default_convert", "init_kwargs"]
