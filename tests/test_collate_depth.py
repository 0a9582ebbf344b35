"""Collate reaches at least as deep into nested samples as torch's ``default_collate``.

torch's ``collate`` recurses once per level of nesting: one frame per level of a list (a loop),
two for a dict or a tuple (a comprehension). Ours took three for each (the container's rule, a
comprehension, ``ctx.collate``), so a sample that torch collated raised RecursionError here
from about a third of the recursion limit. The container rules now call the next rule
themselves (``CollateContext.enter``), one frame per level, and a plain list or dict is rebuilt
with no ABC check (two frames of ``isinstance`` at the deepest level). Each case finds torch's deepest nest (from the same place,
under the same recursion limit) and collates that one with ours, in both flavours.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from shmloader.collate import collate

torch = pytest.importorskip("torch")
from torch.utils.data import default_collate as torch_collate  # noqa: E402

WRAPS: dict[str, Callable[[Any, int], Any]] = {
    "list": lambda x, i: [x],
    "tuple": lambda x, i: (x,),
    "dict": lambda x, i: {"k": x},
    "mixed": lambda x, i: [x] if i % 2 else {"k": x},
}


def nest(kind: str, depth: int) -> Any:
    sample: Any = np.float32(1.0)
    for i in range(depth):
        sample = WRAPS[kind](sample, i)
    return sample


def _collates(fn: Callable[[list[Any]], Any], kind: str, depth: int) -> bool:
    try:
        fn([nest(kind, depth), nest(kind, depth)])
    except RecursionError:
        return False
    return True


def deepest(fn: Callable[[list[Any]], Any], kind: str) -> int:
    """The deepest nest of ``kind`` that ``fn`` collates without RecursionError (binary search)."""
    lo, hi = 0, 4000
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if _collates(fn, kind, mid) else (lo, mid - 1)
    return lo


def unwrap(batch: Any, depth: int) -> Any:
    for _ in range(depth):
        batch = batch["k"] if isinstance(batch, dict) else batch[0]
    return batch


@pytest.mark.parametrize("to_torch", [False, True], ids=["numpy", "torch"])
@pytest.mark.parametrize("kind", sorted(WRAPS))
def test_collate_reaches_as_deep_as_torchs_default_collate(kind: str, to_torch: bool) -> None:
    depth = deepest(torch_collate, kind)
    assert depth > 100, f"torch's default_collate stopped at {depth} levels: the test's stack is too deep"
    ours = functools.partial(collate, to_torch=to_torch)  # called as torch's is: no frame of the test's own
    assert _collates(ours, kind, depth), \
        f"RecursionError at {depth} levels of {kind}, which torch's default_collate collates (ours: {deepest(ours, kind)})"
    leaf = unwrap(ours([nest(kind, depth), nest(kind, depth)]), depth)
    assert leaf.tolist() == [1.0, 1.0] and type(leaf) is (torch.Tensor if to_torch else np.ndarray)
