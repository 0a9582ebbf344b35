"""torch parity of a sample's strides with ``batch_size=None`` and workers (the torch flavour).

torch's workers send a sample's tensors through shared memory with their sizes *and strides*
(``rebuild_tensor``), so a zero-size tensor (``torch.as_tensor`` of numpy's ``zeros((3, 0))`` has
strides (0, 0)) and a contiguous tensor whose size-1 dimension has an unusual stride come back as
they were made. The slot's ``"t"`` record kept only the shape, so both came back with the
strides of a fresh contiguous tensor.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")
from torch.utils import data as tdata  # noqa: E402

import shmloader.torch as st  # noqa: E402


class OddStrides(tdata.Dataset):
    """Samples whose tensors are contiguous (or empty) with strides other than a fresh tensor's."""

    def __len__(self) -> int:
        return 2

    def __getitem__(self, i: int) -> Any:
        return {
            "np_empty": np.zeros((3, 0), dtype=np.float32),  # as_tensor: strides (0, 0)
            "empty": torch.empty_strided((2, 0, 3), (7, 5, 2)),
            "unit_dim": torch.arange(12.0).reshape(3, 1, 4).transpose(0, 1),  # (1, 3, 4), strides (4, 4, 1)
            "plain": torch.arange(6.0).reshape(2, 3) + i,
        }


def _layout(loader: Any) -> list[dict[str, Any]]:
    return [{k: (tuple(v.shape), v.stride(), v.tolist()) for k, v in sample.items()} for sample in loader]


@pytest.mark.timeout(120)
def test_sample_strides_match_torch_with_workers() -> None:
    ours = _layout(st.DataLoader(OddStrides(), batch_size=None, num_workers=1))
    theirs = _layout(tdata.DataLoader(OddStrides(), batch_size=None, num_workers=1))
    assert theirs[0]["np_empty"][1] == (0, 0)  # what torch gives: the check below can fail
    assert ours == theirs
