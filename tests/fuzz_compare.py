"""Compare what shmloader's loaders gave a fuzz case with what torch's DataLoader gave.

``compare(case, ours, theirs, flavour)`` raises AssertionError on the first difference:

- an error torch raised must be raised by ours too, of the same class or a subclass, at the same
  point (construction; ``len``; the epoch, after the same batches);
- ``len(loader)``, the number of batches and every batch must be equal: for ``"torch"``
  (``shmloader.torch.DataLoader``) exactly, types included; for ``"numpy"``
  (``shmloader.DataLoader``) after :func:`numpy_expected` turns torch's batch into what the numpy
  flavour promises (docs/index.md: "numpy in, numpy out; tensors in, tensors out");
- with workers and ``in_order=False`` the batches of an epoch are compared as a multiset.

The numpy flavour's documented differences from torch are in :func:`numpy_may_differ`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
from fuzz_cases import Case, Outcome
from fuzz_samples import has_leaf
from parity_helpers import assert_same_structure

__all__ = ["compare", "numpy_expected", "numpy_may_differ"]


def compare(case: Case, ours: Outcome, theirs: Outcome, flavour: str) -> None:
    """Assert ``ours`` is what torch's ``theirs`` promises for ``flavour`` ("torch" or "numpy")."""
    if theirs.error_at == "construct":
        _same_error(ours.error, theirs.error, "construction")
        return
    if ours.error_at == "construct" and _documented_early(case):
        _same_error(ours.error, theirs.epochs[0][1], "construction (torch: the first epoch)")
        return
    assert ours.error_at is None, f"ours raised {ours.error} at construction, torch did not"
    if isinstance(theirs.length, type):
        assert isinstance(ours.length, type), f"len(loader): ours {ours.length}, torch raised {theirs.length}"
        _same_error(ours.length, theirs.length, "len(loader)")
    else:
        assert ours.length == theirs.length, f"len(loader): ours {ours.length}, torch {theirs.length}"
    assert len(ours.epochs) == len(theirs.epochs)
    for epoch, (mine, their) in enumerate(zip(ours.epochs, theirs.epochs)):
        _compare_epoch(case, mine, their, flavour, epoch)


def _compare_epoch(case: Case, ours: tuple[list[Any], type | None], theirs: tuple[list[Any], type | None],
                   flavour: str, epoch: int) -> None:
    (our_batches, our_error), (their_batches, their_error) = ours, theirs
    if flavour == "numpy" and their_error is not None and numpy_may_differ(case):
        return
    where = f"epoch {epoch}"
    if their_error is not None:
        _same_error(our_error, _documented_error(case, their_error), where)
    else:
        assert our_error is None, f"{where}: ours raised {our_error.__name__}, torch raised nothing"
    unordered = not case.options.get("in_order", True) and case.options.get("num_workers", 0) > 0
    if unordered and their_error is not None:
        return  # which batches came before the error depends on timing
    assert len(our_batches) == len(their_batches), (
        f"{where}: {len(our_batches)} batches, torch gave {len(their_batches)}"
    )
    if flavour == "numpy":
        expected = [numpy_expected(b, case) for b in their_batches]
        our_batches = [mask_mixed(b, case) for b in our_batches]
    else:
        expected = their_batches
    if unordered:
        our_batches = sorted(our_batches, key=fingerprint)
        expected = sorted(expected, key=fingerprint)
    for i, (mine, their) in enumerate(zip(our_batches, expected)):
        assert_same_structure(mine, their, f"{where} batch {i}")


def _documented_early(case: Case) -> bool:
    """Whether ours refuses at construction what torch refuses at ``iter()``: ``prefetch_factor=0``
    with workers, "refused before any worker starts" (docs/errors.md), torch's AssertionError."""
    return case.options.get("prefetch_factor") == 0 and bool(case.options.get("num_workers"))


def _documented_error(case: Case, theirs: type) -> type | tuple[type, ...]:
    """The error torch raised, or the one shmloader documents instead: a worker's exception that
    cannot be rebuilt from one message comes back "as its nearest base class that can be"
    (docs/reliability.md), where torch's workers raise a RuntimeError."""
    if theirs is RuntimeError and "'TwoArgError'" in repr(case.recipe) and case.options.get("num_workers"):
        return (RuntimeError, ValueError)  # ValueError: TwoArgError's nearest base that takes one message
    return theirs


