"""Collate rules that make torch tensors: tensors in any mode, and numbers and arrays in torch mode.

Owns the torch side of collation: stacking tensors into memory from the allocator, turning numpy
arrays, numpy scalars and Python numbers into the tensors ``torch.utils.data.default_collate``
returns, and the dtype bridge between numpy and torch. Runs wherever a batch is collated. Only
called once a tensor has been seen or torch mode was asked for, so torch is already imported;
importing this module does not import torch.

Promises:

- a result tensor's memory comes from the allocator: ``torch.from_numpy(alloc(shape, dtype))``,
  or for dtypes numpy lacks (bfloat16, float8, complex32, ...) ``alloc((nbytes,), uint8)`` viewed
  as that dtype and shape; a zero-size one has no memory to take: a fresh tensor, with the
  strides torch gives it;
- values, dtypes and shapes equal torch's default_collate, in the same process: in a worker
  torch stacks tensors (and arrays) of mixed dtypes into the first sample's dtype, elsewhere it
  promotes (``_stacked_dtype``). The fast paths cover the common cases
  (one dtype, plain Python numbers); anything else replays torch's own conversion
  (``torch.as_tensor`` / ``torch.tensor``) so dtype inference and errors are torch's, then copies
  the result into the allocator;
- a batch of tensors is laid out as torch lays it out: contiguous in a worker (torch's worker stacks
  into a contiguous shared tensor), elsewhere with the strides ``torch.stack`` gives (samples in
  channels_last give a channels_last batch), in memory from the allocator either way;
- the exceptions: CUDA tensors and tensors that require grad are stacked by ``torch.stack``
  without an allocator, since neither can live in a shared-memory slot — except that in a
  torch-mode worker samples that require grad (``torch.nn.Parameter``) raise torch's RuntimeError,
  as torch's worker does (it stacks them with ``out=``, which autograd refuses).
"""

from __future__ import annotations

import functools
import math
from operator import attrgetter
from typing import TYPE_CHECKING, Any

import numpy as np

from shmloader.caches import remember
from shmloader.collate.context import Alloc, CollateContext
from shmloader.collate.field_errors import names_field, type_name
from shmloader.collate.rules import (
    _PY_NUMBERS,
    check_array_dtype,
    raise_shape_error,
    stack_checked,
    write_array,
)
from shmloader.worker_info import get_worker_info

if TYPE_CHECKING:
    from collections.abc import Sequence


__all__ = [
    "collate_arrays",
    "collate_floats",
    "collate_ints",
    "collate_numpy_scalars",
    "collate_tensors",
    "copy_into_alloc",
    "numpy_dtype_of",
    "tensor_from_alloc",
    "torch_dtype_of",
]

_shape = attrgetter("shape")
_dtype = attrgetter("dtype")
_requires_grad = attrgetter("requires_grad")
_numel = attrgetter("numel")
_PY_INTS = frozenset({int, bool})
_INT64 = np.dtype(np.int64)
_BOOL = np.dtype(np.bool_)
_UINT8 = np.dtype(np.uint8)
_FLOAT64 = np.dtype(np.float64)
# torch's error for a worker's stack of samples that require grad (torch.stack with out=)
_OUT_GRAD_MESSAGE = (
    "stack(): functions with out=... arguments don't support automatic differentiation, "
    "but one of the arguments requires grad."
)

# dtype bridges, filled on first use of each dtype (bounded caches): None means "no counterpart".
_numpy_of: dict[Any, np.dtype | None] = {}
_torch_of: dict[np.dtype, Any] = {}
_scalar_ok: dict[type, bool] = {}


def _torch() -> Any:
    import torch  # noqa: PLC0415  (lazy: shmloader must import without torch)

    return torch


def numpy_dtype_of(dtype: Any) -> np.dtype | None:
    """The numpy dtype with the same memory layout as a torch dtype, or None (e.g. bfloat16)."""
    try:
        return _numpy_of[dtype]
    except KeyError:
        pass
    try:
        found: np.dtype | None = _torch().empty(0, dtype=dtype).numpy().dtype
    except (TypeError, RuntimeError):
        found = None
    remember(_numpy_of, dtype, found)
    return found


