"""How many slot bytes a batch needs, read off its samples without collating them.

Owns :func:`needed_bytes`: the bytes the built-in rules would ask of the allocator for one batch,
as an upper bound (each request rounded up to the allocator's 64-byte alignment), computed from
the samples' types, shapes and dtypes alone — nothing is stacked, nothing written. Runs in a
worker whose batch did not fit its slot: the worker reports this size instead of collating the
whole batch into ordinary memory first, and collates straight into the larger slot it gets back
(issue 16: the heap collate and the copy of it into the slot were a large part of the first big
batch's time).

Promises: the answer is either None (unknown) or at least what collate asks for with the same
samples, mode and rules. It is None for anything it does not model exactly — a rule given in
``rules``, registered, or from a plugin (found first, as collate finds it), mixed sample types
or dtypes, tensors that stay off the slot, values collate would reject, anything while torch's
``default_collate_fn_map`` is not torch's own (torch mode: the user's entries, or one of torch's
deleted) — so the caller falls
back to collating on the heap and measuring. It never raises and never changes a sample.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping, Sequence
from operator import itemgetter
from typing import Any

import numpy as np

from shmloader.collate import find_rule
from shmloader.collate import rules as _rules
from shmloader.collate import torch_map as _torch_map
from shmloader.collate import torch_rules as _torch_rules
from shmloader.collate.context import CollateRule

__all__ = ["needed_bytes"]

_ALIGN = 64  # the slot allocator's alignment (transport.alloc.ALIGN_BYTES; collate does not import transport)
_NUMBER_KINDS = frozenset("biufc")
_Sizer = Callable[[Sequence[Any], Any, bool], "int | None"]


def _aligned(nbytes: int) -> int:
    return -(-nbytes // _ALIGN) * _ALIGN


def needed_bytes(batch: Sequence[Any], *, to_torch: bool = False,
                 rules: Mapping[Any, CollateRule] | None = None) -> int | None:
    """An upper bound of the bytes ``collate(batch, alloc, to_torch=..., rules=...)`` allocates, or None."""
    if to_torch and _torch_map.overrides() is not None:
        return None  # torch's default_collate_fn_map changed: the user's function or torch's dispatch decides
    try:
        return _size(batch, rules, to_torch)
    except Exception:  # a sample that does not behave as its type promises: unknown
        return None


def _size(batch: Sequence[Any], rules: Any, to_torch: bool) -> int | None:
    if not batch:
        return None
    sizer = _SIZERS.get(find_rule(type(batch[0]), rules, to_torch))
    return None if sizer is None else sizer(batch, rules, to_torch)


def _stacked_arrays(batch: Sequence[Any], rules: Any, to_torch: bool) -> int | None:
    """numpy arrays (both modes): one array of the batch's dtype, ``len(batch)`` × the sample shape."""
    elem = batch[0]
    if any(type(s) is not type(elem) or s.shape != elem.shape for s in batch):
        return None  # mixed types or shapes: collate converts, promotes or raises
    dtypes = {s.dtype for s in batch}
    if len(dtypes) > 1 or elem.dtype.kind not in _NUMBER_KINDS:
        return None
    if to_torch and (any(min(s.strides, default=0) < 0 for s in batch)
                     or _torch_rules.torch_dtype_of(elem.dtype) is None):
        return None  # torch mode converts these through torch.as_tensor (or raises)
    return _aligned(len(batch) * elem.nbytes)


def _stacked_tensors(batch: Sequence[Any], rules: Any, to_torch: bool) -> int | None:
    """CPU tensors of one dtype and shape: one tensor stacked into the slot."""
    torch = sys.modules.get("torch")
    elem = batch[0]
    if torch is None or any(type(s) is not type(elem) for s in batch):
        return None
    if elem.is_nested or elem.layout is not torch.strided or elem.device.type != "cpu":
        return None
    if any(s.shape != elem.shape or s.dtype != elem.dtype or s.requires_grad for s in batch):
        return None  # promotion, a shape error, or a stack that stays off the slot
    return _aligned(len(batch) * elem.numel() * elem.element_size())


def _numbers(batch: Sequence[Any], rules: Any, to_torch: bool) -> int | None:
    """Python or numpy numbers: one 1-d array, at most 16 bytes an item (complex128)."""
    arr = np.asarray(batch)
    if arr.ndim != 1 or arr.dtype.kind not in _NUMBER_KINDS:
        return None
    return _aligned(len(batch) * max(arr.dtype.itemsize, 16))


def _nothing(batch: Sequence[Any], rules: Any, to_torch: bool) -> int | None:
    return 0  # strings and bytes stay in the descriptor


def _mappings(batch: Sequence[Any], rules: Any, to_torch: bool) -> int | None:
    return _sum(_size(list(map(itemgetter(key), batch)), rules, to_torch) for key in batch[0])


def _namedtuples(batch: Sequence[Any], rules: Any, to_torch: bool) -> int | None:
    return _sum(_size(list(samples), rules, to_torch) for samples in zip(*batch))


def _sequences(batch: Sequence[Any], rules: Any, to_torch: bool) -> int | None:
    if len(set(map(len, batch))) > 1:
        return None  # collate raises
    return _sum(_size(list(samples), rules, to_torch) for samples in zip(*batch))


def _sum(parts: Any) -> int | None:
    total = 0
    for part in parts:
        if part is None:
            return None
        total += part
    return total


_SIZERS: dict[Any, _Sizer] = {
    _rules.collate_arrays: _stacked_arrays,
    _torch_rules.collate_arrays: _stacked_arrays,
    _torch_rules.collate_tensors: _stacked_tensors,
    _rules.collate_numpy_scalars: _numbers,
    _rules.collate_floats: _numbers,
    _rules.collate_ints: _numbers,
    _rules.collate_complex: _numbers,
    _torch_rules.collate_numpy_scalars: _numbers,
    _torch_rules.collate_floats: _numbers,
    _torch_rules.collate_ints: _numbers,
    _rules.keep_batch: _nothing,
    _rules.collate_mappings: _mappings,
    _rules.collate_namedtuples: _namedtuples,
    _rules.collate_sequences: _sequences,
}
