"""A worker SIGKILLed inside a sample, across the policy × persistent × in_order × dataset kind
matrix: the epoch's batches are exactly-once, or the error says why not, and the next epoch is whole.

The test kills the worker when it reaches sample 5 (``adv_fault_datasets.Gate``: it says so and
waits), so the kill lands at the same point every run. Under ``on_worker_death='restart'`` a
map-style epoch has every batch once (in order with ``in_order=True``), as the no-fault run has
them. An iterable dataset's worker cannot be restarted (its position in the stream died with it):
``WorkerDied`` says so, and so does the ``raise`` policy for both kinds, naming the signal and the
pid; the batches handed out before it came once each, uncorrupted. Either way the next epoch (on
the kept workers, or on new ones) has every batch once.
"""

from __future__ import annotations

import os
import signal
import threading
from typing import Any

import pytest

from adv_fault_datasets import Gate, StopsAt
from fault_datasets import first_time, sample
from shmloader import DataLoader, IterableDataset, WorkerDied, get_worker_info
from test_adv2_exactly_once import firsts

N = 16


class StreamStopsAt(IterableDataset):
    """``n`` samples, worker k yielding k, k + num_workers, ...; the first worker to reach sample
    ``at`` stops at the gate (once: a marker in ``once_dir``)."""

    def __init__(self, n: int, at: int, gate: Gate, once_dir: str) -> None:
        self.n, self.at, self.gate, self.once_dir = n, at, gate, once_dir

    def __iter__(self):  # type: ignore[no-untyped-def]
        info = get_worker_info()
        k, step = (info.id, info.num_workers) if info is not None else (0, 1)
        for i in range(k, self.n, step):
            if i == self.at and info is not None and first_time(self.once_dir, f"gate{i}"):
                self.gate.reach()
            yield sample(i)


def kill_at_gate(gate: Gate, pids: list[int]) -> threading.Thread:
    """A thread that SIGKILLs the worker that reaches the gate, once."""
    def kill() -> None:
        pids.append(gate.wait())
        os.kill(pids[0], signal.SIGKILL)

    thread = threading.Thread(target=kill, daemon=True)
    thread.start()
    return thread


@pytest.mark.timeout(30)
@pytest.mark.parametrize("kind", ["map", "iterable"])
@pytest.mark.parametrize("in_order", [True, False])
@pytest.mark.parametrize("persistent", [False, True])
@pytest.mark.parametrize("policy", ["raise", "restart"])
def test_a_kill_inside_a_sample_is_exactly_once_or_named(tmp_path: Any, policy: str, persistent: bool,
                                                        in_order: bool, kind: str) -> None:
    gate = Gate()
    dataset = StopsAt(N, 5, gate, str(tmp_path)) if kind == "map" else StreamStopsAt(N, 5, gate, str(tmp_path))
    loader: DataLoader[Any] = DataLoader(dataset, batch_size=2, num_workers=2, on_worker_death=policy,
                                         persistent_workers=persistent, in_order=in_order, timeout=20)
    pids: list[int] = []
    killer = kill_at_gate(gate, pids)
    try:
        with loader:
            got: list[int] = []
            survives = policy == "restart" and kind == "map"
            try:
                for b in loader:
                    got += firsts([b])
            except WorkerDied as exc:
                assert not survives, f"the restart policy did not survive a map-style death: {exc}"
                assert exc.pid == pids[0] and exc.signal == signal.SIGKILL
                assert "(SIGKILL, 9)" in str(exc)
                assert kind == "map" or "IterableDataset" in str(exc)
                assert len(got) == len(set(got)) and 5 not in got, f"repeated or impossible: {got}"
            else:
                assert survives, f"no error, though the worker died with its samples: {got}"
                assert sorted(got) == list(range(N)), f"lost or repeated: {got}"
                assert got == list(range(N)) or not in_order, f"out of order: {got}"
            killer.join(10)
            again = firsts(loader)
            assert sorted(again) == list(range(N)), f"the next epoch lost or repeated: {again}"
            assert again == list(range(N)) or not in_order or kind == "iterable"
    finally:
        gate.close()
