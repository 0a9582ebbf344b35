"""Helpers for the torch parity tests: compare two batches recursively, two failures, two loaders.

``assert_same_structure(ours, theirs)`` passes only if both have the same container types (at
every level), the same keys and lengths, and leaves equal in type, dtype, shape and value (NaN
equal to NaN). ``assert_same_outcome(dataset, **kwargs)`` runs torch's ``DataLoader`` and
``shmloader.torch.DataLoader`` over one dataset and compares every batch, or the error's type.
``torch_raises(loader, error)`` asserts torch's loader raises by its first batch, then stops its workers.
Importing this module does not import torch.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

__all__ = ["ListDataset", "assert_same_error", "assert_same_outcome", "assert_same_structure", "outcome",
           "stop_torch_workers", "torch_raises"]


def assert_same_structure(ours: Any, theirs: Any, path: str = "batch") -> None:
    """Assert ``ours`` equals ``theirs`` in structure, container types, dtypes, shapes, values."""
    assert type(ours) is type(theirs), (
        f"{path}: type {type(ours).__name__} != {type(theirs).__name__}"
    )
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(theirs, torch.Tensor):
        _assert_same_tensor(ours, theirs, path, torch)
    elif isinstance(theirs, np.ndarray):
        _assert_same_array(ours, theirs, path)
    elif isinstance(theirs, Mapping):
        keys = list(theirs.keys())
        assert list(ours.keys()) == keys, f"{path}: keys {list(ours)} != {keys}"
        for key in theirs:
            assert_same_structure(ours[key], theirs[key], f"{path}[{key!r}]")
    elif isinstance(theirs, Sequence) and not isinstance(theirs, (str, bytes, range)):
        assert len(ours) == len(theirs), f"{path}: length {len(ours)} != {len(theirs)}"
        for i, (a, b) in enumerate(zip(ours, theirs)):
            assert_same_structure(a, b, f"{path}[{i}]")
    elif isinstance(theirs, float) and theirs != theirs:
        assert ours != ours, f"{path}: {ours!r} != nan"
    else:
        assert ours == theirs, f"{path}: {ours!r} != {theirs!r}"
    _assert_same_extra_state(ours, theirs, path)


def _assert_same_tensor(ours: Any, theirs: Any, path: str, torch: Any) -> None:
    assert ours.dtype == theirs.dtype, f"{path}: dtype {ours.dtype} != {theirs.dtype}"
    assert ours.shape == theirs.shape, f"{path}: shape {tuple(ours.shape)} != {tuple(theirs.shape)}"
    assert ours.device == theirs.device, f"{path}: device {ours.device} != {theirs.device}"
    assert ours.requires_grad == theirs.requires_grad, f"{path}: requires_grad differs"
    if theirs.dtype.is_floating_point or theirs.dtype.is_complex:
        same = torch.equal(ours.isnan(), theirs.isnan()) and torch.equal(
            ours.nan_to_num(0.0), theirs.nan_to_num(0.0)
        )
    else:
        same = torch.equal(ours, theirs)
    assert same, f"{path}: values differ:\n{ours}\n!=\n{theirs}"


def _assert_same_array(ours: np.ndarray, theirs: np.ndarray, path: str) -> None:
    assert ours.dtype == theirs.dtype, f"{path}: dtype {ours.dtype} != {theirs.dtype}"
    assert ours.shape == theirs.shape, f"{path}: shape {ours.shape} != {theirs.shape}"
    equal_nan = ours.dtype.kind in "fc"
    assert np.array_equal(ours, theirs, equal_nan=equal_nan), f"{path}: values differ"


def _assert_same_extra_state(ours: Any, theirs: Any, path: str) -> None:
    """Custom containers may carry public attributes (torch clones them); those must match too."""
    if not isinstance(theirs, (Mapping, list)) or not hasattr(theirs, "__dict__"):
        return
    state_ours = {k: v for k, v in vars(ours).items() if not k.startswith("_")}
    state_theirs = {k: v for k, v in vars(theirs).items() if not k.startswith("_")}
    if state_theirs or state_ours:
        assert state_ours == state_theirs, f"{path}: attributes {state_ours} != {state_theirs}"


def assert_same_error(ours: Callable[[], Any], theirs: Callable[[], Any]) -> BaseException:
    """Assert both calls raise the same exception type and that ours starts with torch's words."""
    their_error = _raised(theirs)
    our_error = _raised(ours)
    assert their_error is not None, "torch did not raise"
    assert our_error is not None, f"torch raised {their_error!r} but ours did not"
    assert type(our_error) is type(their_error) or isinstance(our_error, type(their_error)), (
        f"ours raised {type(our_error).__name__}: {our_error}; "
        f"torch raised {type(their_error).__name__}: {their_error}"
    )
    assert str(our_error).startswith(_first_words(their_error)), (
        f"message {str(our_error)!r} does not start as torch's {str(their_error)!r}"
    )
    return our_error


def _raised(fn: Callable[[], Any]) -> BaseException | None:
    try:
        fn()
    except Exception as error:  # noqa: BLE001  (the point is to capture any error)
        return error
    return None


def _first_words(error: BaseException) -> str:
    """torch's message up to its first detail (sizes, indices): what users grep for."""
    text = str(error)
    for stop in (", but got", " at entry", "; found"):
        if stop in text:
            return text[: text.index(stop)]
    return text[:40]


class ListDataset:
    """The samples given, as a map-style dataset (torch's loaders take any ``__getitem__``/``__len__``)."""

    def __init__(self, samples: list[Any]) -> None:
        self.samples = samples

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i: int) -> Any:
        return self.samples[i]


def outcome(loader_cls: type, dataset: Any, each: Callable[[Any], Any] | None = None, **kwargs: Any) -> Any:
    """Every batch the loader yields (``each(batch)`` if given, taken while iterating), or the type
    of the error it raises; the loader is then closed (torch's, which has no ``close``, has its
    iterator's workers stopped)."""
    loader = loader_cls(dataset, **kwargs)
    it = None
    try:
        it = iter(loader)
        return [batch if each is None else each(batch) for batch in it]
    except Exception as error:  # noqa: BLE001  (the outcome compared is the error's type)
        return type(error)
    finally:
        if hasattr(loader, "close"):
            loader.close()
        else:
            stop_torch_workers(it)


def stop_torch_workers(it: Any) -> None:
    """Stop the workers of torch's iterator ``it`` now. An iterator that raised sits in a reference
    cycle with its traceback; collected later, it would find its queues' feeder threads already
    finalized, so its ``None`` to each worker is never sent and each join waits out its 5 s."""
    if it is not None and hasattr(it, "_shutdown_workers"):
        it._shutdown_workers()


def assert_same_outcome(dataset: Any, **kwargs: Any) -> Any:
    """Assert torch's loader and ours yield the same batches (or raise the same type); return them."""
    from torch.utils import data as tdata  # noqa: PLC0415  (importing this module must not import torch)

    import shmloader.torch as st  # noqa: PLC0415

    theirs = outcome(tdata.DataLoader, dataset, **kwargs)
    ours = outcome(st.DataLoader, dataset, **kwargs)
    if isinstance(theirs, type):
        assert ours is theirs
    else:
        assert_same_structure(ours, theirs, path="batches")
    return theirs


def torch_raises(loader: Any, error: type[BaseException]) -> None:
    """Assert torch's ``loader`` raises ``error`` by its first batch; its workers are then stopped here
    (an iterator that raised keeps them until it is collected)."""
    import pytest

    it = None
    try:
        with pytest.raises(error):
            it = iter(loader)
            next(it)
    finally:
        stop_torch_workers(it)
