"""The docs' figures that do not depend on the machine are what the code gives today.

Timings move with the machine and its load (docs/performance.md says how to rerun them); sizes and
the design constants the docs quote do not, so each is checked here against what it describes:

- the reply sizes of docs/design/descriptor-protocol.md (its own ``python -c`` line, both batches);
- the pickled sizes of a resume state with and without a ``generator=`` (docs/resume.md);
- the slot sizes, growth factor, reservation step, shrink band, split threshold and shutdown
  deadlines that the design notes and docs/config.md state in words.
"""

from __future__ import annotations

import mmap
import pickle
import re
from pathlib import Path

import pytest

from shmloader.collate.heap_pool import REUSE_MIN_BYTES
from shmloader.collate.threads import SPLIT_MIN_BYTES
from shmloader.engine import reaping, workers
from shmloader.engine.growth import CHUNK_BYTES
from shmloader.engine.mp_iterator import _BROKEN_GRACE_S, FIRST_SLOT_BYTES
from shmloader.engine.slot_size import GROWTH
from shmloader.engine.stepguard import CLOSE_WAIT_S
from shmloader.transport import codec, wire
from shmloader.transport.alloc import SlotAllocator
from shmloader.transport.messages import Filled
from shmloader.transport.ring_reclaim import SHRINK

REPO = Path(__file__).resolve().parents[1]
MIB = 1 << 20


def doc(name: str) -> str:
    """One page's text, its lines joined so that a phrase may span a line break."""
    return " ".join((REPO / name).read_text(encoding="utf-8").split())


def stated(text: str, pattern: str) -> str:
    """The one group of ``pattern``, which must occur in ``text``: the figure the page states."""
    found = re.search(pattern, text)
    assert found is not None, f"the docs no longer say {pattern!r}"
    return found.group(1)


def reply_size(batch_of: str) -> int:
    """Bytes of a ``tiny`` batch's reply frame, as the descriptor page's command prints them."""
    alloc = SlotAllocator(mmap.mmap(-1, MIB), MIB)
    x, y = alloc((64, 16), "f4"), alloc((64,), "i8")
    batch = (x, y) if batch_of == "tuple" else {"x": x, "y": y}
    desc, nbytes = codec.encode(batch, alloc)
    return len(wire.reply_frame(Filled(0, 7, 1, desc, nbytes, 0.0, 0.0, alloc.pos)))


def test_the_descriptor_page_states_the_reply_sizes_its_command_prints() -> None:
    text = doc("docs/design/descriptor-protocol.md")
    assert int(stated(text, r"(\d+) for a tuple of two arrays")) == reply_size("tuple")
    assert int(stated(text, r"(\d+) for a dict of the same two")) == reply_size("dict")


def state_size(with_generator: bool) -> int:
    """Pickled bytes of a shuffled torch-flavour loader's state one batch in (docs/resume.md)."""
    torch = pytest.importorskip("torch")
    import shmloader.torch as st

    extra = {"generator": torch.Generator()} if with_generator else {}
    loader = st.DataLoader(torch.arange(100.0), batch_size=4, shuffle=True, **extra)
    next(iter(loader))
    return len(pickle.dumps(loader.state_dict()))


def test_the_resume_page_states_the_state_sizes_its_command_prints() -> None:
    text = doc("docs/resume.md")
    sizes = stated(text, r"pickled, ([\d,]+ bytes .*? and [\d,]+) with one")
    without, with_one = (int(n.replace(",", "")) for n in re.findall(r"[\d,]+\d", sizes))
    assert (without, with_one) == (state_size(False), state_size(True))


def test_the_design_notes_state_the_slot_constants() -> None:
    text = doc("docs/design/slot-lifecycle.md")
    assert float(stated(text, r"the first slots are ([\d.]+) MiB")) * MIB == FIRST_SLOT_BYTES
    assert float(stated(text, r"grows the slot to ([\d.]+) × the need")) == GROWTH
    assert float(stated(text, r"reserved ([\d.]+) MiB at a time")) * MIB == CHUNK_BYTES
    assert int(stated(text, r"free slot over (\d+) × the ask")) == SHRINK
    assert int(stated(text, r"an array of (\d+) MiB or more")) * MIB == REUSE_MIN_BYTES
    config = doc("docs/config.md")
    assert int(stated(config, r"at least (\d+) MiB \(`shmloader.collate.threads")) * MIB == SPLIT_MIN_BYTES


def test_the_design_notes_state_the_shutdown_deadlines() -> None:
    text = doc("docs/design/shutdown-order.md")
    assert float(stated(text, r"deadline: ([\d.]+) s \(torch's\) after a normal end")) == workers._JOIN_TIMEOUT_S
    assert float(stated(text, r"([\d.]+) s when the loader failed")) == _BROKEN_GRACE_S
    assert float(stated(text, r"SIGTERM, join \(([\d.]+) s\)")) == reaping.KILL_TIMEOUT_S
    ownership = doc("docs/design/ownership.md")
    assert float(stated(ownership, r"waits \(([\d.]+) s at most\)")) == CLOSE_WAIT_S
