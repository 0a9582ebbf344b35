"""The descriptor codec: a batch's structure pickled, its arrays replaced by slot records.

This is how ``torch.save`` writes a checkpoint: a pickler whose ``persistent_id`` turns every
array into a small record, and an unpickler whose ``persistent_load`` turns each record back into
memory. Here the memory is the task's slot:

- worker (``encode``): an ndarray or CPU torch tensor that already lives in the slot (collate wrote
  it there through the allocator) becomes ``("a", offset, dtype, shape, strides)`` or
  ``("t", offset, nbytes, dtype_name, shape)`` (``("v", ...)`` with its strides for a
  non-contiguous tensor: ``torch_views.strided_record``); one that lives elsewhere (a user's
  collate_fn made it) is first copied into the slot, once, in the layout the main process would
  have it. Strings, numbers and small objects travel inline.
- main (``decode``): each record is validated against the slot's bounds, then becomes a numpy view
  of the lease buffer (a torch tensor through ``torch.from_numpy`` for ``"t"``, whose storage also
  holds the lease across ``share_memory_()``: ``torch_views.py``), so every view keeps the lease
  alive. Nothing is copied.

Object arrays, tensor subclasses, non-CPU, sparse, nested and quantized tensors are pickled inline
(by value).

Classes and functions of the main script travel by name, as pickle and torch's loader send them.
Under spawn and forkserver the worker spec is cloudpickled, so in a worker such a class is a copy
that ``__main__`` (the re-imported script, or none) does not hold, and plain pickle refuses it
("not the same object as __main__.Pair"). Then, once per worker process, the batch is described
again by an encoder that writes ``("m", qualname)`` for every class and function whose module is
``__main__``, and the main process's decoder returns its own ``__main__.<qualname>`` — its class,
untouched (cloudpickle would send the class by value, and loading that overwrites the main
class's attributes and methods with the worker's copies on every batch): ``transport/main_names.py``.
The retry starts from the slot position the first try started from, so it places and shares arrays
exactly as one try.

The common case — a list or tuple of plain ndarrays that collate already wrote into the slot — takes
a flat form instead, a tuple with no pickle (``transport/flat.py``). ``encode`` returns either
form; ``decode`` takes either.
"""

from __future__ import annotations

import io
import pickle
import sys
import types
from typing import Any, Callable, TypeVar

import numpy as np

from shmloader.collate.context import SlotFull
from shmloader.errors import DescriptorError
from shmloader.transport.alloc import SlotAllocator, align_up
from shmloader.transport.flat import Flat, describe_flat, extent, flat_views
from shmloader.transport.main_names import main_object, main_ref
from shmloader.transport.torch_views import (
    HeapCopies,
    copy_bytes,
    fresh_strides,
    leased_tensor,
    strided_record,
    strided_tensor,
    torch_dtype,
)

PROTOCOL = 5

_BY_NAME_ERRORS = (pickle.PicklingError, AttributeError)
"""What plain pickle raises for a class or function it cannot find under its name in this process."""

_NAMEABLE = (type, types.FunctionType)

_by_name = False
"""This process's batches name the main script's classes (``_Naming*``): set, for the rest of the
process's life, by the first batch that plain pickle refused and the naming encoder described."""

_T = TypeVar("_T")


def _torch_tensor_type() -> Any:
    torch = sys.modules.get("torch")
    return None if torch is None else torch.Tensor


def _is_plain_cpu_tensor(obj: Any, tensor_type: Any) -> bool:
    """Whether a tensor is one block of CPU memory that a slot record describes (else: inline).

    Nested tensors (of strided layout) and quantized ones are not: neither has plain sizes and
    bytes to copy into the slot, so they are pickled inline as torch pickles them.
    """
    return (
        type(obj) is tensor_type
        and obj.device.type == "cpu"
        and obj.layout is sys.modules["torch"].strided
        and not obj.requires_grad
        and not obj.is_nested
        and not obj.is_quantized
    )


