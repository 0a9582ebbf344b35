"""The built-in collate rules of numpy mode, the container rules and the collate errors.

Owns how each built-in sample type becomes a batch in numpy mode (numpy in, numpy out), how
containers (mappings, namedtuples, sequences) are rebuilt in both modes, and the errors collation
raises. Torch tensors and torch mode's numbers and arrays live in :mod:`shmloader.collate.torch_rules`,
which builds on this module; this module never imports torch. Runs wherever a batch is collated:
a worker process, or the main process when ``num_workers=0``.

Promises:

- every output array is obtained from ``ctx.alloc`` and written once (np.concatenate / np.stack
  with ``out=``, or one assignment), never built elsewhere and copied afterwards — except for the
  numbers of a batch, which numpy converts on the heap first (a few bytes per sample);
- containers are rebuilt as torch rebuilds them (tuples become lists, mappings and mutable
  sequences are cloned, namedtuples keep their type), with each value collated exactly once;
- errors keep torch's type and wording and add the field path (``batch['image'][0]``) and, when
  the field's samples are of mixed types, the first entry of another type than entry 0's (a dict
  and a tuple, a number and None); a sample mapping that lacks a key entry 0 has raises torch's
  bare ``KeyError(key)``, with a note (not its args, which stay torch's) naming the field and the
  entry.

Every rule has the :class:`~shmloader.collate.CollateRule` signature ``rule(batch, ctx)``.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Mapping, MutableMapping, MutableSequence, Sequence
from operator import itemgetter
from typing import Any

import numpy as np

from shmloader.collate.context import CollateContext
from shmloader.collate.field_errors import CollateShapeError, mixed_entries, name_field
from shmloader.kept import note

__all__ = [
    "CollateShapeError",
    "UNSUPPORTED_MESSAGE",
    "check_array_dtype",
    "collate_arrays",
    "collate_complex",
    "collate_floats",
    "collate_ints",
    "collate_mappings",
    "collate_namedtuples",
    "collate_numpy_scalars",
    "collate_sequences",
    "keep_batch",
    "raise_shape_error",
    "rebuild_mapping",
    "rebuild_sequence",
    "reject",
    "stack_checked",
    "stack_into",
    "write_array",
]

# torch's pattern and message: numpy arrays of strings or objects cannot become tensors.
_STR_OBJ_DTYPE = re.compile(r"[SaUO]")
UNSUPPORTED_MESSAGE = (
    "default_collate: batch must contain tensors, numpy arrays, numbers, dicts or lists; found {}"
)
_UNEQUAL_LENGTH_MESSAGE = "each element in list of batch should be of equal size"
# Sample types the number fast paths write straight into alloc (numpy converts them exactly).
_PY_NUMBERS = frozenset({float, int, bool})
_PY_COMPLEX = frozenset({complex, float, int, bool})
_FLOAT64 = np.dtype(np.float64)
_COMPLEX128 = np.dtype(np.complex128)

def raise_shape_error(batch: Sequence[Any], ctx: CollateContext) -> None:
    """Raise :class:`CollateShapeError` for the first sample whose shape differs from entry 0.

    Returns (without raising) only if every shape is equal.
    """
    first = tuple(np.shape(batch[0]))
    for index, sample in enumerate(batch):
        shape = tuple(np.shape(sample))
        if shape != first:
            raise CollateShapeError(ctx.path, (first, shape), (0, index))


def reject(batch: Sequence[Any], ctx: CollateContext) -> Any:
    """Rule for types no rule handles: torch's TypeError, plus the field path (and the entries, if mixed)."""
    raise TypeError(f"{UNSUPPORTED_MESSAGE.format(type(batch[0]))} (at {ctx.path}{mixed_entries(batch)})")


def keep_batch(batch: Sequence[Any], ctx: CollateContext) -> Any:
    """str and bytes: the batch is returned as it came (a list or a tuple), as torch does."""
    return batch


# ---------------------------------------------------------------------------------- arrays


