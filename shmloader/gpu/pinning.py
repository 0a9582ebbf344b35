"""Pinning: choosing the backend that registers each slot once, so batches are pinned with no copy.

Owns the selection of a pin backend for a loader (:func:`select`, :func:`backend_for`), the
built-in answer to the ``shmloader_pin_backend`` hook (:func:`builtin_pin_backend` and
:class:`BuiltinPinPlugin`, which the plugin manager registers like any plugin), the
``SHMLOADER_PIN_BACKEND`` variable, and torch's "no accelerator" warning. The backends themselves
live in ``gpu.backends`` (torch), ``gpu.cupy_backend``, ``gpu.mlock`` and ``gpu.fake`` (CI).

Runs in the main process only. Promises:

- Selection order: a backend named explicitly (``name=`` or ``SHMLOADER_PIN_BACKEND``) > the
  first plugin that answers ``shmloader_pin_backend`` > built-in: torch when
  ``torch.cuda.is_available()``, else cupy when it sees a device, else none.
- One selection per loader (the hook is called once per loader); ring hooks are wired in
  ``loader_services.ring_maker``: ``register_segment`` when a segment is created (new slot or growth),
  ``unregister_segment`` when it is retired, which the ring does before it unlinks and unmaps —
  also at ``close()`` for a segment whose batch the user still holds (see docs/gpu.md).
- ``pin_memory=True`` with nothing to pin for a device warns in torch's words, as torch does, at
  each iterator the loader makes (every ``iter()`` but a persistent iterator's restart), and the
  batches stay correct (unpinned). An accelerator that no backend registers slots for (XPU:
  the built-ins register for CUDA only) gets each batch pinned by torch's copy, as torch does; on
  MPS torch switches pinning off with its warning, and so does shmloader.
- ``SHMLOADER_PIN_BACKEND`` is read only where ``pin_memory=True``: a value that is not a backend,
  or names one that cannot work here, raises ConfigError at ``iter()`` with workers or without
  (:func:`check_requested`). Importing this module imports neither torch nor cupy.

Per-loader state is one attribute of the loader, ``_pin`` (a :class:`PinState`: the backend
selected by :func:`backend_for`). Whether torch sees an
accelerator is asked once per process, a forked child asking for itself (:func:`accelerator_available`).
"""

from __future__ import annotations

import functools
import importlib.util
import inspect
import os
import sys
from dataclasses import dataclass
from typing import Any

import numpy as np

from shmloader.config import register_variable
from shmloader.errors import ConfigError, PluginError
from shmloader.gpu.backends import PinBackend, TorchCudaBackend, Transfer
from shmloader.gpu.batch_tree import iter_leaves, map_batch
from shmloader.gpu.cupy_backend import CupyBackend
from shmloader.gpu.mlock import MlockBackend
from shmloader.warning_origin import warn

__all__ = [
    "BACKEND_NAMES", "BuiltinPinPlugin", "PinBackend", "Transfer", "accelerator_available", "accelerator_type",
    "backend_for", "builtin_pin_backend", "check_requested", "check_usable", "make_backend", "pin_copy",
    "refuse_cuda_in_bad_fork", "requested_backend", "select", "torch_pins", "warn_if_unpinned",
]

ENV_BACKEND = "SHMLOADER_PIN_BACKEND"
BACKEND_NAMES = ("auto", "torch", "cupy", "mlock", "fake", "none")
NO_ACCELERATOR = ("'pin_memory' argument is set as true but no accelerator is found, then device pinned "
                  "memory won't be used.")
MPS_UNSUPPORTED = ("'pin_memory' argument is set as true but not supported on MPS now, device pinned memory "
                   "won't be used.")

register_variable(ENV_BACKEND, "pin backend for pin_memory=True: " + "|".join(BACKEND_NAMES) + " (default auto)")



def _installed(module: str) -> bool:
    """Whether ``module`` can be imported: imported already, or found; a ``None`` left in
    ``sys.modules`` (the usual way to hide a package) reads as not installed."""
    if module in sys.modules:
        return sys.modules[module] is not None
    return importlib.util.find_spec(module) is not None


@functools.cache
def accelerator_available() -> bool:
    """Whether torch sees an accelerator (torch is imported here only if installed).

    Asked once per process, so a per-batch call is a lookup; a forked child asks again (the cache
    is cleared there), as torch's loader asks in whatever process it runs.
    """
    if not _installed("torch"):
        return False
    import torch

    try:
        return bool(torch.accelerator.is_available())
    except AttributeError:
        return bool(torch.cuda.is_available())


os.register_at_fork(after_in_child=accelerator_available.cache_clear)


@functools.cache
def accelerator_type() -> str | None:
    """The type of torch's current accelerator (``"cuda"``, ``"mps"``, ...), None without one;
    asked once per process, as :func:`accelerator_available`."""
    if not accelerator_available():
        return None
    import torch

    try:
        current = torch.accelerator.current_accelerator()
    except AttributeError:  # a torch older than torch.accelerator: only CUDA counted
        return "cuda"
    return None if current is None else str(current.type)


