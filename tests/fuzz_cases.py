"""Seeded random cases for the differential fuzz of shmloader's loaders against torch's DataLoader.

:func:`make_case` turns a seed into a :class:`Case`: a dataset (map-style or iterable, of a random
sample recipe from :mod:`fuzz_samples`) and loader options drawn over torch's whole signature.
:func:`run` iterates a case through one loader class, two epochs, and records what a user would
see: ``len(loader)``, every batch (deep-copied as it arrives), and the type of any error with
where it came (construction, ``len``, or after how many batches). The same seed always gives the
same case, so a failure reruns from its test id. Objects with state (torch Generators, samplers)
are built afresh for each loader by :func:`loader_kwargs`.
"""

from __future__ import annotations

import copy
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from fuzz_samples import (
    FuzzIterable,
    FuzzIterableLen,
    FuzzMap,
    FuzzMapItems,
    collate_counted,
    collate_identity,
    has_leaf,
    random_recipe,
    worker_init_seed,
)

__all__ = ["Case", "Outcome", "loader_kwargs", "make_case", "run"]

# How often a case breaks one of torch's argument rules on purpose (its error is then compared).
P_BAD_OPTION = 0.06


@dataclass
class Case:
    """One fuzz case: everything needed to build the same loader twice."""

    seed: int
    recipe: tuple
    n: int
    iterable: bool = False
    getitems: bool = False  # the map-style dataset has __getitems__
    shard: bool = False
    with_len: bool = True
    options: dict[str, Any] = field(default_factory=dict)  # plain values, passed as they are
    generator: int | None = None  # seed of the torch.Generator passed as generator=
    sampler: tuple | None = None
    batch_sampler: tuple | None = None
    collate: str | None = None
    worker_init: bool = False
    epochs: int = 1
    stop_after: int | None = None  # the first epoch is left after this many batches

    def describe(self) -> str:
        """One line naming the case's choices, for failure messages."""
        extras = {k: v for k, v in vars(self).items() if k not in ("seed", "recipe") and v not in (None, False)}
        return f"seed={self.seed} recipe={self.recipe} {extras}"


# ------------------------------------------------------------------------------ generation


def make_case(seed: int) -> Case:
    """The case of ``seed``: deterministic."""
    rnd = random.Random(seed)
    case = Case(seed=seed, recipe=random_recipe(rnd), n=rnd.randint(0, 13) if rnd.random() < 0.1 else rnd.randint(1, 13))
    case.iterable = rnd.random() < 0.3
    if case.iterable:
        case.shard, case.with_len = rnd.random() < 0.7, rnd.random() < 0.6
    else:
        case.getitems = rnd.random() < 0.25
    _draw_workers(rnd, case)
    _draw_batching(rnd, case)
    case.collate = rnd.choice([None] * 6 + ["identity", "counted", "torch_default", "torch_convert"])
    case.epochs = 2 if rnd.random() < 0.3 else 1
    if case.epochs == 2 and rnd.random() < 0.4:
        case.stop_after = rnd.randint(0, 2)
    if rnd.random() < 0.4:
        case.generator = rnd.randint(0, 2**31)
    if has_leaf(case.recipe, {"rand"}) and not case.options.get("in_order", True):
        case.options["in_order"] = True  # random draws depend on which worker ran a task
    return case


def _draw_workers(rnd: random.Random, case: Case) -> None:
    options = case.options
    workers = rnd.choice([0, 0, 1, 2, 2])
    options["num_workers"] = workers
    bad = rnd.random() < P_BAD_OPTION
    if workers or bad:
        if rnd.random() < 0.4:
            options["persistent_workers"] = True
        if rnd.random() < 0.4:
            options["prefetch_factor"] = rnd.choice([1, 2, 3] if not bad else [0, 2])
        if rnd.random() < 0.05:
            options["pin_memory"] = True
        if rnd.random() < 0.2:
            # long enough never to fire (a spawn worker on a busy machine takes seconds to start;
            # what each loader does after a timeout differs, and torch's own next epoch breaks)
            options["timeout"] = rnd.choice([60, 90.0] if not bad else [-1, 60])
        if rnd.random() < (0.05 if not bad else 0.5):
            options["multiprocessing_context"] = rnd.choice(["spawn", "fork", "forkserver"])
        elif rnd.random() < 0.2:
            options["multiprocessing_context"] = "fork"
    if rnd.random() < 0.3:
        options["in_order"] = False
    case.worker_init = workers > 0 and rnd.random() < 0.3