def collate_arrays(batch: Sequence[Any], ctx: CollateContext) -> Any:
    """A batch of numpy arrays: one stacked array written into alloc (dtype promoted if mixed).

    The promoted dtype is checked, not only the first sample's, so a string or object array
    anywhere in the batch raises torch's TypeError whatever the order of the samples.
    """
    elem, samples = batch[0], batch
    if len(set(map(type, batch))) > 1:  # lists or numbers mixed in: make them arrays first
        batch = [np.asarray(sample) for sample in batch]
    try:
        dtype = np.result_type(*batch)
    except TypeError:  # no common dtype: name a string/object sample if there is one
        for sample in batch:
            check_array_dtype(sample, ctx)
        raise
    if _STR_OBJ_DTYPE.search(dtype.str) is not None:
        raise TypeError(f"{UNSUPPORTED_MESSAGE.format(dtype)} (at {ctx.path}{mixed_entries(samples)})")
    if not dtype.isnative:
        dtype = dtype.newbyteorder("=")
    out = ctx.alloc((len(batch), *elem.shape), dtype)
    return stack_checked(batch, out, ctx)


def check_array_dtype(elem: np.ndarray, ctx: CollateContext) -> None:
    """Arrays of strings or objects cannot be collated: torch's TypeError, plus the field path."""
    if _STR_OBJ_DTYPE.search(elem.dtype.str) is not None:
        raise TypeError(f"{UNSUPPORTED_MESSAGE.format(elem.dtype)} (at {ctx.path})")


def stack_checked(batch: Sequence[Any], out: np.ndarray, ctx: CollateContext) -> np.ndarray:
    """Stack the samples into ``out`` (shaped after entry 0) with ``ctx.stack``; unequal shapes:
    CollateShapeError.

    numpy checks every dimension but the first; the first is checked here, by ``len``.
    """
    try:
        if out.ndim > 1 and len(set(map(len, batch))) > 1:
            raise ValueError("samples differ in length")
        return ctx.stack(batch, out)
    except (ValueError, TypeError):
        raise_shape_error(batch, ctx)
        raise


def stack_into(batch: Sequence[Any], out: np.ndarray) -> np.ndarray:
    """Stack equally shaped arrays along a new first axis into ``out``, in one pass.

    ``np.concatenate`` into a flattened view costs about half of ``np.stack``, which expands
    every sample first. The view comes from ``reshape``, which copies when the first two axes
    cannot merge; such a copy shares no memory with ``out`` and is never written: ``np.stack``
    writes into ``out`` instead, so the write can never land in a temporary. (Assigning
    ``flat.shape``, which raised instead of copying, is deprecated since numpy 2.5.)
    """
    if out.ndim > 1:
        flat = out.reshape(out.shape[0] * out.shape[1], *out.shape[2:])
        if np.may_share_memory(flat, out):
            np.concatenate(batch, axis=0, out=flat)
            return out
    np.stack(batch, out=out)
    return out


def write_array(arr: np.ndarray, ctx: CollateContext) -> np.ndarray:
    """Copy a small array made on the heap (numbers of a batch) into alloc."""
    dtype = arr.dtype if arr.dtype.isnative else arr.dtype.newbyteorder("=")
    out = ctx.alloc(arr.shape, dtype)
    out[...] = arr
    return out


# --------------------------------------------------------------------------------- numbers


def collate_numpy_scalars(batch: Sequence[Any], ctx: CollateContext) -> Any:
    """numpy scalars (datetime64 and void too): an array of their dtype, promoted if mixed.

    Strings or objects mixed in (numpy would make a string or object array): torch's TypeError,
    naming the first such sample's type and the field. A numpy integer first and a Python int
    outside int64 later (numpy would round them into float64, or make objects): torch's ValueError.
    """
    arr = np.asarray(batch)
    if arr.dtype.kind not in "iub" and isinstance(batch[0], np.integer):
        _check_int64(batch, ctx)
    if arr.dtype.hasobject or arr.dtype.kind in "SU":
        found = next(
            (type(s) for s in batch if not isinstance(s, np.generic) or s.dtype.kind in "SUO"),
            type(batch[0]),
        )
        raise TypeError(f"{UNSUPPORTED_MESSAGE.format(found)} (at {ctx.path}{mixed_entries(batch)})")
    return write_array(arr, ctx)


def collate_floats(batch: Sequence[Any], ctx: CollateContext) -> Any:
    """Python floats: a float64 array; anything numpy cannot make a number raises TypeError."""
    return _write_scalars(batch, _PY_NUMBERS, "floats", "biuf", _FLOAT64, ctx)


