"""More workers than this process can open descriptors for: the loader names ``num_workers``,
the worker that could not start and the limit, instead of a bare ``OSError: [Errno 24] Too many
open files`` from ``os.pipe()`` inside multiprocessing; the workers already started are stopped."""

from __future__ import annotations

import errno
import os
import resource
from typing import Any

import numpy as np
import pytest

import shmloader
from shmloader.cli.options import open_descriptors


@pytest.mark.timeout(120)
@pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")  # torch's 30-workers warning, expected
def test_workers_past_the_open_file_limit_are_named(monkeypatch: pytest.MonkeyPatch) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    limit = open_descriptors() + 40  # room for a few workers, not for 30
    if hard != resource.RLIM_INFINITY and limit > hard:
        pytest.skip("the hard open-file limit is too low to test this")
    loader: shmloader.DataLoader[Any] = shmloader.DataLoader(np.arange(64.0).reshape(32, 2), batch_size=2, num_workers=30,
                                  multiprocessing_context="fork")  # fmt: skip
    resource.setrlimit(resource.RLIMIT_NOFILE, (limit, hard))
    try:
        with pytest.raises(OSError) as exc:
            next(iter(loader))
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
        loader.close()
    assert exc.value.errno == errno.EMFILE
    text = str(exc.value)
    assert "num_workers=30" in text and f"RLIMIT_NOFILE = {limit}" in text, text
    assert "worker " in text and os.strerror(errno.EMFILE) in text
