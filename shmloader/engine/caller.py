"""Who drives a loader's iterator, as the errors that say what to do next name the calls.

Owns the two wordings: the loader's own (``next()``, ``iter(loader)``), and the device
prefetcher's (``to_device``), which calls ``next()`` and ``iter(loader)`` itself, so that advice
to call those would send its user past the prefetcher, to host batches. Promises: an iterator
starts every epoch with the loader's wording (``iterator.BaseIter``); the prefetcher marks each
epoch it drives (``gpu.prefetch_epoch.Epoch``), so the loader iterated directly afterwards is
named as the loader again. Imports nothing of the engine: the prefetcher imports it freely.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["LOADER", "TO_DEVICE", "Caller"]


@dataclass(frozen=True)
class Caller:
    """The user's calls on an iterator, as a message names them."""

    next: str  # the call that waits for the next batch
    epoch: str  # the call that starts the next epoch


LOADER = Caller("next()", "iter(loader)")
TO_DEVICE = Caller("next() on the to_device() iterator", "iter() on the to_device() prefetcher")
