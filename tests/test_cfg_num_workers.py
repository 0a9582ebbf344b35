"""A ``num_workers`` no process could start (beyond ``sys.maxsize``) is refused naming it, at
construction, never as a bare OverflowError from inside ``iter()``; an ``SHMLOADER_*`` integer that
large is out of range, naming the variable."""

from __future__ import annotations

import sys
import warnings

import pytest

import shmloader
from shmloader.errors import ConfigError

DATA = list(range(4))


@pytest.mark.parametrize("late", [False, True], ids=["argument", "attribute"])
def test_a_num_workers_beyond_sys_maxsize_is_refused_naming_it(late):
    huge = sys.maxsize + 1
    if late:
        loader = shmloader.DataLoader(DATA, batch_size=2)
        loader.num_workers = huge
        with pytest.raises(OverflowError, match=rf"num_workers={huge} is more worker processes"), \
                warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch's "will create N worker processes" comes first
            iter(loader)
    else:
        with pytest.raises(OverflowError, match=rf"num_workers={huge} is more worker processes"):
            shmloader.DataLoader(DATA, batch_size=2, num_workers=huge)


@pytest.mark.parametrize("variable", ["SHMLOADER_NUM_WORKERS", "SHMLOADER_MAX_SLOTS", "SHMLOADER_MAX_RESTARTS"])
def test_an_integer_variable_beyond_sys_maxsize_is_out_of_range_naming_it(monkeypatch, variable):
    monkeypatch.setenv(variable, str(sys.maxsize + 1))
    with pytest.raises(ConfigError, match=rf"^{variable}='\d+' is out of range"):
        shmloader.DataLoader(DATA, batch_size=2)
