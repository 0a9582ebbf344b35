"""Sample types the other parity tests leave out, through ``shmloader.torch.DataLoader`` and torch's
own, with ``num_workers=0`` and 2, batched and with ``batch_size=None`` (``default_convert``): the
batches the main process receives are equal in type, dtype, shape and value.

One dataset holds them all, one field each (float8 kinds, complex32, uint16/32/64 and bfloat16
tensors, channels_last and expanded tensors, float16/complex/bool/0-d/Fortran/read-only/masked/
broadcast numpy arrays, numpy strings, ints mixed with numpy ints, NaN and inf, namedtuples with
defaults, OrderedDict, defaultdict, range, nested containers of tensors and arrays), so each
configuration starts its workers once."""

from __future__ import annotations

import collections
import copy
from typing import Any, NamedTuple

import numpy as np
import pytest
from parity_helpers import ListDataset, assert_same_structure, outcome

torch = pytest.importorskip("torch")
from torch.utils import data as tdata  # noqa: E402

import shmloader.torch as st  # noqa: E402

pytestmark = [
    pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning"),
    pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental:UserWarning"),
    pytest.mark.filterwarnings("ignore:The given NumPy array is not writable:UserWarning"),
]


class WithDefaults(NamedTuple):
    a: int
    b: float = 2.5


def _readonly(i: int) -> np.ndarray:
    array = np.arange(3.0) + i
    array.flags.writeable = False
    return array


FLOAT8 = ["float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz"]


def sample(i: int) -> dict[str, Any]:
    tensors = {name: (torch.arange(3.0) + i).to(getattr(torch, name)) for name in [*FLOAT8, "bfloat16"]}
    return {
        **tensors,
        "complex32": (torch.arange(3.0) + 1j * i).to(torch.complex32),
        "uint16": torch.tensor([i, 65535], dtype=torch.uint16),
        "uint32": torch.tensor([i, 2**32 - 1], dtype=torch.uint32),
        "uint64": torch.tensor([i, 2**63 + 5], dtype=torch.uint64),
        "bool_tensor": torch.tensor([True, i % 2 == 0]),
        "channels_last": (torch.arange(24.0).view(1, 2, 3, 4) + i).contiguous(memory_format=torch.channels_last)[0],
        "expanded": torch.tensor([float(i)]).expand(3),
        "float16": np.arange(3, dtype="f2") + i,
        "complex128": (np.arange(3) + 1j * i).astype("c16"),
        "complex64_scalar": np.complex64(i + 1j),
        "bool_array": np.array([True, i % 2 == 0]),
        "zero_d": np.array(i, dtype="int16"),
        "fortran": np.asfortranarray(np.arange(6.0).reshape(2, 3) + i),
        "readonly": _readonly(i),
        "masked": np.ma.masked_array(np.arange(3.0) + i, mask=[False, True, False]),
        "broadcast": np.broadcast_to(np.float32(i), (3,)),
        "uint64_array": np.arange(3, dtype=np.uint64) + i,
        "np_str": np.str_(f"s{i}"),
        "int_then_np_int64": i if i % 2 == 0 else np.int64(i),
        "nan_inf": [float("nan"), float("inf"), -float("inf"), 1.0][i % 4],
        "defaults": WithDefaults(i),
        "ordered": collections.OrderedDict([("b", i), ("a", float(i))]),
        "default_dict": collections.defaultdict(int, {"k": np.arange(2) + i}),
        "range": range(i, i + 2),
        "nested": {"t": torch.ones(2) * i, "a": [np.arange(2) + i, (i, "s", torch.tensor(i))]},
    }


def as_bytes(batch: Any) -> Any:
    """Tensors of dtypes torch cannot compare as numbers (float8, complex32, uint16+) as their bytes."""
    if isinstance(batch, torch.Tensor):
        if batch.dtype in (*(getattr(torch, n) for n in FLOAT8), torch.complex32, torch.uint16, torch.uint32,
                           torch.uint64):
            return (str(batch.dtype), tuple(batch.shape), batch.contiguous().reshape(-1).view(torch.uint8))
        return batch
    if isinstance(batch, dict):
        converted = copy.copy(batch)  # a defaultdict keeps its factory
        converted.update((key, as_bytes(value)) for key, value in batch.items())
        return converted
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):
        return type(batch)(*(as_bytes(value) for value in batch))
    if isinstance(batch, (list, tuple)):
        return type(batch)(as_bytes(value) for value in batch)
    return batch


@pytest.mark.timeout(90)
@pytest.mark.parametrize("batch_size", [2, None], ids=["batched", "convert"])
@pytest.mark.parametrize("num_workers", [0, 2])
def test_every_type_arrives_as_torchs(num_workers: int, batch_size: int | None) -> None:
    data = ListDataset([sample(i) for i in range(4)])
    kwargs = {"batch_size": batch_size, "num_workers": num_workers}
    theirs = outcome(tdata.DataLoader, data, as_bytes, **kwargs)
    ours = outcome(st.DataLoader, data, as_bytes, **kwargs)
    assert not isinstance(theirs, type), f"torch's loader raised {theirs}"
    assert_same_structure(ours, theirs, "batches")
