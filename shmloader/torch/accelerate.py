"""Keep Hugging Face accelerate's prepared loaders on shmloader's workers and slot ring.

accelerate's ``Accelerator.prepare(loader)`` does not return the loader it is given: it builds a
wrapper (``DataLoaderShard``, or ``DataLoaderDispatcher`` for dispatched batches) that constructs a
new *torch* ``DataLoader`` from the given loader's dataset, (sharded) batch sampler and torch
options, and iterates that one. A ``shmloader.torch.DataLoader`` passed to it would be sharded
correctly but loaded by torch's workers. accelerate has no hook for the loader class it builds, so
this module swaps the inner loader instead:

- ``Accelerator``: accelerate's ``Accelerator`` whose ``prepare``/``prepare_data_loader`` and
  ``skip_first_batches`` keep shmloader loaders on shmloader (change one import);
- :func:`prepare` and :func:`skip_first_batches`: the same, for an ``Accelerator`` you did not
  create (``prepare(accelerator, model, optimizer, loader)``);
- :func:`adopt`: the one step both use.

Runs in the main process of each accelerate process. Promises: accelerate's wrapper keeps doing
everything it does (per-process shards through its ``BatchSamplerShard``/``IterableDatasetShard``,
RNG synchronisation, device placement, ``GradientState.end_of_dataloader``, ``set_epoch``,
``skip_first_batches``); only its inner loader becomes a ``shmloader.torch.DataLoader`` built
from the torch loader accelerate made (:func:`shmloader.torch.init_kwargs`) plus the shmloader
options the original loader was given. Loaders that are not shmloader's are left alone. accelerate's
per-batch snapshot of an inner loader's ``state_dict()`` is kept off, as it is for torch's
DataLoader (which has none); use ``loader.state_dict()`` (docs/resume.md) to checkpoint. Refuses
``use_stateful_dataloader=True`` (torchdata's loader) with a ValueError. See docs/frameworks.md.
"""

from __future__ import annotations

import warnings
from typing import Any

try:
    import accelerate as _accelerate  # noqa: F401  (this module is the accelerate adapter)
except ModuleNotFoundError as _exc:
    if _exc.name != "accelerate":
        raise
    raise ModuleNotFoundError(
        "shmloader.torch.accelerate needs Hugging Face accelerate, which is not installed: "
        "pip install accelerate",
        name="accelerate",
    ) from None

from accelerate import Accelerator as _Accelerator
from accelerate.data_loader import DataLoaderAdapter
from accelerate.data_loader import skip_first_batches as _skip_first_batches
from torch.utils.data import DataLoader as _TorchDataLoader

from shmloader.torch.loader import EXTRA_OPTIONS, init_kwargs
from shmloader.torch.loader import DataLoader as ShmTorchDataLoader
from shmloader.warning_types import AccelerateWarning

__all__ = ["Accelerator", "adopt", "prepare", "skip_first_batches"]


def _no_state_snapshot() -> None:
    """Stands in for accelerate's per-batch ``_update_state_dict`` (a no-op for torch's DataLoader)."""


def _shmloader_source(loader: Any) -> ShmTorchDataLoader | None:
    """The shmloader loader behind ``loader`` (itself, or an accelerate wrapper's inner one)."""
    if isinstance(loader, DataLoaderAdapter):
        loader = loader.base_dataloader
    return loader if isinstance(loader, ShmTorchDataLoader) else None


def _extras(source: ShmTorchDataLoader) -> dict[str, Any]:
    return {name: value for name in EXTRA_OPTIONS if (value := getattr(source, name)) is not None}


def adopt(prepared: Any, source: Any) -> Any:
    """Make accelerate's ``prepared`` wrapper of ``source`` iterate a shmloader loader; return it.

    ``source`` is what was given to accelerate; unless it is (or wraps) a
    ``shmloader.torch.DataLoader``, ``prepared`` is returned untouched. The wrapper's inner torch
    loader is replaced by ``type(source)(**init_kwargs(inner), **source's shmloader options)``; a
    bare torch loader (what ``skip_first_batches`` makes of an unwrapped loader) is rebuilt the same
    way and returned instead.
    """
    shm = _shmloader_source(source)
    if shm is None:
        return prepared
    if isinstance(prepared, DataLoaderAdapter):
        if isinstance(prepared.base_dataloader, ShmTorchDataLoader):
            return prepared
        if getattr(prepared, "use_stateful_dataloader", False):
            raise ValueError(
                "use_stateful_dataloader=True (accelerate's DataLoaderConfiguration) makes accelerate load "
                "with torchdata's StatefulDataLoader, which shmloader cannot stand in for: leave it False "
                "and checkpoint with loader.state_dict() / load_state_dict() (docs/resume.md)")
        prepared.base_dataloader = type(shm)(**init_kwargs(prepared.base_dataloader, **_extras(shm)))
        prepared._update_state_dict = _no_state_snapshot
        return prepared
    if type(prepared) is _TorchDataLoader:
        return type(shm)(**init_kwargs(prepared, **_extras(shm)))
    warnings.warn(f"shmloader.torch.accelerate: accelerate returned a {type(prepared).__name__}, which "
                  "shmloader does not know how to adopt; its batches come from torch's DataLoader",
                  AccelerateWarning, stacklevel=2)
    return prepared


def prepare(accelerator: _Accelerator, *args: Any, device_placement: list[bool] | None = None) -> Any:
    """``accelerator.prepare(*args)``, with every shmloader loader among ``args`` kept on shmloader.

    Returns what ``accelerator.prepare`` returns (one object, or a tuple in the order given).
    """
    prepared = accelerator.prepare(*args, device_placement=device_placement)
    results = prepared if isinstance(prepared, tuple) else (prepared,)
    adopted = tuple(adopt(out, given) for out, given in zip(results, args))
    return adopted if isinstance(prepared, tuple) else adopted[0]


def skip_first_batches(dataloader: Any, num_batches: int = 0) -> Any:
    """accelerate's ``skip_first_batches(dataloader, num_batches)``, kept on shmloader."""
    if isinstance(num_batches, bool) or not isinstance(num_batches, int) or num_batches < 0:
        raise ValueError(f"num_batches should be a non-negative integer, but got num_batches={num_batches!r}")
    return adopt(_skip_first_batches(dataloader, num_batches=num_batches), dataloader)


class Accelerator(_Accelerator):
    """accelerate's ``Accelerator``; the loaders it prepares from shmloader loaders stay on shmloader.

    ``prepare``, ``prepare_data_loader`` and ``skip_first_batches`` behave as accelerate's, with
    :func:`adopt` applied to each shmloader loader's wrapper. Everything else is accelerate's.
    """

    def prepare_data_loader(self, data_loader: Any, device_placement: bool | None = None,
                            slice_fn_for_dispatch: Any = None) -> Any:
        prepared = super().prepare_data_loader(data_loader, device_placement=device_placement,
                                               slice_fn_for_dispatch=slice_fn_for_dispatch)
        return adopt(prepared, data_loader)

    def skip_first_batches(self, dataloader: Any, num_batches: int = 0) -> Any:
        return skip_first_batches(dataloader, num_batches)
