"""Collation in numpy mode, the allocator contract, rules and errors (torch parity is in
test_parity_collate.py)."""

from __future__ import annotations

import collections
import subprocess
import sys
from collections.abc import Mapping
from typing import Any

import numpy as np
import pytest

from shmloader.collate import (
    CollateShapeError,
    SlotFull,
    collate,
    default_collate,
    default_convert,
    heap_alloc,
)

Point = collections.namedtuple("Point", ["x", "y"])


class RecordingAlloc:
    """Hands out 64-byte-aligned views of one buffer, as a slot does, and records each request."""

    def __init__(self, nbytes: int = 1 << 20, fail_at: int | None = None) -> None:
        self.buffer = np.zeros(nbytes, np.uint8)
        self.offset = 0
        self.requests: list[tuple[tuple[int, ...], np.dtype]] = []
        self.arrays: list[np.ndarray] = []
        self.fail_at = fail_at

    def __call__(self, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
        if self.fail_at is not None and len(self.requests) == self.fail_at:
            raise SlotFull("slot too small: request 1")
        self.requests.append((tuple(shape), np.dtype(dtype)))
        nbytes = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
        start = -(-self.offset // 64) * 64
        self.offset = start + nbytes
        view = self.buffer[start : start + nbytes].view(dtype).reshape(shape)
        self.arrays.append(view)
        return view


def in_buffer(array: np.ndarray, alloc: RecordingAlloc) -> bool:
    return np.shares_memory(array, alloc.buffer)


# ------------------------------------------------------------------------ allocator contract


def test_typical_batch_asks_alloc_for_exactly_its_outputs() -> None:
    rng = np.random.default_rng(0)
    batch = [(rng.random(16).astype(np.float32), i) for i in range(64)]
    alloc = RecordingAlloc()
    images, labels = collate(batch, alloc)
    assert alloc.requests == [((64, 16), np.dtype(np.float32)), ((64,), np.dtype(np.int64))]
    assert images is alloc.arrays[0] and labels is alloc.arrays[1]
    np.testing.assert_array_equal(images, np.stack([b[0] for b in batch]))
    np.testing.assert_array_equal(labels, np.arange(64))


def test_every_output_of_a_nested_batch_lives_in_the_buffer() -> None:
    batch = [
        {"image": np.full((2, 3), i, np.uint8), "meta": {"id": i, "score": i / 2, "ok": i > 0},
         "name": f"s{i}", "pair": (np.float32(i), np.ones(2, np.int16))}
        for i in range(4)
    ]
    alloc = RecordingAlloc()
    out = collate(batch, alloc)
    leaves = [out["image"], out["meta"]["id"], out["meta"]["score"], out["meta"]["ok"],
              out["pair"][0], out["pair"][1]]
    assert all(in_buffer(leaf, alloc) for leaf in leaves)
    assert len(alloc.requests) == len(leaves)
    assert out["name"] == ["s0", "s1", "s2", "s3"]


def test_slot_full_propagates_from_inside_containers() -> None:
    batch = [{"a": np.zeros(2), "b": {"c": np.ones(3)}} for _ in range(2)]
    with pytest.raises(SlotFull) as info:
        collate(batch, RecordingAlloc(fail_at=1))
    assert str(info.value) == "slot too small: request 1"  # the allocator's own exception, untouched


def test_heap_alloc_is_the_default() -> None:
    out = heap_alloc((2, 3), np.dtype(np.float32))
    assert out.shape == (2, 3) and out.dtype == np.float32 and out.flags.c_contiguous
    batch = [np.ones(2), np.zeros(2)]
    np.testing.assert_array_equal(default_collate(batch), collate(batch))


# ------------------------------------------------------------------------------ numpy mode


@pytest.mark.parametrize("dtype", ["float32", "float16", "int8", "uint64", "bool", "complex64"])
@pytest.mark.parametrize("shape", [(), (5,), (2, 3), (0, 3)])
def test_arrays_stack_with_their_dtype(dtype: str, shape: tuple[int, ...]) -> None:
    batch = [np.asarray(np.arange(np.prod(shape, dtype=int)).reshape(shape) + i).astype(dtype)
             for i in range(3)]
    out = collate(batch)
    assert type(out) is np.ndarray and out.dtype == np.dtype(dtype) and out.shape == (3, *shape)
    np.testing.assert_array_equal(out, np.stack(batch))


def test_arrays_of_any_layout_and_byte_order() -> None:
    base = np.arange(12, dtype=np.float64).reshape(3, 4)
    for batch in ([base.T, base.T + 1], [np.asfortranarray(base)] * 2, [base[:, ::2]] * 3):
        np.testing.assert_array_equal(collate(batch), np.stack(batch))
    big_endian = [np.arange(3, dtype=">i4"), np.arange(3, dtype=">i4") * 2]
    out = collate(big_endian)
    assert out.dtype == np.dtype("=i4") and out.dtype.isnative
    np.testing.assert_array_equal(out, [[0, 1, 2], [0, 2, 4]])


def test_mixed_array_dtypes_promote_as_numpy_does() -> None:
    out = collate([np.ones(2, np.int64), np.ones(2, np.float32)])
    assert out.dtype == np.float64
    out = collate([np.arange(2), [5, 6]])
    np.testing.assert_array_equal(out, [[0, 1], [5, 6]])


def test_datetime_arrays_and_scalars_stay_numpy() -> None:
    out = collate([np.arange(2).astype("M8[s]"), np.arange(2).astype("M8[s]")])
    assert out.dtype == np.dtype("M8[s]") and out.shape == (2, 2)
    out = collate([np.datetime64(1, "D"), np.datetime64(2, "D")])
    assert out.dtype == np.dtype("M8[D]") and out.shape == (2,)


@pytest.mark.parametrize(
    ("batch", "dtype"),
    [
        ([np.float32(1), np.float32(2)], np.float32),
        ([np.uint8(1), np.uint8(255)], np.uint8),
        ([np.bool_(True), np.bool_(False)], np.bool_),
        ([np.int8(1), np.float64(2)], np.float64),
        ([1, 2, -3], np.int64),
        ([1.0, 2.5], np.float64),
        ([True, False], np.bool_),
        ([True, 2], np.int64),
        ([1 + 2j, 3j], np.complex128),
        ([1.0, np.float32(2.5)], np.float64),
        ([1.5, np.int64(2)], np.float64),
        ([1j, np.float32(2)], np.complex128),
    ],
)
def test_numbers_become_arrays(batch: list[Any], dtype: type) -> None:
    alloc = RecordingAlloc()
    out = collate(batch, alloc)
    assert type(out) is np.ndarray and out.dtype == np.dtype(dtype) and out.shape == (len(batch),)
    assert in_buffer(out, alloc)
    np.testing.assert_array_equal(out, np.array(batch, dtype=dtype))


@pytest.mark.parametrize("batch", [["a", "b"], [b"x", b"y"], [np.str_("u"), np.str_("v")]])
def test_strings_are_returned_unchanged(batch: list[Any]) -> None:
    assert collate(batch) is batch


class TaggedDict(dict):
    pass


class FrozenMapping(Mapping):
    def __init__(self, data: dict) -> None:
        self._data = dict(data)

    def __getitem__(self, key: Any) -> Any:
        return self._data[key]

    def __iter__(self) -> Any:
        return iter(self._data)

    def __len__(self) -> int:
        return len(self._data)


class NoInitMapping(FrozenMapping):
    def __init__(self, a: Any, b: Any) -> None:
        super().__init__({"a": a, "b": b})


def test_mappings_keep_their_type_and_state() -> None:
    ordered = collate([collections.OrderedDict(b=1, a=2.0), collections.OrderedDict(b=3, a=4.0)])
    assert type(ordered) is collections.OrderedDict and list(ordered) == ["b", "a"]
    np.testing.assert_array_equal(ordered["b"], [1, 3])
    tagged = TaggedDict(v=1)
    tagged.tag = "kept"  # type: ignore[attr-defined]
    out = collate([tagged, TaggedDict(v=2)])
    assert type(out) is TaggedDict and out.tag == "kept" and out is not tagged  # type: ignore[attr-defined]
    frozen = collate([FrozenMapping({"k": 1}), FrozenMapping({"k": 2})])
    assert type(frozen) is FrozenMapping and list(frozen["k"]) == [1, 2]
    plain = collate([NoInitMapping(1, 0), NoInitMapping(2, 0)])
    assert type(plain) is dict and list(plain["a"]) == [1, 2]


def test_sequences_transpose_like_torch() -> None:
    out = collate([(np.zeros(2), 1, "a"), (np.ones(2), 2, "b")])
    assert type(out) is list and out[2] == ("a", "b")
    np.testing.assert_array_equal(out[1], [1, 2])
    point = collate([Point(1, 2.0), Point(3, 4.0)])
    assert type(point) is Point and point.x.dtype == np.int64 and point.y.dtype == np.float64
    nested = collate([[1, [2, 3]], [4, [5, 6]]])
    assert type(nested) is list and [list(a) for a in nested[1]] == [[2, 5], [3, 6]]
    assert [list(a) for a in collate([range(2), range(2, 4)])] == [[0, 2], [1, 3]]


def test_default_convert_numpy_mode_keeps_leaves() -> None:
    array, scalar = np.ones(2), np.float32(1)
    out = default_convert({"a": (array, scalar), "p": Point(array, "s"), "l": [3]})
    assert type(out["a"]) is list and out["a"][0] is array and out["a"][1] is scalar
    assert type(out["p"]) is Point and out["p"].x is array
    assert out["l"] == [3] and default_convert(5) == 5


# ---------------------------------------------------------------------------------- errors


def test_unequal_shapes_name_the_field_and_both_shapes() -> None:
    batch = [{"image": np.zeros((3, 4))}, {"image": np.zeros((3, 4))}, {"image": np.zeros((3, 5))}]
    with pytest.raises(RuntimeError) as info:
        collate(batch)
    error = info.value
    assert isinstance(error, CollateShapeError)
    assert error.path == "batch['image']" and error.shapes == ((3, 4), (3, 5))
    assert error.entries == (0, 2)
    assert "batch['image']" in str(error) and "[3, 4]" in str(error) and "[3, 5]" in str(error)


@pytest.mark.parametrize(
    ("batch", "path"),
    [
        ([np.zeros(2), np.zeros(3)], "batch"),
        ([(np.zeros((2, 2)), 1), (np.zeros((3, 2)), 2)], "batch[0]"),
        ([[{"a": Point(np.zeros(1), 0)}], [{"a": Point(np.zeros(()), 0)}]], "batch[0]['a'].x"),
        ([np.zeros(()), np.zeros(1)], "batch"),
        ([np.zeros((2, 3)), np.zeros(2)], "batch"),
    ],
)
def test_shape_errors_name_nested_paths(batch: list[Any], path: str) -> None:
    with pytest.raises(CollateShapeError) as info:
        collate(batch, RecordingAlloc())
    assert info.value.path == path
    assert info.value.shapes[0] != info.value.shapes[1]


def test_unequal_lengths_keep_torch_wording_and_add_the_path() -> None:
    with pytest.raises(RuntimeError, match="each element in list of batch should be of equal size"):
        collate([{"x": [1, 2]}, {"x": [1, 2, 3]}])
    with pytest.raises(RuntimeError, match=r"batch\['x'\]: entry 0 has 2 items, entry 1 has 3"):
        collate([{"x": [1, 2]}, {"x": [1, 2, 3]}])


@pytest.mark.parametrize(
    "batch",
    [[np.array(["a"]), np.array(["b"])], [np.array([None]), np.array([None])],
     [np.array([b"a"]), np.array([b"b"])],
     # anywhere in the batch, in either order: no object array may be put in the slot
     [np.zeros(1), np.array([None])], [np.array([None]), np.zeros(1)],
     [np.zeros(1), np.array(["a"])], [np.array(["a"]), np.zeros(1)],
     [np.zeros(1), np.array([b"a"])], [np.array([b"a"]), np.zeros(1)]],
)
def test_string_and_object_arrays_raise_torchs_type_error(batch: list[Any]) -> None:
    alloc = RecordingAlloc()
    with pytest.raises(TypeError, match=r"default_collate: batch must contain tensors.*\(at batch\)"):
        collate(batch, alloc)
    assert alloc.requests == []


@pytest.mark.parametrize(
    ("batch", "match"),
    [([np.float64(1), "a"], r"found <class 'str'> \(at batch\['v'\]: entry 0 is a numpy.float64, entry 1 a str\)"),
     ([np.float64(1), np.str_("a")], r"found <class 'numpy.str_'> \(at batch\['v'\]: entry 0 is a numpy.float64, "
                                     r"entry 1 a numpy.str_\)"),
     ([np.int8(1), None], r"found <class 'NoneType'> \(at batch\['v'\]: entry 0 is a numpy.int8, entry 1 a NoneType\)"),
     ([1.0, None], r"floats .* numpy made dtype object \(at batch\['v'\]"),
     ([1.0, "a"], r"floats .* numpy made dtype <U\d+ \(at batch\['v'\]"),
     ([1.0, [1.0, 2.0]], r"floats .* \(at batch\['v'\]"),
     ([1j, None], r"complex numbers .* numpy made dtype object \(at batch\['v'\]"),
     ([1j, b"a"], r"complex numbers .* numpy made dtype \|S\d+ \(at batch\['v'\]")],
)
def test_numbers_mixed_with_non_numbers_raise_type_error_naming_the_field(
    batch: list[Any], match: str
) -> None:
    with pytest.raises(TypeError, match=match):
        collate([{"v": sample} for sample in batch], RecordingAlloc())


@pytest.mark.parametrize(
    ("batch", "match"),
    [([1, 2, None], r"ints .* \(at batch\['v'\]: entry 0 is a int, entry 2 a NoneType\)"),
     ([1.0, "a"], r"floats .* \(at batch\['v'\]: entry 0 is a float, entry 1 a str\)"),
     ([1.0, [1.0, 2.0]], r"floats .* \(at batch\['v'\]: entry 0 is a float, entry 1 a list\)"),
     ([1j, 2j, b"a"], r"complex numbers .* \(at batch\['v'\]: entry 0 is a complex, entry 2 a bytes\)")],
)
def test_numbers_mixed_with_non_numbers_name_the_entry(batch: list[Any], match: str) -> None:
    """The numpy flavour's error says which sample is not a number, as the torch flavour's does."""
    with pytest.raises(TypeError, match=match):
        collate([{"v": sample} for sample in batch], RecordingAlloc())


def test_unsupported_type_names_the_field() -> None:
    with pytest.raises(TypeError, match=r"found <class 'NoneType'> \(at batch\[1\]\['v'\]\)"):
        collate([(1, {"v": None}), (2, {"v": None})])


# ------------------------------------------------------------------------- torch, optional


def test_tensors_in_numpy_mode_stay_tensors_in_alloc_memory() -> None:
    torch = pytest.importorskip("torch")
    alloc = RecordingAlloc()
    out = collate([{"t": torch.ones(2, 3) * i, "n": np.int16(i)} for i in range(4)], alloc)
    assert isinstance(out["t"], torch.Tensor) and out["t"].shape == (4, 2, 3)
    assert type(out["n"]) is np.ndarray and out["n"].dtype == np.int16
    assert out["t"].data_ptr() == alloc.arrays[0].ctypes.data
    assert torch.equal(out["t"][3], torch.full((2, 3), 3.0))


def test_torch_mode_results_share_alloc_memory() -> None:
    torch = pytest.importorskip("torch")
    alloc = RecordingAlloc()
    batch = [(np.full(4, i, np.float32), i, float(i), np.uint8(i), torch.ones(2)) for i in range(3)]
    out = collate(batch, alloc, to_torch=True)
    assert all(isinstance(t, torch.Tensor) for t in out)
    assert [t.data_ptr() for t in out] == [a.ctypes.data for a in alloc.arrays]
    assert [t.dtype for t in out] == [torch.float32, torch.int64, torch.float64, torch.uint8,
                                      torch.float32]


@pytest.mark.timeout(60)
def test_importing_collation_does_not_import_torch() -> None:
    code = (
        "import sys, numpy as np, shmloader, shmloader.collate as c;"
        "c.collate([(np.zeros(2), 1, {'a': 'b'})]); c.default_convert((1,));"
        "assert 'torch' not in sys.modules, 'torch was imported'"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=50)
    assert result.returncode == 0, result.stderr
