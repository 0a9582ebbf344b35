"""torch parity of a training loop that leaves each epoch early (``break``, as a step limit per
epoch does) with ``persistent_workers=True``, run side by side with torch 2.13's ``DataLoader``.

torch's ``iter(loader)`` on a kept iterator (``_reset``) first waits for its workers to finish the
tasks the abandoned epoch sent ahead, then sends ``prefetch_factor`` tasks per worker of the new
epoch, reading the sampler that far before ``iter()`` returns — as its first ``iter()`` does. So
what a sampler draws as it is read (a ``RandomSampler`` on the loader's ``generator`` draws another
permutation as it is read to its end; a multi-scale batch sampler draws a size per batch from the
global RNG) is drawn at the same points of the loop, and every task read is run by its worker.
"""

from __future__ import annotations

import hashlib
from typing import Any

import pytest

torch = pytest.importorskip("torch")
from torch.utils import data as tdata  # noqa: E402

import shmloader.torch as st  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")


class Augmented(tdata.Dataset[dict[str, Any]]):
    """Sample i (or ``(i, size)`` from a batch sampler) and the worker's random augmentation of it."""

    def __len__(self) -> int:
        return 12

    def __getitem__(self, key: Any) -> dict[str, Any]:
        i, size = key if isinstance(key, tuple) else (key, 0)
        return {"i": int(i), "size": size, "aug": torch.rand(2)}


class MultiScaleBatches(tdata.Sampler[list[tuple[int, int]]]):
    """Batches of 3 in order, each with an image size drawn from torch's global RNG as it is read
    (multi-scale training's batch sampler)."""

    def __iter__(self) -> Any:
        for start in range(0, 12, 3):
            size = int(torch.randint(8, 16, ()).item())
            yield [(i, size) for i in range(start, start + 3)]

    def __len__(self) -> int:
        return 4


def _loop(loader_cls: type, make: Any, taken: int, epochs: int = 4) -> list[Any]:
    """Each epoch: ``iter()``, ``taken`` batches (with a training step's own draw from the global
    RNG after each), then ``break``. Returns the batches, the draws and the generator's state."""
    torch.manual_seed(0)
    loader, generator = make(loader_cls)
    seen: list[Any] = []
    try:
        for _epoch in range(epochs):
            it = iter(loader)
            seen.append(("after iter()", None if generator is None else _digest(generator)))
            for k, batch in enumerate(it):
                seen.append({name: value.tolist() for name, value in batch.items()})
                seen.append(("training step", torch.rand(()).item()))  # dropout, say
                if k + 1 == taken:
                    break
            del it
    finally:
        if hasattr(loader, "close"):
            loader.close()
        elif loader._iterator is not None:
            loader._iterator._shutdown_workers()
    return seen


def _digest(generator: Any) -> str:
    """Where ``generator`` is: a digest of its state, short enough for an assertion message."""
    return hashlib.sha256(generator.get_state().numpy().tobytes()).hexdigest()[:16]


def _first_difference(ours: list[Any], theirs: list[Any]) -> str:
    for step, (a, b) in enumerate(zip(ours, theirs)):
        if a != b:
            return f"step {step}: ours {str(a)[:200]} != torch's {str(b)[:200]}"
    return f"lengths {len(ours)} != {len(theirs)}"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("taken", [1, 2])
@pytest.mark.parametrize("num_workers", [1, 2])
def test_a_shuffle_on_the_loaders_generator_draws_as_torchs_after_a_break(num_workers: int, taken: int) -> None:
    """12 samples in batches of 4: torch's ``iter()`` reads the whole epoch (and the sampler's
    permutation for its end) on 2 workers; the generator must be where torch's is each epoch."""
    def make(loader_cls: type) -> tuple[Any, Any]:
        generator = torch.Generator().manual_seed(8)
        return loader_cls(Augmented(), batch_size=4, shuffle=True, num_workers=num_workers,
                          persistent_workers=True, generator=generator), generator

    theirs, ours = _loop(tdata.DataLoader, make, taken), _loop(st.DataLoader, make, taken)
    assert ours == theirs, _first_difference(ours, theirs)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("prefetch_factor", [1, 2])
def test_a_batch_sampler_drawing_from_the_global_rng_interleaves_as_under_torch_after_a_break(
        prefetch_factor: int) -> None:
    """Each epoch's first ``prefetch_factor`` × 2 batch sizes are drawn at ``iter()``, before the
    training step's draws, as under torch; and each worker runs every task read, so its
    augmentations stay torch's."""
    def make(loader_cls: type) -> tuple[Any, None]:
        return loader_cls(Augmented(), batch_sampler=MultiScaleBatches(), num_workers=2,
                          prefetch_factor=prefetch_factor, persistent_workers=True), None

    theirs, ours = _loop(tdata.DataLoader, make, taken=1), _loop(st.DataLoader, make, taken=1)
    assert ours == theirs, _first_difference(ours, theirs)
