"""Random sample recipes and the datasets that serve them, for the differential fuzz against torch.

A *recipe* is a plain, picklable tree of tuples that says what each sample looks like:
``("leaf", kind, params)`` or ``(container, children)`` with container one of ``dict``,
``odict``, ``record`` (a dict subclass), ``tuple``, ``list`` or ``nt`` (a namedtuple). Sample
``i`` of a recipe is built by :func:`make_sample` from ``numpy.random.default_rng([seed, i])``
only, so torch's loader and ours, in any process and under any start method, see the same
samples. A ``rand`` leaf draws from the process's global ``random``/numpy/torch generators
instead: that is how the fuzz checks that workers are seeded as torch seeds them.

Everything here is defined at module level, so it pickles for the ``spawn`` start method.
Importing this module does not import torch; building a tensor leaf does.
"""

from __future__ import annotations

import collections
import random
from typing import Any

import numpy as np

ARRAY_DTYPES = ["float32", "float64", "float16", "int8", "int16", "int32", "int64", "uint8",
                "uint16", "uint32", "bool", "complex64", "complex128"]
SCALAR_DTYPES = ["float32", "float64", "float16", "int8", "int16", "int32", "int64", "uint8",
                 "uint16", "uint32", "uint64", "bool", "complex64"]
TENSOR_DTYPES = ["float32", "float64", "int64", "int32", "uint8", "bool", "bfloat16", "float16",
                 "complex64"]
# Leaves whose batch torch's default_collate refuses (TypeError/RuntimeError): drawn rarely.
BAD_LEAVES = ["none", "complex", "varlen_nd", "varlen_list", "object_nd", "raise", "mixed", "mixed", "bigint"]
# What a "mixed" leaf alternates between (by index parity): torch collates by the first sample.
MIXED = [("int", {}), ("float", {}), ("bool", {}), ("str", {}),
         ("npscalar", {"dtype": "int32"}), ("npscalar", {"dtype": "float32"}), ("npscalar", {"dtype": "bool"}),
         ("nd", {"dtype": "int32", "shape": (2,), "layout": "c"}), ("nd", {"dtype": "float32", "shape": (2,), "layout": "c"}),
         ("nd", {"dtype": "uint8", "shape": (2,), "layout": "c"}), ("nd", {"dtype": "float64", "shape": (2,), "layout": "c"}),
         ("tensor", {"dtype": "int64", "shape": (2,), "layout": "c"}), ("tensor", {"dtype": "float32", "shape": (2,), "layout": "c"})]
# What a "raise" leaf raises for every index i with i % 4 == 3.
RAISES = ["ValueError", "KeyError", "IndexError", "ZeroDivisionError", "TwoArgError"]

NT2 = collections.namedtuple("NT2", ["a", "b"])
NT3 = collections.namedtuple("NT3", ["a", "b", "c"])


class Record(dict):
    """A dict subclass: torch rebuilds it as its own type."""


class TwoArgError(ValueError):
    """An exception that cannot be rebuilt from one message (torch's workers re-raise a RuntimeError)."""

    def __init__(self, what: str, index: int) -> None:
        super().__init__(f"{what} at {index}")


# ------------------------------------------------------------------------------ recipes


def random_recipe(rnd: random.Random, depth: int = 0, bad: float = 0.05) -> tuple:
    """A random recipe: containers up to depth 2, leaves of every kind (``bad`` ones rarely)."""
    if depth < 2 and rnd.random() < (0.6 if depth == 0 else 0.3):
        container = rnd.choice(["dict", "odict", "record", "tuple", "list", "nt"])
        n = 2 if container == "nt" and rnd.random() < 0.5 else (3 if container == "nt" else rnd.randint(1, 3))
        children = [random_recipe(rnd, depth + 1, bad) for _ in range(n)]
        if container in ("dict", "odict", "record"):
            keys = rnd.sample(["x", "y", "label", "meta", "img", 7, ("k", 1)], n)
            return (container, list(zip(keys, children)))
        return (container, children)
    return random_leaf(rnd, bad)


def random_leaf(rnd: random.Random, bad: float = 0.05) -> tuple:
    """One leaf recipe."""
    if rnd.random() < bad:
        kind = rnd.choice(BAD_LEAVES)
        return ("leaf", kind, {"dtype": rnd.choice(ARRAY_DTYPES), "pair": rnd.sample(MIXED, 2),
                               "raise": rnd.choice(RAISES)})
    if rnd.random() < 0.03:
        return ("leaf", rnd.choice(["itype", "big"]), {})
    kind = rnd.choice(["nd", "nd", "nd", "npscalar", "int", "float", "bool", "str", "bytes",
                       "tensor", "tensor", "rand"])
    params: dict[str, Any] = {}
    if kind in ("nd", "tensor"):
        params["dtype"] = rnd.choice(ARRAY_DTYPES if kind == "nd" else TENSOR_DTYPES)
        ndim = rnd.choice([0, 1, 1, 2, 3])
        params["shape"] = tuple(rnd.choice([0, 1, 2, 3, 4]) if rnd.random() < 0.1 else rnd.randint(1, 4)
                                for _ in range(ndim))
        params["layout"] = rnd.choice(["c", "c", "strided", "transposed"]) if ndim >= 1 else "c"
    elif kind == "npscalar":
        params["dtype"] = rnd.choice(SCALAR_DTYPES)
    return ("leaf", kind, params)


