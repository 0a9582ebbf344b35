"""The one factory that builds a loader's plugin manager, and the errors plugins cause.

Owns the pluggy ``PluginManager`` of one loader: the hook specifications
(:mod:`shmloader.hookspecs`), the built-in plugins (:mod:`shmloader.builtin`), the plugins found
through the ``shmloader`` entry-point group, and those passed as ``DataLoader(..., plugins=[...])``
— registered in that order, all the same way. Runs in the main process (one manager per loader)
and in each worker at start (:func:`worker_collate_rules`, which loads entry-point plugins there).

Promises:

- a plugin that fails pluggy's validation, names a ``shmloader_`` hook that does not exist,
  returns a malformed result or raises inside a hook raises :class:`PluginError` naming the plugin
  and the hook; the original exception is its ``__cause__``;
- a function named ``shmloader_<hook>`` is a hook implementation whether or not it is marked
  with :data:`shmloader.hookspecs.hookimpl` (the mark adds ``tryfirst``/``trylast``);
- an entry point may name a module, an object or a class (instantiated with no arguments, once per
  loader); the group is scanned once per ``sys.path``;
- ``SHMLOADER_DISABLE_PLUGIN_AUTOLOAD`` set true (as pytest's ``PYTEST_DISABLE_PLUGIN_AUTOLOAD``)
  loads no entry point, in the main process or the workers; explicit ``plugins=[...]`` still
  register. A value that is not a boolean is a :class:`~shmloader.errors.ConfigError` naming it.
"""

from __future__ import annotations

import importlib.metadata
import inspect
import os
import sys
from collections.abc import Iterable, Mapping
from types import TracebackType
from typing import Any

import pluggy

from shmloader import hookspecs
from shmloader.builtin.collate import RegisteredRules
from shmloader.builtin.stats import Stats
from shmloader.config import register_variable
from shmloader.config_fields import bool_switch
from shmloader.errors import PluginError

__all__ = ["ENTRY_POINT_GROUP", "PluginError", "Plugins", "build_plugin_manager", "plugin_name",
           "worker_collate_rules"]

ENTRY_POINT_GROUP = "shmloader"
_HOOK_PREFIX = "shmloader_"
# What every instance has from ``object`` (and its class's bookkeeping): never a hook implementation.
_NEVER_HOOKS = frozenset(dir(object)) | {"__dict__", "__module__", "__weakref__", "__slots__"}
ENV_NO_AUTOLOAD = "SHMLOADER_DISABLE_PLUGIN_AUTOLOAD"

_NO_AUTOLOAD = bool_switch(ENV_NO_AUTOLOAD, "1: load no plugin from the 'shmloader' entry-point group (default 0)")
register_variable(ENV_NO_AUTOLOAD, _NO_AUTOLOAD.meaning)


def autoload_enabled(environ: Mapping[str, str] | None = None) -> bool:
    """Whether entry-point plugins are loaded: not when ``SHMLOADER_DISABLE_PLUGIN_AUTOLOAD`` is true."""
    value = (os.environ if environ is None else environ).get(ENV_NO_AUTOLOAD)
    return value is None or not _NO_AUTOLOAD.from_env(value)  # set but empty: an error, as for every variable


class _Manager(pluggy.PluginManager):
    """pluggy's manager, also accepting unmarked functions named ``shmloader_<hook>``."""

    def parse_hookspec_opts(self, module_or_class: Any, name: str) -> Any:
        if not name.startswith(_HOOK_PREFIX):  # every spec is shmloader_<hook>: skip pluggy's MRO walk
            return None
        return super().parse_hookspec_opts(module_or_class, name)

    def parse_hookimpl_opts(self, plugin: Any, name: str) -> Any:
        if name in _NEVER_HOOKS:  # skips pluggy's MRO walk for them: one loader's 3 built-ins 1.2 -> 0.4 ms
            return None
        opts = super().parse_hookimpl_opts(plugin, name)
        if opts is None and name.startswith(_HOOK_PREFIX) and inspect.isroutine(getattr(plugin, name, None)):
            return {}
        return opts


