"""torch parity of collation: ``torch_default_collate`` and ``default_convert(to_torch=True)``
return what torch's ``default_collate`` / ``default_convert`` return, for every sample type, and
fail with the same exception types and leading words."""

from __future__ import annotations

import collections
from collections.abc import Mapping
from typing import Any, NamedTuple

import numpy as np
import pytest
from parity_helpers import assert_same_error, assert_same_structure

from shmloader.collate import collate, default_convert, torch_default_collate

torch = pytest.importorskip("torch")
from torch.utils.data import default_collate as torch_collate  # noqa: E402
from torch.utils.data import default_convert as torch_convert  # noqa: E402

Point = collections.namedtuple("Point", ["x", "y"])


class Sample(NamedTuple):
    image: Any
    label: Any


class FrozenMapping(Mapping):
    """An immutable Mapping: torch rebuilds it with ``type(elem)(dict)``."""

    def __init__(self, data: dict) -> None:
        self._data = dict(data)

    def __getitem__(self, key: Any) -> Any:
        return self._data[key]

    def __iter__(self) -> Any:
        return iter(self._data)

    def __len__(self) -> int:
        return len(self._data)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, FrozenMapping) and self._data == other._data


class TaggedDict(dict):
    """A dict subclass with state: torch clones it, keeping the attribute."""


class NoInitMapping(Mapping):
    """A Mapping that cannot be rebuilt from a dict: torch falls back to a plain dict."""

    def __init__(self, a: Any, b: Any) -> None:
        self._data = {"a": a, "b": b}

    def __getitem__(self, key: Any) -> Any:
        return self._data[key]

    def __iter__(self) -> Any:
        return iter(self._data)

    def __len__(self) -> int:
        return 2


class Pair(collections.abc.Sequence):
    """An immutable Sequence rebuilt by ``type(elem)(list)``."""

    def __init__(self, items: Any) -> None:
        self._items = list(items)

    def __getitem__(self, i: Any) -> Any:
        return self._items[i]

    def __len__(self) -> int:
        return len(self._items)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Pair) and self._items == other._items


def _tagged(value: Any) -> TaggedDict:
    d = TaggedDict(v=value)
    d.tag = "kept"  # type: ignore[attr-defined]
    return d


def _arrays(dtype: str, shape: tuple[int, ...], n: int = 3) -> list[np.ndarray]:
    rng = np.random.default_rng(0)
    return [np.asarray(rng.random(shape) * 100).astype(dtype) for _ in range(n)]


ARRAY_DTYPES = [
    "float32", "float64", "float16", "int8", "int16", "int32", "int64",
    "uint8", "uint16", "uint32", "uint64", "bool", "complex64", "complex128",
]
SCALAR_TYPES = [
    np.float32, np.float64, np.float16, np.int8, np.int16, np.int32, np.int64,
    np.uint8, np.uint16, np.uint32, np.bool_, np.complex64, np.complex128,
]
TENSOR_DTYPES = [
    "float32", "float64", "float16", "bfloat16", "int8", "int16", "int32", "int64",
    "uint8", "bool", "complex64", "complex128",
]


def _tensors(dtype: str, shape: tuple[int, ...], n: int = 3) -> list[Any]:
    gen = torch.Generator().manual_seed(0)
    return [(torch.rand(shape, generator=gen) * 100).to(getattr(torch, dtype)) for _ in range(n)]