os.register_at_fork(after_in_child=accelerator_type.cache_clear)


def torch_pins() -> bool:
    """Whether torch's loader pins batches here: with an accelerator, but not MPS, where its
    pin_memory fails and torch switches pinning off with a warning (pytorch#86060)."""
    return accelerator_available() and accelerator_type() != "mps"


def _cuda_in_bad_fork() -> bool:
    """Whether this process was forked after torch initialised CUDA in its parent (asking
    ``torch.cuda.is_available()`` does): every CUDA call raises here. Never imports torch."""
    torch = sys.modules.get("torch")
    in_bad_fork = getattr(getattr(torch, "cuda", None), "_is_in_bad_fork", None)
    return bool(in_bad_fork()) if callable(in_bad_fork) else False


def refuse_cuda_in_bad_fork(name: str) -> None:
    """torch's RuntimeError when backend ``name`` would pin through CUDA in a process forked after
    CUDA was initialised: torch's DataLoader raises it at ``iter()`` there (with workers) or at
    the first batch (without), and pinning through torch here would fail at every call."""
    if name not in ("auto", "torch") or not _cuda_in_bad_fork():
        return
    if name == "auto" and not accelerator_available():
        return
    raise RuntimeError("Cannot re-initialize CUDA in forked subprocess. To use CUDA with multiprocessing, you must "
                       "use the 'spawn' start method (shmloader: pin_memory=True in a process forked after its "
                       "parent initialised CUDA; build the loader in a spawned process, or with pin_memory=False)")


def requested_backend(name: str | None = None, environ: Any = None) -> str:
    """The backend asked for: ``name`` if given, else ``SHMLOADER_PIN_BACKEND``, else "auto".

    The one parser of the variable (loaders and ``doctor`` both call it): any case, surrounding
    blanks ignored; another value raises ConfigError naming the variable and the value as given.
    """
    env = os.environ if environ is None else environ
    source = "pin backend" if name is not None else ENV_BACKEND
    raw = name if name is not None else env.get(ENV_BACKEND, "auto")
    value = raw.strip().lower()
    if not raw.isascii() or value not in BACKEND_NAMES:  # lower() maps the Kelvin sign onto 'k'
        raise ConfigError(f"{source}={raw!r} is not a pin backend; expected one of {', '.join(BACKEND_NAMES)}",
                          name=source, value=raw)  # fmt: skip
    return value


def check_usable(name: str) -> None:
    """Raise ConfigError when backend ``name`` cannot work here: torch or cupy seeing no CUDA device."""
    if name not in ("torch", "cupy"):
        return
    cls: type[TorchCudaBackend] | type[CupyBackend] = TorchCudaBackend if name == "torch" else CupyBackend
    if not _installed(name) or not cls.usable():
        raise ConfigError(f"pin backend {name!r} was asked for ({ENV_BACKEND} or pin backend) but "
                          f"{name} sees no CUDA device here", name=ENV_BACKEND, value=name)  # fmt: skip


def make_backend(name: str) -> PinBackend | None:
    """Build a backend by name ("none" gives None). Raises ConfigError when it cannot work here."""
    if name == "none":
        return None
    if name == "fake":
        from shmloader.gpu.fake import FakeBackend

        return FakeBackend()
    if name == "mlock":
        return MlockBackend()
    check_usable(name)
    return TorchCudaBackend() if name == "torch" else CupyBackend()


def check_requested(loader: Any) -> None:
    """At each ``iter(loader)``: a ``SHMLOADER_PIN_BACKEND`` that is not a backend, or names one
    that cannot work here, raises the same ConfigError whatever ``num_workers``.

    With workers the selection (:func:`backend_for`, with the loader's first ring) reads the
    variable and raises. Without workers batches are not in slots and torch's copy pins them
    (:func:`pin_copy`), so no backend is built, but the variable is read and checked here all
    the same. With ``pin_memory=False`` it is not read at all. In a child forked after CUDA was
    initialised, torch's RuntimeError (:func:`refuse_cuda_in_bad_fork`), before any worker starts.
    """
    if not loader.pin_memory:
        return
    name = requested_backend()
    if loader.num_workers == 0:
        check_usable(name)
    refuse_cuda_in_bad_fork(name)


def builtin_pin_backend(device: str = "") -> PinBackend | None:
    """The built-in choice: torch when it sees CUDA, else cupy when it sees a device, else None."""
    if _installed("torch") and TorchCudaBackend.usable():
        return TorchCudaBackend()
    if _installed("cupy") and CupyBackend.usable():
        return CupyBackend()
    return None


class BuiltinPinPlugin:
    """The built-in backends as a plugin: implements ``shmloader_pin_backend(device)``.

    The plugin manager registers an instance first (so every other plugin is asked before it);
    mark the method with ``hookspecs.hookimpl`` there if the manager requires markers.
    """

    def shmloader_pin_backend(self, device: str) -> PinBackend | None:
        return builtin_pin_backend(device)


