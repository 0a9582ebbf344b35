"""torch parity of torch's ``default_collate_fn_map`` as the user changes it (torch's "Option 2"):
types added, stock functions replaced, and stock keys deleted, read wherever the batch is collated
(``num_workers=0`` and workers), by ``shmloader.torch.DataLoader`` and ``torch_default_collate``."""

from __future__ import annotations

import fractions
import numbers
from typing import Any

import numpy as np
import pytest
from parity_helpers import ListDataset, assert_same_error, assert_same_outcome, assert_same_structure

from shmloader.collate import collate, torch_default_collate
from shmloader.collate import torch_map as _torch_map

torch = pytest.importorskip("torch")
from torch.utils import data as tdata  # noqa: E402
from torch.utils.data._utils import collate as torch_collate  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")


# ------------------------------------------ types added to torch's default_collate_fn_map


class Box:
    """A type torch's default_collate knows only once it is added to ``default_collate_fn_map``."""

    def __init__(self, value: int) -> None:
        self.value = value


def collate_boxes(batch: list[Box], *, collate_fn_map: dict | None = None) -> Any:
    assert collate_fn_map is torch_collate.default_collate_fn_map
    return torch.tensor([box.value for box in batch]) * 100


def collate_floats_as_float32(batch: list[float], *, collate_fn_map: dict | None = None) -> Any:
    return torch.tensor(batch, dtype=torch.float32)


def collate_rationals(batch: list[Any], *, collate_fn_map: dict | None = None) -> Any:
    return [f"{x.numerator}/{x.denominator}" for x in batch]