_INT_KINDS = {"b": None, "i": np.dtype(np.int64), "u": None, "f": np.dtype(np.float64)}


_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1


def collate_ints(batch: Sequence[Any], ctx: CollateContext) -> Any:
    """Python ints (and bools): an int64 array, or a bool array if all are bools.

    A Python int outside int64 raises torch's ValueError ("Overflow when unpacking long long"),
    where numpy would make a uint64, rounded float64 or object array of the batch.
    """
    try:
        arr = np.asarray(batch)
    except ValueError as exc:  # ragged: a sequence mixed in (torch: TypeError)
        raise _not_numbers(batch, "ints", str(exc), ctx) from exc
    kind = arr.dtype.kind
    if kind not in "ib":
        _check_int64(batch, ctx)
    if kind not in _INT_KINDS and kind != "c":
        raise _not_numbers(batch, "ints", f"numpy made dtype {arr.dtype}", ctx)
    wanted = _INT_KINDS.get(kind)
    if wanted is not None and arr.dtype != wanted:
        arr = arr.astype(wanted)
    return write_array(arr, ctx)


def _check_int64(batch: Sequence[Any], ctx: CollateContext) -> None:
    """torch's ValueError for the first Python int of the batch that int64 cannot hold."""
    for value in batch:
        if isinstance(value, int) and not _INT64_MIN <= value <= _INT64_MAX:
            raise ValueError(f"Overflow when unpacking long long (at {ctx.path}: {value} is outside int64)")


def collate_complex(batch: Sequence[Any], ctx: CollateContext) -> Any:
    """Python complex numbers: a complex128 array (torch's default_collate rejects them)."""
    return _write_scalars(batch, _PY_COMPLEX, "complex numbers", "biufc", _COMPLEX128, ctx)


def _numbers_array(batch: Sequence[Any], what: str, kinds: str, ctx: CollateContext) -> np.ndarray:
    """``np.asarray(batch)``, or a TypeError naming the field if numpy makes no number of ``kinds``."""
    try:
        arr = np.asarray(batch)
    except ValueError as exc:  # ragged: sequences mixed in
        raise _not_numbers(batch, what, str(exc), ctx) from exc
    if arr.dtype.kind not in kinds:
        raise _not_numbers(batch, what, f"numpy made dtype {arr.dtype}", ctx)
    return arr


def _not_numbers(batch: Sequence[Any], what: str, detail: str, ctx: CollateContext) -> TypeError:
    return TypeError(f"cannot collate {what} into one array: {detail} (at {ctx.path}{mixed_entries(batch)})")


def _write_scalars(
    batch: Sequence[Any], python_types: frozenset[type], what: str, kinds: str, dtype: np.dtype,
    ctx: CollateContext,
) -> np.ndarray:
    """Numbers whose types are all ``python_types``: written straight into one ``dtype`` array;
    others (numpy scalars among them) through :func:`_write_numbers`, which checks them."""
    if set(map(type, batch)) <= python_types:
        out = ctx.alloc((len(batch),), dtype)
        out[...] = batch
        return out
    return _write_numbers(batch, what, kinds, dtype, ctx)


def _write_numbers(
    batch: Sequence[Any], what: str, kinds: str, dtype: np.dtype, ctx: CollateContext
) -> np.ndarray:
    """Numbers of mixed types (numpy scalars among Python ones): checked, then one ``dtype`` array."""
    arr = _numbers_array(batch, what, kinds, ctx)
    out = ctx.alloc(arr.shape, dtype)
    out[...] = arr
    return out


# ------------------------------------------------------------------------------ containers


def collate_mappings(batch: Sequence[Any], ctx: CollateContext) -> Any:
    """Mappings: the first sample's mapping type, each key's values collated (torch's rule)."""
    elem = batch[0]
    values = {}
    for key in elem:  # a loop, not a comprehension: one frame per level (ctx.enter)
        try:
            samples = list(map(itemgetter(key), batch))
        except KeyError as error:  # torch's bare KeyError(key), kept: a note names the field and entry
            _name_missing_key(error, key, batch, ctx)
            raise
        except TypeError as error:  # an entry that is no mapping (a tuple): torch's words, then which
            name_field(error, batch, ctx)
            raise
        rule = ctx.enter(samples, f"[{key!r}]")
        try:
            values[key] = rule(samples, ctx)
        finally:
            ctx.leave()
    return rebuild_mapping(elem, values)


