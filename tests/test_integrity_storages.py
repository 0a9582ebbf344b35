"""Tensors of one storage that a ``collate_fn`` returns arrive with their own values: a tensor that
starts where its storage starts but covers only part of it (``base[0]``, the first row of a
dataset's tensor) is copied as a span, and a later tensor of that storage (``base[1]``) must not
be described inside that span as if the whole storage had been copied."""

from __future__ import annotations

import ctypes
import mmap
from typing import Any

import pytest

import shmloader

torch = pytest.importorskip("torch")

import shmloader.torch  # noqa: E402
from shmloader.transport import codec  # noqa: E402
from shmloader.transport.alloc import SlotAllocator  # noqa: E402

BASE = torch.arange(40, dtype=torch.float32).reshape(4, 10)


def _round_trip(batch: Any, size_bytes: int = 1 << 16) -> Any:
    """``batch`` encoded into a fresh slot and decoded from it."""
    m = mmap.mmap(-1, size_bytes)
    payload, _ = codec.encode(batch, SlotAllocator(m, size_bytes))
    buf = (ctypes.c_char * size_bytes).from_buffer(m)
    return codec.decode(payload, buf, size_bytes)[0]


@pytest.mark.parametrize("rows", [[0, 1], [0, 3, 1], [0, 0, 2]])
def test_rows_of_one_tensor_keep_their_values(rows: list[int]) -> None:
    """``[base[0], base[1]]`` arrived as ``[base[0], zeros]``: the first row's span copy was taken
    for a copy of the whole storage, since both start at the storage's first byte."""
    got = _round_trip([BASE[r] for r in rows])
    for r, t in zip(rows, got):
        assert torch.equal(t, BASE[r])


def test_a_row_then_the_whole_tensor_keep_their_values() -> None:
    got = _round_trip([BASE[0], BASE, BASE[2:]])
    assert torch.equal(got[0], BASE[0]) and torch.equal(got[1], BASE) and torch.equal(got[2], BASE[2:])
    got[1].fill_(-1)  # the whole tensor and the view met after it share one copy, as in-process
    assert bool((got[2] == -1).all())


class Rows:
    """A dataset whose samples are rows of one tensor."""

    def __len__(self) -> int:
        return 4

    def __getitem__(self, i: int) -> Any:
        return BASE[i]


def keep_samples(samples: list[Any]) -> list[Any]:
    return samples


@pytest.mark.timeout(60)
@pytest.mark.parametrize("loader", ["numpy", "torch"])
@pytest.mark.parametrize("num_workers", [1, 2])
def test_a_collate_fn_returning_rows_of_a_dataset_tensor(loader: str, num_workers: int) -> None:
    cls = shmloader.DataLoader if loader == "numpy" else shmloader.torch.DataLoader
    batches = list(cls(Rows(), batch_size=2, num_workers=num_workers, collate_fn=keep_samples))
    assert [[t.tolist() for t in b] for b in batches] == [[BASE[i].tolist() for i in (0, 1)],
                                                          [BASE[i].tolist() for i in (2, 3)]]
