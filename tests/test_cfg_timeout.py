"""``timeout=``: what torch refuses is refused here with the same exception type, naming the option,
before any worker starts; ``SHMLOADER_TIMEOUT`` set site-wide never breaks a loader without workers."""

from __future__ import annotations

import math
import multiprocessing

import pytest
from parity_helpers import torch_raises

import shmloader
from shmloader.errors import ConfigError

torch = pytest.importorskip("torch")
from torch.utils.data import DataLoader as TorchDataLoader  # noqa: E402

import shmloader.torch  # noqa: E402  (after the skip: it imports torch)

LOADERS = [shmloader.DataLoader, shmloader.torch.DataLoader]
DATA = list(range(6))


@pytest.mark.parametrize("factory", LOADERS, ids=["numpy", "torch"])
@pytest.mark.parametrize("timeout", [5, 0.5, float("nan"), math.inf])
def test_a_timeout_without_workers_is_refused_at_iter_as_torch_refuses_it(factory, timeout):
    with pytest.raises(AssertionError):  # torch's single-process iterator: "requires timeout == 0"
        iter(TorchDataLoader(DATA, batch_size=2, timeout=timeout))
    loader = factory(DATA, batch_size=2, timeout=timeout)  # construction is accepted, as torch accepts it
    with pytest.raises(AssertionError, match=r"timeout=.* needs num_workers > 0") as info:
        iter(loader)
    assert isinstance(info.value, ConfigError) and info.value.name == "timeout"


def test_a_timeout_set_after_construction_without_workers_is_refused_too():
    loader = shmloader.DataLoader(DATA, batch_size=2)
    loader.timeout = 3
    with pytest.raises(AssertionError, match=r"timeout=3 needs num_workers > 0"):
        iter(loader)
    loader.timeout = 0
    assert [b.tolist() for b in loader] == [[0, 1], [2, 3], [4, 5]]


def test_shmloader_timeout_in_the_environment_is_ignored_without_workers(monkeypatch):
    monkeypatch.setenv("SHMLOADER_TIMEOUT", "30")
    loader = shmloader.DataLoader(DATA, batch_size=2)
    assert [b.tolist() for b in loader] == [[0, 1], [2, 3], [4, 5]]
    assert loader.timeout == 0
    assert "SHMLOADER_TIMEOUT='30' ignored: num_workers is 0" in loader._config.notes["timeout"]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("late", [False, True], ids=["argument", "attribute"])
def test_an_infinite_timeout_raises_overflow_naming_it_before_any_worker_starts(late):
    loader = shmloader.DataLoader(DATA, batch_size=2, num_workers=1, timeout=0 if late else math.inf)
    if late:
        loader.timeout = math.inf
    with pytest.raises(OverflowError, match=r"timeout=inf .*timeout=0 to wait forever"):
        iter(loader)  # torch raises OverflowError too, at its first wait; here at once, whatever the timing
    assert multiprocessing.active_children() == []
    loader.close()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("value", ["5", None, b"5"])
def test_a_timeout_that_is_not_a_number_set_after_construction_is_a_type_error_naming_it(value):
    theirs = TorchDataLoader(DATA, batch_size=2, num_workers=1)
    theirs.timeout = value
    torch_raises(theirs, TypeError)
    loader = shmloader.DataLoader(DATA, batch_size=2, num_workers=1)
    loader.timeout = value
    with pytest.raises(TypeError, match=r"timeout=.* is not a number of seconds"):
        iter(loader)
    assert multiprocessing.active_children() == []
    loader.close()
