"""The services a loader hands its iterators in their ``Plan``, made from the loader's values.

Owns the four callables of ``engine.plan.Plan`` (the worker spec for a base seed, the slot ring,
the ring's pre-flight space check, a batch's last step) and what each captures. Runs in the main
process. Why: an iterator keeps its plan for its whole life, and a plan of the loader's bound
methods held the loader. With persistent workers the loader holds its iterator too, so the two
made a reference cycle: a loader dropped without ``close()`` kept its workers, pipes and segments
until the cyclic collector came by (tests/test_leak_cycles.py), where torch's ``del loader``
stops them at once. Promises: no callable made here refers to the loader; each reads the
loader's settings as they were when ``iter(loader)`` made the plan (torch's iterator copies them
then too); the pin backend is still chosen once per loader, in its ``PinState``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from shmloader import collate as _collate
from shmloader.config import Config
from shmloader.gpu import pinning
from shmloader.log import worker_log_setup
from shmloader.transport.preflight import check_ring_fits
from shmloader.transport.ring import Ring
from shmloader.transport.sweep import sweep_dead_segments
from shmloader.worker.main import WorkerSpec

__all__ = ["finisher", "preflight", "ring_maker", "spec_maker"]


def spec_maker(loader: Any) -> Callable[[int], WorkerSpec]:
    """base seed -> the ``WorkerSpec`` every worker of the iterator runs (collate rules asked for then)."""
    kind, to_torch = _collate.worker_plan(loader.collate_fn)
    fields = dict(
        dataset=loader.dataset, num_workers=loader.num_workers, shm_dir=loader._config.shm_dir,
        iterable=loader._is_iterable, auto_collation=loader._auto_collation, batch_size=loader.batch_size,
        drop_last=loader.drop_last, collate_kind=kind, collate_fn=loader.collate_fn if kind == "user" else None,
        to_torch=to_torch, worker_init_fn=loader.worker_init_fn,
    )
    return functools.partial(_spec, fields, loader._plugins)


def _spec(fields: dict[str, Any], plugins: Any, base_seed: int) -> WorkerSpec:
    return WorkerSpec(base_seed=base_seed, collate_rules=plugins.collate_rules(), log_setup=worker_log_setup(),
                      **fields)


def ring_maker(loader: Any) -> Callable[[], Ring]:
    """The iterator's slot ring, in the configured directory (swept first unless ``sweep=False``),
    with the loader's pin backend registering each segment (chosen here on the first ring)."""
    pin_memory, pin, plugins = loader.pin_memory, loader._pin, loader._plugins
    return functools.partial(_make_ring, loader._config, pin_memory, pin, plugins, loader.pin_memory_device or "")


def _make_ring(config: Config, pin_memory: bool, pin: pinning.PinState, plugins: Any, device: str) -> Ring:
    if config.sweep:  # sweep=False / SHMLOADER_SWEEP=0: leave the directory alone
        sweep_dead_segments(config.shm_dir)
    backend = pinning.choose(pin, pin_memory, plugins, device)
    # A dropped batch's slot is reused only once the copies enqueued before the drop are done.
    fence = getattr(backend, "fence", None) if backend is not None and backend.device_pinned else None
    return Ring(config.shm_dir, max_slots=config.max_slots,
                on_create=backend.register_segment if backend else None,
                on_retire=backend.unregister_segment if backend else None, fence=fence)


def preflight(num_workers: int, prefetch_factor: int | None) -> Callable[..., None]:
    """(ring, slot bytes, slots, given=False) -> raises ShmSpaceError unless they fit
    (transport/preflight.py); ``given``: the size is the user's ``slot_bytes``."""
    return functools.partial(_preflight, num_workers, prefetch_factor or 0)


def _preflight(num_workers: int, prefetch_factor: int, ring: Ring, slot_bytes: int, slots: int,
               given: bool = False) -> None:  # fmt: skip
    check_ring_fits(ring, slot_bytes, slots, num_workers=num_workers, prefetch_factor=prefetch_factor, given=given)


def finisher(loader: Any) -> Callable[[Any], Any]:
    """A batch's last step before the user: slot-backed tensors marked pinned by the backend, or
    pinned by a copy (``num_workers=0``, or an accelerator no backend registers slots for); else
    the batch itself."""
    if not loader.pin_memory:
        return _as_is
    return functools.partial(_finish, loader._pin, loader.num_workers)


def _as_is(batch: Any) -> Any:
    return batch


def _finish(pin: pinning.PinState, num_workers: int, batch: Any) -> Any:
    if num_workers == 0:  # in no slot, whatever backend an epoch with workers chose: torch's copy pins it
        return pinning.pin_copy(batch) if pinning.torch_pins() else batch
    if pin.backend is not None:
        return pin.backend.finish(batch)
    if pin.copy:
        return pinning.pin_copy(batch)
    return batch