def torch_dtype_of(dtype: np.dtype) -> Any:
    """The torch dtype ``torch.from_numpy`` gives for a numpy dtype, or None where it refuses."""
    try:
        return _torch_of[dtype]
    except KeyError:
        pass
    try:
        found = _torch().from_numpy(np.empty(0, dtype)).dtype
    except (TypeError, ValueError):  # unsupported type, or non-native byte order
        found = None
    remember(_torch_of, dtype, found)
    return found


def tensor_from_alloc(alloc: Alloc, shape: tuple[int, ...], dtype: Any) -> Any:
    """An uninitialised tensor of ``shape`` and torch ``dtype`` whose memory comes from alloc."""
    torch = _torch()
    np_dtype = numpy_dtype_of(dtype)
    if np_dtype is not None:
        return _from_numpy(alloc(shape, np_dtype), torch)
    nbytes = math.prod(shape) * dtype.itemsize
    if not nbytes:
        return torch.empty(shape, dtype=dtype)
    return torch.from_numpy(alloc((nbytes,), _UINT8)).view(dtype).view(shape)


def _from_numpy(arr: np.ndarray, torch: Any) -> Any:
    """``torch.from_numpy(arr)``; for a zero-size ``arr`` (no bytes to share) a fresh tensor, whose
    strides are those torch's stack gives: numpy 2's ``empty`` of a zero-size shape has all-zero
    strides, which ``from_numpy`` kept ((0, 0, 0) where torch's batch has (3, 3, 1))."""
    if arr.size:
        return torch.from_numpy(arr)
    return torch.empty(arr.shape, dtype=torch_dtype_of(arr.dtype))


def copy_into_alloc(tensor: Any, ctx: CollateContext) -> Any:
    """Copy a tensor made by torch's own conversion into memory from the allocator."""
    out = tensor_from_alloc(ctx.alloc, tuple(tensor.shape), tensor.dtype)
    out.copy_(tensor)
    return out


# --------------------------------------------------------------------------------- tensors


@names_field
def collate_tensors(batch: Sequence[Any], ctx: CollateContext) -> Any:
    """Tensors: ``torch.stack(batch, 0, out=...)`` into alloc, with torch's checks and errors.

    A non-tensor after the first sample (an array, a list) gets the error torch gives it: in a
    torch-mode worker an AttributeError (``'numpy.ndarray' object has no attribute 'numel'``),
    elsewhere ``torch.stack``'s TypeError ("expected Tensor as element 1 ...").
    """
    torch = _torch()
    elem = batch[0]
    _check_layout(elem, torch)
    try:
        if len(set(map(_shape, batch))) > 1:
            _refuse_non_tensors(batch, ctx, torch)
            raise_shape_error(batch, ctx)
        if torch.is_grad_enabled() and any(map(_requires_grad, batch)):
            return _stack_with_grad(batch, ctx, torch)
        if elem.device.type != "cpu":
            return torch.stack(batch, 0)  # cannot live in a slot: torch's result as is
        dtypes = list(dict.fromkeys(map(_dtype, batch)))  # in the batch's order, as torch promotes
    except AttributeError:  # no shape / requires_grad / dtype: not a tensor
        _refuse_non_tensors(batch, ctx, torch)
        return torch.stack(batch, 0)
    if len(dtypes) == 1:
        dtype = elem.dtype
    else:
        _refuse_non_tensors(batch, ctx, torch)  # a numpy dtype among them: an array, not a tensor
        dtype = _stacked_dtype(elem, dtypes, ctx, torch)
    shape = (len(batch), *elem.shape)
    if elem.is_contiguous() or _in_a_worker(torch):
        out = tensor_from_alloc(ctx.alloc, shape, dtype)  # a worker's batch is contiguous, as torch's
    else:
        out = _laid_out_as_stack(batch, shape, dtype, ctx, torch)
    return torch.stack(batch, 0, out=out)


