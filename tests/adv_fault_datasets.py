"""Datasets of the adversarial fault tests (tests/test_adv_fault_*.py) that stop at a moment and
say so: the test then acts (a signal to that worker) at that exact point, with no sleep.

``Gate`` is two pipes made before the loader, inherited by forked workers: a worker that reaches
the moment writes its pid on one and waits (bounded: 60 s, far past any test's timeout) for the
test's signal, or for ``release`` on the other; the test reads the pid with ``Gate.wait``.
"""

from __future__ import annotations

import faulthandler
import os
import select
import threading
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from fault_datasets import first_time, sample
from shmloader import get_worker_info


class Gate:
    """Workers write ``pid`` lines on one pipe, the test reads them; ``release`` lets them go on."""

    def __init__(self) -> None:
        self.r, self.w = os.pipe()
        self.go_r, self.go_w = os.pipe()

    def reach(self) -> None:
        """In a worker: say so, then wait for the test to act (a signal, or ``release``)."""
        faulthandler.disable()  # a signal's own default action, without pytest's traceback dump in the output
        os.write(self.w, f"{os.getpid()}\n".encode())
        select.select([self.go_r], [], [], 60)

    def release(self) -> None:
        """In the test: every worker waiting at the gate, and every later one, goes on."""
        os.write(self.go_w, b"x")

    def wait(self, timeout_s: float = 20.0) -> int:
        """In the test: the pid of the next worker that reached the moment."""
        line = b""
        while not line.endswith(b"\n"):
            ready, _, _ = select.select([self.r], [], [], timeout_s)
            assert ready, f"no worker reached the gate within {timeout_s} s"
            line += os.read(self.r, 1)
        return int(line)

    def close(self) -> None:
        for fd in (self.r, self.w, self.go_r, self.go_w):
            os.close(fd)


class StopsAt:
    """``n`` samples (``fault_datasets.sample``); the first worker to fetch sample ``at`` stops at
    the gate (once: a marker in ``once_dir``), then returns it if it lives on."""

    def __init__(self, n: int, at: int, gate: Gate, once_dir: str) -> None:
        self.n, self.at, self.gate, self.once_dir = n, at, gate, once_dir

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> np.ndarray:
        if i == self.at and get_worker_info() is not None and first_time(self.once_dir, f"gate{i}"):
            self.gate.reach()
        return sample(i)


def epoch_error(loader: Any, gate: Gate, act: Callable[[int], None], error: type[BaseException]) -> BaseException:
    """Run an epoch of ``loader`` (closed after) while a thread of the test calls ``act(pid)`` with
    the pid of the worker that reaches the gate; the epoch must raise ``error``, which is returned.
    The gate is released and closed after."""
    thread = threading.Thread(target=lambda: act(gate.wait()), daemon=True)
    thread.start()
    try:
        with pytest.raises(error) as err:
            for _batch in loader:
                pass
        thread.join(10)
    finally:
        gate.release()  # a worker still waiting there (a slow sample) goes on: the loader's close is quick
        loader.close()
        gate.close()
    return err.value
