"""A saved state holds plain Python values, even where a state_dict() returned numpy scalars.

``state_dict()`` promises plain, JSON-serialisable data (docs/resume.md). A sampler's or dataset's
own ``state_dict()`` that returned a numpy scalar (a ``np.float64`` level, an ``np.int64`` offset,
an ``np.bool_`` flag: what numpy arithmetic gives) reached the loader's state as it was: an
``np.int64`` or ``np.bool_`` made ``state_dict()`` raise "not JSON-serialisable", and an
``np.float64`` (a float subclass, so JSON took it) made a checkpoint that ``torch.load`` refuses
under ``weights_only=True``, torch's default. Now every numpy scalar is saved as the Python number
it holds.
"""

from __future__ import annotations

import io
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from resume_helpers import second_epoch_and_saved

import shmloader

torch = pytest.importorskip("torch")

N = 23
DATA = np.arange(float(N))


class Curriculum(shmloader.Sampler):
    """Each pass starts ``offset`` further on; its state holds numpy scalars, as numpy arithmetic makes them."""

    def __init__(self) -> None:
        self.offset, self.level, self.warm = np.int64(0), np.float64(0.5), np.bool_(False)

    def __iter__(self) -> Iterator[int]:
        start = int(self.offset)
        self.offset, self.level, self.warm = self.offset + 5, self.level * 2, np.bool_(True)
        return iter([(start + i) % N for i in range(N)])

    def __len__(self) -> int:
        return N

    def state_dict(self) -> dict[str, Any]:
        return {"offset": self.offset, "level": self.level, "warm": self.warm, "shape": (np.int32(2), 3)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.offset, self.level, self.warm = np.int64(state["offset"]), np.float64(state["level"]), state["warm"]


def _loader() -> shmloader.DataLoader:
    return shmloader.DataLoader(DATA, batch_size=3, sampler=Curriculum())


def test_numpy_scalars_are_saved_as_python_values_and_load_under_weights_only() -> None:
    second, before, state = second_epoch_and_saved(_loader, 2)
    saved = state["objects"]["sampler"]
    assert saved == {"offset": 5, "level": 1.0, "warm": True, "shape": (2, 3)}
    assert [type(v) for v in saved.values()] == [int, float, bool, tuple]
    assert [type(v) for v in saved["shape"]] == [int, int]
    buffer = io.BytesIO()
    torch.save({"loader": state}, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=True)["loader"]
    resumed = _loader()
    resumed.load_state_dict(loaded)
    assert before + [b.tolist() for b in resumed] == second