def _same_error(ours: type | None, theirs: type | tuple[type, ...] | None, where: str) -> None:
    assert ours is not None, f"{where}: torch raised {theirs}, ours did not"
    assert theirs is not None and issubclass(ours, theirs), f"{where}: ours raised {ours.__name__}, torch raised {theirs}"


# ------------------------------------------------------------------------------ numpy flavour


def numpy_may_differ(case: Case) -> bool:
    """Whether torch's collate error may be a batch in the numpy flavour, which collates every
    numpy type and Python complex numbers (shmloader/collate/rules.py, ``collate_complex``: "torch's
    default_collate rejects them"; numpy's uint64 scalars, which torch cannot make a tensor of)."""
    if case.collate is not None:
        return False
    return has_leaf(case.recipe, {"complex", "mixed"}) or "'uint64'" in repr(case.recipe)


def numpy_expected(theirs: Any, case: Case) -> Any:
    """torch's batch as the numpy flavour returns it: what torch made a tensor of, from a numpy
    array, numpy scalar or Python number, is the numpy array (batched) or the sample's own value
    (``batch_size=None``: default_convert leaves every leaf as it is, shmloader/collate
    ``default_convert``); tensors, strings and a custom collate_fn's results are torch's."""
    if case.collate is not None:
        return theirs
    batched = case.options.get("batch_size", 1) is not None or case.batch_sampler is not None
    return mask_mixed(_project(theirs, case.recipe, batched), case)


def mask_mixed(batch: Any, case: Case) -> Any:
    """The numpy flavour's batch with each ``mixed`` leaf (samples of different types) as None:
    numpy promotes mixed types by its own rules (``np.result_type``), torch by its own, and the
    numpy flavour promises numpy's."""
    if case.collate is not None or not has_leaf(case.recipe, {"mixed"}):
        return batch
    return _mask(batch, case.recipe)


def _mask(batch: Any, recipe: tuple) -> Any:
    kind = recipe[0]
    if kind == "leaf":
        return None if recipe[1] == "mixed" else batch
    if kind in ("dict", "odict", "record"):
        children = dict(recipe[1])
        return type(batch)((key, _mask(value, children[key])) for key, value in batch.items())
    values = [_mask(value, child) for value, child in zip(batch, recipe[1])]
    return type(batch)(*values) if kind == "nt" else type(batch)(values)


def _project(theirs: Any, recipe: tuple, batched: bool) -> Any:
    kind = recipe[0]
    if kind == "leaf":
        return _project_leaf(theirs, recipe[1], batched)
    if kind in ("dict", "odict", "record"):
        assert isinstance(theirs, Mapping)
        children = dict(recipe[1])
        rebuild: Any = type(theirs)  # the mapping's own class, as collate rebuilds it
        return rebuild((key, _project(value, children[key], batched)) for key, value in theirs.items())
    values = [_project(value, child, batched) for value, child in zip(theirs, recipe[1])]
    return type(theirs)(*values) if kind == "nt" else type(theirs)(values)


def _project_leaf(theirs: Any, kind: str, batched: bool) -> Any:
    import torch

    if kind == "rand":  # [random.random(), np.random.random_sample(), torch.rand(())]
        first, second, third = theirs
        # np.random.random_sample() is a Python float: batched, both floats are float64 arrays
        return type(theirs)([first.numpy(), second.numpy(), third]) if batched else theirs
    if kind == "varlen_list":  # batched: one tensor per position, if the lengths were equal
        return type(theirs)(_project_leaf(value, "int", batched) for value in theirs)
    if kind in ("tensor", "str", "bytes", "none") or not isinstance(theirs, torch.Tensor):
        return theirs
    if kind == "npscalar" and not batched:
        return theirs.numpy()[()]
    return theirs.numpy()


def fingerprint(batch: Any) -> str:
    """A string equal for equal batches (types, dtypes, shapes, values): the sort key of a multiset."""
    import torch

    if isinstance(batch, torch.Tensor):
        return f"T({batch.dtype},{tuple(batch.shape)},{batch.tolist()})"
    if isinstance(batch, np.ndarray):
        return f"A({batch.dtype},{batch.shape},{batch.tolist()})"
    if isinstance(batch, Mapping):
        return f"{type(batch).__name__}{{" + ",".join(f"{k!r}:{fingerprint(v)}" for k, v in batch.items()) + "}"
    if isinstance(batch, (list, tuple)):
        return f"{type(batch).__name__}[" + ",".join(fingerprint(v) for v in batch) + "]"
    return f"{type(batch).__name__}:{batch!r}"
