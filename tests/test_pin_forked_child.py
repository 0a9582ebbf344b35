"""``pin_memory=True`` in a loader built inside a forked child of a process that asked about CUDA.

The defect: whether torch sees an accelerator was cached once for the module
(``functools.cache``), so a forked child answered with its parent's answer, never its own; and a
child forked after CUDA was initialised (asking torch's ``cuda.is_available()`` already does that)
tried the torch backend, where every CUDA call raises "Cannot re-initialize CUDA in forked
subprocess": a failed-registration warning, then a RuntimeError from the fence of a dropped batch.

Now the answer belongs to the process that asked (the cache is cleared in a forked child), and in
such a child ``iter(loader)`` raises torch's RuntimeError at once, before any worker starts, as
torch's DataLoader raises there; a child where torch sees no accelerator warns as torch does and
its batches are correct and unpinned. CUDA is faked (tests/cuda_fakes.py, test_cuda_mock.py).
"""

from __future__ import annotations

import json
import multiprocessing
import os
import select
import time
import traceback
import warnings
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from cuda_fakes import FakeRuntime, data, expected, pin_warnings
from test_cuda_mock import fake_cuda  # noqa: F401  (the fixture)

import shmloader
from shmloader.gpu import pinning

BAD_FORK = "Cannot re-initialize CUDA in forked subprocess"


def _in_child(body: Callable[[], dict[str, Any]], deadline_s: float = 30) -> dict[str, Any]:
    """Run ``body`` in an ``os.fork`` child; its JSON answer, or the traceback it raised."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read)
        try:
            answer = body()
        except BaseException:
            answer = {"raised": traceback.format_exc()}
        try:
            os.write(write, json.dumps(answer).encode())
        finally:
            os._exit(0)
    os.close(write)
    chunks, end = [], time.monotonic() + deadline_s
    try:
        while time.monotonic() < end and select.select([read], [], [], end - time.monotonic())[0]:
            chunk = os.read(read, 65536)
            if not chunk:
                break
            chunks.append(chunk)
    finally:
        os.close(read)
        os.waitpid(pid, 0)
    return json.loads(b"".join(chunks) or b'{"raised": "no answer"}')


def _first_batches(num_workers: int) -> dict[str, Any]:
    """Build a pinning loader here and read an epoch: what raised, what warned, whether it is right."""
    loader: shmloader.DataLoader[Any] = shmloader.DataLoader(shmloader.ArrayDataset(data()), batch_size=8,
                                                             num_workers=num_workers, pin_memory=True,
                                                             multiprocessing_context="fork" if num_workers else None)
    answer: dict[str, Any] = {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            answer["right"] = all(np.array_equal(x, expected(k)) for k, (x,) in enumerate(loader))
        except RuntimeError as exc:
            answer["error"] = str(exc)
            answer["workers_started"] = len(multiprocessing.active_children())
        finally:
            loader.close()
    answer["warnings"] = pin_warnings(caught)
    return answer


@pytest.mark.timeout(60)
@pytest.mark.parametrize("num_workers", [0, 1])
def test_a_forked_child_asks_torch_itself_whether_there_is_an_accelerator(
        fake_cuda: FakeRuntime, num_workers: int, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: F811
    import torch

    assert pinning.accelerator_available()  # the parent's answer, cached here

    def child() -> dict[str, Any]:
        monkeypatch.setattr(torch.accelerator, "is_available", lambda: False)  # this process sees none
        monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
        return _first_batches(num_workers)

    answer = _in_child(child)
    assert answer == {"right": True, "warnings": [pinning.NO_ACCELERATOR]}, answer
    assert pinning.accelerator_available()  # the parent's own answer is still its own


def _bad_fork(*args: Any, **kwargs: Any) -> Any:
    raise RuntimeError(f"{BAD_FORK}. To use CUDA with multiprocessing, you must use the 'spawn' start method")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("num_workers", [0, 1])
def test_a_child_forked_after_cuda_was_initialised_raises_at_iter_as_torch_does(
        fake_cuda: FakeRuntime, num_workers: int, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: F811
    import torch

    assert pinning.accelerator_available()

    def child() -> dict[str, Any]:
        # What torch is in a child forked after its parent initialised CUDA: it still says CUDA is
        # available (the device count is cached), and every call that needs the device raises.
        monkeypatch.setattr(torch.cuda, "_is_in_bad_fork", lambda: True)
        for name in ("_lazy_init", "init", "cudart", "current_stream", "Event", "Stream", "synchronize"):
            monkeypatch.setattr(torch.cuda, name, _bad_fork)
        monkeypatch.setattr(torch.Tensor, "pin_memory", _bad_fork)
        return _first_batches(num_workers)

    answer = _in_child(child)
    assert BAD_FORK in answer.get("error", ""), answer
    assert "pin_memory=True" in answer["error"] and "spawn" in answer["error"]
    assert answer["workers_started"] == 0 and answer["warnings"] == []