def select(pin_memory: bool, plugins: Any, *, device: str = "", name: str | None = None) -> PinBackend | None:
    """The pin backend for a loader, or None (see the module docstring for the order).

    ``plugins`` is the loader's plugin manager, whose hook already asks the built-ins last
    (:class:`BuiltinPinPlugin`): its answer is final. One without a ``shmloader_pin_backend``
    hook (the placeholder) leaves the choice to the built-ins.
    """
    if not pin_memory:
        return None
    requested = requested_backend(name)
    if requested != "auto":
        return make_backend(requested)
    hook = getattr(getattr(plugins, "hook", None), "shmloader_pin_backend", None)
    if hook is None:
        return builtin_pin_backend(device)
    # a plugin's failure, or an answer that is not a backend, is a PluginError naming the plugin
    first_result = getattr(plugins, "first_result", None)
    plugin, offered = (None, hook(device=device)) if first_result is None else \
        first_result("shmloader_pin_backend", device=device)  # fmt: skip
    if offered is not None and (inspect.isclass(offered) or not all(hasattr(offered, a) for a in _BACKEND_API)):
        name = plugin or "<unknown plugin>"
        raise PluginError(f"plugin {name!r}: shmloader_pin_backend must return a pin backend (an object with "
                          f"{', '.join(_BACKEND_API)}) or None, got {offered!r}", plugin=name,
                          hook="shmloader_pin_backend")
    return offered


_BACKEND_API = ("register_segment", "unregister_segment", "finish", "fence", "device_pinned")


@dataclass
class PinState:
    """A loader's pinning, its one attribute ``loader._pin``: the backend (chosen once, None being a
    choice too)."""

    backend: PinBackend | None = None
    chosen: bool = False
    copy: bool = False  # no backend chosen by "auto", yet torch sees an accelerator: pin by a copy


def backend_for(loader: Any) -> PinBackend | None:
    """The loader's pin backend, selected once per loader and then reused by every ring."""
    return choose(loader._pin, loader.pin_memory, loader._plugins, loader.pin_memory_device or "")


def choose(pin: PinState, pin_memory: bool, plugins: Any, device: str) -> PinBackend | None:
    """``pin``'s backend (None without ``pin_memory``), selected on the first call, kept after."""
    if not pin_memory:
        return None
    if not pin.chosen:
        pin.backend = select(True, plugins, device=device)
        # e.g. XPU: no backend registers slots there, so torch's copy pins, as torch's loader does
        pin.copy = pin.backend is None and requested_backend() == "auto" and torch_pins()
        pin.chosen = True
    return pin.backend


def will_pin(loader: Any) -> bool:
    """Whether the loader's batches will be pinned for a device."""
    if loader.num_workers == 0:
        return torch_pins()  # torch's pin_memory copy, as torch does
    backend = backend_for(loader)
    return loader._pin.copy or (backend is not None and bool(getattr(backend, "device_pinned", False)))


def warn_if_unpinned(loader: Any, stacklevel: int = 3) -> None:
    """torch's warning when ``pin_memory=True`` finds no accelerator, or MPS (where torch switches
    pinning off), given at each call as torch gives it at each new iterator (not when there is
    another accelerator and the user named a backend that does not pin for it: the words would be
    false). The caller is the loader's ``_get_iterator``, the frame ``stacklevel`` names (torch's
    iterator warns from its own module); the torch flavour names torch's module there
    (shmloader/warning_origin.py)."""
    if not loader.pin_memory or will_pin(loader) or torch_pins():
        return
    warn(MPS_UNSUPPORTED if accelerator_type() == "mps" else NO_ACCELERATOR, stacklevel=stacklevel,
         torch_module=getattr(loader, "_warning_module", None))


def pin_copy(batch: Any) -> Any:
    """``num_workers=0``: copy into pinned memory as torch does (the batch is not in a slot).

    torch's ``pin_memory`` pins tensors (and whatever has a ``pin_memory()``) and passes numpy
    arrays through; a numpy array is copied here into pinned memory of its own (``pinned_host``),
    so a numpy batch is pinned without workers as it is with them (its slot is registered). The
    copy keeps dtype, shape and values; its memory lives as long as the array does.
    """
    from torch.utils.data._utils.pin_memory import pin_memory

    pinned = pin_memory(batch)
    if any(isinstance(leaf, np.ndarray) for leaf in iter_leaves(pinned)):
        pinned = map_batch(pinned, _pinned_array)
    return pinned


def pinned_host(nbytes: int) -> np.ndarray:
    """``nbytes`` of page-locked host memory, as a uint8 array that keeps its allocation alive
    (torch's pinned allocator: the array's base is the tensor that owns the memory)."""
    import torch

    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True).numpy()


def _pinned_array(leaf: Any) -> Any:
    if not isinstance(leaf, np.ndarray) or leaf.dtype.hasobject or not leaf.dtype.itemsize:
        return leaf  # objects are pointers into the heap: nothing a device copy could use
    out = pinned_host(leaf.nbytes).view(leaf.dtype).reshape(leaf.shape)
    np.copyto(out, leaf)
    return out
