"""An alias of a torch batch survives ``share_memory_()`` on the batch.

The defect: ``share_memory_()`` (which ``torch.multiprocessing.Queue.put``, ``multiprocessing``
queues and ``nn.Module.share_memory`` call) swaps a tensor's storage to fresh shared memory and
drops the old DataPtr, which (``torch.from_numpy`` of the slot's bytes) was the only holder of the
slot's lease: the slot was reused while a numpy alias taken before (``x.numpy()``,
``np.from_dlpack(x)``) still pointed into it, and the alias changed under the user. With torch's
own loader the batch is in shared memory already: ``share_memory_()`` does nothing and the alias
stays valid.

Now each batch tensor's storage holds the lease too (``transport/torch_views.py``), so any alias
that references the storage keeps the slot, the tensor kept or not (docs/design/slot-lifecycle.md).
"""

from __future__ import annotations

import copy
import gc
import io
import pickle
from typing import Any

import numpy as np
import pytest
from ring_helpers import OWNER, leased

from shmloader.transport import codec, torch_views
from shmloader.transport.alloc import SlotAllocator
from shmloader.transport.ring import Ring, SlotState

torch = pytest.importorskip("torch")

D, BS, N = 64, 4, 64


def _dataset() -> Any:
    data = torch.arange(N, dtype=torch.float32)[:, None].repeat(1, D)
    return torch.utils.data.TensorDataset(data, torch.arange(N))


def _alias(x: Any, how: str) -> Any:
    if how == "numpy":
        return x.numpy()
    if how == "dlpack":
        return np.from_dlpack(x)
    return x[1:].numpy()  # an alias of a view of the batch tensor


@pytest.mark.timeout(60)
@pytest.mark.parametrize("keep_tensor", [True, False])
@pytest.mark.parametrize("how", ["numpy", "dlpack", "view"])
def test_an_alias_of_a_batch_survives_share_memory(how: str, keep_tensor: bool) -> None:
    import shmloader.torch

    loader = shmloader.torch.DataLoader(_dataset(), batch_size=BS, num_workers=2, prefetch_factor=1,
                                        persistent_workers=True)
    try:
        it = iter(loader)
        x, _y = next(it)
        alias = _alias(x, how)
        expected = alias.copy()
        x.share_memory_()  # what torch.multiprocessing.Queue.put(x) does
        assert x.is_shared() and np.array_equal(x.numpy()[-expected.shape[0]:], expected)
        kept = x if keep_tensor else None
        del x, _y
        for _ in it:  # the rest of the epoch, then two more: every slot is written again
            pass
        for _ in range(2):
            for _ in loader:
                pass
        assert np.array_equal(alias, expected), "an alias of a held batch changed under the user"
        del kept
    finally:
        loader.close()


@pytest.mark.timeout(60)
def test_torch_dataloader_reference_behaviour() -> None:
    """torch's own loader: the same steps leave the alias intact (its batches are shared already)."""
    loader = torch.utils.data.DataLoader(_dataset(), batch_size=BS, num_workers=2, prefetch_factor=1)
    it = iter(loader)
    x, _y = next(it)
    alias = x.numpy()
    expected = alias.copy()
    x.share_memory_()
    del x, _y
    for _ in it:
        pass
    assert np.array_equal(alias, expected)


def _decoded_tensor(ring: Ring) -> tuple[Any, Any]:
    """A slot holding one float32 tensor [0..15] written by an encoder, decoded as the iterator does."""
    slot = ring.grow(4096, OWNER)
    alloc = SlotAllocator(slot.segment.buf, slot.size_bytes)
    payload, _ = codec.encode({"x": torch.arange(16, dtype=torch.float32)}, alloc)
    batch, views = codec.decode(payload, leased(ring, slot), slot.size_bytes)
    assert views == 1
    return slot, batch["x"]


def test_the_storage_holds_the_lease_until_every_alias_is_gone() -> None:
    ring = Ring("/dev/shm")
    try:
        slot, x = _decoded_tensor(ring)
        assert list(vars(x.untyped_storage())) == [torch_views.LEASE_ATTRIBUTE]
        alias = np.from_dlpack(x)
        x.share_memory_()  # the old DataPtr, and with it the numpy view of the slot, is dropped
        del x
        gc.collect()
        assert ring.collect_released() == 0 and slot.state is SlotState.LEASED  # the alias's storage holds it
        assert alias.tolist() == list(range(16))
        del alias
        gc.collect()
        assert ring.collect_released() == 1 and slot.state is SlotState.FREE  # all gone: the slot is free
    finally:
        ring.close()


def test_a_held_tensor_pickles_saves_and_copies_as_before() -> None:
    """The hold is no attribute of the tensor, and nothing carries its storage's: nothing of the
    slot is saved, copied or pickled."""
    ring = Ring("/dev/shm")
    try:
        _slot, x = _decoded_tensor(ring)
        plain = torch.arange(16, dtype=torch.float32)
        assert not x.__dict__
        assert len(pickle.dumps(x)) == len(pickle.dumps(plain))
        assert len(pickle.dumps(x.untyped_storage())) == len(pickle.dumps(plain.untyped_storage()))
        buf = io.BytesIO()
        torch.save(x, buf)
        buf.seek(0)
        loaded = torch.load(buf, weights_only=True)
        assert torch.equal(loaded, plain) and not vars(loaded.untyped_storage())
        copied = copy.deepcopy(x)
        assert torch.equal(copied, plain) and not vars(copied.untyped_storage())
        del x
    finally:
        ring.close()
