"""The random sources of a loader state: which generators an epoch draws from, their saved form.

Owns, for ``state.py``: finding every stateful generator a loader reaches (its ``generator``, its
samplers' generators, torch's global RNG), snapshotting them, encoding a snapshot as plain JSON
data, and checking a saved snapshot against a loader before putting it back. Runs in the main process. Promises: a snapshot restored
into a loader of the same configuration makes its generators draw what the saved ones drew next;
torch's global RNG is only ever borrowed (``global_rng`` puts the caller's state back).
"""

from __future__ import annotations

import base64
import contextlib
import functools
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from shmloader.errors import StateError
from shmloader.state_fields import numpy_state

# Where a loader's generators live: its own, its sampler's, its batch sampler's and that one's sampler's.
_SOURCE_PATHS = ("generator", "sampler", "batch_sampler", "batch_sampler.sampler")

Sources = list[tuple[list[str], str, Any]]  # (paths, kind "torch" | "numpy", raw state) per generator


@dataclass(frozen=True)
class Snapshot:
    """Every generator's state and torch's global RNG state (None without torch), taken as an epoch
    starts, before ``iter(sampler)``; ``seed_drawn``: the epoch then drew its base seed from them
    (False when it reused one), so a resume replays that draw too; ``torch_first``: with
    ``num_workers=0``, torch's global RNG state at the first ``next()`` when something drew from
    it after ``iter()`` (None otherwise), since the sampler's first draw is made there;
    ``torch_used``: the epoch's order drew from torch's global RNG (``iter(sampler)`` or the
    sampler's first item changed it), so only torch can re-create it."""

    sources: Sources
    torch_global: Any
    seed_drawn: bool = False
    torch_first: Any = None
    torch_used: bool = False

    def encoded(self) -> dict[str, Any]:
        """As the state's ``random`` field (plain, JSON-serialisable)."""
        return {**encode_random(self.sources, self.torch_global), "base_seed_drawn": self.seed_drawn,
                "torch_global_first_batch": None if self.torch_first is None else _b64(self.torch_first),
                "torch_global_used": self.torch_used}


def snapshot(loader: Any) -> Snapshot:
    """The loader's random sources now (``seed_drawn`` is set once the base seed is decided)."""
    torch = sys.modules.get("torch")
    return Snapshot(take_random(loader), None if torch is None else torch.get_rng_state())


@contextlib.contextmanager
def global_rng(saved: Any) -> Iterator[None]:
    """With ``saved`` (bytes, or a state tensor), torch's global RNG is that state inside the
    block, then the caller's again."""
    torch = sys.modules.get("torch")
    if saved is None or torch is None:
        yield
        return
    caller = torch.get_rng_state()
    torch.set_rng_state(saved if isinstance(saved, torch.Tensor) else torch_bytes(saved))
    try:
        yield
    finally:
        torch.set_rng_state(caller)


def source_at(loader: Any, path: str) -> Any:
    """The generator at ``path`` (one of ``_SOURCE_PATHS``), or None."""
    if path == "generator":
        return loader._generator_source  # an int seed's stream, made once by the loader
    obj = loader
    for part in path.split("."):
        obj = getattr(obj, part, None)
    if obj is None:
        return None
    return obj._source if hasattr(obj, "_source") else getattr(obj, "generator", None)


def kind_of(source: Any) -> str | None:
    """"numpy", "torch", or None for what holds no state we can save (None, an int seed, ...)."""
    if isinstance(source, np.random.Generator):
        return "numpy"
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(source, torch.Generator):
        return "torch"
    return None


def take_random(loader: Any) -> Sources:
    """The state of every stateful generator reachable from the loader, one entry per object."""
    seen: dict[int, tuple[list[str], str, Any]] = {}
    for path in _SOURCE_PATHS:
        source = source_at(loader, path)
        kind = kind_of(source)
        if kind is None:
            continue
        if id(source) in seen:
            seen[id(source)][0].append(path)
        else:
            seen[id(source)] = ([path], kind, source.get_state() if kind == "torch" else source.bit_generator.state)
    return list(seen.values())


def encode_random(sources: Sources, torch_global: Any) -> dict[str, Any]:
    """A snapshot as the state's ``random`` field (plain, JSON-serialisable)."""
    encoded = [{"paths": paths, "kind": kind,
                "state": _b64(raw) if kind == "torch" else _plain(raw)} for paths, kind, raw in sources]
    return {"sources": encoded, "torch_global": None if torch_global is None else _b64(torch_global)}


def prepare_restore(loader: Any, sources: list[dict[str, Any]]) -> list[Callable[[], None]]:
    """Check every saved generator state of ``sources`` (``random.sources``) against the loader's
    generator at its paths; return what puts each back. Raises StateError, having changed nothing,
    for a generator of another kind or type, or one of the loader's that the state holds no state
    for, so ``load`` can check everything before it acts."""
    setters = []
    saved = {path for entry in sources for path in entry["paths"]}
    for path in _SOURCE_PATHS:
        kind = kind_of(source_at(loader, path))
        if kind is not None and path not in saved:  # it would draw an order the state knows nothing of
            raise StateError(f"this loader has a {kind} generator at {path}, but the state holds no generator state "
                             f"there: the saving loader had none (its order came from elsewhere, torch's global RNG "
                             f"with generator=None), so this loader would draw another order and its delivered tasks "
                             f"would be other batches; build it with the saving loader's generators", None, kind)
    for entry in sources:
        for path in entry["paths"]:
            target = source_at(loader, path)
            if kind_of(target) != entry["kind"]:
                raise StateError(f"the state holds a {entry['kind']} generator at {path}, but this loader has "
                                 f"{type(target).__name__} there", entry["kind"], kind_of(target))
            if entry["kind"] == "torch":
                setters.append(_torch_setter(target, entry["state"], path))
            else:
                setters.append(_numpy_setter(target, entry["state"], path))
    return setters


def _torch_setter(target: Any, encoded: str, path: str) -> Callable[[], None]:
    import torch

    state = torch_bytes(base64.b64decode(encoded))
    try:  # a generator of the target's device takes it, so the target will too
        torch.Generator(device=target.device).set_state(state)
    except (RuntimeError, ValueError) as exc:
        raise StateError(f"the state's random.sources ({path}) is not a state this loader's torch generator "
                         f"there ({target.device}) can take: {exc}", len(state), str(target.device)) from None
    return functools.partial(target.set_state, state)


def _numpy_setter(target: Any, encoded: Any, path: str) -> Callable[[], None]:
    state = numpy_state(encoded, f"random.sources ({path})")
    mine = type(target.bit_generator).__name__
    if state["bit_generator"] != mine:
        raise StateError(f"the state's random.sources ({path}) holds a {state['bit_generator']} generator state, "
                         f"but this loader's numpy generator there is a {mine}", state["bit_generator"], mine)
    return functools.partial(setattr, target.bit_generator, "state", state)


def torch_bytes(raw: bytes) -> Any:
    """A torch generator state (a uint8 tensor) from its bytes."""
    import torch

    return torch.frombuffer(bytearray(raw), dtype=torch.uint8).clone()


def _b64(tensor: Any) -> str:
    return base64.b64encode(tensor.numpy().tobytes()).decode("ascii")


def _plain(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, np.ndarray):
        return {"ndarray": value.tolist(), "dtype": str(value.dtype)}
    if isinstance(value, np.integer):
        return int(value)
    return value
