"""Arrays a collate rule writes into the slot keep their dtype whole through a worker: a dtype
with metadata (h5py's enum and string dtypes carry theirs there) keeps it, as in-process, in the
flat descriptor of a list of arrays as in the pickled one."""

from __future__ import annotations

import ctypes
import mmap
from collections.abc import Sequence
from typing import Any

import numpy as np
import pytest

import shmloader
from shmloader.collate import register_collate_rule, unregister_collate_rule
from shmloader.transport import codec
from shmloader.transport.alloc import SlotAllocator

TAGGED = np.dtype("f4", metadata={"unit": "m"})


class Reading:
    """A sample only the rule below knows."""

    def __init__(self, v: float) -> None:
        self.v = v


class Readings:
    def __len__(self) -> int:
        return 4

    def __getitem__(self, i: int) -> Reading:
        return Reading(i + 0.5)


def tagged_rule(batch: Sequence[Reading], ctx: Any) -> list[np.ndarray]:
    out = ctx.alloc((len(batch),), TAGGED)
    out[:] = [r.v for r in batch]
    plain = ctx.alloc((len(batch),), np.dtype(np.int64))
    plain[:] = range(len(batch))
    return [out, plain]


@pytest.fixture
def rule() -> Any:
    register_collate_rule(Reading, tagged_rule)
    yield
    unregister_collate_rule(Reading)


@pytest.mark.parametrize("wrap", [list, tuple, lambda arrays: {"x": arrays[0], "y": arrays[1]}])
def test_in_slot_arrays_keep_their_dtype_metadata(wrap: Any) -> None:
    """The flat descriptor (a list or tuple of in-slot arrays) sent ``dtype.str``, which has no
    metadata: the array arrived as plain float32."""
    size_bytes = 1 << 16
    m = mmap.mmap(-1, size_bytes)
    alloc = SlotAllocator(m, size_bytes)
    batch = wrap(tagged_rule([Reading(1.5), Reading(2.5)], type("Ctx", (), {"alloc": alloc})()))
    payload, _ = codec.encode(batch, alloc)
    got, _ = codec.decode(payload, (ctypes.c_char * size_bytes).from_buffer(m), size_bytes)
    x = got["x"] if isinstance(got, dict) else got[0]
    assert type(got) is type(batch) and x.dtype.metadata == {"unit": "m"} and x.tolist() == [1.5, 2.5]
    del got, x


@pytest.mark.timeout(60)
@pytest.mark.parametrize("num_workers", [1, 2])
def test_a_rules_tagged_arrays_through_workers_as_in_process(rule: None, num_workers: int) -> None:
    ref = list(shmloader.DataLoader(Readings(), batch_size=2, num_workers=0))
    got = list(shmloader.DataLoader(Readings(), batch_size=2, num_workers=num_workers))
    for r, g in zip(ref, got):
        assert [a.dtype.metadata for a in g] == [a.dtype.metadata for a in r] == [{"unit": "m"}, None]
        assert [a.tolist() for a in g] == [a.tolist() for a in r]


# ------------------------------------------------------------------ user-defined dtypes

def _rational() -> Any:
    """numpy's own test user-defined dtype (``dtype.isbuiltin == 2``, as ml_dtypes' bfloat16 is)."""
    for name in ("numpy._core._rational_tests", "numpy.core._rational_tests"):
        try:
            return __import__(name, fromlist=["rational"]).rational
        except ImportError:
            continue
    pytest.skip("this numpy has no _rational_tests module")


class Fractions:
    def __len__(self) -> int:
        return 4

    def __getitem__(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        rational = _rational()
        return np.array([rational(i, i + 1), rational(1, 3)]), np.array([i])


@pytest.mark.timeout(60)
@pytest.mark.parametrize("num_workers", [1, 2])
def test_user_defined_dtypes_arrive_as_themselves(num_workers: int) -> None:
    """A stack of a user-defined dtype (ml_dtypes' bfloat16, numpy's test rational) arrived as raw
    void records (``|V8``): the flat descriptor sent ``dtype.str``, which names no such dtype."""
    rational = np.dtype(_rational())
    ref = list(shmloader.DataLoader(Fractions(), batch_size=2, num_workers=0))
    got = list(shmloader.DataLoader(Fractions(), batch_size=2, num_workers=num_workers))
    for r, g in zip(ref, got):
        assert g[0].dtype == r[0].dtype == rational
        assert g[0].tolist() == r[0].tolist() and g[1].tolist() == r[1].tolist()
