"""Resumable iteration: the saved state of a loader, its version, validation and restoring.

Owns the state format (plain, JSON-serialisable, versioned) and the ``EpochRecord`` each iterator
keeps of its epoch. Runs in the main process only. Promises, for map-style datasets: a state saved
at any point of an epoch and loaded into a loader of the same configuration (any ``num_workers``,
any ``in_order``) makes the next ``iter(loader)`` deliver exactly the batches that had not been
delivered, in the order an uninterrupted epoch would have, because it records

- the epoch number and the base seed (so per-task seeds, ``task_seed(base_seed, epoch, task)``,
  are the same);
- what re-creates the epoch's index order: the state of every random generator the loader and
  its samplers draw from, taken as the epoch starts, before ``iter(sampler)`` (torch's global RNG
  included when torch is imported), whether the base seed was then drawn from them, and
  ``state_dict()`` of the sampler, batch sampler (and its sampler) and dataset when they define one
  (a DistributedSampler without one: its epoch, ``state_objects``), taken when
  the epoch started;
- WHICH tasks had been delivered (ranges of task numbers), not how many: tasks in flight or held
  in the reorder buffer at save time are dispatched again, delivered ones never.

An iterable dataset is fast-forwarded instead: the first ``yielded`` batches are made again and
dropped. See docs/resume.md.
"""

from __future__ import annotations

import base64
import copy
import json
import random
import sys
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from shmloader.errors import StateError
from shmloader.state_config import check_config, config_of, type_name
from shmloader.state_fields import check_fields, check_ranges
from shmloader.state_objects import object_at, saved_objects, stateful
from shmloader.state_random import Snapshot, prepare_restore, take_random

__all__ = ["STATE_VERSION", "StateError", "TaskSet", "EpochRecord", "Resume", "loader_state", "load"]

STATE_VERSION = 1
FORMAT = "shmloader.DataLoader"
_KEYS = ("format", "version", "config", "epoch", "in_progress", "base_seed", "delivered", "yielded",
         "random", "objects")


class TaskSet:
    """Task numbers of one epoch, as ``[0, low)`` plus the few above ``low`` (the reorder window)."""

    __slots__ = ("low", "above")

    def __init__(self) -> None:
        self.low = 0
        self.above: set[int] = set()

    def add(self, task: int) -> None:
        if task < self.low:
            return
        if task != self.low:
            self.above.add(task)
            return
        self.low += 1
        while self.low in self.above:
            self.above.remove(self.low)
            self.low += 1

    def discard(self, task: int) -> None:
        """Take ``task`` out (a batch counted as handed out that was not, after all)."""
        if task < self.low:
            self.above.update(range(task + 1, self.low))
            self.low = task
        else:
            self.above.discard(task)

    def __contains__(self, task: object) -> bool:
        return isinstance(task, int) and (0 <= task < self.low or task in self.above)

    def __len__(self) -> int:
        return self.low + len(self.above)

    def to_ranges(self) -> list[list[int]]:
        """Half-open ``[start, stop)`` ranges, sorted and disjoint."""
        ranges = [[0, self.low]] if self.low else []
        for task in sorted(self.above):
            if ranges and ranges[-1][1] == task:
                ranges[-1][1] += 1
            else:
                ranges.append([task, task + 1])
        return ranges

    @classmethod
    def from_ranges(cls, ranges: Any) -> TaskSet:
        """The tasks of ``to_ranges()``'s form; anything else raises StateError naming ``delivered``."""
        check_ranges(ranges)
        tasks = cls()
        for start, stop in ranges:
            if start == 0:
                tasks.low = stop
            else:
                tasks.above.update(range(start, stop))
        return tasks


@dataclass(frozen=True)
class Resume:
    """A loaded mid-epoch state, waiting for the next ``iter(loader)``."""

    epoch: int
    base_seed: int
    delivered: TaskSet
    yielded: int
    torch_global: bytes | None
    seed_drawn: bool  # the saved epoch drew its base seed after iter(sampler): the resume draws it again
    torch_first: bytes | None  # torch's global RNG at the saved epoch's first next(), if not what start left
    state: dict[str, Any]


