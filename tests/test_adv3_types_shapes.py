"""Samples of one field that differ in shape raise :class:`CollateShapeError` (a RuntimeError, as
torch's "stack expects each tensor to be equal size") with or without workers, in both flavours.

Before, a worker's CollateShapeError came back as a plain RuntimeError: the main process rebuilds a
worker's exception from one message, and CollateShapeError could not be built from one, so
``except CollateShapeError`` (docs/errors.md) caught it with ``num_workers=0`` only, and its
``path``, ``shapes`` and ``entries`` were gone."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from parity_helpers import ListDataset, stop_torch_workers

import shmloader
from shmloader.collate import CollateShapeError

torch = pytest.importorskip("torch")
from torch.utils import data as tdata  # noqa: E402

import shmloader.torch as st  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")


def ragged(kind: str) -> ListDataset:
    """Sample i: ``{"y": i, "x": zeros(2 + i % 2, 3)}`` (an array or a tensor): no batch of two stacks."""
    arrays = [np.zeros((2 + i % 2, 3), np.float32) for i in range(4)]
    return ListDataset([{"y": i, "x": torch.from_numpy(x) if kind == "tensor" else x} for i, x in enumerate(arrays)])


def _first_batch_error(loader: Any) -> BaseException:
    it = iter(loader)
    try:
        next(it)
    except Exception as error:  # noqa: BLE001  (the error is what is checked)
        return error
    finally:
        if hasattr(loader, "close"):
            loader.close()
        else:
            stop_torch_workers(it)
    raise AssertionError("the loader did not raise")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("kind", ["array", "tensor"])
@pytest.mark.parametrize("flavour", ["numpy", "torch"])
def test_a_ragged_field_raises_collate_shape_error_with_or_without_workers(
        flavour: str, kind: str, num_workers: int) -> None:
    cls = st.DataLoader if flavour == "torch" else shmloader.DataLoader
    theirs = _first_batch_error(tdata.DataLoader(ragged(kind), batch_size=2, num_workers=num_workers))  # type: ignore[arg-type]
    ours = _first_batch_error(cls(ragged(kind), batch_size=2, num_workers=num_workers))
    assert type(theirs) is RuntimeError and "stack expects each tensor to be equal size" in str(theirs)
    assert isinstance(ours, CollateShapeError), f"{type(ours).__name__}: {ours}"
    assert (ours.path, ours.shapes, ours.entries) == ("batch['x']", ((2, 3), (3, 3)), (0, 1))
    assert "but got [2, 3] at entry 0 and [3, 3] at entry 1, at batch['x']" in str(ours)
    if num_workers:
        assert "sample indices [0..1]" in str(ours)


def test_rebuilt_from_its_message_it_keeps_what_it_names() -> None:
    original = CollateShapeError("batch['a'][0]", ((4,), (5, 1)), (0, 3))
    rebuilt = CollateShapeError(f"Caught CollateShapeError in DataLoader worker process 1 (pid 7, task 2, "
                                f"sample indices [4..7]).\nOriginal Traceback ...\nCollateShapeError: {original}")
    assert (rebuilt.path, rebuilt.shapes, rebuilt.entries) == ("batch['a'][0]", ((4,), (5, 1)), (0, 3))
    assert str(rebuilt).endswith(str(original))


def test_a_message_it_cannot_read_leaves_the_facts_unknown() -> None:
    error = CollateShapeError("stack expects each tensor to be equal size")
    assert (error.path, error.shapes, error.entries) == ("", ((), ()), (-1, -1))
    assert str(error) == "stack expects each tensor to be equal size"
