"""The GPU handoff: pin backends (torch, cupy, mlock, the fake one for tests), the loader's
pinning choice, the CUDA runtime's error clearing, and the device prefetcher ``to_device``.

Every backend object belongs to the process that made it: see docs/gpu.md.
"""