class Plugins:
    """One loader's plugins: ``hook`` (the relay), ``stats`` and ``collate_rules()``."""

    def __init__(self) -> None:
        self.pm = _Manager(hookspecs.PROJECT)
        self.pm.add_hookspecs(hookspecs)
        self.hook = self.pm.hook
        self.stats = Stats()
        self.generation = 0  # bumped by every registration; Events rebuilds its call lists on change

    # -- registration ---------------------------------------------------------------------------
    def register(self, plugin: Any, name: str | None = None) -> str:
        """Register one plugin under a unique name; PluginError if pluggy refuses it."""
        if inspect.isclass(plugin):
            raise PluginError(f"plugin {plugin.__name__!r} is a class: pass an instance of it",
                              plugin=plugin.__name__, hook=None)
        name = self._unique(name or plugin_name(plugin))
        try:
            self.pm.register(plugin, name)
        except pluggy.PluginValidationError as exc:
            raise PluginError(f"plugin {name!r} failed validation: {exc}", plugin=name,
                              hook=_hook_named_in(str(exc))) from exc
        except ValueError as exc:  # already registered, or its name is blocked
            raise PluginError(f"plugin {name!r} was not registered: {exc}", plugin=name, hook=None) from exc
        except Exception as exc:  # reading one of its attributes raised (a property)
            raise PluginError(f"plugin {name!r} was not registered: reading its hooks raised "
                              f"{type(exc).__name__}: {exc}", plugin=name, hook=None) from exc
        self._check_known_hooks(plugin, name)
        self.generation += 1
        return name

    def _unique(self, name: str) -> str:
        candidate, n = name, 1
        while self.pm.has_plugin(candidate):
            n += 1
            candidate = f"{name}#{n}"
        return candidate

    def _check_known_hooks(self, plugin: Any, name: str) -> None:
        for caller in self.pm.get_hookcallers(plugin) or []:
            if not caller.has_spec():
                self.pm.unregister(plugin)
                raise PluginError(f"plugin {name!r} implements {caller.name!r}, which is not a shmloader hook "
                                  f"(known: {', '.join(_spec_names())})", plugin=name, hook=caller.name)

    def names(self) -> list[str]:
        """The registered plugins' names, in registration order."""
        return [name for name, _plugin in self.pm.list_name_plugin()]

    # -- calls ----------------------------------------------------------------------------------
    def collate_rules(self) -> dict[Any, Any]:
        """All plugins' collate rules, merged (plugin called first wins a shared key); once per loader."""
        merged: dict[Any, Any] = {}
        caller = self.hook.shmloader_collate_rules
        for impl in reversed(caller.get_hookimpls()):  # pluggy's call order
            try:
                rules = impl.function()
            except Exception as exc:
                raise self.error("shmloader_collate_rules", exc, plugin=impl.plugin_name) from exc
            for key, rule in _checked_rules(rules, impl.plugin_name).items():
                merged.setdefault(key, rule)
        return merged

    def first_result(self, hook: str, **kwargs: Any) -> tuple[str | None, Any]:
        """A ``firstresult`` hook's answer and the name of the plugin that gave it, in pluggy's order
        and argument selection (the name is None when none answered, or a wrapper made the call)."""
        caller = getattr(self.hook, hook)
        impls = caller.get_hookimpls()
        if any(impl.hookwrapper or impl.wrapper for impl in impls):
            try:
                return None, caller(**kwargs)
            except Exception as exc:
                raise self.error(hook, exc) from exc
        for impl in reversed(impls):  # pluggy's call order
            try:
                result = impl.function(*[kwargs[name] for name in impl.argnames])
            except Exception as exc:
                raise self.error(hook, exc, plugin=impl.plugin_name) from exc
            if result is not None:
                return impl.plugin_name, result
        return None, None

    def error(self, hook: str, exc: BaseException, plugin: str | None = None) -> PluginError:
        """The PluginError for ``exc`` raised by a ``hook`` call (its plugin found in the traceback)."""
        plugin = plugin or self._culprit(hook, exc.__traceback__) or "<unknown plugin>"
        return PluginError(f"plugin {plugin!r} raised in {hook}: {type(exc).__name__}: {exc}",
                           plugin=plugin, hook=hook)

    def _culprit(self, hook: str, tb: TracebackType | None) -> str | None:
        codes = {_code_of(impl.function): impl.plugin_name
                 for impl in getattr(self.hook, hook).get_hookimpls()}
        while tb is not None:
            name = codes.get(tb.tb_frame.f_code)
            if name is not None:
                return name
            tb = tb.tb_next
        return None


