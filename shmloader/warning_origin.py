"""Which module a warning in torch's words says it comes from, so that a user's filters match it.

Owns :func:`warn`, which the loader's warnings in torch's words go through (the worker-number,
``pin_memory_device``, "no accelerator", DataPipe ``Shuffler`` and "Got pickle error" warnings).
Runs in the main process. Promises:

- Without ``torch_module`` (the numpy flavour), or when the frame that ``stacklevel`` names is
  not shmloader's own (a user's call), it is ``warnings.warn`` exactly.
- With ``torch_module`` (the torch flavour) and a frame of shmloader's own, the warning names
  ``torch_module`` — the module torch's loader emits it from — so a filter written for torch
  (``filterwarnings("ignore", module="torch.utils.data.dataloader")``, pytest's
  ``-W ignore::UserWarning:torch.utils.data.dataloader``, ``"error"`` alike) acts on ours as on
  torch's. Its file and line stay those of that frame (shmloader's, where the warning is given),
  and the "once per location" registry is that frame's module's, as ``warnings.warn`` would use,
  so Python's default filter still shows it once per location.

See docs/frameworks.md ("Warnings").
"""

from __future__ import annotations

import sys
import warnings

__all__ = ["TORCH_LOADER_MODULE", "warn"]

TORCH_LOADER_MODULE = "torch.utils.data.dataloader"


def warn(message: str, *, stacklevel: int = 1, torch_module: str | None = None,
         category: type[Warning] = UserWarning) -> None:
    """``warnings.warn(message, category, stacklevel)`` as seen from the caller, naming
    ``torch_module`` instead of a frame of shmloader's own (see the module docstring)."""
    try:
        frame = sys._getframe(stacklevel)  # the frame warnings.warn(stacklevel=stacklevel) names for our caller
    except ValueError:  # a stack shorter than that: warnings.warn names "sys", as it does
        frame = None
    if torch_module is None or frame is None or not _ours(frame.f_globals.get("__name__")):
        del frame
        warnings.warn(message, category, stacklevel=stacklevel + 1)
        return
    module_globals = frame.f_globals
    filename, lineno = frame.f_code.co_filename, frame.f_lineno
    del frame  # a frame kept in a local is a reference cycle
    warnings.warn_explicit(message, category, filename, lineno, module=torch_module,
                           registry=module_globals.setdefault("__warningregistry__", {}),
                           module_globals=module_globals)


def _ours(module: object) -> bool:
    return isinstance(module, str) and (module == "shmloader" or module.startswith("shmloader."))