@pytest.fixture
def torch_map_entries(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch's "Option 2": a new type, a stock type's function replaced, an ABC after the stock keys."""
    fn_map = torch_collate.default_collate_fn_map
    monkeypatch.setitem(fn_map, Box, collate_boxes)
    monkeypatch.setitem(fn_map, float, collate_floats_as_float32)
    monkeypatch.setitem(fn_map, numbers.Rational, collate_rationals)  # int stays stock: exact key first


def _sample(i: int) -> dict[str, Any]:
    return {"box": Box(i), "boxes": [Box(i), Box(-i)], "f": i / 2, "q": fractions.Fraction(i, 3), "i": i,
            "x": np.full(2, i, np.float32)}


def test_types_added_to_torchs_map_collate_as_torch_does(torch_map_entries: None) -> None:
    batch = [_sample(i) for i in range(3)]
    expected = tdata.default_collate(batch)
    assert expected["box"].tolist() == [0, 100, 200] and expected["f"].dtype == torch.float32
    assert expected["q"] == ["0/1", "1/3", "2/3"] and expected["i"].dtype == torch.int64
    assert_same_structure(torch_default_collate(batch), expected)


def test_types_in_torchs_map_are_read_at_collate_time(monkeypatch: pytest.MonkeyPatch) -> None:
    batch = [_sample(i) for i in range(2)]
    assert_same_error(lambda: torch_default_collate(batch), lambda: tdata.default_collate(batch))
    monkeypatch.setitem(torch_collate.default_collate_fn_map, Box, collate_boxes)
    monkeypatch.setitem(torch_collate.default_collate_fn_map, numbers.Rational, collate_rationals)
    assert_same_structure(torch_default_collate(batch), tdata.default_collate(batch))


def test_the_rest_of_the_batch_is_still_collated_into_the_slot(torch_map_entries: None) -> None:
    seen: list[np.ndarray] = []

    def alloc(shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
        seen.append(np.empty(shape, dtype))
        return seen[-1]

    out = collate([_sample(i) for i in range(2)], alloc, to_torch=True)
    assert out["x"].data_ptr() in {a.ctypes.data for a in seen}
    assert out["i"].data_ptr() in {a.ctypes.data for a in seen}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("collate_fn", [None, tdata.default_collate], ids=["default", "torch_default_collate"])
@pytest.mark.parametrize("num_workers", [0, 2])
def test_loader_collates_types_added_to_torchs_map(torch_map_entries: None, num_workers: int,
                                                   collate_fn: Any) -> None:
    batches = assert_same_outcome(ListDataset([_sample(i) for i in range(4)]), batch_size=2,
                                  num_workers=num_workers, collate_fn=collate_fn)
    assert [b["box"].tolist() for b in batches] == [[0, 100], [200, 300]]


# ------------------------------------------------------ torch's own keys deleted from the map

STOCK_KEYS: dict[str, Any] = {
    "Tensor": torch.Tensor, "ndarray": np.ndarray, "numpy_scalars": (np.bool_, np.number, np.object_),
    "float": float, "int": int, "str": str, "bytes": bytes,
}
SAMPLES: dict[str, list[Any]] = {
    "tensor": [torch.ones(2), torch.zeros(2)],
    "array": [np.ones(2, np.float32), np.zeros(2, np.float32)],
    "tensor_in_dict": [{"t": torch.ones(1)}, {"t": torch.zeros(1)}],
    "np_float64": [np.float64(1), np.float64(2)],  # a float subclass: torch's float rule once numpy's is gone
    "np_float32": [np.float32(1), np.float32(2)],
    "np_int64": [np.int64(1), np.int64(2)],
    "np_bool": [np.bool_(True), np.bool_(False)],
    "float": [1.5, 2.0],
    "int": [1, 2],
    "bool": [True, False],
    "str_of_two_lengths": ["a", "bcd"],  # a Sequence once str is gone (equal lengths: RecursionError)
    "bytes": [b"ab", b"cd"],  # a Sequence of ints once bytes is gone
}


@pytest.fixture
def torch_map() -> Any:
    """torch's map, restored afterwards with its keys in their order (``monkeypatch.delitem`` would
    put a deleted key back at the end, which changes torch's dispatch for later tests)."""
    fn_map = torch_collate.default_collate_fn_map
    saved = dict(fn_map)
    try:
        yield fn_map
    finally:
        fn_map.clear()
        fn_map.update(saved)


def _assert_same_as_torch(batch: list[Any]) -> None:
    try:
        expected = tdata.default_collate(batch)
    except Exception:  # noqa: BLE001  (torch's error is compared, type and wording)
        assert_same_error(lambda: torch_default_collate(batch), lambda: tdata.default_collate(batch))
    else:
        assert_same_structure(torch_default_collate(batch), expected)


@pytest.mark.parametrize("sample", sorted(SAMPLES))
@pytest.mark.parametrize("key", sorted(STOCK_KEYS))
def test_a_deleted_stock_key_collates_as_torch_then_does(key: str, sample: str, torch_map: Any) -> None:
    del torch_map[STOCK_KEYS[key]]
    _assert_same_as_torch(SAMPLES[sample])


def test_a_deleted_stock_key_is_seen_at_the_next_batch_and_its_return_too(torch_map: Any) -> None:
    batch = SAMPLES["tensor"]
    assert isinstance(torch_default_collate(batch), torch.Tensor)
    fn = torch_map.pop(torch.Tensor)
    with pytest.raises(TypeError, match="default_collate: batch must contain .*found <class 'torch.Tensor'>"):
        torch_default_collate(batch)
    rest = dict(torch_map)
    torch_map.clear()
    torch_map.update({torch.Tensor: fn, **rest})  # back, in its place
    assert _torch_map.overrides() is None  # torch's own map again: the built-in rules, nothing looked up
    assert_same_structure(torch_default_collate(batch), tdata.default_collate(batch))


def doubled_tensors(batch: list[Any], *, collate_fn_map: dict | None = None) -> Any:
    return torch.stack(batch) * 2


@pytest.mark.parametrize("sample", ["tensor", "array", "tensor_in_dict"])
def test_a_replaced_tensor_function_collates_arrays_too(sample: str, torch_map: Any) -> None:
    # torch's collate_numpy_array_fn converts the arrays and collates the tensors through the map
    torch_map[torch.Tensor] = doubled_tensors
    _assert_same_as_torch(SAMPLES[sample])


@pytest.mark.timeout(60)
@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("key", ["Tensor", "numpy_scalars", "int"])
def test_loader_with_a_deleted_stock_key_as_torchs(key: str, num_workers: int, torch_map: Any) -> None:
    del torch_map[STOCK_KEYS[key]]
    samples = [{"x": torch.full((2,), float(i)), "s": np.float64(i), "i": i} for i in range(4)]
    theirs = assert_same_outcome(ListDataset(samples), batch_size=2, num_workers=num_workers)
    if key == "numpy_scalars":  # np.float64 is a float: torch's float rule collates it
        assert theirs[0]["s"].dtype == torch.float64
    else:
        assert theirs is TypeError
