"""The hook specifications of shmloader: every extension point, each docstring its contract.

Owns the names and signatures plugins implement. A plugin is any object (module, class instance)
with functions named ``shmloader_<hook>``, marked with :data:`hookimpl` or simply named so; it is
registered by ``DataLoader(..., plugins=[...])`` or discovered through the ``shmloader``
entry-point group (see :mod:`shmloader.plugins`, the one factory that builds the manager).

Hooks are always called with keyword arguments, so an implementation may accept any subset of a
hook's arguments, by name. Unless a hook says otherwise, every implementation is called and its
return value ignored. Implementations run in the order pluggy gives: the plugin registered last
first, ``tryfirst``/``trylast`` adjust it. Registration order is: built-in plugins, then
entry-point plugins (sorted by name), then the loader's ``plugins=`` in list order.

Where each hook runs:

- ``shmloader_collate_rules`` — wherever batches are collated: collected once per loader in the
  main process, and again once per worker start (entry-point plugins). Never per batch.
- ``shmloader_pin_backend`` — main process, once per loader (first iterator with pinning).
- ``shmloader_worker_*``, ``shmloader_batch_ready``, ``shmloader_epoch_end`` — observers, main
  process only. ``shmloader_batch_ready`` runs once per batch: it is on the hot path.

Importing this module imports only pluggy.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import pluggy

if TYPE_CHECKING:
    from shmloader.collate.context import CollateRule
    from shmloader.gpu.pinning import PinBackend

PROJECT = "shmloader"
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)
"""Mark a plugin's hook function: ``@hookimpl`` or ``@hookimpl(tryfirst=True)``."""


# ----------------------------------------------------------------------------- collation


@hookspec
def shmloader_collate_rules() -> Mapping[Any, CollateRule] | None:  # type: ignore[empty-body]
    """Contribute collate rules: a mapping ``type (or tuple of types) -> rule(batch, ctx)``.

    Called: in the main process once per loader (the merged rules travel to workers in the
    worker spec, cloudpickled under spawn/forkserver), and in each worker once when it starts,
    for entry-point plugins (loaded there). Never per batch: a rule found by type lookup costs a
    dict walk along the sample type's MRO, where a hook call per value would cost pluggy's
    dispatch for every field of every sample.

    Return a mapping, or None to contribute nothing. Each rule has the
    :class:`~shmloader.collate.CollateRule` signature: ``batch`` holds one field's samples (the
    first is of the rule's type); it must ask ``ctx.alloc(shape, dtype)`` for every output
    array (so the batch is written once, into the slot) and collate nested fields with
    ``ctx.collate(sub_batch, where)``. It runs in the worker, so it must be importable there (or
    picklable by cloudpickle) and must let ``SlotFull`` propagate.

    Merging: a key given by several plugins takes the rule of the plugin called first (the one
    registered last: ``plugins=`` beat entry-point plugins, which beat built-ins). A sample type
    finds its rule by exact type, then along its MRO, then by ``issubclass``; plugin rules come
    before :func:`~shmloader.collate.register_collate_rule` rules, which come before the built-in
    numpy/torch rules (torch's default_collate order). A worker merges the rules its own
    entry-point plugins give beneath the rules carried in the spec.
    """


# ------------------------------------------------------------------------------- pinning


@hookspec(firstresult=True)
def shmloader_pin_backend(device: str) -> PinBackend | None:  # type: ignore[empty-body]
    """Offer a backend that pins the loader's slots for ``device``, or None to pass.

    Called in the main process once per loader, when ``pin_memory=True`` and the first
    multi-process iterator makes its ring. ``device`` is the accelerator asked for
    (``pin_memory_device``; ``""`` means the current accelerator). First result wins: the first
    implementation that returns an object stops the call; an object that is not a backend
    (below) raises PluginError naming the plugin. The built-in backends are built-in
    plugins (``shmloader.gpu.pinning.BuiltinPinPlugin``), registered first, so every other plugin is
    asked before them.

    The backend has ``register_segment(segment)`` (called once per segment the ring creates; pin
    it), ``unregister_segment(segment)`` (before the segment is unlinked) and ``finish(batch)``
    (once per batch, main process, before the user gets it: mark or wrap slot-backed arrays as
    pinned and return the batch). An exception in ``register_segment`` unlinks the new segment
    and propagates. A backend belongs to the main process that made it: a worker forked later
    inherits it (and may garbage-collect batches that reach it), so subclass
    ``shmloader.gpu.owned.Owned`` and guard each device entry point with ``@owner_only`` as the
    built-in backends do, making it inert in any other process (docs/design/ownership.md).
    """


# -------------------------------------------------------------------- observers (main process)


@hookspec
def shmloader_worker_started(worker_id: int, pid: int | None) -> None:
    """A worker process started (once per worker per start, main process; not for a restart)."""


@hookspec
def shmloader_worker_died(worker_id: int, pid: int | None, exitcode: int | None,
                          tasks: dict[int, Any]) -> None:
    """A worker exited unexpectedly: killed by a signal (negative ``exitcode``) or ``os._exit``.

    Main process, once per death, before the loader raises or replaces the worker. ``tasks``:
    task number -> sample indices of the tasks it held.
    """


@hookspec
def shmloader_worker_restarted(worker_id: int, pid: int | None, old_pid: int | None) -> None:
    """A dead worker was replaced under a restart policy (main process, after ``worker_died``)."""


@hookspec
def shmloader_batch_ready(task: int, worker_id: int, nbytes: int, fetch_s: float, collate_s: float,
                          wait_s: float, ready: int, in_flight: int, slots: int) -> None:
    """A batch is about to be handed to the user. Main process, once per batch: the hot path.

    ``task``: the batch's task number in its epoch; ``worker_id``: the worker that made it;
    ``nbytes``: bytes written into its slot; ``fetch_s`` / ``collate_s``: the worker's time to
    fetch the samples / collate and encode them; ``wait_s``: how long the consumer waited in
    ``next()`` for it. Slot occupancy when it was handed out: ``ready`` further batches already
    filled and waiting, ``in_flight`` tasks at workers, ``slots`` in the ring.

    Keep it cheap (well under a microsecond of work is the goal): no I/O, no locks; aggregate
    and report in ``shmloader_epoch_end``. An exception stops the iteration with a PluginError.
    """


@hookspec
def shmloader_epoch_end(epoch: int, stats: dict[str, Any]) -> None:
    """An epoch's last batch was handed out (main process, once per epoch).

    ``epoch`` counts from 0 for the loader's iterator; ``stats`` is ``loader.stats()`` at that
    moment (cumulative over the loader's life). Not called for an epoch abandoned early.
    """