def _name_missing_key(error: KeyError, key: Any, batch: Sequence[Any], ctx: CollateContext) -> None:
    """Note on ``error`` the field and the first entry that lacks ``key``, which entry 0 has. Its
    class and args stay torch's; a mapping that lists the key but raised for it gets no note."""
    for index, sample in enumerate(batch):
        try:
            missing = key not in sample
        except Exception:  # a mapping whose membership test fails: say nothing of it
            return
        if missing:
            note(error, f"(at {ctx.path}[{key!r}]: entry {index} has no key {key!r}, which entry 0 has)")
            return


def rebuild_mapping(template: Mapping[Any, Any], values: dict[Any, Any]) -> Any:
    """A mapping like ``template`` holding ``values`` (its keys), rebuilt as torch rebuilds one.

    Mutable mappings are cloned (``copy.copy``) and updated, since the type may carry extra
    state; others are made as ``type(template)(values)``; if either raises TypeError (no
    copy()/update(), or no ``__init__(mapping)``), ``values`` itself: a plain dict. A plain dict
    template gives ``values`` at once (its clone would be equal), with no ABC check, which costs
    frames at the deepest level of a nested sample (tests/test_collate_depth.py).
    """
    if type(template) is dict:
        return values
    try:
        if isinstance(template, MutableMapping):
            clone = copy.copy(template)
            clone.update(values)
            return clone
        return type(template)(values)  # type: ignore[call-arg]
    except TypeError:
        return values


def collate_namedtuples(batch: Sequence[Any], ctx: CollateContext) -> Any:
    """namedtuples: the same namedtuple type, each field collated."""
    elem = batch[0]
    fields = []
    for name, samples in zip(elem._fields, zip(*batch)):  # one frame per level (ctx.enter)
        rule = ctx.enter(samples, f".{name}")
        try:
            fields.append(rule(samples, ctx))
        finally:
            ctx.leave()
    return type(elem)(*fields)


def collate_sequences(batch: Sequence[Any], ctx: CollateContext) -> Any:
    """Sequences: transposed and collated position by position; tuples become lists (torch)."""
    try:
        sizes = set(map(len, batch))
    except TypeError as error:  # an entry with no len() (a number): torch's words, then which
        name_field(error, batch, ctx)
        raise
    if len(sizes) > 1:
        _raise_unequal_lengths(batch, ctx)
    collated = []
    for i, samples in enumerate(zip(*batch)):  # one frame per level (ctx.enter)
        rule = ctx.enter(samples, f"[{i}]")
        try:
            collated.append(rule(samples, ctx))
        finally:
            ctx.leave()
    return rebuild_sequence(batch[0], collated)


def rebuild_sequence(template: Sequence[Any], values: list[Any]) -> Any:
    """A sequence like ``template`` holding ``values`` (one per item), rebuilt as torch does.

    Tuples (namedtuples are not meant for this) become ``values`` itself, a list: torch's
    "Backwards compatibility". Mutable sequences are cloned (``copy.copy``) and filled item by
    item; others are made as ``type(template)(values)``; if either raises TypeError (no
    copy()/``__setitem__``, or no ``__init__(iterable)``, e.g. range), ``values`` itself. A plain
    list template gives ``values`` at once, as a tuple does (its clone would be equal).
    """
    if type(template) is list or isinstance(template, tuple):
        return values
    try:
        if isinstance(template, MutableSequence):
            clone = copy.copy(template)
            for i, value in enumerate(values):
                clone[i] = value
            return clone
        return type(template)(values)  # type: ignore[call-arg]
    except TypeError:
        return values


def _raise_unequal_lengths(batch: Sequence[Any], ctx: CollateContext) -> None:
    first = len(batch[0])
    index, other = next((i, len(s)) for i, s in enumerate(batch) if len(s) != first)
    raise RuntimeError(
        f"{_UNEQUAL_LENGTH_MESSAGE} (at {ctx.path}: entry 0 has {first} items, "
        f"entry {index} has {other})"
    )