def has_leaf(recipe: tuple, kinds: set[str]) -> bool:
    """Whether any leaf of ``recipe`` is of one of ``kinds``."""
    if recipe[0] == "leaf":
        return recipe[1] in kinds
    return any(has_leaf(child, kinds) for child in _children(recipe))


def _children(recipe: tuple) -> list[tuple]:
    if recipe[0] in ("dict", "odict", "record"):
        return [child for _, child in recipe[1]]
    return list(recipe[1])


# ------------------------------------------------------------------------------ samples


def make_sample(recipe: tuple, seed: int, i: int, itype: str = "int") -> Any:
    """Sample ``i``: the recipe filled from ``default_rng([seed, i])`` (and global RNGs for ``rand``);
    an ``itype`` leaf is ``itype``, the type of index the dataset was given."""
    return _build(recipe, np.random.default_rng([seed, i]), i, itype)


def _build(recipe: tuple, rng: np.random.Generator, i: int, itype: str) -> Any:
    kind = recipe[0]
    if kind == "leaf":
        return itype if recipe[1] == "itype" else _leaf(recipe[1], recipe[2], rng, i)
    if kind in ("dict", "odict", "record"):
        items = [(key, _build(child, rng, i, itype)) for key, child in recipe[1]]
        return {"dict": dict, "odict": collections.OrderedDict, "record": Record}[kind](items)
    values = [_build(child, rng, i, itype) for child in recipe[1]]
    if kind == "nt":
        return (NT2 if len(values) == 2 else NT3)(*values)
    return tuple(values) if kind == "tuple" else values


def _leaf(kind: str, params: dict[str, Any], rng: np.random.Generator, i: int) -> Any:
    maker = _LEAVES[kind]
    return maker(params, rng, i)


