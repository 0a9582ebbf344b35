"""A batch whose samples are of different kinds (a number and None, a dict and a tuple): the error
keeps its type and first words, and names the first entry whose type is not entry 0's, and both
types, in either flavour.

torch's ``default_collate`` raises for these with words that name no sample: ``TypeError: tuple
indices must be integers or slices, not str`` for ``[dict, tuple]``, ``TypeError: object of type
'int' has no len()`` for ``[tuple, int]``, ``RuntimeError: Could not infer dtype of NoneType`` for
``[numpy.float32, None]``. The torch flavour raises torch's type with torch's words first; the numpy
flavour (which makes arrays, not tensors) raises TypeError. Before, the numpy flavour named neither
the entry nor the types for these, or raised numpy's ValueError ("inhomogeneous shape") for
``[int, tuple]``, where torch raises TypeError.
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np
import pytest

import shmloader
from shmloader.collate import collate

CASES: list[tuple[str, list[Any], str, str]] = [
    # (name, batch, the numpy flavour's first words, the entries named)
    ("dict_tuple", [{"a": 1}, (1, 2)], "tuple indices must be integers or slices, not str",
     "entry 0 is a dict, entry 1 a tuple"),
    ("dict_list", [{"a": 1}, [1]], "list indices must be integers or slices, not str",
     "entry 0 is a dict, entry 1 a list"),
    ("dict_dict_tuple", [{"a": 1}, {"a": 2}, (1, 2)], "tuple indices must be integers or slices, not str",
     "entry 0 is a dict, entry 2 a tuple"),
    ("dict_int", [{"a": 1}, 5], "'int' object is not subscriptable", "entry 0 is a dict, entry 1 a int"),
    ("tuple_int", [(1,), 1], "object of type 'int' has no len()", "entry 0 is a tuple, entry 1 a int"),
    ("int_tuple", [1, (1,)], "cannot collate ints into one array", "entry 0 is a int, entry 1 a tuple"),
    ("npfloat_none", [np.float32(1), None],
     "default_collate: batch must contain tensors, numpy arrays, numbers, dicts or lists; found <class 'NoneType'>",
     "entry 0 is a numpy.float32, entry 1 a NoneType"),
    ("array_none", [np.zeros(2), None],
     "default_collate: batch must contain tensors, numpy arrays, numbers, dicts or lists; found object",
     "entry 0 is a numpy.ndarray, entry 1 a NoneType"),
    ("none_int", [None, 1],
     "default_collate: batch must contain tensors, numpy arrays, numbers, dicts or lists; found <class 'NoneType'>",
     "entry 0 is a NoneType, entry 1 a int"),
    ("int_none", [1, None], "cannot collate ints into one array", "entry 0 is a int, entry 1 a NoneType"),
]


def _error(fn: Any) -> BaseException:
    with pytest.raises(Exception) as info:
        fn()
    return info.value


@pytest.mark.parametrize(("name", "batch", "words", "entries"), CASES, ids=[c[0] for c in CASES])
def test_the_numpy_flavour_names_the_entries_and_their_types(name: str, batch: list[Any], words: str,
                                                             entries: str) -> None:
    error = _error(lambda: collate(batch))
    assert type(error) is TypeError
    assert str(error).startswith(words)
    assert str(error).endswith(f"(at batch: {entries})")


def test_a_nested_field_is_named_with_its_entries() -> None:
    error = _error(lambda: collate([{"v": {"a": 1}}, {"v": (1, 2)}]))
    assert type(error) is TypeError
    assert str(error) == "tuple indices must be integers or slices, not str (at batch['v']: entry 0 is a dict, entry 1 a tuple)"


@pytest.mark.timeout(60)
def test_a_workers_error_carries_the_entries_and_the_sample_indices() -> None:
    loader: shmloader.DataLoader[Any] = shmloader.DataLoader([{"a": 1}, (1, 2)], batch_size=2, num_workers=1)
    try:
        error = _error(lambda: next(iter(loader)))
    finally:
        loader.close()
    assert type(error) is TypeError
    assert re.search(r"sample indices \[0\.\.1\]|sample indices \[0, 1\]", str(error)), str(error)
    assert "(at batch: entry 0 is a dict, entry 1 a tuple)" in str(error)


torch = pytest.importorskip("torch")
from torch.utils.data import default_collate as torch_collate  # noqa: E402


@pytest.mark.parametrize(("name", "batch", "words", "entries"), CASES, ids=[c[0] for c in CASES])
def test_the_torch_flavour_raises_torchs_type_and_words_then_the_entries(name: str, batch: list[Any], words: str,
                                                                         entries: str) -> None:
    theirs = _error(lambda: torch_collate(batch))
    ours = _error(lambda: collate(batch, to_torch=True))
    assert type(ours) is type(theirs)
    assert str(ours).startswith(str(theirs))
    assert str(ours).endswith(f": {entries})")