def _laid_out_as_stack(batch: Sequence[Any], shape: tuple[int, ...], dtype: Any, ctx: CollateContext,
                       torch: Any) -> Any:
    """Memory from the allocator with the strides ``torch.stack(batch)`` gives its result.

    Outside a worker torch stacks without ``out=``, so samples in a memory format (channels_last)
    give a batch in it; stacking meta tensors of the samples' strides says which, at no data cost.
    """
    metas = [torch.empty_strided(s.shape, s.stride(), dtype=dtype, device="meta") for s in batch]
    strides = torch.stack(metas, 0).stride()
    flat = tensor_from_alloc(ctx.alloc, (math.prod(shape),), dtype)
    return flat.as_strided(shape, strides)


def _in_a_worker(torch: Any) -> bool:
    """Whether this process is a worker, shmloader's (whenever torch was imported) or torch's."""
    return get_worker_info() is not None or torch.utils.data.get_worker_info() is not None


def _stack_with_grad(batch: Sequence[Any], ctx: CollateContext, torch: Any) -> Any:
    """Samples that require grad (``torch.nn.Parameter``), grad mode on: stacked as torch stacks them.

    Outside a worker ``torch.stack`` records autograd: a tensor with a ``grad_fn``, off the slot.
    In a torch-mode worker torch stacks with ``out=`` into shared memory, which autograd refuses:
    its RuntimeError, with the field and what to do.
    """
    if not _in_torch_worker(ctx, torch):
        return torch.stack(batch, 0)  # cannot live in a slot: torch's result as is
    _refuse_non_tensors(batch, ctx, torch)  # torch's worker reads numel() of every sample first
    index = next(i for i, sample in enumerate(batch) if sample.requires_grad)
    raise RuntimeError(
        f"{_OUT_GRAD_MESSAGE} (at {ctx.path}: entry {index} is a {type(batch[index]).__name__} that "
        "requires grad; a worker stacks the samples into shared memory, as torch's workers do, and "
        "such a stack cannot record autograd. Return detached tensors from the dataset "
        "(param.detach()), or use num_workers=0.)"
    )


def _in_torch_worker(ctx: CollateContext, torch: Any) -> bool:
    """Whether torch's ``collate_tensor_fn`` would take its worker path here: torch mode, and
    ``torch.utils.data.get_worker_info()`` not None (a worker of ours sets it, as torch's do)."""
    return ctx.to_torch and torch.utils.data.get_worker_info() is not None


def _stacked_dtype(elem: Any, dtypes: list[Any], ctx: CollateContext, torch: Any) -> Any:
    """The dtype of a batch of tensors of several dtypes, as torch's ``collate_tensor_fn`` gives it.

    In torch mode inside a worker — as torch decides it, ``torch.utils.data.get_worker_info()`` is
    not None — torch stacks into a shared tensor of the first sample's dtype, so float32 then
    float64 gives float32 and ``torch.stack(..., out=)`` raises for a dtype it cannot cast (int64
    then float32). Elsewhere, and in numpy mode, ``torch.stack`` promotes.
    """
    if _in_torch_worker(ctx, torch):
        return elem.dtype
    return functools.reduce(torch.promote_types, dtypes)


def _refuse_non_tensors(batch: Sequence[Any], ctx: CollateContext, torch: Any) -> None:
    """A non-tensor among a tensor field's samples: the error torch's ``collate_tensor_fn`` raises.

    In a torch-mode worker torch sums ``x.numel()`` over the samples before it stacks them: the
    AttributeError of the first sample without ``numel``, in torch's words, then the field and
    what was mixed. Elsewhere (or for a non-tensor that has ``numel``) ``torch.stack``'s TypeError
    ("expected Tensor as element 1 in argument 0, but got numpy.ndarray"). For error paths:
    returns only when every sample is a tensor.
    """
    if all(isinstance(sample, torch.Tensor) for sample in batch):
        return
    if _in_torch_worker(ctx, torch):
        for index, sample in enumerate(batch):
            try:
                _numel(sample)
            except AttributeError as exc:
                raise AttributeError(
                    f"{exc} (at {ctx.path}: entry {index} is a {type_name(sample)}, entry 0 a "
                    f"{type_name(batch[0])}; in a worker torch's default_collate counts the "
                    "elements of every sample of a tensor field before stacking them. Make the "
                    "field's samples all tensors, or all numpy arrays.)"
                ) from None
    torch.stack(batch, 0)