def _values(dtype: str, shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    """An array of ``dtype`` and ``shape`` with values that survive a round trip through torch."""
    values: np.ndarray
    if dtype == "bool":
        values = rng.random(shape) < 0.5
    elif dtype.startswith("complex"):
        values = rng.standard_normal(shape) + 1j * rng.standard_normal(shape)
    elif dtype.startswith("float"):
        values = rng.standard_normal(shape) * 10
    else:
        values = rng.integers(0, 100, shape)
    return np.asarray(values).astype(dtype)  # 0-d: an array too, not a numpy scalar


def _nd(params: dict[str, Any], rng: np.random.Generator, i: int) -> np.ndarray:
    shape, layout = params["shape"], params["layout"]
    if layout == "strided":  # every other element of the last axis: not contiguous
        base = _values(params["dtype"], (*shape[:-1], shape[-1] * 2), rng)
        return base[..., ::2]
    if layout == "transposed":
        return _values(params["dtype"], shape[::-1], rng).T
    return _values(params["dtype"], shape, rng)


def _tensor(params: dict[str, Any], rng: np.random.Generator, i: int) -> Any:
    import torch

    dtype = params["dtype"]
    array = _nd({**params, "dtype": "float32" if dtype == "bfloat16" else dtype}, rng, i)
    if params["layout"] == "strided":
        base = torch.from_numpy(np.ascontiguousarray(np.repeat(array, 2, axis=-1)))
        tensor = base[..., ::2]
    elif params["layout"] == "transposed":
        tensor = torch.from_numpy(np.ascontiguousarray(array.T)).permute(*range(array.ndim - 1, -1, -1))
    else:
        tensor = torch.from_numpy(np.ascontiguousarray(array))
    return tensor.to(torch.bfloat16) if dtype == "bfloat16" else tensor


def _npscalar(params: dict[str, Any], rng: np.random.Generator, i: int) -> Any:
    return _values(params["dtype"], (), rng)[()]


def _rand(params: dict[str, Any], rng: np.random.Generator, i: int) -> Any:
    """Draws from the global generators: equal only if the process was seeded as torch seeds it."""
    import torch

    return [random.random(), np.random.random_sample(), torch.rand(())]


def _mixed(params: dict[str, Any], rng: np.random.Generator, i: int) -> Any:
    kind, leaf_params = params["pair"][i % 2]
    return _leaf(kind, leaf_params, rng, i)


def _raise(params: dict[str, Any], rng: np.random.Generator, i: int) -> Any:
    if i % 4 != 3:
        return i
    name = params["raise"]
    if name == "TwoArgError":
        raise TwoArgError("bad sample", i)
    raise {"ValueError": ValueError, "KeyError": KeyError, "IndexError": IndexError,
           "ZeroDivisionError": ZeroDivisionError}[name](f"bad sample {i}")


def _varlen_nd(params: dict[str, Any], rng: np.random.Generator, i: int) -> np.ndarray:
    return _values(params["dtype"], (1 + i % 3,), rng)


_LEAVES: dict[str, Any] = {
    "nd": _nd,
    "tensor": _tensor,
    "npscalar": _npscalar,
    "rand": _rand,
    "int": lambda p, rng, i: int(rng.integers(-1000, 1000)) + i,
    "float": lambda p, rng, i: float(rng.standard_normal()) + i,
    "bool": lambda p, rng, i: bool(rng.random() < 0.5),
    "str": lambda p, rng, i: f"s{i}-{int(rng.integers(100))}",
    "bytes": lambda p, rng, i: bytes([i % 256, int(rng.integers(256))]),
    "none": lambda p, rng, i: None,
    "complex": lambda p, rng, i: complex(float(rng.standard_normal()), i),
    "varlen_nd": _varlen_nd,
    "varlen_list": lambda p, rng, i: list(range(1 + i % 3)),
    "object_nd": lambda p, rng, i: np.array([f"o{i}", i], dtype=object),
    "mixed": _mixed,
    "raise": _raise,
    "bigint": lambda p, rng, i: 2**63 + i if i % 3 == 1 else i,  # outside int64: torch's ValueError
    "big": lambda p, rng, i: np.full(300_000, i, np.float64),  # 2.4 MB: the slots must grow
}


# ------------------------------------------------------------------------------ datasets


class FuzzMap:
    """A map-style dataset of ``n`` samples of ``recipe`` (torch's loader takes any such class)."""

    def __init__(self, recipe: tuple, seed: int, n: int) -> None:
        self.recipe, self.seed, self.n = recipe, seed, n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> Any:
        return self._sample(i, type(i).__name__)

    def _sample(self, i: Any, itype: str) -> Any:
        if not 0 <= int(i) < self.n:
            raise IndexError(f"index {i} out of range for {self.n} samples")
        return make_sample(self.recipe, self.seed, int(i), itype)


class FuzzMapItems(FuzzMap):
    """:class:`FuzzMap` with ``__getitems__``: the loader hands it each batch of indices as the
    batch sampler made it (an ``itype`` leaf says the batch's type and the index's)."""

    def __getitems__(self, indices: Any) -> list[Any]:
        return [self._sample(i, f"{type(indices).__name__}/{type(i).__name__}") for i in indices]


def _torch_iterable_base() -> type:
    """torch's IterableDataset when torch is importable (both loaders recognise it), else object."""
    try:
        from torch.utils.data import IterableDataset
    except ImportError:  # pragma: no cover - the fuzz test skips without torch
        return object
    return IterableDataset


class FuzzIterable(_torch_iterable_base()):  # type: ignore[misc]
    """An iterable dataset of ``n`` samples, without ``__len__``; ``shard`` splits them over
    workers by torch's ``get_worker_info()`` (else each worker yields all of them, as a naive
    dataset does)."""

    def __init__(self, recipe: tuple, seed: int, n: int, shard: bool) -> None:
        self.recipe, self.seed, self.n, self.shard = recipe, seed, n, shard

    def __iter__(self) -> Any:
        from torch.utils.data import get_worker_info

        info = get_worker_info()
        start, step = (info.id, info.num_workers) if self.shard and info is not None else (0, 1)
        for i in range(start, self.n, step):
            yield make_sample(self.recipe, self.seed, i)



class FuzzIterableLen(FuzzIterable):
    """:class:`FuzzIterable` with ``__len__`` (torch's loader then has a length too)."""

    def __len__(self) -> int:
        return self.n


# ------------------------------------------------------------------------------ callables


def collate_identity(batch: Any) -> Any:
    """A custom collate_fn that returns the samples as they are."""
    return batch


def collate_counted(batch: Any) -> Any:
    """A custom collate_fn around torch's default_collate, returning a tuple (kept as a tuple)."""
    from torch.utils.data import default_collate

    return (len(batch) if isinstance(batch, list) else -1, default_collate(batch))


def worker_init_seed(worker_id: int) -> None:
    """A worker_init_fn that reseeds the global generators from the worker id and torch's seed."""
    import torch

    seed = (torch.initial_seed() + 7 * worker_id) % 2**32
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
