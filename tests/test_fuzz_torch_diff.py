"""Differential fuzz: shmloader's loaders against torch's DataLoader on seeded random cases.

Each seed (in the test id) makes one case (tests/fuzz_cases.py): a map-style or iterable dataset
of random samples — numpy arrays of many dtypes and layouts, numpy scalars, Python numbers,
strings, bytes, None, tensors, nested dicts/tuples/lists/namedtuples, samples that cannot be
collated — and random loader options over torch's whole signature. torch's loader,
``shmloader.torch.DataLoader`` and ``shmloader.DataLoader`` run it; ours must give torch's
``len``, batches and error types (tests/fuzz_compare.py says exactly what is compared).

``FUZZ_SEEDS`` picks the seeds (``0-39`` by default; ``100-499`` or ``3,17,42`` to explore or
rerun a failure: ``FUZZ_SEEDS=17 pytest tests/test_fuzz_torch_diff.py``).
"""

from __future__ import annotations

import os

import pytest

torch = pytest.importorskip("torch")
from fuzz_cases import make_case, run  # noqa: E402
from fuzz_compare import compare  # noqa: E402
from torch.utils.data import DataLoader as TorchDataLoader  # noqa: E402

import shmloader  # noqa: E402
import shmloader.torch  # noqa: E402

pytestmark = [
    pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning"),
    pytest.mark.filterwarnings("ignore:Length of IterableDataset:UserWarning"),
    pytest.mark.filterwarnings("ignore:'pin_memory' argument is set as true:UserWarning"),
]


def seeds_from_env(default: str = "0-39") -> list[int]:
    """The seeds ``FUZZ_SEEDS`` names: comma-separated numbers and ``a-b`` ranges (inclusive)."""
    seeds: list[int] = []
    for part in os.environ.get("FUZZ_SEEDS", default).split(","):
        low, _, high = part.strip().partition("-")
        seeds.extend(range(int(low), int(high or low) + 1))
    return seeds


# torch's own iterator, refused in its __init__ (prefetch_factor=0 asserts before ``_shutdown`` is
# set), fails again in its __del__: torch's noise, not ours
@pytest.mark.filterwarnings(r"ignore:Exception ignored in.*_MultiProcessingDataLoaderIter\.__del__"
                            r":pytest.PytestUnraisableExceptionWarning")
@pytest.mark.timeout(120)
@pytest.mark.parametrize("seed", seeds_from_env(), ids=lambda s: f"seed={s}")
def test_same_as_torch(seed: int) -> None:
    case = make_case(seed)
    theirs = run(case, TorchDataLoader)
    for flavour, cls in (("torch", shmloader.torch.DataLoader), ("numpy", shmloader.DataLoader)):
        ours = run(case, cls)
        try:
            compare(case, ours, theirs, flavour)
        except AssertionError as error:
            raise AssertionError(
                f"{flavour} flavour, {case.describe()}:\n{error}\n"
                f"torch's errors: {theirs.messages}\nour errors: {ours.messages}"
            ) from None
