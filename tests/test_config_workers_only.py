"""Variables that only make sense with workers never break a loader without them (config.py).

``SHMLOADER_PREFETCH_FACTOR``, ``SHMLOADER_PERSISTENT_WORKERS`` and ``SHMLOADER_START_METHOD`` set
site-wide are ignored, and noted, when the effective ``num_workers`` is 0; passed as arguments the
same options keep torch's errors.
"""

from __future__ import annotations

import pytest

import shmloader
from shmloader.config import resolve_config


@pytest.mark.parametrize("method", ["fork", "spawn", "forkserver"])
def test_a_start_method_in_the_environment_does_not_break_a_loader_without_workers(monkeypatch, method):
    monkeypatch.setenv("SHMLOADER_START_METHOD", method)
    loader = shmloader.DataLoader(list(range(4)), batch_size=2)  # num_workers=0 (the default)
    assert [b.tolist() for b in loader] == [[0, 1], [2, 3]]


def test_a_start_method_in_the_environment_is_noted_as_ignored_without_workers():
    config = resolve_config({}, {"SHMLOADER_START_METHOD": "spawn"})
    assert config.multiprocessing_context is None
    assert "SHMLOADER_START_METHOD='spawn' ignored: num_workers is 0" in config.notes["multiprocessing_context"]
    assert resolve_config({"num_workers": 2}, {"SHMLOADER_START_METHOD": "spawn"}).multiprocessing_context == "spawn"


def test_a_start_method_passed_without_workers_is_refused_as_torch_refuses_it():
    with pytest.raises(ValueError, match="multiprocessing_context can only be used"):
        shmloader.DataLoader(list(range(4)), batch_size=2, multiprocessing_context="spawn")
