"""The shape of a saved loader state, field by field: what ``load_state_dict`` refuses before it acts.

Runs in the main process, called by ``state.check`` once the format, version and keys are known.
Owns nothing. Promises: a state whose fields have the wrong type or range (a string epoch, a seed
that is no 64-bit unsigned integer, a generator state that does not decode) raises ``StateError``
naming the field and its value, before anything is restored; a state that passes is one the
loader can act on without a ``TypeError`` from deep inside, or a crash blamed on a worker.
"""

from __future__ import annotations

import base64
import binascii
import sys
from collections.abc import Mapping
from typing import Any

import numpy as np

from shmloader.errors import StateError
from shmloader.state_objects import PATHS

_SEED_LIMIT = 1 << 64  # base seeds are drawn as torch draws them: 64-bit unsigned


def check_fields(state: Mapping[str, Any]) -> None:
    """Raise ``StateError`` for the first field of ``state`` of the wrong type or range."""
    _expect(isinstance(state["config"], Mapping), "config", state["config"], "a mapping")
    _expect(isinstance(state["objects"], Mapping), "objects", state["objects"], "a mapping")
    for name in state["objects"]:  # a foreign name would reach any loader attribute (``__class__``)
        _expect(name in PATHS, "objects", name, f"a mapping with keys among {', '.join(PATHS)}")
    for name in ("epoch", "yielded"):
        _expect(_count(state[name]), name, state[name], "an integer >= 0")
    _expect(type(state["in_progress"]) is bool, "in_progress", state["in_progress"], "true or false")
    seed = state["base_seed"]
    ok = (seed is None and not state["in_progress"]) or (type(seed) is int and 0 <= seed < _SEED_LIMIT)
    _expect(ok, "base_seed", seed, "an integer in [0, 2**64)" + ("" if state["in_progress"] else ", or null"))
    _expect(isinstance(state["delivered"], list), "delivered", state["delivered"], "a list of [start, stop) ranges")
    check_ranges(state["delivered"])
    if not state["in_progress"]:  # the start of an epoch: loaded, such tasks were skipped in that epoch
        _expect(not state["delivered"], "delivered", state["delivered"], "empty when in_progress is false")
    delivered = sum(stop - start for start, stop in state["delivered"])
    if state["yielded"] > delivered:  # an iterable dataset's resume would make and drop that many batches
        raise StateError(f"the state's yielded ({state['yielded']}) cannot exceed the {delivered} delivered tasks "
                         "(every batch handed out was delivered)", state["yielded"], delivered)
    _check_random(state["random"])


def check_ranges(ranges: Any) -> None:
    """``delivered``: sorted, disjoint ``[start, stop)`` ranges of task numbers (ints >= 0)."""
    stop = 0
    for item in ranges:
        if not (isinstance(item, (list, tuple)) and len(item) == 2 and all(type(v) is int for v in item)
                and stop <= item[0] < item[1]):
            raise StateError(f"the state's delivered must be sorted, disjoint [start, stop) ranges of task numbers "
                             f"(integers >= 0); got {item!r:.80} after stop={stop}", item, None)
        stop = item[1]


def numpy_state(encoded: Any, name: str) -> dict[str, Any]:
    """A numpy bit generator's state as saved (arrays as ``{"ndarray", "dtype"}``), decoded: it must
    name a numpy bit generator and be a state numpy can set on one as it is (else StateError
    naming ``name``): numpy before 2.0 wraps an out-of-range word instead of refusing it (1.24 to
    1.26 with a DeprecationWarning, which a user's filters show, ignore or raise: refused either
    way), so the state is read back and compared."""
    try:  # no catch_warnings: it swaps the process-wide filters under every other thread
        state = _set_and_read_back(encoded)
    except (ValueError, TypeError, KeyError, IndexError, AttributeError, OverflowError, DeprecationWarning) as exc:
        raise StateError(f"the state's {name} is not a numpy generator state numpy can set "
                         f"({type(exc).__name__}: {exc}): {encoded!r:.80}", encoded, None) from None
    return state


def _set_and_read_back(encoded: Any) -> dict[str, Any]:
    """The decoded state, once set on a fresh bit generator of its kind and read back unchanged."""
    state = _unplain(encoded)
    bit_generator = getattr(np.random, state["bit_generator"])
    if not (isinstance(bit_generator, type) and issubclass(bit_generator, np.random.BitGenerator)):
        raise ValueError(f"{state['bit_generator']!r} is not a numpy bit generator")
    made = bit_generator()
    made.state = state
    if not _same(made.state, state):
        raise ValueError("numpy stores it changed: a value is out of its range")
    return state


