"""The warnings shmloader gives in its own words, under one base a filter can name.

Owns the warning classes; raises nothing. Promises: every warning shmloader gives in its own words
is a :class:`ShmloaderWarning`, so ``warnings.filterwarnings("ignore", category=ShmloaderWarning)``
(or ``"error"``, or pytest's ``-W "error::shmloader.ShmloaderWarning"``) acts on all of them; one
that was given under another builtin category is still of that category too::

    Warning
    └── UserWarning
        └── ShmloaderWarning        any warning in shmloader's own words
            ├── ConfigWarning       a ``SHMLOADER_*`` variable nothing reads (most likely a misspelling)
            ├── PinWarning          a pin backend could not register slot memory (also a RuntimeWarning)
            └── AccelerateWarning   accelerate returned a loader shmloader.torch.accelerate cannot adopt

The warnings shmloader gives in torch's words (the worker number, ``pin_memory_device``, "no
accelerator", MPS, a DataPipe without a ``Shuffler``, an IterableDataset's length, ``random_split``'s
empty split) are torch's, not these: they keep torch's category, ``UserWarning``, and the module
torch names, so the filters written for torch act on them (``shmloader.warning_origin``).
See docs/frameworks.md ("Warnings").
"""

from __future__ import annotations

__all__ = ["AccelerateWarning", "ConfigWarning", "PinWarning", "ShmloaderWarning"]


class ShmloaderWarning(UserWarning):
    """The base of every warning shmloader gives in its own words."""


class ConfigWarning(ShmloaderWarning):
    """A ``SHMLOADER_*`` variable that nothing reads (most likely a misspelling); given as the
    configuration is resolved, naming the closest valid variable."""


class PinWarning(ShmloaderWarning, RuntimeWarning):
    """A pin backend could not register a slot's memory (mlock refused, CUDA could not start):
    given once per backend; the batches stay correct, unpinned. A ``RuntimeWarning`` as before."""


class AccelerateWarning(ShmloaderWarning):
    """``shmloader.torch.accelerate`` was handed back a loader it does not know how to adopt; that
    loader's batches come from torch's DataLoader."""
