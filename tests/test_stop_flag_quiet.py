"""An idle worker exits on its stop flag alone, with no stop message behind it.

The main process stops a worker by setting its stop flag and then writing ``None`` to its task
pipe; when the pipe is full that ``None`` never gets there. The worker reads the flag before each
message, and also each time its task pipe has been quiet for ``PARENT_CHECK_S``
(``worker.main.serve``): so a worker waiting for a task, which no message will wake, still
sees the flag and exits. Here the flag is set on an idle persistent worker and nothing is written:
the worker must exit by itself (exit code 0, no signal) within a bound.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from iter_helpers import mp_iter
from process_helpers import until, workers_left

from shmloader import DataLoader
from shmloader.worker.main import PARENT_CHECK_S

EXIT_BOUND_S = PARENT_CHECK_S + 10.0  # one quiet poll, and a loaded machine's scheduling


@pytest.mark.timeout(90)
@pytest.mark.parametrize("context", ["fork", "spawn"])
def test_an_idle_worker_exits_on_its_stop_flag_without_a_stop_message(context: str) -> None:
    data = np.arange(16, dtype=np.int64)
    loader: DataLoader[Any] = DataLoader(data, batch_size=4, num_workers=1, persistent_workers=True,
                                         multiprocessing_context=context)
    with loader:
        it = mp_iter(iter(loader))
        assert [b.tolist() for b in it] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11], [12, 13, 14, 15]]
        handle = it._pool.workers[0]  # the epoch is over: the worker waits on a quiet task pipe
        assert handle.running and handle.stop is not None
        handle.stop.set()  # the flag only: no None follows it
        assert until(lambda: not handle.running, EXIT_BOUND_S), \
            f"worker {handle.pid} ignored its stop flag for {EXIT_BOUND_S} s on a quiet task pipe"
        handle.join(5.0)
        assert handle.process.exitcode == 0, f"the worker did not exit by itself: exit code {handle.process.exitcode}"
    assert workers_left() == []