class _Encoder(pickle.Pickler):
    def __init__(self, file: io.BytesIO, alloc: SlotAllocator) -> None:
        super().__init__(file, protocol=PROTOCOL)
        self.alloc = alloc
        self.tensor_type = _torch_tensor_type()
        self.nbytes = 0
        self._records: dict[int, int] = {}  # id of an array or tensor described -> its record's number
        # ... and the object itself, kept alive to the end of the dump: an array an object's
        # __getstate__ made would otherwise die once pickled, and the next one could take its id
        self._described: list[Any] = []
        self._copies = HeapCopies(alloc)

    def persistent_id(self, obj: Any) -> Any:
        number = self._records.get(id(obj))
        if number is not None:  # the same object again (``{"input": x, "target": x}``): one copy, one
            return ("=", number)  # object in the main process, as pickle's memo gives torch's loader
        record: tuple | None = None
        if type(obj) is np.ndarray:
            record = None if obj.dtype.hasobject else self._array(obj)
        elif self.tensor_type is not None and _is_plain_cpu_tensor(obj, self.tensor_type):
            record = self._tensor(obj)
        if record is not None:
            self._records[id(obj)] = len(self._described)
            self._described.append(obj)
        return record

    def _array(self, arr: np.ndarray) -> tuple:
        if not arr.size:  # no bytes to place: its own strides (numpy 2 gives a fresh one 0s), not a copy's
            return ("a", 0, arr.dtype, arr.shape, arr.strides)
        self.nbytes += arr.nbytes
        address = arr.__array_interface__["data"][0]
        lo, hi = extent(arr.shape, arr.strides, arr.itemsize)
        offset = self.alloc.offset_of(address + lo, hi - lo)
        if offset is None:
            dst = self._copy_target(arr)
            if arr.dtype.fields is None:
                np.copyto(dst, arr, casting="no")
            else:  # byte for byte: a field-wise copy leaves the padding as the slot had it (another batch's)
                whole = np.dtype((np.void, arr.itemsize))
                np.copyto(dst.view(whole), arr.view(whole))
            offset = dst.__array_interface__["data"][0] - self.alloc.base_address
            return ("a", offset, dst.dtype, dst.shape, dst.strides)
        return ("a", offset - lo, arr.dtype, arr.shape, arr.strides)

    def _copy_target(self, arr: np.ndarray) -> np.ndarray:
        """Slot memory for a copy of ``arr`` in the order pickle keeps (so torch's workers and the
        main process have it): Fortran for a Fortran-ordered array, else C."""
        if arr.flags.f_contiguous and not arr.flags.c_contiguous:
            return self.alloc(arr.shape[::-1], arr.dtype).T
        return self.alloc(arr.shape, arr.dtype)

    def _tensor(self, t: Any) -> tuple:
        nbytes = t.numel() * t.element_size()
        self.nbytes += nbytes
        shape = tuple(t.shape)
        if not t.is_contiguous() or t.is_conj() or t.is_neg() or (  # a lazy view's storage holds other values
                (0 in shape or 1 in shape) and t.stride() != fresh_strides(shape)):  # strides torch's workers keep
            return strided_record(t, self.alloc, self._copies)
        offset = self.alloc.offset_of(t.data_ptr(), nbytes) if nbytes else 0
        if offset is None:
            offset = self._copies.place(t, nbytes)
        return ("t", offset, nbytes, str(t.dtype), shape)


class _NamingEncoder(_Encoder):
    """``_Encoder`` that also describes a class or function of the main script by its name.

    Its ``persistent_id`` is ``_Encoder``'s, one test added, written out again: calling that one
    (``super()``) for each of the 50-odd objects of a small batch added 10 µs to its 26, this 2.
    A batch without such a class gives the same descriptor as ``_Encoder`` (tests/test_codec.py).
    """

    def persistent_id(self, obj: Any) -> Any:
        number = self._records.get(id(obj))
        if number is not None:
            return ("=", number)
        record: tuple | None = None
        if type(obj) is np.ndarray:
            record = None if obj.dtype.hasobject else self._array(obj)
        elif self.tensor_type is not None and _is_plain_cpu_tensor(obj, self.tensor_type):
            record = self._tensor(obj)
        elif isinstance(obj, _NAMEABLE):
            return main_ref(obj)
        if record is not None:
            self._records[id(obj)] = len(self._described)
            self._described.append(obj)
        return record


def encode(batch: Any, alloc: SlotAllocator) -> tuple[bytes | Flat, int]:
    """Describe ``batch``, its arrays placed in the slot; returns (descriptor, array bytes): a
    ``Flat`` tuple for a list/tuple of in-slot arrays, else a pickle with a record per array.

    May raise ``SlotFull`` when arrays must be copied into a slot too small for them.
    """
    flat = describe_flat(batch, alloc)
    if flat is not None:
        return flat
    if _by_name:
        return _encode_with(_NamingEncoder, batch, alloc)
    start = alloc.pos
    try:
        return _encode_with(_Encoder, batch, alloc)
    except _BY_NAME_ERRORS:
        alloc.pos = start  # the copies the failed try made are given back: the retry places them again
        described = _retry(_encode_with, _NamingEncoder, batch, alloc)
        if described is None:
            raise  # named, it fails too: the first error, as it was
        return described


def _encode_with(encoder: type[_Encoder], batch: Any, alloc: SlotAllocator) -> tuple[bytes, int]:
    buf = io.BytesIO()
    enc = encoder(buf, alloc)
    enc.dump(batch)
    return buf.getvalue(), enc.nbytes


def _retry(describe: Callable[..., _T], *args: Any) -> _T | None:
    """The second try at a batch that plain pickle refused, naming the main script's classes; when
    it succeeds, this process names them from now on (``_by_name``). None when it fails too;
    ``SlotFull`` propagates (the batch needs a larger slot: measured, then tried again)."""
    global _by_name
    try:
        result = describe(*args)
    except SlotFull:
        raise
    except Exception:
        return None
    _by_name = True
    return result