def _draw_batching(rnd: random.Random, case: Case) -> None:
    options = case.options
    bad = rnd.random() < P_BAD_OPTION
    choice = rnd.random()
    if choice < 0.15 and not case.iterable:
        case.batch_sampler = _draw_batch_sampler(rnd, case.n)
        if bad:
            options[rnd.choice(["batch_size", "shuffle", "drop_last"])] = rnd.choice([True, 3])
        return
    options["batch_size"] = rnd.choice([None, 1, 2, 3, 3, 4, 5])
    if rnd.random() < 0.4:
        options["drop_last"] = True
    if (not case.iterable or bad) and rnd.random() < 0.3:
        case.sampler = _draw_sampler(rnd, case.n)
        if bad:
            options["shuffle"] = True
    elif (not case.iterable or bad) and rnd.random() < 0.5:
        options["shuffle"] = True


def _draw_sampler(rnd: random.Random, n: int) -> tuple:
    kind = rnd.choice(["list", "random", "subset", "weighted", "nolen", "sequential", "tensor", "ndarray"])
    indices = [rnd.randrange(max(n, 1)) for _ in range(rnd.randint(0, 2 * n))]
    if kind == "random":
        return (kind, rnd.random() < 0.5, rnd.choice([None, n, n + 2]), rnd.randint(0, 999))
    if kind == "weighted":
        return (kind, [rnd.random() + 0.01 for _ in range(max(n, 1))], rnd.randint(1, n + 3), rnd.randint(0, 999))
    if kind == "subset":
        return (kind, indices, rnd.randint(0, 999))
    return (kind, indices)


def _draw_batch_sampler(rnd: random.Random, n: int) -> tuple:
    if rnd.random() < 0.5:
        return ("batch", rnd.choice(["sequential", "random"]), rnd.randint(1, 4), rnd.random() < 0.5, rnd.randint(0, 999))
    kind = rnd.choice(["lists", "lists", "tuples", "ranges", "arrays", "tensors"])
    batches = [[rnd.randrange(max(n, 1)) for _ in range(rnd.randint(1, 4))] for _ in range(rnd.randint(0, 5))]
    return (kind, batches)


# ------------------------------------------------------------------------------ building


def make_dataset(case: Case) -> Any:
    """The case's dataset (a fresh object)."""
    if not case.iterable:
        return (FuzzMapItems if case.getitems else FuzzMap)(case.recipe, case.seed, case.n)
    cls = FuzzIterableLen if case.with_len else FuzzIterable
    return cls(case.recipe, case.seed, case.n, case.shard)


def loader_kwargs(case: Case, dataset: Any) -> dict[str, Any]:
    """The keyword arguments of both loaders, stateful objects made afresh."""
    import torch
    from torch.utils import data as tdata

    kwargs = dict(case.options)
    if case.generator is not None:
        kwargs["generator"] = torch.Generator().manual_seed(case.generator)
    if case.sampler is not None:
        kwargs["sampler"] = _make_sampler(case.sampler, dataset)
    if case.batch_sampler is not None:
        spec = case.batch_sampler
        if spec[0] != "batch":
            kwargs["batch_sampler"] = [_batch_of(spec[0], b) for b in spec[1]]
        else:
            inner = _make_sampler((spec[1], False, None, spec[4]) if spec[1] == "random" else ("sequential", []), dataset)
            kwargs["batch_sampler"] = tdata.BatchSampler(inner, spec[2], spec[3])
    collate = {"identity": collate_identity, "counted": collate_counted,
               "torch_default": tdata.default_collate, "torch_convert": tdata.default_convert}
    if case.collate is not None:
        kwargs["collate_fn"] = collate[case.collate]
    if case.worker_init:
        kwargs["worker_init_fn"] = worker_init_seed
    return kwargs


class _NoLenSampler:
    """A sampler without ``__len__`` (torch's loader then has no length)."""

    def __init__(self, indices: list[int]) -> None:
        self.indices = indices

    def __iter__(self) -> Any:
        return iter(self.indices)