BATCHES: dict[str, list[Any]] = {
    "ints": [0, 1, -7, 2**40],
    "floats": [0.5, -1.25, float("inf"), float("nan")],
    "bools": [True, False, True],
    "int_then_bool": [1, True, 0],
    "bool_then_int": [True, 3],
    "int_then_float": [1, 2.5],
    "float_then_int": [1.5, 2],
    "str": ["a", "bc", ""],
    "bytes": [b"a", b"bc"],
    "np_str": [np.str_("a"), np.str_("b")],
    "dict": [{"x": np.float32(i), "y": i, "s": str(i)} for i in range(3)],
    "nested_dict": [
        {"a": {"b": np.arange(3) + i, "c": [i, i + 1]}, "d": (float(i), "t")} for i in range(3)
    ],
    "ordered_dict": [collections.OrderedDict(b=i, a=float(i)) for i in range(3)],
    "defaultdict": [collections.defaultdict(list, k=np.ones(2) * i) for i in range(2)],
    "tagged_dict": [_tagged(i) for i in range(2)],
    "frozen_mapping": [FrozenMapping({"k": i}) for i in range(2)],
    "no_init_mapping": [NoInitMapping(i, float(i)) for i in range(2)],
    "list": [[i, float(i), np.arange(2) * i] for i in range(3)],
    "tuple": [(np.ones((2, 2)) * i, i) for i in range(3)],
    "tuple_of_str": [("a", 1), ("b", 2)],
    "nested_lists": [[(i, [i, i]), {"z": i}] for i in range(2)],
    "namedtuple": [Point(i, float(i)) for i in range(3)],
    "typed_namedtuple": [Sample(np.zeros((2, 2), "uint8") + i, i) for i in range(3)],
    "namedtuple_in_dict": [{"p": Point(np.ones(2) * i, "s")} for i in range(2)],
    "custom_sequence": [Pair([i, 2 * i]) for i in range(3)],
    "range": [range(i, i + 2) for i in range(3)],
    "zero_d_arrays": [np.array(i, dtype="float32") for i in range(3)],
    "empty_arrays": [np.zeros((0, 3), "int16") for _ in range(2)],
    "noncontiguous": [np.arange(12, dtype="float64").reshape(3, 4).T + i for i in range(3)],
    "fortran": [np.asfortranarray(np.arange(6).reshape(2, 3)) + i for i in range(2)],
    "mixed_array_dtypes": [np.ones(2, "float32"), np.ones(2, "int64"), np.ones(2, "int8")],
    "mixed_float_array_dtypes": [np.ones(2, "float16"), np.ones(2, "float64")],
    "array_then_list": [np.arange(3), [4, 5, 6]],
    "mixed_scalars": [np.float32(1), np.float64(2), np.int64(3)],
    "int8_float32_scalars": [np.int8(1), np.float32(2)],
    "mixed_tensor_dtypes": [torch.ones(2, dtype=torch.int64), torch.ones(2), torch.ones(2).bool()],
    "zero_d_tensors": [torch.tensor(float(i)) for i in range(3)],
    "noncontiguous_tensors": [torch.arange(6.0).view(2, 3).t() + i for i in range(2)],
    "tensor_in_dict": [{"t": torch.ones(2, 2) * i, "id": i} for i in range(3)],
    "grad_tensors": [torch.ones(2, requires_grad=True) for _ in range(2)],
}


@pytest.mark.parametrize("name", sorted(BATCHES))
def test_batch_matches_torch(name: str) -> None:
    batch = BATCHES[name]
    assert_same_structure(torch_default_collate(batch), torch_collate(batch))


@pytest.mark.parametrize("dtype", ARRAY_DTYPES)
@pytest.mark.parametrize("shape", [(), (4,), (2, 3), (1, 2, 3)])
def test_numpy_arrays_match_torch(dtype: str, shape: tuple[int, ...]) -> None:
    batch = _arrays(dtype, shape)
    assert_same_structure(torch_default_collate(batch), torch_collate(batch))


@pytest.mark.parametrize("scalar_type", SCALAR_TYPES, ids=lambda t: t.__name__)
def test_numpy_scalars_match_torch(scalar_type: type) -> None:
    batch = [scalar_type(v) for v in (0, 1, 5)]
    assert_same_structure(torch_default_collate(batch), torch_collate(batch))


@pytest.mark.parametrize("dtype", TENSOR_DTYPES)
@pytest.mark.parametrize("shape", [(), (3,), (2, 2)])
def test_tensors_match_torch(dtype: str, shape: tuple[int, ...]) -> None:
    batch = _tensors(dtype, shape)
    assert_same_structure(torch_default_collate(batch), torch_collate(batch))


@pytest.mark.parametrize("dtype", TENSOR_DTYPES)
def test_tensors_in_numpy_mode_match_torch(dtype: str) -> None:
    batch = _tensors(dtype, (2, 3))
    assert_same_structure(collate(batch), torch_collate(batch))


