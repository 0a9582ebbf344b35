"""A recording stand-in for the CUDA runtime, shared by the pin-backend mock tests
(test_cuda_mock.py: torch; test_cuda_mock_cupy.py: cupy): the runtime's host-register calls,
events, streams, the test data, and queries on the recorded log."""

from __future__ import annotations

import itertools
import warnings
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from shmloader.gpu import pinning

ROWS, COLS = 64, 8


def data() -> np.ndarray:
    return np.arange(ROWS * COLS, dtype=np.float32).reshape(ROWS, COLS)


def expected(k: int) -> np.ndarray:
    return data()[k * 8:(k + 1) * 8]


class Status(int):
    """Like the binding's pybind11 ``cudaError`` enum: convertible with ``int()``."""


@dataclass
class FakeRuntime:
    """Records the runtime calls; ``fail_register`` makes cudaHostRegister return that error.

    Registrations of addresses outside ``ours`` (segments this test did not create: an earlier
    loader's, collected late) are not recorded, when ``ours`` is given.
    """

    log: list[tuple[Any, ...]] = field(default_factory=list)
    fail_register: int = 0
    ours: set[int] | None = None

    def cudaHostRegister(self, ptr: int, size: int, flags: int) -> Status:  # noqa: N802
        if self.ours is None or ptr in self.ours:
            self.log.append(("register", ptr, size, flags))
        return Status(self.fail_register)

    def cudaHostUnregister(self, ptr: int) -> Status:  # noqa: N802
        if self.ours is None or ptr in self.ours:
            self.log.append(("unregister", ptr))
        return Status(0)

    def cudaGetErrorString(self, status: Any) -> str:  # noqa: N802
        return {1: "invalid argument", 712: "part or all of the requested memory range is already mapped"}.get(
            int(status), "unknown")


class FakeEvent:
    serials = itertools.count()

    def __init__(self, log: list[tuple[Any, ...]], current: Any) -> None:
        self.serial, self.log, self._current, self.done = next(self.serials), log, current, False

    def record(self, stream: Any = None) -> None:
        self.log.append(("record", self.serial, stream if stream is not None else self._current()))

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.done = True
        self.log.append(("event_sync", self.serial))


class FakeStream:
    def __init__(self, name: str, log: list[tuple[Any, ...]]) -> None:
        self.name, self.log = name, log

    def wait_event(self, event: FakeEvent) -> None:
        self.log.append(("wait", self.name, event.serial))

    def synchronize(self) -> None:
        self.log.append(("stream_sync", self.name))

    def __repr__(self) -> str:
        return self.name


def kinds(log: list[tuple[Any, ...]], *names: str) -> list[tuple[Any, ...]]:
    return [entry for entry in log if entry[0] in names]


def pin_warnings(caught: list[warnings.WarningMessage]) -> list[str]:
    """shmloader's pinning warnings among ``caught``: "no accelerator", or a failed registration."""
    texts = [str(w.message) for w in caught]
    return [t for t in texts if t == pinning.NO_ACCELERATOR or "could not pin slot memory" in t]


def registered_range(runtime: FakeRuntime, array: np.ndarray) -> int | None:
    """The registered address whose range holds ``array``'s memory, or None."""
    address = array.__array_interface__["data"][0]
    for _kind, ptr, size, _flags in kinds(runtime.log, "register"):
        if ptr <= address and address + array.nbytes <= ptr + size:
            return int(ptr)
    return None
