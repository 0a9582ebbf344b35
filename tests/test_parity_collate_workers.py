"""torch parity of collation where torch's own depends on the process: ``shmloader.torch.DataLoader``
yields what torch's ``DataLoader`` yields with ``num_workers=0`` and with worker processes, for
samples of mixed dtypes (a worker stacks into the first sample's dtype, the main process promotes),
samples that require grad (a worker refuses them), a tensor field with an array in it (a worker
raises AttributeError, the main process TypeError), and nested and quantized tensors, which a
worker hands back pickled by value. torch's ``default_collate_fn_map``: test_parity_collate_map.py."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from parity_helpers import ListDataset, assert_same_error, assert_same_outcome, assert_same_structure, outcome

from shmloader.collate import torch_default_collate

torch = pytest.importorskip("torch")
from torch.utils import data as tdata  # noqa: E402
from torch.utils.data._utils import worker as torch_worker  # noqa: E402

import shmloader  # noqa: E402
import shmloader.torch as st  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")


# ----------------------------------------------------------------------------- mixed dtypes


def _tensor(dtype: str) -> Any:
    return torch.ones(2, dtype=getattr(torch, dtype))


MIXED: dict[str, Callable[[], list[Any]]] = {
    "float32_then_float64": lambda: [_tensor("float32"), _tensor("float64")],
    "uint8_then_int8": lambda: [_tensor("uint8"), _tensor("int8")],
    "bfloat16_then_float32": lambda: [_tensor("bfloat16"), _tensor("float32")],
    "float32_then_float64_arrays": lambda: [np.ones(2, np.float32), np.ones(2, np.float64)],
}
MIXED_ERRORS: dict[str, Callable[[], list[Any]]] = {
    "int64_then_float32": lambda: [_tensor("int64"), _tensor("float32")],
    "bool_then_int64": lambda: [_tensor("bool"), _tensor("int64")],
    "float32_then_complex64": lambda: [_tensor("float32"), _tensor("complex64")],
    "int64_then_float32_arrays": lambda: [np.ones(2, np.int64), np.ones(2, np.float32)],
}


@pytest.fixture
def in_a_torch_worker(monkeypatch: pytest.MonkeyPatch) -> None:
    """This process looks like a worker to torch's ``get_worker_info()``, as in a real worker."""
    # any dataset will do (torch's stubs ask for its Dataset class)
    info = torch_worker.WorkerInfo(id=0, num_workers=1, seed=0, dataset=ListDataset([]))  # type: ignore[arg-type]
    monkeypatch.setattr(torch_worker, "_worker_info", info)


@pytest.mark.parametrize("name", sorted(MIXED))
def test_mixed_dtypes_in_a_worker_keep_the_first_samples_dtype(name: str, in_a_torch_worker: None) -> None:
    batch = MIXED[name]()
    expected = tdata.default_collate(batch)
    assert expected.dtype == torch.as_tensor(batch[0]).dtype
    assert_same_structure(torch_default_collate(batch), expected)


@pytest.mark.parametrize("name", sorted(MIXED_ERRORS))
def test_mixed_dtypes_in_a_worker_that_do_not_cast_raise_torchs_error(name: str, in_a_torch_worker: None) -> None:
    batch = MIXED_ERRORS[name]()
    assert_same_error(lambda: torch_default_collate(batch), lambda: tdata.default_collate(batch))


@pytest.mark.parametrize("name", sorted(MIXED) + sorted(MIXED_ERRORS))
def test_mixed_dtypes_outside_workers_promote(name: str) -> None:
    batch = {**MIXED, **MIXED_ERRORS}[name]()
    assert_same_structure(torch_default_collate(batch), tdata.default_collate(batch))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("name", ["float32_then_float64", "uint8_then_int8", "float32_then_float64_arrays",
                                  "int64_then_float32"])
def test_loader_collates_mixed_dtypes_as_torchs_does(name: str, num_workers: int) -> None:
    samples = {**MIXED, **MIXED_ERRORS}[name]() * 2
    batches = assert_same_outcome(ListDataset(samples), batch_size=2, num_workers=num_workers)
    promoted = torch.promote_types(torch.as_tensor(samples[0]).dtype, torch.as_tensor(samples[1]).dtype)
    if num_workers == 0:  # torch.stack promotes; in a worker torch stacks into the first dtype
        assert [b.dtype for b in batches] == [promoted, promoted]


# -------------------------------------------- samples that require grad (torch.nn.Parameter)


def _parameter(i: int, requires_grad: bool = True) -> Any:
    return torch.nn.Parameter(torch.full((2,), float(i)), requires_grad=requires_grad)