@dataclass
class EpochRecord:
    """What one epoch needs to be resumed; kept by the loader, so it outlives the iterator."""

    epoch: int
    base_seed: int
    objects: dict[str, Any]
    random: Snapshot  # as the epoch started, before iter(sampler)
    unsaveable: str | None
    delivered: TaskSet = field(default_factory=TaskSet)
    yielded: int = 0
    finished: bool = False


# -- taking an epoch's record (epoch_book.EpochBook calls these) -----------------------------------
def object_states(loader: Any) -> dict[str, Any]:
    """Copies of ``state_dict()`` of the objects ``state_objects.saved_objects`` finds, taken
    now (an epoch's start): what those objects change afterwards, in the dict they returned too,
    does not reach the copies. One that cannot be copied is kept as an ``_Uncopied``, which saving
    refuses by name; iterating goes on."""
    return {name: _copied(name, obj) for name, obj in saved_objects(loader).items()}


@dataclass(frozen=True)
class _Uncopied:
    """Stands for a state_dict() that deepcopy refused: why, for the StateError saving raises."""

    message: str


def _copied(name: str, obj: Any) -> Any:
    try:
        return _python_scalars(copy.deepcopy(obj.state_dict()))
    except Exception as exc:  # what state_dict() returned holds a lock, a file, a generator object...
        return _Uncopied(f"cannot save the loader state: the {name}'s state_dict() ({type_name(obj)}) could not "
                         f"be copied when the epoch started ({type(exc).__name__}: {exc}); it must return plain "
                         "values (dict, list, str, int, float, bool, None)")


def _python_scalars(value: Any) -> Any:
    """``value`` with each numpy scalar (an ``np.float64`` level, an ``np.int64`` offset: what numpy
    arithmetic makes) as the Python value it holds, through dicts, lists and tuples: the state is
    plain data, which JSON takes and ``torch.load(weights_only=True)``, torch's default, loads."""
    if isinstance(value, np.generic):
        return value.item()
    kind = type(value)
    if kind is dict:
        return {_python_scalars(k): _python_scalars(v) for k, v in value.items()}
    if kind is list or kind is tuple:
        return kind(_python_scalars(v) for v in value)
    return value


def new_record(loader: Any, book: Any, base_seed: int, objects: dict[str, Any], random: Snapshot,
               resume: Resume | None) -> EpochRecord:
    """Number the epoch; ``random`` is its random sources as it started (before ``iter(sampler)``)."""
    epoch = resume.epoch if resume is not None else book.epoch_count
    record = EpochRecord(epoch, base_seed, objects, random, _unsaveable(loader))
    if resume is not None:
        record.delivered = TaskSet.from_ranges(resume.delivered.to_ranges())
        record.yielded = resume.yielded
    book.epoch_count = epoch + 1
    book.record = record
    return record


def peeked(it: Iterator[Any]) -> Iterator[Any]:
    """Take the sampler's first item now, so its first draw happens while the epoch starts, where
    torch's multi-process iterator makes it (it sends its first tasks at ``iter()``).

    The rest is read with ``next()`` only, as torch reads a sampler iterator: ``chain`` would call
    ``iter()`` on it again, and an iterator whose ``__iter__`` restarts it (Lightning's
    ``_IndexBatchSamplerWrapper`` for ``predict``) would then yield its first batch twice.
    """
    try:
        first = next(it)
    except StopIteration:
        return iter(())
    return _then_the_rest(first, it)


def _then_the_rest(first: Any, it: Iterator[Any]) -> Iterator[Any]:
    """``first``, then every item of ``it`` by ``next()`` alone; an item is never compared with
    anything (``iter(callable, sentinel)`` compares each with ``==``, which an index array of a
    bucketing batch sampler answers element-wise)."""
    yield first
    while True:
        try:
            item = next(it)
        except StopIteration:
            return
        yield item


