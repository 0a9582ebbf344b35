"""Pinning: registering slots with an accelerator once, so batches are pinned with no copy.

Placeholder wiring until the pin backends land: ``select`` returns None (no backend), and
``accelerator_available`` says whether torch sees an accelerator.
"""

from __future__ import annotations

import sys
from typing import Any, Protocol

from .segment import Segment


class PinBackend(Protocol):
    def register_segment(self, segment: Segment) -> None: ...
    def unregister_segment(self, segment: Segment) -> None: ...
    def finish(self, batch: Any) -> Any: ...


def accelerator_available() -> bool:
    torch = sys.modules.get("torch")
    if torch is None:
        return False
    try:
        return bool(torch.accelerator.is_available())
    except AttributeError:
        return bool(torch.cuda.is_available())


def select(pin_memory: bool, plugins: Any) -> PinBackend | None:
    return None


def pin_copy(batch: Any) -> Any:
    from torch.utils.data._utils.pin_memory import pin_memory

    return pin_memory(batch)
