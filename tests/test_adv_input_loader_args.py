"""Hostile values of DataLoader's own arguments (and their SHMLOADER_* variables): each raises
torch's exception type, at torch's moment or earlier, with a message naming the argument and the
value, where torch's own message names neither ('<' not supported between 'str' and 'int') or
comes from deep inside (islice, a millisecond conversion)."""

from __future__ import annotations

import sys

import numpy as np
import pytest

import shmloader
from shmloader.config import resolve_config
from shmloader.errors import ConfigError

DATA = np.arange(16.0).reshape(8, 2)


@pytest.mark.parametrize("num_workers", [0, 1])
@pytest.mark.parametrize("timeout", ["1", None, 1j, b"1"])
def test_a_timeout_that_is_not_a_number_is_named_at_construction(num_workers: int, timeout: object) -> None:
    """torch raises TypeError here too, at construction, but as "'<' not supported between
    instances of 'str' and 'int'": the same type at the same moment, naming timeout."""
    with pytest.raises(TypeError, match=rf"timeout.*timeout={timeout!r}"):
        shmloader.DataLoader(DATA, num_workers=num_workers, timeout=timeout)


@pytest.mark.parametrize("prefetch_factor", ["2", b"2", 2j])
def test_a_prefetch_factor_that_is_not_a_number_is_named_at_construction(prefetch_factor: object) -> None:
    """Same as timeout: torch's TypeError at construction, worded with the argument and value."""
    with pytest.raises(TypeError, match=rf"prefetch_factor.*prefetch_factor={prefetch_factor!r}"):
        shmloader.DataLoader(DATA, num_workers=1, prefetch_factor=prefetch_factor)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("option", ["timeout", "task_timeout_s"])
def test_a_finite_wait_too_long_to_count_in_milliseconds_is_named(option: str) -> None:
    """1e308 s is finite but its milliseconds are not: next() raised a bare OverflowError
    ('cannot convert float infinity to integer') from the wait. torch raises the same bare
    OverflowError at its first wait: here OverflowError (timeout) or ConfigError (shmloader's own
    task_timeout_s) names the argument, no later than iter(), before any worker starts."""
    loaders: list[shmloader.DataLoader] = []
    with pytest.raises((OverflowError, ConfigError), match=rf"{option}=1e\+308"):
        loaders.append(shmloader.DataLoader(DATA, batch_size=2, num_workers=1, **{option: 1e308}))
        next(iter(loaders[0]))
    for loader in loaders:
        loader.close()


@pytest.mark.parametrize("variable", ["SHMLOADER_TIMEOUT", "SHMLOADER_TASK_TIMEOUT_S"])
def test_a_wait_variable_too_long_to_count_in_milliseconds_is_refused_naming_it(variable: str) -> None:
    with pytest.raises(ConfigError, match=rf"^{variable}='1e308' is too large"):
        resolve_config({"num_workers": 1}, {variable: "1e308"})
    assert resolve_config({"num_workers": 1}, {variable: "1e12"})  # long, but a wait can count it


@pytest.mark.parametrize("batch_size", [sys.maxsize + 1, 2**70])
def test_a_batch_size_past_sys_maxsize_is_named(batch_size: int) -> None:
    """torch raises ValueError only at the first next(), from itertools.islice ('Stop argument for
    islice() must be None or an integer'); here the same ValueError at construction, naming it."""
    with pytest.raises(ValueError, match=rf"batch_size={batch_size}"):
        shmloader.DataLoader(DATA, batch_size=batch_size)


@pytest.mark.parametrize("option", ["sampler", "batch_sampler"])
def test_a_sampler_that_is_not_iterable_is_named_at_construction(option: str) -> None:
    """torch raises "'int' object is not iterable" at the first next(): the same TypeError,
    earlier (when the loader is built: samplers cannot be replaced afterwards), naming the argument."""
    with pytest.raises(TypeError, match=rf"^{option}=3 is not iterable"):
        shmloader.DataLoader(DATA, **{option: 3})


class _OldStyle:
    """Iterable through __getitem__ alone, as Python allows."""

    def __getitem__(self, i: int) -> list[int]:
        if i >= 2:
            raise IndexError(i)
        return [i]


def test_a_sampler_iterable_through_getitem_is_still_taken() -> None:
    assert [b.tolist() for b in shmloader.DataLoader(DATA, batch_sampler=_OldStyle())] == [[[0.0, 1.0]], [[2.0, 3.0]]]