def build_plugin_manager(plugins: Iterable[Any] | None = None, *, entry_points: bool = True) -> Plugins:
    """THE factory: specs, then built-in, entry-point and explicit plugins, registered alike."""
    manager = Plugins()
    for name, plugin in _builtin_plugins(manager):
        manager.register(plugin, name)
    if entry_points and autoload_enabled():
        for name, plugin in load_entry_point_plugins():
            if not manager.pm.is_registered(plugin):
                manager.register(plugin, name)
    for plugin in plugins or ():
        if not manager.pm.is_registered(plugin):
            manager.register(plugin)
    return manager


def _builtin_plugins(manager: Plugins) -> list[tuple[str, Any]]:
    """The built-ins, registered first: the collate registry, stats, and the pin backends.

    ``shmloader.gpu.pinning.BuiltinPinPlugin`` is the plugin whose ``shmloader_pin_backend`` offers
    the built-in torch/cupy backends.
    """
    from shmloader.gpu import pinning  # noqa: PLC0415  (pinning imports no accelerator library at import)

    return [("shmloader.builtin.collate", RegisteredRules()),
            ("shmloader.builtin.stats", manager.stats),
            ("shmloader.builtin.pin", pinning.BuiltinPinPlugin())]


def worker_collate_rules(spec_rules: Mapping[Any, Any]) -> dict[Any, Any]:
    """In a worker at start: the spec's rules over those of the plugins loaded in this process."""
    local = build_plugin_manager().collate_rules()
    if not local:
        return dict(spec_rules)
    return {**local, **spec_rules}


# -- entry points --------------------------------------------------------------------------------

_scanned: dict[tuple[str, ...], list[importlib.metadata.EntryPoint]] = {}


def entry_point_list() -> list[importlib.metadata.EntryPoint]:
    """The ``shmloader`` group's entry points, sorted by name; scanned once per ``sys.path``."""
    key = tuple(sys.path)
    found = _scanned.get(key)
    if found is None:
        eps = importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)
        found = _scanned[key] = sorted({ep.name: ep for ep in eps}.values(), key=lambda ep: ep.name)
    return found


def load_entry_point_plugins() -> list[tuple[str, Any]]:
    """Load every entry point of the group: (name, plugin); a class is instantiated with no arguments."""
    loaded = []
    for ep in entry_point_list():
        try:
            obj = ep.load()
            plugin = obj() if inspect.isclass(obj) else obj
        except Exception as exc:
            raise PluginError(f"plugin {ep.name!r} (entry point {ep.value!r}) could not be loaded: "
                              f"{type(exc).__name__}: {exc}", plugin=ep.name, hook=None) from exc
        loaded.append((ep.name, plugin))
    return loaded


# -- helpers -------------------------------------------------------------------------------------


def plugin_name(plugin: Any) -> str:
    """The name a plugin is registered under by default: a module's name, else its class's."""
    if inspect.ismodule(plugin):
        return plugin.__name__
    return type(plugin).__name__


def _spec_names() -> list[str]:
    return sorted(n for n in vars(hookspecs) if n.startswith("shmloader_"))


def _hook_named_in(message: str) -> str | None:
    return next((n for n in _spec_names() if n in message), None)


def _code_of(fn: Any) -> Any:
    return getattr(getattr(fn, "__func__", fn), "__code__", None)


def _checked_rules(rules: Any, plugin: str) -> Mapping[Any, Any]:
    """A plugin's collate-rules result, validated: None, or a mapping type(s) -> callable."""
    if rules is None:
        return {}
    hook = "shmloader_collate_rules"
    if not isinstance(rules, Mapping):
        raise PluginError(f"plugin {plugin!r}: {hook} must return a mapping type -> rule or None, got "
                          f"{type(rules).__name__}", plugin=plugin, hook=hook)
    for key, rule in rules.items():
        types = key if isinstance(key, tuple) else (key,)
        if not types or not all(isinstance(t, type) for t in types) or not callable(rule):
            raise PluginError(f"plugin {plugin!r}: {hook} returned {key!r}: {rule!r}; keys must be types (or "
                              "tuples of types) and values rules callable as rule(batch, ctx)",
                              plugin=plugin, hook=hook)
    return rules