def _check_layout(elem: Any, torch: Any) -> None:
    if elem.is_nested:
        raise RuntimeError(
            "Batches of nested tensors are not currently supported by the default collate_fn; "
            "please provide a custom collate_fn to handle them appropriately."
        )
    if elem.layout in {
        torch.sparse_coo, torch.sparse_csr, torch.sparse_bsr, torch.sparse_csc, torch.sparse_bsc
    }:
        raise RuntimeError(
            "Batches of sparse tensors are not currently supported by the default collate_fn; "
            "please provide a custom collate_fn to handle them appropriately."
        )


# ---------------------------------------------------------------------- torch-mode numbers


@names_field
def collate_arrays(batch: Sequence[Any], ctx: CollateContext) -> Any:
    """numpy arrays in torch mode: one tensor (``torch.from_numpy`` of the stacked alloc array).

    An array with a negative stride (``a[::-1]``) gets torch's ValueError, as ``default_collate``
    gives it (``torch.as_tensor`` refuses such arrays); the numpy flavour still stacks them.
    """
    elem = batch[0]
    check_array_dtype(elem, ctx)
    if len(set(map(type, batch))) > 1:  # not all arrays: torch converts each with as_tensor
        return _as_tensors(batch, ctx)
    if any(min(sample.strides, default=0) < 0 for sample in batch):
        return _as_tensors(batch, ctx)  # raises torch's own ValueError, for the first such sample
    if len(set(map(_dtype, batch))) > 1 or torch_dtype_of(elem.dtype) is None:
        # mixed dtypes follow torch's rule (collate_tensors); a refused dtype raises torch's own error
        return _as_tensors(batch, ctx)
    out = ctx.alloc((len(batch), *elem.shape), elem.dtype)
    return _from_numpy(stack_checked(batch, out, ctx), _torch())


def _as_tensors(batch: Sequence[Any], ctx: CollateContext) -> Any:
    torch = _torch()
    return collate_tensors([torch.as_tensor(sample) for sample in batch], ctx)


@names_field
def collate_numpy_scalars(batch: Sequence[Any], ctx: CollateContext) -> Any:
    """numpy scalars in torch mode: ``torch.as_tensor(batch)``, written into alloc."""
    types = set(map(type, batch))
    if len(types) == 1 and _scalar_type_ok(batch[0]):
        return _torch().from_numpy(write_array(np.asarray(batch), ctx))
    return copy_into_alloc(_torch().as_tensor(batch), ctx)


def _scalar_type_ok(elem: Any) -> bool:
    """Whether numpy gives the dtype torch.as_tensor infers for a list of this scalar type."""
    tp = type(elem)
    ok = _scalar_ok.get(tp)
    if ok is None:
        try:
            expected = _torch().as_tensor([elem]).dtype
        except (TypeError, ValueError, RuntimeError):  # e.g. uint64: torch raises; replay it
            expected = None
        made = torch_dtype_of(np.asarray([elem]).dtype)
        ok = remember(_scalar_ok, tp, expected is not None and made == expected)
    return ok


@names_field
def collate_floats(batch: Sequence[Any], ctx: CollateContext) -> Any:
    """Python floats in torch mode: ``torch.tensor(batch, dtype=torch.float64)``."""
    if set(map(type, batch)) <= _PY_NUMBERS:
        out = ctx.alloc((len(batch),), _FLOAT64)
        out[...] = batch
        return _torch().from_numpy(out)
    torch = _torch()
    return copy_into_alloc(torch.tensor(batch, dtype=torch.float64), ctx)


@names_field
def collate_ints(batch: Sequence[Any], ctx: CollateContext) -> Any:
    """Python ints and bools in torch mode: ``torch.tensor(batch)`` (int64, or bool)."""
    if set(map(type, batch)) <= _PY_INTS:
        try:
            arr = np.asarray(batch)
        except OverflowError:
            arr = None
        if arr is not None and (arr.dtype == _INT64 or arr.dtype == _BOOL):
            return _torch().from_numpy(write_array(arr, ctx))
    # floats mixed in, int subclasses, or values past int64: torch's inference and errors
    return copy_into_alloc(_torch().tensor(batch), ctx)