# -- saving --------------------------------------------------------------------------------------
def loader_state(loader: Any, record: EpochRecord | None = None) -> dict[str, Any]:
    """The state of ``record``'s epoch (default: the loader's latest), or of the next epoch's start.

    Between epochs, ``base_seed`` is the seed the next epoch will reuse (a persistent iterator
    keeps its base seed, as torch's does) or None when the next ``iter()`` draws a new one; with
    it the loaded loader continues its generators exactly as the saving one would have.
    """
    book = loader._book
    if record is None and book.resume is not None:
        return json.loads(json.dumps(book.resume.state))
    record = record if record is not None else book.record
    if record is not None and record.finished and record.epoch + 1 != book.epoch_count:
        # the start of the epoch after it is gone: the generators have drawn a later epoch since
        raise StateError(f"cannot save the state of an iterator whose epoch {record.epoch} has ended after a later "
                         f"epoch has started (epoch {book.epoch_count - 1}): that epoch's own iterator, or the "
                         "loader, has the state to save")
    if record is None or record.finished:
        state = _state(loader, book.epoch_count, False, book.reused_seed, [], 0,
                       _next_epoch_random(loader), object_states(loader))
    else:
        if record.unsaveable:
            raise StateError(record.unsaveable)
        state = _state(loader, record.epoch, True, record.base_seed, record.delivered.to_ranges(),
                       record.yielded, record.random.encoded(), copy.deepcopy(record.objects))
    for value in state["objects"].values():
        if isinstance(value, _Uncopied):
            raise StateError(value.message)
    try:
        json.dumps(state)
    except (TypeError, ValueError) as exc:
        raise StateError(f"the loader state is not JSON-serialisable ({exc}); a sampler's or dataset's "
                         "state_dict() must return plain values (dict, list, str, int, float, bool, None)") from exc
    return state


def _next_epoch_random(loader: Any) -> dict[str, Any]:
    """Between epochs: the generators as the next epoch will start from them (nothing drawn yet)."""
    return Snapshot(take_random(loader), None).encoded()


def _state(loader: Any, *values: Any) -> dict[str, Any]:
    """epoch, in_progress, base_seed, delivered, yielded, random, objects → the versioned state."""
    return {"format": FORMAT, "version": STATE_VERSION, "config": config_of(loader), **dict(zip(_KEYS[3:], values))}


# -- loading -------------------------------------------------------------------------------------
def load(loader: Any, state: Mapping[str, Any]) -> None:
    """Check ``state`` against ``loader``, restore samplers, dataset and generators, arm the resume.

    Everything is checked before anything is restored; an object whose ``load_state_dict``
    refuses its state (raises) has the objects loaded before it put back, and nothing else restored.
    """
    check(loader, state)
    delivered = TaskSet.from_ranges(state["delivered"])
    random = state["random"]  # check() imported torch already where its generators made the order
    # without torch (check() found the order did not come from it) there is no global RNG to borrow
    borrow = sys.modules.get("torch") is not None
    restore_sources(loader, state)
    loader.close()  # persistent workers restart with the restored dataset
    book = loader._book
    book.record, book.resume, book.epoch_count = None, None, state["epoch"]
    if state["in_progress"] or state["base_seed"] is not None:  # mid-epoch, or a seed to reuse
        torch_global, torch_first = random.get("torch_global"), random.get("torch_global_first_batch")
        book.resume = Resume(state["epoch"], state["base_seed"], delivered, state["yielded"],
                             None if torch_global is None or not borrow else base64.b64decode(torch_global),
                             random.get("base_seed_drawn", False),
                             None if torch_first is None or not borrow else base64.b64decode(torch_first),
                             json.loads(json.dumps(dict(state))))


def restore_sources(loader: Any, state: Mapping[str, Any]) -> None:
    """Put back the sampler, batch sampler and dataset states and the generators of a checked
    ``state``: all of them, or (StateError, or an object's own error) none. The configuration is
    checked again once the objects are loaded: a length ``check`` left to them must match now."""
    targets = [(_object_target(loader, name, saved), saved) for name, saved in state["objects"].items()]
    put_back = prepare_restore(loader, state["random"]["sources"])
    loaded = _load_objects(targets)
    try:
        check_config(loader, state, lengths_may_follow=False)
    except StateError:
        _unload(loaded)
        raise
    for setter in put_back:
        setter()


