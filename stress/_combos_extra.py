"""The options stress/combos.py's main lives leave out, drawn for a share of its lives (``--extra-share``).

Runs in the script's main process and (the dataset, ``collate_fn`` and ``worker_init_fn``) in its
workers. An *extra* life is map-style and draws, besides the main lives' options: the flavour
(``shmloader.DataLoader`` or ``shmloader.torch.DataLoader``), ``batch_size`` (None: each sample is
delivered alone, and samples vary in size), ``collate_fn`` (default or one returning a dict of
concatenated arrays, which takes samples of varying sizes), the sampler (sequential, ``shuffle``
with a generator, or a ``RandomSampler`` with its own generator, perhaps with replacement),
``drop_last``, ``timeout``, ``pin_memory`` and ``worker_init_fn``. An extra *stream* life (an
``IterableDataset`` life, ``stream``) draws the flavour, ``batch_size`` (None: the stream's samples
delivered one by one), ``drop_last`` (each worker drops its own short last batch, as torch's do),
``timeout``, ``pin_memory`` and ``worker_init_fn``.

Promises: the batches each pass must yield come from a *reference* loader iterated in step (torch's
own ``DataLoader`` for the torch flavour, ``shmloader.DataLoader`` without workers for the numpy
one), built with the same dataset, sampler, generator seed and collate; a batch is compared by a
checksum of its whole tree (container types, keys, dtypes, shapes and bytes), so a wrong type, a
lost key or a batch out of the generator's order is a difference. A cut epoch's fresh loader gets a
fresh generator of the same seed and must continue from the state it loads, as if never cut. A
stream life's batches are computed in the main process instead (``stream_pass``), each checked with
its type and shape too (``typed_checksum``), so a batch of one in place of its sample is a difference.
"""

from __future__ import annotations

import importlib.util
import random
import warnings
import zlib
from typing import Any

import _combos_data as d
import numpy as np

import shmloader
from shmloader import get_worker_info
from shmloader.samplers import RandomSampler

# the torch flavour is drawn only where torch is installed (the draw itself is made either way, so a
# seed gives the same lives with and without torch, the flavour aside)
HAVE_TORCH = importlib.util.find_spec("torch") is not None

# the warning pin_memory=True gives without an accelerator (docs/gpu.md), once per loader
warnings.filterwarnings("ignore", message=".*pin_memory.*")


class ExtraSet:
    """``n`` samples, each a dict of its number and its data: at ``level`` (0 to 3) when it is one
    for the whole dataset, else at a level that varies with the number (``level`` -1)."""

    def __init__(self, n: int, level: int) -> None:
        self.n, self.level = n, level

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, Any]:
        level = self.level if self.level >= 0 else (i * 5) % len(d.LEVELS)
        return {"i": i, "x": d.sample(i, level)}


def dict_collate(samples: list[dict[str, Any]]) -> dict[str, Any]:
    """A batch of samples of any sizes: their data end to end, their numbers, how many."""
    return {"x": np.concatenate([s["x"] for s in samples]), "i": np.array([s["i"] for s in samples]),
            "n": len(samples)}


def check_worker(worker_id: int) -> None:
    """``worker_init_fn``: the id it is given is the worker's own."""
    info = get_worker_info()
    if info is None or info.id != worker_id:
        raise RuntimeError(f"worker_init_fn got {worker_id}, get_worker_info() says {info}")


def tree_checksum(obj: Any) -> int:
    """A checksum of a batch's whole tree: containers' types and keys, arrays' and tensors' types,
    dtypes, shapes and bytes, scalars' types and values."""
    parts: list[bytes] = []
    _walk(obj, parts)
    return zlib.crc32(b"".join(parts))


def _walk(obj: Any, parts: list[bytes]) -> None:
    parts.append(type(obj).__name__.encode() + b":")
    if isinstance(obj, dict):
        for k, v in obj.items():
            parts.append(repr(k).encode())
            _walk(v, parts)
    elif isinstance(obj, (list, tuple)):
        parts.append(str(len(obj)).encode())
        for v in obj:
            _walk(v, parts)
    elif isinstance(obj, np.ndarray):
        parts += [obj.dtype.str.encode(), repr(obj.shape).encode(), np.ascontiguousarray(obj).tobytes()]
    elif type(obj).__name__ == "Tensor":
        parts += [str(obj.dtype).encode(), repr(tuple(obj.shape)).encode(), obj.contiguous().numpy().tobytes()]
    else:
        parts.append(repr(obj).encode())


