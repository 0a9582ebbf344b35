"""``prefetch_factor``: every hostile value against torch 2.13's DataLoader, side by side.

The choice, value by value (``num_workers`` > 0 unless said):

- any value but None with ``num_workers=0``, and a negative one: torch's ValueError at
  construction, its words to the letter;
- ``0`` (and ``False``): torch asserts only at ``iter()`` (AssertionError in
  _MultiProcessingDataLoaderIter); shmloader refuses it at construction, since no task could ever be
  sent, with PrefetchFactorError: a ValueError (ConfigError) and an AssertionError, so code written
  against either type of torch's still catches it;
- a non-integer number (``2.0``, ``1.5``, NaN, inf): torch's TypeError comes at ``iter()`` ("'float'
  object cannot be interpreted as an integer"); shmloader's TypeError comes at construction, naming it;
- a str or bytes (``"2"``): TypeError at construction in both, shmloader's naming the option;
- ``True``, ``np.int64(2)``, None: taken, as torch takes them.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import shmloader.torch as shm_torch  # noqa: E402
from shmloader.errors import ConfigError  # noqa: E402

DATA = np.arange(8.0, dtype=np.float32).reshape(4, 2)


def _outcome(cls: Any, **kwargs: Any) -> tuple[str, type[BaseException] | None]:
    """('init' | 'iter' | 'ok', the exception type raised there)."""
    try:
        loader = cls(DATA, batch_size=2, **kwargs)
    except Exception as exc:
        return "init", type(exc)
    try:
        iterator = iter(loader)
        next(iterator)
    except Exception as exc:
        return "iter", type(exc)
    finally:
        getattr(loader, "close", lambda: None)()
    del iterator
    return "ok", None


@pytest.mark.timeout(120)
@pytest.mark.parametrize("num_workers, prefetch_factor, ours", [
    (0, 0, ("init", ValueError)), (0, 2, ("init", ValueError)), (0, 2.0, ("init", ValueError)),
    (0, None, ("ok", None)),
    (1, -1, ("init", ValueError)),
    (1, 0, ("init", AssertionError)), (1, False, ("init", AssertionError)),
    (1, 2.0, ("init", TypeError)), (1, 1.5, ("init", TypeError)), (1, float("nan"), ("init", TypeError)),
    (1, float("inf"), ("init", TypeError)), (1, "2", ("init", TypeError)), (1, b"2", ("init", TypeError)),
    (1, True, ("ok", None)), (1, np.int64(2), ("ok", None)), (1, None, ("ok", None)),
])  # fmt: skip
# torch's iterator whose __init__ failed on its assert runs __del__ on a half-made object (torch's own)
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_prefetch_factor_beside_torch(num_workers: int, prefetch_factor: Any, ours: tuple[str, Any]) -> None:
    theirs = _outcome(torch.utils.data.DataLoader, num_workers=num_workers, prefetch_factor=prefetch_factor)
    mine = _outcome(shm_torch.DataLoader, num_workers=num_workers, prefetch_factor=prefetch_factor)
    assert mine[0] == ours[0] and (mine[1] is None) == (ours[1] is None)
    if ours[1] is not None:
        assert mine[1] is not None and theirs[1] is not None
        assert issubclass(mine[1], ours[1]) and issubclass(mine[1], theirs[1])  # torch's type, never another
    if theirs[0] != "iter":
        assert mine[0] == theirs[0]  # never later than torch


def test_a_zero_prefetch_factor_is_named_at_construction_and_catchable_as_either_type() -> None:
    with pytest.raises(ConfigError, match=r"prefetch_factor=0") as exc:
        shm_torch.DataLoader(DATA, num_workers=1, prefetch_factor=0)
    assert isinstance(exc.value, AssertionError) and exc.value.name == "prefetch_factor"
