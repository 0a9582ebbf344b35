"""A release fence that cannot be recorded: the slot is not rewritten under a copy that may run.

When a pinned batch's last view dies, the pin backend records a fence on the current stream; the
slot goes back to the ring once the fence has completed. If recording it raises (a CUDA error, a
device this thread cannot reach), nothing says the copies that read the slot are done. The slot
used to go back to the ring at once, to be rewritten by a worker while such a copy might still
read it. Now its segment is retired instead: the pin backend waits for the device before it unpins
it (torch: every device in use), then it is unmapped, and the slot gets a fresh segment.
"""

from __future__ import annotations

import gc
import logging
from typing import Any

import pytest
from ring_helpers import OWNER, leased

from shmloader.gpu.fake import FakeBackend
from shmloader.transport.ring import Ring

PAGE = 4096


class FenceFails(FakeBackend):
    def fence(self) -> Any:
        self._record("fence", "failed")
        raise RuntimeError("CUDA error: an illegal memory access was encountered")


def test_a_slot_whose_fence_failed_gets_a_fresh_segment(tmp_path: Any, caplog: pytest.LogCaptureFixture) -> None:
    fake = FenceFails()
    ring = Ring(str(tmp_path), on_create=fake.register_segment, on_retire=fake.unregister_segment, fence=fake.fence)
    try:
        slot = ring.grow(PAGE, OWNER)
        first = slot.segment.name
        buf = leased(ring, slot)
        with caplog.at_level(logging.WARNING, logger="shmloader"):
            del buf
            gc.collect()
        assert any("could not fence slot 0" in r.getMessage() and "illegal memory access" in r.getMessage()
                   for r in caplog.records)
        again = ring.take(PAGE, OWNER)
        assert again is slot and slot.segment.name != first  # never rewritten in place
        kinds = [(c.kind, c.target) for c in fake.calls]
        assert kinds.index(("unregister", first)) > kinds.index(("fence", "failed"))
        assert kinds[-1] == ("register", slot.segment.name)  # the fresh one, after the old one went
    finally:
        ring.close()
