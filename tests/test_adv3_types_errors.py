"""Where torch's ``default_collate`` refuses a field through torch's own conversion (``torch.tensor``,
``torch.as_tensor``, ``torch.stack``, dtype promotion), ours raises torch's exception, of torch's
class and in torch's words, and also names the field (``batch['x']``); through a worker the loader
adds the worker, pid and sample indices. Before, these errors said neither the field nor which
samples were mixed, so a dataset of many fields left the user guessing which one failed; and
tensors of several dtypes were promoted in the order of a set, so torch's "attempted to promote
UInt64 and Byte" could read "Byte and UInt64" (both orders of a pair are checked)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from parity_helpers import ListDataset, assert_same_error, assert_same_structure, stop_torch_workers

from shmloader.collate import collate, torch_default_collate

torch = pytest.importorskip("torch")
from torch.utils import data as tdata  # noqa: E402

import shmloader.torch as st  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")

# A field's samples (entry 0, entry 1) that torch's default_collate refuses in its own conversion.
REFUSED: dict[str, Callable[[], list[Any]]] = {
    "none_after_int": lambda: [1, None],
    "none_after_float": lambda: [1.0, None],
    "none_after_array": lambda: [np.ones(2), None],
    "str_after_int": lambda: [1, "s"],
    "big_endian_arrays": lambda: [np.ones(2, ">f4"), np.ones(2, ">f4")],
    "big_endian_after_native": lambda: [np.ones(2, ">f4"), np.ones(2)],
    "negative_strides": lambda: [np.arange(3.0)[::-1], np.arange(3.0)[::-1]],
    "datetime_arrays": lambda: [np.zeros(2, "M8[s]"), np.zeros(2, "M8[s]")],
    "structured_arrays": lambda: [np.zeros(2, "i4,f8"), np.zeros(2, "i4,f8")],
    "uint64_scalars": lambda: [np.uint64(1), np.uint64(2)],
    "uint64_after_int": lambda: [1, np.uint64(2**63)],
    "uint64_then_uint8_tensors": lambda: [torch.ones(1, dtype=torch.uint64), torch.ones(1, dtype=torch.uint8)],
    "uint8_then_uint64_tensors": lambda: [torch.ones(1, dtype=torch.uint8), torch.ones(1, dtype=torch.uint64)],
    "float8_then_float32_tensors": lambda: [torch.ones(1).to(torch.float8_e4m3fn), torch.ones(1)],
    "none_after_tensor": lambda: [torch.ones(2), None],
    "numpy_scalar_after_tensor": lambda: [torch.ones(()), np.float32(1)],
}
# Those whose samples are all tensors: the numpy flavour stacks tensors as torch does, so it refuses them too.
TENSOR_FIRST = ["uint64_then_uint8_tensors", "uint8_then_uint64_tensors", "float8_then_float32_tensors",
                "none_after_tensor", "numpy_scalar_after_tensor"]


def _in_a_field(name: str) -> list[dict[str, Any]]:
    return [{"ok": i, "x": value} for i, value in enumerate(REFUSED[name]())]


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_torchs_own_conversion_errors_name_the_field(name: str) -> None:
    batch = _in_a_field(name)
    error = assert_same_error(lambda: torch_default_collate(batch), lambda: tdata.default_collate(batch))
    assert "at batch['x']" in str(error), str(error)


@pytest.mark.parametrize("name", TENSOR_FIRST)
def test_tensor_fields_in_the_numpy_flavour_name_the_field(name: str) -> None:
    batch = _in_a_field(name)
    error = assert_same_error(lambda: collate(batch), lambda: tdata.default_collate(batch))
    assert "at batch['x']" in str(error), str(error)


def test_mixed_entries_are_named_with_their_types() -> None:
    batch = _in_a_field("none_after_int")
    with pytest.raises(RuntimeError, match=r"^Could not infer dtype of NoneType \(at batch\['x'\]: "
                                           r"entry 0 is a int, entry 1 a NoneType\)$"):
        torch_default_collate(batch)


def fields(name: str) -> ListDataset:
    """Four samples of ``{"ok": i, "x": value}``, the values of ``REFUSED[name]`` in turn."""
    return ListDataset([{"ok": i, "x": REFUSED[name]()[i % 2]} for i in range(4)])


def _torch_error(dataset: Any, num_workers: int) -> BaseException:
    it = iter(tdata.DataLoader(dataset, batch_size=2, num_workers=num_workers))
    try:
        next(it)
    except Exception as error:  # noqa: BLE001  (the error compared)
        return error
    finally:
        stop_torch_workers(it)
    raise AssertionError("torch's loader did not raise")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("name", ["none_after_int", "big_endian_arrays", "uint64_then_uint8_tensors"])
def test_the_loaders_error_names_the_field_and_with_workers_the_samples(name: str, num_workers: int) -> None:
    theirs = _torch_error(fields(name), num_workers)
    loader = st.DataLoader(fields(name), batch_size=2, num_workers=num_workers)
    try:
        with pytest.raises(type(theirs)) as raised:
            next(iter(loader))
    finally:
        loader.close()
    text = str(raised.value)
    assert "at batch['x']" in text, text
    torch_words = str(theirs).strip().splitlines()[-1]  # the original error's last line, in a worker too
    assert torch_words in text, f"{torch_words!r} not in {text!r}"
    if num_workers:
        assert "sample indices [0..1]" in text, text


UNSIGNED = ["uint16", "uint32", "uint64"]
OTHERS = ["uint8", "int8", "int16", "int32", "int64", "float32", "bool"]


@pytest.mark.parametrize("unsigned_first", [True, False], ids=["unsigned_first", "unsigned_second"])
def test_tensors_of_two_dtypes_are_promoted_in_the_batchs_order(unsigned_first: bool) -> None:
    # torch names the pair it could not promote in the samples' order; a set of dtypes has its own
    for unsigned in UNSIGNED:
        for other in OTHERS:
            pair = [torch.zeros(1, dtype=getattr(torch, unsigned)), torch.zeros(1, dtype=getattr(torch, other))]
            batch = pair if unsigned_first else pair[::-1]
            try:
                expected = tdata.default_collate(batch)
            except RuntimeError as theirs:
                with pytest.raises(RuntimeError) as ours:
                    torch_default_collate(batch)
                assert str(ours.value).startswith(str(theirs)), f"{ours.value} != {theirs}"
            else:
                assert_same_structure(torch_default_collate(batch), expected)