def test_bfloat16_result_memory_comes_from_alloc() -> None:
    seen: list[np.ndarray] = []

    def alloc(shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
        seen.append(np.empty(shape, dtype))
        return seen[-1]

    out = collate(_tensors("bfloat16", (2, 3)), alloc, to_torch=True)
    assert out.dtype == torch.bfloat16 and tuple(out.shape) == (3, 2, 3)
    assert len(seen) == 1 and seen[0].dtype == np.uint8 and seen[0].nbytes == 3 * 2 * 3 * 2
    assert out.data_ptr() == seen[0].ctypes.data


ERROR_BATCHES: dict[str, list[Any]] = {
    "unequal_arrays": [np.zeros(2), np.zeros(3)],
    "unequal_arrays_2d": [np.zeros((2, 3)), np.zeros((2, 4))],
    "unequal_ndim": [np.zeros((2, 3)), np.zeros(2)],
    "unequal_tensors": [torch.zeros(2), torch.zeros(3)],
    "unequal_lists": [[1, 2], [1, 2, 3]],
    "string_arrays": [np.array(["a"]), np.array(["b"])],
    "object_arrays": [np.array([object()]), np.array([object()])],
    "bytes_arrays": [np.array([b"a"]), np.array([b"b"])],
    "complex": [1 + 2j, 3j],
    "none": [None, None],
    "object": [object(), object()],
    "datetime_arrays": [np.zeros(2, "M8[s]"), np.zeros(2, "M8[s]")],
    "datetime_scalars": [np.datetime64(1, "s"), np.datetime64(2, "s")],
    "big_endian_arrays": [np.zeros(2, ">f4"), np.zeros(2, ">f4")],
    "uint64_scalars": [np.uint64(1), np.uint64(2)],
    "int_overflow": [2**64, 1],
    "nested_none": [{"a": None}, {"a": None}],
    "sparse": [torch.zeros(2).to_sparse(), torch.zeros(2).to_sparse()],
    "tensor_then_array": [torch.zeros(2), np.zeros(2)],
    "tensor_then_longer_array": [torch.zeros(2), np.zeros(3)],
    "tensor_then_list": [torch.zeros(2), [1.0, 2.0]],
    "tensor_then_number": [torch.zeros(()), 1.0],
}


@pytest.mark.parametrize("name", sorted(ERROR_BATCHES))
def test_errors_match_torch(name: str) -> None:
    batch = ERROR_BATCHES[name]
    assert_same_error(lambda: torch_default_collate(batch), lambda: torch_collate(batch))


@pytest.mark.parametrize("name", [n for n in ERROR_BATCHES if n.startswith("tensor_then")])
def test_tensor_then_non_tensor_errors_match_torch_in_numpy_mode_and_without_grad(name: str) -> None:
    batch = ERROR_BATCHES[name]
    error = assert_same_error(lambda: collate(batch), lambda: torch_collate(batch))
    assert "expected Tensor as element 1" in str(error)
    with torch.no_grad():
        assert_same_error(lambda: torch_default_collate(batch), lambda: torch_collate(batch))


def test_unequal_shapes_error_names_field_and_shapes() -> None:
    batch = [{"image": torch.zeros(3, 4)}] * 2 + [{"image": torch.zeros(3, 5)}]
    error = assert_same_error(lambda: torch_default_collate(batch), lambda: torch_collate(batch))
    assert "batch['image']" in str(error)
    assert "[3, 4] at entry 0 and [3, 5] at entry 2" in str(error)


CONVERT_SAMPLES: dict[str, Any] = {
    "array": np.arange(6, dtype="float32").reshape(2, 3),
    "string_array": np.array(["a", "b"]),
    "scalar": np.float32(1.5),
    "np_str": np.str_("s"),
    "int": 3,
    "float": 2.5,
    "str": "text",
    "bytes": b"raw",
    "none": None,
    "tensor": torch.ones(2),
    "dict": {"a": np.ones(2), "b": [np.int64(1), "s"]},
    "tagged_dict": _tagged(np.ones(1)),
    "frozen_mapping": FrozenMapping({"k": np.zeros(1)}),
    "no_init_mapping": NoInitMapping(np.zeros(1), 1),
    "tuple": (np.zeros(2), 1, "s"),
    "namedtuple": Point(np.zeros(2), np.float64(1)),
    "list": [np.zeros(1), (np.ones(1),)],
    "custom_sequence": Pair([np.zeros(1), 2]),
    "range": range(3),
}


@pytest.mark.parametrize("name", sorted(CONVERT_SAMPLES))
def test_default_convert_matches_torch(name: str) -> None:
    sample = CONVERT_SAMPLES[name]
    assert_same_structure(default_convert(sample, to_torch=True), torch_convert(sample))


def test_default_convert_converts_each_value_once(monkeypatch: pytest.MonkeyPatch) -> None:
    import shmloader.collate as collate_module

    seen: list[Any] = []
    original = collate_module._convert

    def counting(data: Any, torch_module: Any) -> Any:
        seen.append(data)
        return original(data, torch_module)

    monkeypatch.setattr(collate_module, "_convert", counting)
    sample = {"m": NoInitMapping(np.int64(1), np.int64(2)), "r": range(2)}
    assert_same_structure(default_convert(sample, to_torch=True), torch_convert(sample))
    assert sorted(int(d) for d in seen if isinstance(d, (int, np.integer))) == [0, 1, 1, 2]


def test_default_convert_shares_memory_as_torch_does() -> None:
    array = np.arange(4.0)
    converted = default_convert({"a": array}, to_torch=True)["a"]
    array[0] = 42.0
    assert converted[0].item() == 42.0