class _Measurer(pickle.Pickler):
    def __init__(self, file: io.BytesIO) -> None:
        super().__init__(file, protocol=PROTOCOL)
        self.tensor_type = _torch_tensor_type()
        self.total = 0
        self._seen: set[int] = set()  # an object the batch holds twice is copied once (``_Encoder``)
        self._measured: list[Any] = []  # ... each kept alive, so that no other takes its id (``_Encoder``)

    def persistent_id(self, obj: Any) -> Any:
        if id(obj) in self._seen:
            return 0
        if type(obj) is np.ndarray and not obj.dtype.hasobject:
            self._seen.add(id(obj))
            self._measured.append(obj)
            self.total = align_up(self.total) + obj.nbytes
            return 0
        if self.tensor_type is not None and _is_plain_cpu_tensor(obj, self.tensor_type):
            self._seen.add(id(obj))
            self._measured.append(obj)
            self.total = align_up(self.total) + copy_bytes(obj)
            return 0
        return None


class _NamingMeasurer(_Measurer):
    """``_Measurer`` that lets a class or function of the main script pass, as ``_NamingEncoder`` names it."""

    def persistent_id(self, obj: Any) -> Any:
        pid = super().persistent_id(obj)
        if pid is None and isinstance(obj, _NAMEABLE) and main_ref(obj) is not None:
            return 0
        return pid


def measure(batch: Any) -> int:
    """The slot bytes ``encode`` needs to copy every array of ``batch`` into an empty slot."""
    if _by_name:
        return _measure_with(_NamingMeasurer, batch)
    try:
        return _measure_with(_Measurer, batch)
    except _BY_NAME_ERRORS:
        total = _retry(_measure_with, _NamingMeasurer, batch)
        if total is None:
            raise
        return total


def _measure_with(measurer: type[_Measurer], batch: Any) -> int:
    m = measurer(io.BytesIO())
    m.dump(batch)
    return m.total


class _Decoder(pickle.Unpickler):
    def __init__(self, file: io.BytesIO, buf: Any, size_bytes: int) -> None:
        super().__init__(file)
        self.buf = buf
        self.size_bytes = size_bytes
        self.views = 0
        self._made: list[Any] = []  # the arrays and tensors made so far, in record order

    def persistent_load(self, record: Any) -> Any:
        kind = record[0] if isinstance(record, tuple) and record else None
        if kind == "=":
            return self._again(record)
        if kind == "m":
            return main_object(record)
        if kind == "a":
            _, offset, dtype, shape, strides = record
            self._check(offset, *extent(shape, strides, np.dtype(dtype).itemsize))
            made: Any = np.ndarray(shape, dtype=dtype, buffer=self.buf, offset=offset, strides=strides)
        elif kind == "t":
            _, offset, nbytes, dtype_name, shape = record
            self._check(offset, 0, nbytes)
            u8: np.ndarray = np.ndarray((nbytes,), dtype=np.uint8, buffer=self.buf, offset=offset)
            made = leased_tensor(u8, torch_dtype(dtype_name), tuple(shape), self.buf)  # share_memory_ keeps it
        elif kind == "v":
            _, offset, span, dtype_name, shape, strides, conj, neg = record
            self._check(offset, 0, span)
            u8 = np.ndarray((span,), dtype=np.uint8, buffer=self.buf, offset=offset)
            made = strided_tensor(u8, torch_dtype(dtype_name), tuple(shape), tuple(strides), conj, neg, self.buf)
        else:
            raise DescriptorError(f"unknown record in descriptor: {record!r}")
        self.views += 1
        self._made.append(made)
        return made

    def _again(self, record: tuple) -> Any:
        """An object described earlier in the same descriptor (``("=", its record's number)``)."""
        number = record[1] if len(record) == 2 else None
        if type(number) is not int or not 0 <= number < len(self._made):
            raise DescriptorError(f"descriptor record {record!r} names no earlier array; nothing was viewed")
        return self._made[number]

    def _check(self, offset: int, lo: int, hi: int) -> None:
        if offset + lo < 0 or offset + hi > self.size_bytes:
            raise DescriptorError(
                f"descriptor region [{offset + lo}, {offset + hi}) lies outside the slot of "
                f"{self.size_bytes} bytes; no view was made"
            )


def decode(payload: bytes | Flat, buf: Any, size_bytes: int) -> tuple[Any, int]:
    """Rebuild a batch as views of ``buf`` (a lease buffer); returns (batch, number of views)."""
    if type(payload) is tuple:
        return flat_views(payload, buf, size_bytes)
    if not isinstance(payload, bytes):
        raise DescriptorError(f"a descriptor is bytes or a flat tuple, not {type(payload).__name__}")
    dec = _Decoder(io.BytesIO(payload), buf, size_bytes)
    return dec.load(), dec.views
