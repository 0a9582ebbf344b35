"""An optional tqdm progress observer: batches and throughput of each epoch.

Runs in the main process; pass it explicitly, ``DataLoader(..., plugins=[Progress(total=...)])``.
tqdm is an optional extra (``pip install shmloader[progress]``): it is imported when the first
bar opens, and a missing tqdm is reported when ``Progress`` is made, not mid-epoch. Promises: one
bar per epoch (opened at its first batch, closed at its end), advanced once per batch, showing
batches/s and the bytes moved per second; tqdm's own refresh throttling keeps the per-batch cost
small.
"""

from __future__ import annotations

import importlib.util
from typing import Any

from shmloader.hookspecs import hookimpl


class Progress:
    """A tqdm bar per epoch. ``total``: batches per epoch (e.g. ``len(loader)``), if known."""

    def __init__(self, total: int | None = None, desc: str = "epoch", **tqdm_kwargs: Any) -> None:
        if importlib.util.find_spec("tqdm") is None:
            raise ImportError("Progress needs tqdm: pip install 'shmloader[progress]' (or tqdm)", name="tqdm")
        self.total = total
        self.desc = desc
        self.tqdm_kwargs = tqdm_kwargs
        self.bar: Any = None
        self._epoch = 0
        self._bytes = 0

    def _open(self) -> Any:
        from tqdm.auto import tqdm  # noqa: PLC0415  (optional dependency, imported on use)

        self._bytes = 0
        return tqdm(total=self.total, desc=f"{self.desc} {self._epoch}", unit="batch",
                    **self.tqdm_kwargs)

    @hookimpl
    def shmloader_batch_ready(self, nbytes: int) -> None:
        bar = self.bar
        if bar is None:
            bar = self.bar = self._open()
        self._bytes += nbytes
        bar.update(1)
        if bar.n == bar.last_print_n:  # tqdm just refreshed: refresh the throughput alongside
            elapsed = max(bar.format_dict["elapsed"], 1e-9)
            bar.set_postfix_str(f"{self._bytes / elapsed / 1e6:.1f} MB/s", refresh=False)

    @hookimpl
    def shmloader_epoch_end(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None
        self._epoch += 1

    def close(self) -> None:
        """Close a bar left open by an epoch that was abandoned early."""
        if self.bar is not None:
            self.bar.close()
            self.bar = None
