"""The built-in plugins, registered by the plugin factory exactly as third-party plugins are.

- :mod:`.collate` — collate rules registered in this process (``register_collate_rule``),
  contributed so they reach spawn/forkserver workers;
- :mod:`.stats` — the stats observer behind ``loader.stats()``;
- ``shmloader.builtin.pin`` — the pin backends, registered from ``shmloader.gpu.pinning.BuiltinPinPlugin``;
- :mod:`.progress` — an optional tqdm progress observer (not registered by default; pass
  ``plugins=[Progress()]``).

Nothing here imports torch or tqdm at import time.
"""
