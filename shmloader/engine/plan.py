"""The plan: everything an iterator needs from its loader, fixed when ``iter(loader)`` is called.

Owns nothing live; it is a frozen record the loader builds (``DataLoader._plan``) and hands to the
iterator it makes (and, with persistent workers, to ``_reset`` each epoch). Runs in the main
process. Promises: an iterator reads only its plan — never the loader's attributes — so what an
iterator does is decided by one value the loader computed once, and the loader's privates have
one reader. The callables are the loader's narrow services (``loader_services``, none of which
refers to the loader): building a ``WorkerSpec`` for a base seed, making the slot ring (with the
loader's pin backend), the pre-flight space check, the last step of each batch (pinning); and the
epoch bookkeeping of resume (``epoch_book.EpochBook``, which refers to its loader weakly).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.context import BaseContext
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from shmloader.config import Config
    from shmloader.epoch_book import EpochBook
    from shmloader.events import Events
    from shmloader.transport.ring import Ring
    from shmloader.worker.main import WorkerSpec


@dataclass(frozen=True)
class Plan:
    """One iterator's settings and services (see the module docstring)."""

    config: Config
    dataset: Any
    num_workers: int
    prefetch_factor: int
    timeout_s: float
    in_order: bool
    persistent: bool
    iterable: bool
    auto_collation: bool
    index_sampler: Any
    len_called: int | None  # len(loader) of an IterableDataset, for torch's over-length warning
    events: Events
    book: EpochBook
    context: BaseContext
    worker_spec: Callable[[int], WorkerSpec]  # base seed -> what each worker runs
    make_ring: Callable[[], Ring]
    preflight: Callable[..., None]  # (ring, slot bytes, slots, given=False) -> raises ShmSpaceError
    finish: Callable[[Any], Any]  # the batch's last step before the user (pinning)
    # The module torch's warnings in torch's words name (the torch flavour's torch.utils.data.dataloader;
    # None for the numpy flavour, which gives none of the pool's): shmloader/warning_origin.py
    warning_module: str | None = None
    reset_seed: int | None = None  # each persistent epoch's Reset carries it to the workers (DataPipes)
    # The loader, held by an iterator it does not hold itself (without persistent workers), so that
    # the iterator's state_dict() can read it; None for the persistent iterator, which the loader
    # holds: the plan refers to nothing that refers back to the iterator (loader_services.py).
    loader: Any = None
