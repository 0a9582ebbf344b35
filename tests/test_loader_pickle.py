"""A loader pickles and deep-copies, as torch's does (``mp.spawn`` and Lightning's ``ddp_spawn`` pickle
the loaders they are handed; ``copy.deepcopy(loader)`` is a common idiom). The copy iterates the
same batches with the plugins it was given; iterators and workers are never carried: it starts
without them. A loader holding its persistent iterator refuses, as torch's does."""

from __future__ import annotations

import copy
import multiprocessing
import pickle
import threading
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

import numpy as np
import plugin_fixtures as pf
import pytest

import shmloader
from shmloader.errors import PluginError

pytestmark = pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")


def _round_trip(loader: Any) -> Any:
    return pickle.loads(pickle.dumps(loader))


COPIES: dict[str, Callable[[Any], Any]] = {"pickle": _round_trip, "deepcopy": copy.deepcopy}


def _batches(loader: Any) -> list[Any]:
    return [np.asarray(b).tolist() for b in loader]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("how", sorted(COPIES))
def test_a_copy_iterates_the_batches_the_original_would(how: str, num_workers: int) -> None:
    loader: shmloader.DataLoader[Any] = shmloader.DataLoader(np.arange(10), batch_size=3, shuffle=True, generator=7,
                                                             num_workers=num_workers)
    _batches(loader)  # an epoch done: the copy goes on from there (epoch count, generator state)
    clone = COPIES[how](loader)
    try:
        assert clone._plugins is not loader._plugins and clone._book is not loader._book
        assert clone.state_dict() == loader.state_dict() and clone.state_dict()["epoch"] == 1
        epochs = [_batches(clone) for _ in range(2)]
        assert epochs == [_batches(loader) for _ in range(2)]  # the generator's state was carried
        assert epochs[0] != epochs[1] and sorted(sum(epochs[0], [])) == list(range(10))
    finally:
        clone.close()
        loader.close()


def _flavours() -> list[Any]:
    """Both loader classes; torch's flavour only where torch is installed."""
    try:
        import shmloader.torch as shm_torch
    except ImportError:
        return [pytest.param(shmloader.DataLoader, id="shmloader")]
    return [pytest.param(shmloader.DataLoader, id="shmloader"), pytest.param(shm_torch.DataLoader, id="torch")]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("flavour", _flavours())
@pytest.mark.parametrize("how", sorted(COPIES))
def test_a_loader_holding_its_persistent_iterator_refuses_to_be_copied(how: str, flavour: Any) -> None:
    """As torch's: its loader pickles ``_iterator`` and ``_MultiProcessingDataLoaderIter`` raises
    NotImplementedError, mid-epoch and between epochs alike, until the iterator is dropped."""
    loader = flavour(np.arange(8), batch_size=4, num_workers=1, persistent_workers=True)
    try:
        iterator = iter(loader)
        assert np.asarray(next(iterator)).tolist() == [0, 1, 2, 3]
        with pytest.raises(NotImplementedError, match="cannot be pickled"):
            COPIES[how](loader)
        assert np.asarray(next(iterator)).tolist() == [4, 5, 6, 7]  # the original carries on
        assert _batches(loader) == [[0, 1, 2, 3], [4, 5, 6, 7]]  # the iterator is kept between epochs...
        with pytest.raises(NotImplementedError, match="persistent iterator"):
            COPIES[how](loader)
        loader._iterator = None  # ...until dropped (Lightning's way; close() drops it too)
        clone = COPIES[how](loader)
        assert _batches(clone) == [[0, 1, 2, 3], [4, 5, 6, 7]]
        clone.close()
    finally:
        loader.close()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("flavour", _flavours())
def test_a_shallow_copy_does_not_share_the_persistent_iterator(flavour: Any) -> None:
    """``copy.copy`` is allowed, as torch allows it; the copy makes its own iterator and workers,
    so closing one loader never stops the other's (torch's shallow copy shares its iterator)."""
    loader = flavour(np.arange(8), batch_size=4, num_workers=1, persistent_workers=True)
    try:
        iterator = iter(loader)
        assert np.asarray(next(iterator)).tolist() == [0, 1, 2, 3]
        clone = copy.copy(loader)
        assert clone._iterator is None and not clone._live
        assert _batches(clone) == [[0, 1, 2, 3], [4, 5, 6, 7]]
        clone.close()
        assert np.asarray(next(iterator)).tolist() == [4, 5, 6, 7]
    finally:
        loader.close()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("how", sorted(COPIES))
def test_plugins_passed_to_the_loader_come_with_the_copy(how: str, num_workers: int) -> None:
    rules = pf.PointRules()
    loader: shmloader.DataLoader[Any] = shmloader.DataLoader(pf.PointDataset(), batch_size=4, num_workers=num_workers,
                                                             plugins=[rules, pf])
    clone = COPIES[how](loader)
    try:
        carried = [p for p in clone._plugins.pm.get_plugins() if isinstance(p, pf.PointRules)]
        assert len(carried) == 1 and carried[0] is not rules
        assert clone._plugins.pm.is_registered(pf)  # a module plugin travels by name
        got = [b[:, :2].tolist() for b in clone]  # Points collate only through the plugin's rule
        assert got == [b[:, :2].tolist() for b in loader] and len(got) == 3
    finally:
        clone.close()
        loader.close()


class Locked:
    """A plugin holding a lock: it can be neither pickled nor deep-copied."""

    def __init__(self) -> None:
        self.lock = threading.Lock()

    def shmloader_epoch_end(self, epoch: int, stats: dict[str, Any]) -> None:
        pass


@pytest.mark.parametrize("how", sorted(COPIES))
def test_a_plugin_that_cannot_be_copied_is_named(how: str) -> None:
    loader: shmloader.DataLoader[Any] = shmloader.DataLoader(np.arange(4), plugins=[Locked()])
    with pytest.raises(PluginError, match=r"plugin 'Locked' cannot be (pickled|copied) with its loader") as info:
        COPIES[how](loader)
    assert info.value.plugin == "Locked" and isinstance(info.value.__cause__, TypeError)


def _iterate_and_send(loader: Any, conn: Connection) -> None:
    try:
        conn.send(_batches(loader))
    finally:
        loader.close()
        conn.close()


@pytest.mark.timeout(90)
def test_a_loader_handed_to_a_spawned_process_loads_there() -> None:
    """What ``mp.spawn(fn, args=(loader,))`` does: the loader is pickled into a fresh interpreter."""
    loader: shmloader.DataLoader[Any] = shmloader.DataLoader(np.arange(10), batch_size=4, num_workers=2)
    ctx = multiprocessing.get_context("spawn")
    ours, theirs = ctx.Pipe(duplex=False)
    child = ctx.Process(target=_iterate_and_send, args=(loader, theirs))
    child.start()
    theirs.close()
    try:
        assert ours.recv() == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    finally:
        child.join(60)
        ours.close()
        loader.close()
    assert child.exitcode == 0
