"""A ``KeyboardInterrupt`` while a split stack waits for its helper threads.

The caller stacks its own chunk, then waits for the chunks the helpers took. A Ctrl-C landing in
that wait used to be raised at once, while a helper still wrote into ``out``: the interrupted stack
was still being written after ``next()`` had given up on it. Now the caller waits for every chunk
a helper took, and only then raises the interrupt, before any chunk's own error.
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import pytest

from shmloader.collate import threads
from shmloader.collate.rules import stack_into
from shmloader.collate.threads import ThreadedStack


@pytest.mark.timeout(30)
@pytest.mark.parametrize("helper_fails", [False, True])
def test_an_interrupt_in_the_wait_is_raised_once_no_helper_writes(monkeypatch: pytest.MonkeyPatch,
                                                                  helper_fails: bool) -> None:
    helper_started, go = threading.Event(), threading.Event()
    inside: list[str] = []

    def stack(chunk: Any, out: np.ndarray) -> np.ndarray:
        if threading.current_thread() is threading.main_thread():
            assert helper_started.wait(10)  # the helper has claimed the other chunk
            return stack_into(chunk, out)
        inside.append("helper")
        helper_started.set()
        try:
            assert go.wait(10)
            if helper_fails:
                raise ValueError("the helper's chunk failed")
            return stack_into(chunk, out)
        finally:
            inside.remove("helper")

    class Interrupted:
        """The done queue, with a Ctrl-C landing in the caller's first wait on it."""

        def __init__(self, done: Any) -> None:
            self.done, self.gets = done, 0

        def put(self, item: Any) -> None:
            self.done.put(item)

        def get(self) -> Any:
            self.gets += 1
            if self.gets == 1:
                raise KeyboardInterrupt
            go.set()  # waiting again: the helper may finish its chunk
            return self.done.get()

    class Call(threads._Call):
        def __init__(self, *args: Any) -> None:
            super().__init__(*args)
            self.done = Interrupted(self.done)  # type: ignore[assignment]

    monkeypatch.setattr(threads, "stack_into", stack)
    monkeypatch.setattr(threads, "_Call", Call)
    batch = [np.full(3, i) for i in range(2)]
    out = np.zeros((2, 3), int)
    try:
        with pytest.raises(KeyboardInterrupt):
            ThreadedStack(2, min_bytes=0)(batch, out)
        assert inside == []  # no helper still writes into the stack given up on
    finally:
        go.set()
    if not helper_fails:
        assert (out == np.array([[0] * 3, [1] * 3])).all()
