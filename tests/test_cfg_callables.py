"""``collate_fn`` and ``worker_init_fn`` that cannot be called: torch's TypeError, naming the option,
never a bare assertion from inside, and for ``worker_init_fn`` before any worker starts."""

from __future__ import annotations

import multiprocessing

import pytest
from parity_helpers import torch_raises

import shmloader

torch = pytest.importorskip("torch")
from torch.utils.data import DataLoader as TorchDataLoader  # noqa: E402

import shmloader.torch  # noqa: E402  (after the skip: it imports torch)

DATA = list(range(6))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("num_workers", [0, 1])
@pytest.mark.parametrize("value", [None, 3], ids=["None", "int"])
def test_a_collate_fn_that_cannot_be_called_is_torchs_type_error_naming_it(num_workers, value):
    theirs = TorchDataLoader(DATA, batch_size=2, num_workers=num_workers)
    theirs.collate_fn = value  # None given to the constructor means the default; set later it is called
    torch_raises(theirs, TypeError)
    for factory in (shmloader.DataLoader, shmloader.torch.DataLoader):
        loader = factory(DATA, batch_size=2, num_workers=num_workers)
        loader.collate_fn = value
        try:
            with pytest.raises(TypeError, match=rf"collate_fn={value!r} is not callable"):
                next(iter(loader))
        finally:
            loader.close()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("late", [False, True], ids=["argument", "attribute"])
def test_a_worker_init_fn_that_cannot_be_called_is_refused_before_any_worker_starts(late):
    torch_raises(TorchDataLoader(DATA, batch_size=2, num_workers=1, worker_init_fn=5), TypeError)  # from worker 0
    loader = shmloader.DataLoader(DATA, batch_size=2, num_workers=1, worker_init_fn=None if late else 5)
    if late:
        loader.worker_init_fn = 5
    try:
        with pytest.raises(TypeError, match=r"worker_init_fn=5 is not callable"):
            iter(loader)
        assert multiprocessing.active_children() == []
    finally:
        loader.close()


def test_a_worker_init_fn_is_not_checked_without_workers_as_torch_never_calls_it():
    assert len(list(TorchDataLoader(DATA, batch_size=2, worker_init_fn=5))) == 3
    assert len(list(shmloader.DataLoader(DATA, batch_size=2, worker_init_fn=5))) == 3