def _same(stored: Any, given: Any) -> bool:
    """Whether numpy's read-back ``stored`` holds the values of ``given`` (arrays compared by value,
    so a negative word given for an unsigned one differs); keys numpy ignores are not compared."""
    if isinstance(stored, Mapping):
        return isinstance(given, Mapping) and all(k in given and _same(v, given[k]) for k, v in stored.items())
    if isinstance(stored, np.ndarray):
        return stored.shape == np.shape(given) and bool(np.array_equal(stored, np.asarray(given)))
    return bool(stored == given)


def _check_random(random: Any) -> None:
    _expect(isinstance(random, Mapping) and isinstance(random.get("sources"), list) and "torch_global" in random,
            "random", random, "a mapping of 'sources' (a list) and 'torch_global'")
    for entry in random["sources"]:
        ok = (isinstance(entry, Mapping) and isinstance(entry.get("paths"), list)
              and all(isinstance(p, str) for p in entry["paths"]) and entry.get("kind") in ("torch", "numpy")
              and "state" in entry)
        _expect(ok, "random.sources", entry, "entries of 'paths', 'kind' (torch or numpy) and 'state'")
        name = f"random.sources ({', '.join(entry['paths'])})"
        if entry["kind"] == "torch":
            _torch_state(entry["state"], name, _import_torch(f"{name} is a torch generator's state"))
        else:
            numpy_state(entry["state"], name)
    drawn = random.get("base_seed_drawn", False)  # absent in states saved before it was recorded
    _expect(type(drawn) is bool, "random.base_seed_drawn", drawn, "true or false")
    used = random.get("torch_global_used")  # absent (None) in states saved before it was recorded
    _expect(used is None or type(used) is bool, "random.torch_global_used", used, "true or false")
    names = [n for n in ("torch_global", "torch_global_first_batch") if random.get(n) is not None]  # the latter
    torch = _torch_for_global(used) if names else None  # absent in states saved before it was kept
    for name in names:
        _torch_state(random[name], f"random.{name}", torch)


def _torch_for_global(used: bool | None) -> Any:
    """torch, to check and borrow the saved global RNG where the epoch's order was drawn from it
    (``used``; None: a state that does not say) or where torch is imported already; else None:
    the saved global RNG is not needed, and loading neither imports torch nor needs it."""
    if used is False:
        return sys.modules.get("torch")
    if used is None:
        why = ("the state does not say whether this epoch's order was drawn from torch's global RNG (it was saved "
               "before shmloader recorded random.torch_global_used), and torch was imported where it was saved")
    else:
        why = ("this epoch's order was drawn from torch's global RNG (a sampler with generator=None, torch "
               "imported), which random.torch_global holds")
    return _import_torch(why)


def _torch_state(encoded: Any, name: str, torch: Any) -> None:
    """A torch CPU generator state, base64: it must decode and (with ``torch``) be one torch can set."""
    try:
        raw = base64.b64decode(encoded, validate=True)
    except (binascii.Error, TypeError, ValueError):
        raise StateError(f"the state's {name} is not a base64 torch generator state: {encoded!r:.80}",
                         encoded, None) from None
    if torch is None:  # not needed here: the order did not come from it, and torch is not imported
        return
    try:
        torch.Generator().set_state(torch.frombuffer(bytearray(raw), dtype=torch.uint8).clone())
    except (RuntimeError, ValueError) as exc:
        raise StateError(f"the state's {name} is not a torch generator state torch can set "
                         f"({len(raw)} bytes): {exc}", len(raw), None) from None


def _unplain(value: Any) -> Any:
    """The inverse of ``state_random``'s encoding: ``{"ndarray": [...], "dtype": ...}`` is an array again."""
    if isinstance(value, dict):
        if set(value) == {"ndarray", "dtype"}:
            return np.asarray(value["ndarray"], dtype=value["dtype"])
        return {k: _unplain(v) for k, v in value.items()}
    return value


def _count(value: Any) -> bool:
    return type(value) is int and value >= 0


def _expect(ok: bool, name: str, value: Any, what: str) -> None:
    if not ok:
        raise StateError(f"the state's {name} must be {what}; got {value!r:.120}", value, what)


def _import_torch(why: str) -> Any:
    """torch, which drew the order in the saving process (``why`` says how), so it must draw it here too."""
    try:
        import torch
    except ImportError as exc:
        raise StateError(f"cannot load this state: {why}, so only torch can re-create the order, but torch cannot "
                         f"be imported here ({type(exc).__name__}: {exc}); load it where torch is installed", why,
                         None) from exc
    return torch
