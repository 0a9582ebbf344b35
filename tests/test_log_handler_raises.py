"""An application's logging handler that raises never breaks the loader's own work.

A handler whose ``emit`` raises (standard handlers catch their errors, a hand-written one may not)
raised out of shmloader's ``logger.info`` in the middle of starting a worker, and again while the
workers were stopped: ``iter()`` failed, and a shutdown was cut short part-way. The loader's log
calls now report such a failure as logging reports its own handlers' errors (``--- Logging
error ---`` on stderr) and go on.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from process_helpers import workers_left

import shmloader
from shmloader.log import apply_log_level, logger


class Raises(logging.Handler):
    def emit(self, record: logging.LogRecord) -> None:
        raise RuntimeError("the application's handler is broken")


@pytest.fixture
def raising_handler() -> Iterator[None]:
    handler = Raises()
    root = logging.getLogger()
    root.addHandler(handler)
    level = logger.level
    apply_log_level("INFO")
    try:
        yield
    finally:
        root.removeHandler(handler)
        apply_log_level(level or logging.WARNING)


@pytest.mark.timeout(60)
@pytest.mark.usefixtures("raising_handler")
def test_a_raising_handler_neither_stops_the_workers_starting_nor_their_shutdown(capfd: pytest.CaptureFixture) -> None:
    loader: shmloader.DataLoader[Any] = shmloader.DataLoader(np.arange(32).reshape(16, 2), batch_size=4, num_workers=2)
    assert [int(b[0, 0]) for b in loader] == [0, 8, 16, 24]
    assert workers_left() == []
    err = capfd.readouterr().err
    assert "--- Logging error ---" in err and "the application's handler is broken" in err
    assert "worker %d started" in err and "worker %d exited" in err  # both start and shutdown logged through it
