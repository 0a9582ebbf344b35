"""The CUDA runtime library this process already loaded, for the one call torch does not bind.

Owns :func:`clear_last_error`. A failed runtime call such as ``cudaHostRegister`` leaves its
error as the thread's *last error*; torch's next kernel-launch check (``cudaGetLastError``) would
then report it as its own failure, far from its cause. torch clears such an error itself where it
expects one (``isPinnedPtr``), but its Python bindings (``torch.cuda.cudart()``) have no
``cudaGetLastError``, so the pin backend calls it here, in the same ``libcudart`` torch uses.

Promises: nothing is loaded that the process had not loaded already (the library is found in
``/proc/self/maps``); without one (no CUDA, another OS) every function is a no-op returning False.
Never raises.
"""

from __future__ import annotations

import ctypes
import functools
import os
from collections.abc import Iterable

__all__ = ["clear_last_error", "find_cudart"]

MAPS = "/proc/self/maps"


def find_cudart(maps_lines: Iterable[str]) -> str | None:
    """The path of the first ``libcudart.so*`` mapped, from lines in ``/proc/<pid>/maps`` form."""
    for line in maps_lines:
        fields = line.split(maxsplit=5)
        if len(fields) == 6:
            path = fields[5].strip()
            if os.path.basename(path).startswith("libcudart.so"):
                return path
    return None


@functools.cache
def _library() -> ctypes.CDLL | None:
    try:
        with open(MAPS, encoding="utf-8", errors="replace") as maps:
            path = find_cudart(maps)
        if path is None:
            return None
        lib = ctypes.CDLL(path, mode=getattr(os, "RTLD_NOLOAD", 0) | ctypes.RTLD_GLOBAL)
        lib.cudaGetLastError.restype = ctypes.c_int
        lib.cudaGetLastError.argtypes = []
        return lib
    except (OSError, AttributeError):
        return None


def clear_last_error() -> bool:
    """Reset the calling thread's CUDA last error (``cudaGetLastError``); False when no runtime."""
    lib = _library()
    if lib is None:
        return False
    lib.cudaGetLastError()
    return True
