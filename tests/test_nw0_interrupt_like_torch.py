"""``num_workers=0``: what an interrupt, and what only looks like one, leaves behind.

Two defects:

- a ``GeneratorExit`` raised by a dataset's ``__getitem__`` was kept for the next ``next()`` to make
  again, like a Ctrl-C, where torch's loader hands it out in the batch's place and goes on with the
  next batch. Only ``KeyboardInterrupt`` and ``SystemExit`` are interrupts (docs/resume.md, "An
  interrupted batch"); any other exception is the batch's own error, as torch treats it;
- after a Ctrl-C mid-epoch the collate helper threads stayed alive, idle, for as long as the
  iterator was referenced (by the traceback, say), where torch's leaves no thread of its own: they
  now end with the interrupted ``next()``, and the batch made again starts them again.
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import pytest

import shmloader
from shmloader.collate import threads

SHAPE = (8, 8)


class OnceRaising:
    """float32 samples filled with their index; sample 5 raises ``exc`` the first time it is read."""

    def __init__(self, exc: type[BaseException], length: int = 12) -> None:
        self.exc = exc
        self.length = length
        self.raised = False

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> np.ndarray:
        if index == 5 and not self.raised:
            self.raised = True
            raise self.exc()
        return np.full(SHAPE, index, np.float32)


def _one_next(it: Any) -> object:
    """What one ``next()`` gives: its batch's first sample index, the exception's type, or None at the end."""
    try:
        return int(next(it)[0, 0, 0])
    except StopIteration:
        return None
    except BaseException as exc:  # noqa: BLE001  (what the loader raised is the result)
        return type(exc)


def _epoch(loader: Any) -> list[object]:
    """What each ``next()`` of one epoch gives (:func:`_one_next`), catching what it raises and going on."""
    it = iter(loader)
    return list(iter(lambda: _one_next(it), None))


def test_a_generator_exit_from_getitem_is_the_batchs_error_as_in_torch() -> None:
    ours = _epoch(shmloader.DataLoader(OnceRaising(GeneratorExit), batch_size=4))
    assert ours == [0, GeneratorExit, 8]  # batch 1 handed out as its error; the epoch goes on
    torch = pytest.importorskip("torch")
    assert _epoch(torch.utils.data.DataLoader(OnceRaising(GeneratorExit), batch_size=4)) == ours


def test_a_generator_exit_names_its_batch_and_counts_as_delivered() -> None:
    loader: shmloader.DataLoader[Any] = shmloader.DataLoader(OnceRaising(GeneratorExit), batch_size=4)
    it = iter(loader)
    next(it)
    with pytest.raises(GeneratorExit) as info:
        next(it)
    assert getattr(info.value, "__notes__", None) == [
        "while loading batch 1 (sample indices [4..7]) in the main process (num_workers=0)"]
    state = it.state_dict()
    loader.load_state_dict(state)
    assert [int(b[0, 0, 0]) for b in loader] == [8]  # a resume does not fetch the failed batch again


def test_a_ctrl_c_is_still_made_again_as_docs_promise() -> None:
    assert _epoch(shmloader.DataLoader(OnceRaising(KeyboardInterrupt), batch_size=4)) == [0, KeyboardInterrupt, 4, 8]


def _helpers() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("shmloader-collate")]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("exc", [KeyboardInterrupt, SystemExit])
def test_no_collate_helper_outlives_an_interrupted_next(monkeypatch: pytest.MonkeyPatch,
                                                        exc: type[BaseException]) -> None:  # fmt: skip
    monkeypatch.setattr(threads, "SPLIT_MIN_BYTES", 1)  # every stack split over the helpers
    it = iter(shmloader.DataLoader(OnceRaising(exc), batch_size=4, collate_threads=2))
    assert int(next(it)[0, 0, 0]) == 0 and _helpers()  # a helper serves the running epoch
    with pytest.raises(exc):
        next(it)
    assert _helpers() == []  # the iterator is still referenced: none waits idle on it
    assert [int(b[0, 0, 0]) for b in it] == [4, 8]  # the batch made again, the helpers started again
    assert _helpers() == []