# what a life draws here: kept when a cut epoch's fresh loader draws the main lives' options anew
KEPT = ("extra", "torch", "batch_size", "collate", "level", "n", "sampler", "seed", "numpy_generator", "drop_last",
        "timeout", "pin_memory", "init", "collate_threads", "stream")
UNBATCHED_ROUND = 8  # an unbatched stream's samples per worker in one size level's round (_combos_data)


def draw(pick: random.Random, samples: int, batch_size: int) -> dict[str, Any]:
    """The extra options of one life; unbatched, fewer samples (each is a batch, which an outside
    kill may follow)."""
    unbatched = pick.random() < 0.25
    collate = "default" if unbatched else pick.choice(("default", "dict"))
    varied = unbatched or collate == "dict"
    flavour = pick.random() < 0.5 and HAVE_TORCH
    return dict(extra=True, torch=flavour, batch_size=None if unbatched else pick.randint(1, 2 * batch_size),
                collate=collate, level=-1 if varied else pick.randint(0, 3),
                n=pick.randint(samples // 8, samples // 4) if unbatched else pick.randint(samples // 4, samples),
                sampler=pick.choice(("sequential", "shuffle", "random", "replacement")), seed=pick.randrange(2**31),
                numpy_generator=pick.random() < 0.5, drop_last=pick.random() < 0.3,
                timeout=pick.choice((0, 0, 20, 60)), pin_memory=pick.random() < 0.3, init=pick.random() < 0.5,
                collate_threads=pick.choice((None, 2)))


def draw_stream(pick: random.Random, batch_size: int) -> dict[str, Any]:
    """The extra options of one stream (``IterableDataset``) life."""
    unbatched = pick.random() < 0.4
    return dict(extra=True, stream=True, torch=pick.random() < 0.5 and HAVE_TORCH,
                batch_size=None if unbatched else pick.randint(1, 2 * batch_size), drop_last=pick.random() < 0.4,
                timeout=pick.choice((0, 0, 20, 60)), pin_memory=pick.random() < 0.3, init=pick.random() < 0.5)


def build_stream(o: dict[str, Any], common: dict[str, Any], samples: int, markers: str, die_every: int) -> Any:
    """The tested loader of a stream life: a ``SizedStream`` (whose workers may die in ``__iter__``)."""
    dataset = d.SizedStream(samples, o["batch_size"] or UNBATCHED_ROUND, markers, die_every)
    kw: dict[str, Any] = dict(batch_size=o["batch_size"], drop_last=o["drop_last"] and o["batch_size"] is not None,
                              timeout=o["timeout"], pin_memory=o["pin_memory"])
    if o["init"]:
        kw["worker_init_fn"] = check_worker
    return _flavour(o)(dataset, max_task_attempts=8, **kw, **common)


def stream_pass(o: dict[str, Any], samples: int, workers: int) -> list[int]:
    """The ``typed_checksum`` of each batch a stream life's pass must yield, in torch's in-order
    delivery: a stacked batch, or the sample itself when unbatched, as the flavour's array type."""
    size = o["batch_size"] or UNBATCHED_ROUND
    kind = "Tensor" if o["torch"] else "ndarray"
    out = []
    for b in d.stream_batches(samples, o["batch_size"] or 1, workers, o["drop_last"] and o["batch_size"] is not None):
        level = d.stream_level(b[0], size * workers)
        arr = d.sample(b[0], level) if o["batch_size"] is None else np.stack([d.sample(i, level) for i in b])
        out.append(_typed(kind, arr.shape, arr))
    return out


def typed_checksum(batch: Any) -> int:
    """A checksum of a batch's type name, shape and bytes."""
    return _typed(type(batch).__name__, tuple(batch.shape), batch)


def _typed(kind: str, shape: tuple[int, ...], arr: Any) -> int:
    return zlib.crc32(f"{kind}{tuple(shape)}".encode() + np.ascontiguousarray(arr).tobytes())


def _flavour(o: dict[str, Any]) -> Any:
    if o["torch"]:
        from shmloader.torch import DataLoader as TorchFlavour
        return TorchFlavour
    return shmloader.DataLoader


def _generator(o: dict[str, Any]) -> Any:
    if o["torch"]:
        import torch
        return torch.Generator().manual_seed(o["seed"])
    return np.random.default_rng(o["seed"]) if o["numpy_generator"] else o["seed"]


def _sampling(o: dict[str, Any], dataset: ExtraSet, generator: Any) -> dict[str, Any]:
    """``shuffle``/``sampler``/``generator`` arguments: the generator goes to the loader (shuffle) or
    to a ``RandomSampler`` of the flavour's kind."""
    kind = o["sampler"]
    if kind == "sequential":
        return {}
    if kind == "shuffle":
        return dict(shuffle=True, generator=generator)
    if o["torch"]:
        from torch.utils.data import RandomSampler as TorchRandomSampler
        cls: Any = TorchRandomSampler
    else:
        cls = RandomSampler
    extra = dict(replacement=True, num_samples=len(dataset) + 5) if kind == "replacement" else {}
    return dict(sampler=cls(dataset, generator=generator, **extra))


def _common(o: dict[str, Any], dataset: ExtraSet) -> dict[str, Any]:
    """What the tested loader and its reference share."""
    kw: dict[str, Any] = dict(batch_size=o["batch_size"], drop_last=o["drop_last"] and o["batch_size"] is not None)
    if o["collate"] == "dict":
        kw["collate_fn"] = dict_collate
    return kw | _sampling(o, dataset, _generator(o))


def build(o: dict[str, Any], common: dict[str, Any]) -> Any:
    """The tested loader: the main lives' options (``common``, from combos.py) and the extra ones."""
    dataset = ExtraSet(o["n"], o["level"])
    kw = _common(o, dataset) | dict(timeout=o["timeout"], pin_memory=o["pin_memory"])
    if o["init"]:
        kw["worker_init_fn"] = check_worker
    return _flavour(o)(dataset, **kw, **common)


def reference(o: dict[str, Any]) -> Any:
    """The loader whose passes the tested one must match, pass for pass: torch's own for the torch
    flavour, shmloader's without workers for the numpy one."""
    dataset = ExtraSet(o["n"], o["level"])
    if o["torch"]:
        import torch.utils.data
        return torch.utils.data.DataLoader(dataset, **_common(o, dataset))  # type: ignore[arg-type]
    threads = {} if o["collate_threads"] is None else {"collate_threads": o["collate_threads"]}
    return shmloader.DataLoader(dataset, **threads, **_common(o, dataset))  # type: ignore[arg-type]


def tally(o: dict[str, Any]) -> dict[str, int]:
    """What this life covers, for the run's final counts (none for a main life); counts, never bools
    (a first ``Counter.update`` keeps the values it is given as they are)."""
    if not o.get("extra"):
        return {}
    both = {"torch flavour": o["torch"], "unbatched": o["batch_size"] is None, "timeout": o["timeout"] > 0,
            "pin_memory": o["pin_memory"]}
    if o.get("stream"):
        own = {"extra streams": True, "drop_last streams": o["drop_last"] and o["batch_size"] is not None}
    else:
        own = {"extra lives": True, "dict collate": o["collate"] == "dict",
               "generator order": o["sampler"] != "sequential"}
    return {k: int(v) for k, v in (own | both).items()}


def fit(o: dict[str, Any]) -> None:
    """Make ``o`` one the reference can follow: where the loader's generator draws the order
    (``shuffle``), workers are not persistent, since a persistent loader, as torch's, draws no base
    seed from it at a later epoch's ``iter()`` and a loader without workers does."""
    if o.get("extra") and o.get("sampler") == "shuffle":
        o["persistent_workers"] = False


def may_abandon(o: dict[str, Any]) -> bool:
    """Whether a pass of this life may be left early: not where a generator draws the order, as how
    far a left pass drew from it depends on how far the loader read ahead (a torch ``RandomSampler``
    draws once more at its end), which the reference cannot follow."""
    return not o.get("extra") or bool(o.get("stream")) or o["sampler"] == "sequential"


def next_pass(ref: Any) -> list[int]:
    """The checksums of the reference's next full pass."""
    return [tree_checksum(b) for b in ref]
