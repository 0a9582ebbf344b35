"""An observer that calls ``next()`` on the iterator it observes, from inside its hook, is refused.

Before this test, with ``num_workers=0`` the inner ``next()`` took the task the outer one was
handing out (its batch already made, waiting for the report) and returned that batch, and the
outer ``next()`` then returned it again: one batch handed out twice and counted twice in the
epoch's record. The multi-process iterator already refused it (its step guard); the
single-process one now refuses it the same way, so the error is a ``PluginError`` (raised by the
following ``next()``, as any observer's) whose cause is the ``LoaderError`` naming the re-entry.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import shmloader
from shmloader.errors import LoaderError, PluginError


class NextFromTheHook:
    """At task 1's report, calls ``next()`` on the observed iterator once and keeps what it got."""

    def __init__(self) -> None:
        self.it: Any = None
        self.got: list[Any] = []
        self.refused: BaseException | None = None

    def shmloader_batch_ready(self, task: int) -> None:
        if task == 1 and self.refused is None and not self.got:
            try:
                self.got.append(next(self.it))
            except LoaderError as exc:
                self.refused = exc
                raise


@pytest.mark.timeout(60)
@pytest.mark.parametrize("num_workers", [0, 2])
def test_next_from_inside_a_hook_is_refused_and_hands_out_no_batch_twice(num_workers: int) -> None:
    hook = NextFromTheHook()
    data = np.arange(16).reshape(8, 2)
    loader: shmloader.DataLoader[Any]
    with shmloader.DataLoader(data, batch_size=2, num_workers=num_workers, plugins=[hook]) as loader:
        it = hook.it = iter(loader)
        firsts, errors = [], []
        while True:
            try:
                firsts.append(int(next(it)[0, 0]))
            except StopIteration:
                break
            except PluginError as exc:
                errors.append(exc)
        state = it.state_dict()
    assert hook.got == []
    assert "from inside this iterator's own next()" in str(hook.refused)
    assert [e.hook for e in errors] == ["shmloader_batch_ready"]
    assert isinstance(errors[0].__cause__, LoaderError)
    assert firsts == [0, 4, 8, 12]  # each batch once, in order
    assert state["in_progress"] is False
