"""An example shmloader plugin: variable-length token sequences, padded into the slot.

Registered through the ``shmloader`` entry-point group (see pyproject.toml), so installing the
package is all it takes: every loader's workers collate a field of :class:`Tokens` samples into
one :class:`PaddedTokens` — ``ids`` of shape ``(batch, longest)`` padded with ``PAD_ID``, and
``lengths`` — both written once, straight into the shared-memory slot through ``ctx.alloc``.

The hook is a plain module-level function named ``shmloader_collate_rules``; it runs once per
loader and once per worker start, never per batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = ["PAD_ID", "PaddedTokens", "Tokens", "collate_tokens", "shmloader_collate_rules"]

PAD_ID = 0


@dataclass(frozen=True)
class Tokens:
    """One sample's token ids: a 1-D integer array of any length."""

    ids: np.ndarray


@dataclass(frozen=True)
class PaddedTokens:
    """A batch of Tokens: ``ids`` (batch, longest), padded with PAD_ID, and each ``lengths``."""

    ids: np.ndarray
    lengths: np.ndarray


def collate_tokens(batch: Sequence[Tokens], ctx: Any) -> PaddedTokens:
    """The collate rule: pad every sample's ids into one array asked of ``ctx.alloc``."""
    lengths = ctx.alloc((len(batch),), np.dtype(np.int64))
    lengths[:] = [len(sample.ids) for sample in batch]
    dtype = np.result_type(*(sample.ids.dtype for sample in batch))
    ids = ctx.alloc((len(batch), int(lengths.max(initial=0))), dtype)
    for row, sample in zip(ids, batch):
        n = len(sample.ids)
        row[:n] = sample.ids
        row[n:] = PAD_ID
    return PaddedTokens(ids, lengths)


def shmloader_collate_rules() -> dict[type, Any]:
    """shmloader hook: collate Tokens with :func:`collate_tokens`."""
    return {Tokens: collate_tokens}