GRAD: dict[str, Callable[[int], Any]] = {
    "parameter": _parameter,
    "parameter_in_dict": lambda i: {"w": _parameter(i), "y": i},
    "frozen_parameter": lambda i: _parameter(i, requires_grad=False),
}


@pytest.mark.parametrize("name", sorted(GRAD))
def test_samples_that_require_grad_in_a_worker_as_torch(name: str, in_a_torch_worker: None) -> None:
    # torch's worker stacks with out= into shared memory, which autograd refuses (RuntimeError)
    batch = [GRAD[name](i) for i in range(2)]
    if name == "frozen_parameter":
        assert_same_structure(torch_default_collate(batch), tdata.default_collate(batch))
    else:
        error = assert_same_error(lambda: torch_default_collate(batch), lambda: tdata.default_collate(batch))
        assert "num_workers=0" in str(error) and "batch" in str(error)


@pytest.mark.parametrize("name", sorted(GRAD))
def test_samples_that_require_grad_outside_workers_stack_with_grad(name: str) -> None:
    batch = [GRAD[name](i) for i in range(2)]
    assert_same_structure(torch_default_collate(batch), tdata.default_collate(batch))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("name", ["parameter", "parameter_in_dict"])
def test_loader_yields_or_refuses_parameters_as_torchs_does(name: str, num_workers: int) -> None:
    theirs = assert_same_outcome(ListDataset([GRAD[name](i) for i in range(4)]), batch_size=2,
                                 num_workers=num_workers)
    assert (theirs is RuntimeError) == (num_workers > 0)
    if num_workers > 0:  # ours says where and what to do
        loader = st.DataLoader(ListDataset([GRAD[name](i) for i in range(4)]), batch_size=2, num_workers=2)
        path = "batch['w']" if name == "parameter_in_dict" else "batch"
        try:
            with pytest.raises(RuntimeError, match=rf"requires grad[\s\S]*at {re.escape(path)}:"):
                next(iter(loader))
        finally:
            loader.close()


# ------------------------------------------------- tensors mixed with arrays (or lists) in a field


KINDS: dict[str, Callable[[], list[Any]]] = {
    "tensor_then_array": lambda: [torch.ones(2), np.ones(2, np.float32)],
    "tensor_then_longer_array": lambda: [torch.ones(2), np.ones(3, np.float32)],
    "tensor_then_list": lambda: [torch.ones(2), [1.0, 1.0]],
    "parameter_then_array": lambda: [_parameter(0), np.ones(2, np.float32)],
}
ARRAY_FIRST: dict[str, Callable[[], list[Any]]] = {  # torch converts each with as_tensor: it stacks
    "array_then_tensor": lambda: [np.ones(2, np.float32), torch.ones(2)],
    "float64_array_then_tensor": lambda: [np.ones(2), torch.ones(2)],
}


@pytest.mark.parametrize("name", sorted(KINDS))
def test_a_non_tensor_after_a_tensor_in_a_worker_raises_torchs_attribute_error(
        name: str, in_a_torch_worker: None) -> None:
    # torch's worker sums x.numel() over the batch before it stacks: AttributeError
    batch = KINDS[name]()
    error = assert_same_error(lambda: torch_default_collate(batch), lambda: tdata.default_collate(batch))
    assert isinstance(error, AttributeError)
    kind = "list" if name == "tensor_then_list" else "numpy.ndarray"
    assert f"entry 1 is a {kind}" in str(error) and "at batch" in str(error)


@pytest.mark.parametrize("name", sorted(KINDS))
def test_a_non_tensor_after_a_tensor_outside_workers_raises_torchs_type_error(name: str) -> None:
    batch = KINDS[name]()
    assert isinstance(assert_same_error(lambda: torch_default_collate(batch),
                                        lambda: tdata.default_collate(batch)), TypeError)


@pytest.mark.parametrize("in_worker", [False, True], ids=["main", "worker"])
@pytest.mark.parametrize("name", sorted(ARRAY_FIRST))
def test_a_tensor_after_an_array_is_converted_as_torch_does(name: str, in_worker: bool,
                                                            request: pytest.FixtureRequest) -> None:
    if in_worker:
        request.getfixturevalue("in_a_torch_worker")
    batch = ARRAY_FIRST[name]()
    assert_same_structure(torch_default_collate(batch), tdata.default_collate(batch))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("first", ["tensor", "array"])
def test_loader_with_tensors_and_arrays_in_a_field_as_torchs(first: str, num_workers: int) -> None:
    kinds = [torch.ones(2), np.ones(2, np.float32)]
    samples = [{"x": kinds[(i + (first == "array")) % 2], "y": i} for i in range(4)]
    theirs = assert_same_outcome(ListDataset(samples), batch_size=2, num_workers=num_workers)
    if first == "tensor":
        assert theirs is (AttributeError if num_workers else TypeError)


