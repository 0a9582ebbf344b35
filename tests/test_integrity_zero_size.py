"""A torch-mode batch of zero-size samples has the strides torch's ``default_collate`` gives it
(those of a fresh tensor of its shape), in the main process as through a worker."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import shmloader.torch  # noqa: E402
from shmloader.collate import torch_default_collate  # noqa: E402

SAMPLES = {
    "tensor": lambda: torch.zeros(0, 3),
    "array": lambda: np.zeros((0, 3), np.float32),
    "bfloat16": lambda: torch.zeros(4, 0, dtype=torch.bfloat16),
}


@pytest.mark.parametrize("kind", sorted(SAMPLES))
def test_zero_size_stacks_have_torchs_strides(kind: str) -> None:
    """``numpy.empty`` of a zero-size shape has all-zero strides (numpy 2), and the tensor made
    from it kept them: (0, 0, 0) where torch gives (3, 3, 1)."""
    batch = [SAMPLES[kind]() for _ in range(2)]
    ours, theirs = torch_default_collate(batch), torch.utils.data.default_collate(batch)
    assert (ours.shape, ours.dtype, ours.stride()) == (theirs.shape, theirs.dtype, theirs.stride())


@pytest.mark.timeout(60)
@pytest.mark.parametrize("num_workers", [0, 1])
def test_loader_zero_size_batches_as_torchs(num_workers: int) -> None:
    for kind in SAMPLES:
        samples = [SAMPLES[kind]() for _ in range(2)]  # a list is a map-style dataset
        (ours,) = list(shmloader.torch.DataLoader(samples, batch_size=2, num_workers=num_workers))
        (theirs,) = list(torch.utils.data.DataLoader(samples, batch_size=2))
        assert (ours.shape, ours.dtype, ours.stride()) == (theirs.shape, theirs.dtype, theirs.stride()), kind