def _object_target(loader: Any, name: str, saved: Any) -> Any:
    """The loader's object at ``name`` (state_objects.PATHS), which must take a saved state_dict."""
    target: Any = stateful(object_at(loader, name))
    if target is None:
        raise StateError(f"the state holds a {name} state_dict but this loader's {name} "
                         f"({type_name(object_at(loader, name))}) has no load_state_dict", saved, None)
    return target


def _load_objects(targets: list[tuple[Any, Any]]) -> list[tuple[Any, Any]]:
    """``load_state_dict`` on each target, all or none: if one raises, the ones loaded before it get
    back the ``state_dict()`` they had, and its error is raised. Returns each target with that
    earlier state, for ``_unload``."""
    loaded: list[tuple[Any, Any]] = []
    try:
        for target, saved in targets:
            before = copy.deepcopy(target.state_dict())
            target.load_state_dict(saved)
            loaded.append((target, before))
    except BaseException:
        _unload(loaded)
        raise
    return loaded


def _unload(loaded: list[tuple[Any, Any]]) -> None:
    for target, before in reversed(loaded):
        target.load_state_dict(before)


def check(loader: Any, state: Mapping[str, Any]) -> None:
    """Raise StateError (both sides printed) unless ``state`` is a state this loader can resume;
    lengths that only the state's own objects may change are checked again once they are loaded."""
    if not isinstance(state, Mapping) or state.get("format") != FORMAT:
        got = state.get("format") if isinstance(state, Mapping) else type(state).__name__
        raise StateError(f"not a shmloader DataLoader state: format is {got!r}, expected {FORMAT!r}", got, FORMAT)
    if type(state.get("version")) is not int or state.get("version") != STATE_VERSION:  # True == 1 is no version
        raise StateError(f"state version {state.get('version')!r} cannot be loaded: this shmloader reads "
                         f"version {STATE_VERSION}", state.get("version"), STATE_VERSION)
    missing = [k for k in _KEYS if k not in state]
    if missing:
        raise StateError(f"the state lacks {', '.join(missing)} (saved keys: {', '.join(sorted(state))})")
    check_fields(state)
    check_config(loader, state, lengths_may_follow=bool(state["objects"]))


# -- what cannot be saved ---------------------------------------------------------------------
_SAMPLERS = ("sampler", "batch_sampler", "batch_sampler.sampler")  # where an order is drawn


def _unsaveable(loader: Any) -> str | None:
    """Why this epoch's order cannot be re-created, if it cannot: a sampler without ``state_dict``
    drawing from a source the state cannot hold."""
    for path in _SAMPLERS:
        sampler = object_at(loader, path)
        if sampler is None or callable(getattr(sampler, "state_dict", None)):  # it saves what it draws from
            continue
        generator = getattr(sampler, "generator", 0)
        if isinstance(generator, (random.Random, np.random.RandomState)):  # stateful, but not saved here
            return (f"cannot save the position of this epoch: the {path} ({type(sampler).__name__}) draws its order "
                    f"from its generator attribute, a {type(generator).__name__}, whose state a loader state does "
                    "not hold, so the order cannot be re-created. Use a numpy.random.Generator "
                    f"(numpy.random.default_rng(seed)) or a torch.Generator there, or give the {path} "
                    "state_dict()/load_state_dict().")
        if generator is None and path != "batch_sampler" and sys.modules.get("torch") is None:
            # a None there hides torch too: the sampler drew without it
            return (f"cannot save the position of this epoch: {type(sampler).__name__} with generator=None "
                    "draws its order from fresh OS entropy when torch is not imported, so the order cannot be "
                    "re-created. Pass generator= (an int seed, numpy or torch Generator) to make it resumable.")
    return None