# ------------------------------------------------- nested and quantized tensors (pickled inline)


class Sequences(tdata.Dataset):
    """Sample i: ``arange(i + 1)``, so no two samples of a batch have one shape."""

    def __len__(self) -> int:
        return 4

    def __getitem__(self, i: int) -> Any:
        return torch.arange(i + 1, dtype=torch.float32)


def nest(batch: list[Any]) -> Any:
    """The collate_fn torch's error for nested samples asks for: one nested tensor per batch."""
    return torch.nested.nested_tensor(list(batch))


class Quantized(tdata.Dataset):
    def __len__(self) -> int:
        return 2

    def __getitem__(self, i: int) -> Any:
        return torch.quantize_per_tensor(torch.full((3,), float(i)), 0.5, 0, torch.quint8)


def _unbound(batch: Any) -> Any:
    return [t.tolist() for t in batch.unbind()]


def _dequantized(batch: Any) -> Any:
    return batch.is_quantized, batch.q_scale(), batch.dequantize().tolist()


@pytest.mark.timeout(60)
@pytest.mark.filterwarnings("ignore:.*nested tensors:UserWarning")
@pytest.mark.parametrize("loader_cls", [st.DataLoader, shmloader.DataLoader], ids=["torch", "numpy"])
@pytest.mark.parametrize("num_workers", [0, 2])
def test_nested_tensor_from_a_collate_fn(loader_cls: type, num_workers: int) -> None:
    kwargs: dict[str, Any] = {"batch_size": 2, "num_workers": num_workers, "collate_fn": nest, "each": _unbound}
    expected = outcome(tdata.DataLoader, Sequences(), **kwargs)
    assert expected == [[[0.0], [0.0, 1.0]], [[0.0, 1.0, 2.0], [0.0, 1.0, 2.0, 3.0]]]
    assert outcome(loader_cls, Sequences(), **kwargs) == expected


@pytest.mark.timeout(60)
@pytest.mark.filterwarnings("ignore::UserWarning")  # quantized tensors and their unpickling: deprecated
@pytest.mark.parametrize("loader_cls", [st.DataLoader, shmloader.DataLoader], ids=["torch", "numpy"])
@pytest.mark.parametrize("num_workers", [0, 2])
def test_quantized_tensor_samples_without_batching(loader_cls: type, num_workers: int) -> None:
    # compared with torch's num_workers=0 only: torch 2.13's workers hand back quantized tensors
    # that have lost their quantizer ("cannot call dequantize on UnknownQuantizer")
    expected = outcome(tdata.DataLoader, Quantized(), batch_size=None, each=_dequantized)
    assert expected == [(True, 0.5, [0.0] * 3), (True, 0.5, [1.0] * 3)]
    got = outcome(loader_cls, Quantized(), batch_size=None, num_workers=num_workers, each=_dequantized)
    assert got == expected


# ------------------------------------------------------- samples that are not contiguous


LAYOUTS: dict[str, Callable[[int], Any]] = {
    "channels_last": lambda i: torch.full((2, 3, 4, 5), float(i)).contiguous(memory_format=torch.channels_last),
    "channels_last_3d": lambda i: torch.full((2, 3, 2, 4, 5), float(i)).contiguous(
        memory_format=torch.channels_last_3d),
    "transposed": lambda i: (torch.arange(12.0).reshape(3, 4) + i).t(),
}


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_outside_workers_samples_stack_into_the_layout_torch_stack_gives(name: str) -> None:
    batch = [LAYOUTS[name](i) for i in range(3)]
    theirs = tdata.default_collate(batch)
    for ours in (torch_default_collate(batch), shmloader.collate.collate(batch)):
        assert_same_structure(ours, theirs)
        assert ours.stride() == theirs.stride()


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_in_a_worker_samples_stack_contiguous_as_torchs_worker(name: str, in_a_torch_worker: None) -> None:
    batch = [LAYOUTS[name](i) for i in range(3)]
    ours, theirs = torch_default_collate(batch), tdata.default_collate(batch)
    assert_same_structure(ours, theirs)
    assert ours.stride() == theirs.stride() and ours.is_contiguous()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("num_workers", [0, 2])
def test_loader_stacks_channels_last_samples_as_torchs(num_workers: int) -> None:
    samples = [LAYOUTS["channels_last"](i) for i in range(4)]
    strides = outcome(st.DataLoader, ListDataset(samples), each=torch.Tensor.stride, batch_size=2,
                      num_workers=num_workers)
    assert strides == outcome(tdata.DataLoader, ListDataset(samples), each=torch.Tensor.stride, batch_size=2,
                              num_workers=num_workers)
