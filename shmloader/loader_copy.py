"""What a pickled or copied ``DataLoader`` carries, and what it makes afresh.

Owns the loader's ``__getstate__``/``__setstate__`` contract. Runs wherever a loader is pickled or
copied (``mp.spawn`` and Lightning's ``ddp_spawn`` pickle the loaders they are handed;
``copy.deepcopy(loader)``) and where the copy is rebuilt. Promises:

- the copy carries the options, dataset, samplers, generator (in its current state), collate_fn,
  the epoch bookkeeping (epochs started, the latest epoch's record, a loaded resume) and the
  plugins passed to the constructor, so it iterates the batches the original would;
- the bookkeeping is the copy's own, ``copy.copy`` included: its ``state_dict()`` is the
  original's position when it was copied, and neither loader's iteration moves the other's;
- it never carries an iterator, worker, ring or plugin manager: the copy makes its own, as a new
  loader does (built-in and entry-point plugins registered again, stats from zero);
- a loader that holds its persistent iterator (``persistent_workers=True`` after ``iter()``, mid-epoch
  or between epochs, until ``close()`` or ``loader._iterator = None`` drops it) refuses to be
  pickled or deep-copied with ``NotImplementedError``, as torch's does (its iterator raises as the
  loader's ``__dict__`` is pickled): a copy without it would draw a new base seed where the original
  reuses its own, and would carry a record of an epoch it cannot go on with. ``copy.copy``, which
  torch allows (its copy shares the iterator), gives a copy that starts without it;
- a passed plugin that cannot be pickled (or deep-copied) raises ``PluginError`` naming it, the
  original error as ``__cause__``; a module passed as a plugin travels by name.
"""

from __future__ import annotations

import copy
import importlib
import inspect
import pickle
from typing import Any

from shmloader.errors import PluginError
from shmloader.plugins import plugin_name

# Made afresh by every loader object (DataLoader._start_machinery); never pickled or copied.
MACHINERY = frozenset({"_plugins", "_events", "_pin", "_book", "_iterator", "_persistent_iterator", "_live",
                       "_creator"})
_BOOK = "_book_fields"  # the epoch book's plain fields, carried under this key


def carried_state(loader: Any, shallow: bool = False) -> dict[str, Any]:
    """``loader.__getstate__()``: its ``__dict__`` without the machinery, the book's fields added.

    Raises NotImplementedError for a loader holding its persistent iterator, unless ``shallow``
    (``copy.copy``)."""
    iterator = loader._iterator
    if iterator is not None and not shallow:
        raise NotImplementedError(
            f"{type(iterator).__name__} cannot be pickled: this {type(loader).__name__} holds its persistent "
            "iterator (persistent_workers=True), whose workers cannot travel, and refuses to be pickled or "
            "deep-copied as torch's DataLoader does. Drop it first: loader.close(), or loader._iterator = None")
    users = loader._user_plugins
    carried = _CarriedPlugins(users)
    state = {k: carried if v is users else v for k, v in loader.__dict__.items() if k not in MACHINERY}
    state["_explicit"] = {k: carried if v is users else v for k, v in loader._explicit.items()}
    book = loader._book
    # a shallow copy gets its own record too: sharing it, its state_dict() would follow the original's epoch
    record = copy.deepcopy(book.record) if shallow else book.record
    state[_BOOK] = (book.epoch_count, record, book.resume)
    return state


def restore(loader: Any, state: dict[str, Any]) -> None:
    """``loader.__setstate__(state)``: the carried attributes, then the loader's own machinery."""
    epoch_count, record, resume = state.pop(_BOOK)
    loader.__dict__.update({k: _plain(v) for k, v in state.items()})
    loader._explicit = {k: _plain(v) for k, v in loader._explicit.items()}
    loader._start_machinery()
    book = loader._book
    book.epoch_count, book.record, book.resume = epoch_count, record, resume


def _plain(value: Any) -> Any:
    """The plugin list itself where a shallow copy (``copy.copy``) left the wrapper in place."""
    return value.plugins if isinstance(value, _CarriedPlugins) else value


class _CarriedPlugins:
    """The plugins passed to a loader, on their way into a pickle or a deep copy; it comes out as
    the plain list. Each plugin is checked on the way, so one that cannot go is named."""

    def __init__(self, plugins: list[Any]) -> None:
        self.plugins = plugins

    def __reduce_ex__(self, protocol: Any) -> tuple[Any, ...]:
        return list, ([_portable(p, protocol) for p in self.plugins],)

    def __deepcopy__(self, memo: dict[int, Any]) -> list[Any]:
        return [p if inspect.ismodule(p) else _copied(p, memo) for p in self.plugins]


class _ModuleByName:
    """A module plugin in a pickle: imported again by name where the loader is rebuilt."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __reduce__(self) -> tuple[Any, ...]:
        return importlib.import_module, (self.name,)


def _portable(plugin: Any, protocol: Any) -> Any:
    if inspect.ismodule(plugin):
        return _ModuleByName(plugin.__name__)
    try:
        pickle.dumps(plugin, protocol)
    except Exception as exc:
        raise _refused(plugin, "pickled", exc) from exc
    return plugin


def _copied(plugin: Any, memo: dict[int, Any]) -> Any:
    try:
        return copy.deepcopy(plugin, memo)
    except Exception as exc:
        raise _refused(plugin, "copied", exc) from exc


def _refused(plugin: Any, how: str, exc: Exception) -> PluginError:
    name = plugin_name(plugin)
    return PluginError(f"plugin {name!r} cannot be {how} with its loader: {type(exc).__name__}: {exc}. A pickled "
                       "or copied loader (mp.spawn, Lightning's ddp_spawn, copy.deepcopy) carries the plugins it "
                       "was given: make this one picklable, or give the copy its plugins when you build it",
                       plugin=name, hook=None)