def _batch_of(kind: str, indices: list[int]) -> Any:
    """One batch of a batch sampler given as a list, of the type ``kind`` names."""
    import torch

    if kind == "ranges":
        return range(indices[0], indices[0] + len(indices))
    makers: dict[str, Callable[[list[int]], Any]] = {"lists": list, "tuples": tuple, "arrays": np.array,
                                                    "tensors": torch.tensor}
    return makers[kind](indices)


def _make_sampler(spec: tuple, dataset: Any) -> Any:
    import torch
    from torch.utils import data as tdata

    kind = spec[0]
    if kind == "sequential":
        return tdata.SequentialSampler(dataset)
    if kind == "list":
        return list(spec[1])
    if kind == "tensor":
        return torch.tensor(spec[1], dtype=torch.int64)
    if kind == "ndarray":
        return np.array(spec[1], dtype=np.int64)
    if kind == "nolen":
        return _NoLenSampler(list(spec[1]))
    generator = torch.Generator().manual_seed(spec[-1])
    if kind == "random":
        return tdata.RandomSampler(dataset, replacement=spec[1], num_samples=spec[2], generator=generator)
    if kind == "subset":
        return tdata.SubsetRandomSampler(list(spec[1]), generator=generator)
    return tdata.WeightedRandomSampler(spec[1], spec[2], replacement=True, generator=generator)


# ------------------------------------------------------------------------------ running


@dataclass
class Outcome:
    """What a user saw from one loader: its length, each epoch's batches and error."""

    error_at: str | None = None  # "construct", or None
    error: type | None = None
    length: Any = None  # an int, or the type of the error len() raised
    epochs: list[tuple[list[Any], type | None]] = field(default_factory=list)
    messages: list[str] = field(default_factory=list)  # every error's text, for failure reports


def run(case: Case, loader_cls: type) -> Outcome:
    """Build the case's loader of ``loader_cls`` and iterate it ``case.epochs`` times."""
    import torch

    random.seed(case.seed)
    np.random.seed(case.seed % 2**32)
    torch.manual_seed(case.seed)
    dataset = make_dataset(case)
    out = Outcome()
    try:
        loader = loader_cls(dataset, **loader_kwargs(case, dataset))
    except Exception as error:  # noqa: BLE001  (the outcome compared is the error's type)
        out.error_at, out.error = "construct", type(error)
        out.messages.append(f"construct: {error!r}")
        return out
    try:
        out.length = _length(loader, out.messages)
        for epoch in range(case.epochs):
            out.epochs.append(_epoch(loader, out.messages, case.stop_after if epoch == 0 else None))
    finally:
        _close(loader)
    return out


def _length(loader: Any, messages: list[str]) -> Any:
    try:
        return len(loader)
    except Exception as error:  # noqa: BLE001
        messages.append(f"len: {error!r}")
        return type(error)


def _epoch(loader: Any, messages: list[str], limit: int | None) -> tuple[list[Any], type | None]:
    """One epoch's batches (the first ``limit`` only, when given) and the type of its error."""
    batches: list[Any] = []
    it = None
    try:
        it = iter(loader)
        if limit == 0:  # iter() alone: its tasks are sent, then left
            _stop(loader, it)
            return batches, None
        for batch in it:
            batches.append(copy.deepcopy(batch))
            if limit is not None and len(batches) >= limit:
                _stop(loader, it)  # left mid-epoch, as a loop that breaks leaves it
                break
    except Exception as error:  # noqa: BLE001
        messages.append(f"after {len(batches)} batches: {type(error).__name__}: {_tail(error)}")
        _stop(loader, it)
        return batches, type(error)
    return batches, None


def _tail(error: BaseException) -> str:
    """The error's last line: a worker's error carries the whole traceback."""
    lines = str(error).strip().splitlines()
    return lines[-1][:300] if lines else ""


def _stop(loader: Any, it: Any) -> None:
    """After an error, stop the workers of torch's iterator now, unless the loader keeps it for
    the next epoch (persistent workers; stopped by :func:`_close`). Ours are stopped by close()."""
    if hasattr(loader, "close") or it is None or getattr(loader, "_iterator", None) is it:
        return
    if hasattr(it, "_shutdown_workers"):
        it._shutdown_workers()


def _close(loader: Any) -> None:
    if hasattr(loader, "close"):
        loader.close()
    else:
        it = getattr(loader, "_iterator", None)
        if it is not None and hasattr(it, "_shutdown_workers"):
            it._shutdown_workers()
