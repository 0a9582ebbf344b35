"""One interface over the random sources a user may hand to a sampler or a loader.

Owns the meaning of a ``generator`` argument. A random source is one of:

- ``None``: torch's global RNG when torch is already imported (exactly what torch's samplers and
  DataLoader use, so a job seeded with ``torch.manual_seed`` draws the same numbers here);
  otherwise numpy's fresh OS entropy;
- an ``int`` seed: a ``numpy.random.Generator`` seeded with it (see :func:`resolve_generator`);
- a ``numpy.random.Generator``: drawn from with numpy;
- a ``torch.Generator``: drawn from with the very torch ops torch's samplers run.

Runs in the main process (samplers, base seeds). Promises: with a ``torch.Generator`` (or ``None``
while torch is imported) every function returns exactly what the matching torch call returns for
the same generator state; results are plain Python ints; this module never imports torch, it only
uses it when ``sys.modules`` already holds it or a ``torch.Generator`` was passed.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any, Union

import numpy as np

__all__ = [
    "RandomSource",
    "resolve_generator",
    "seed_stream",
    "uses_torch",
    "randperm",
    "randint",
    "multinomial",
    "draw_base_seed",
    "new_seed_for_sampler",
]

#: What a ``generator=`` argument may be: None, an int seed, a numpy or a torch Generator.
RandomSource = Union[None, int, np.random.Generator, Any]

# torch's random_() on an int64 tensor draws from [0, 2**63 - 1]; numpy draws the same range.
_SEED_HIGH = 2**63


def _torch() -> Any | None:
    """Return the torch module if (and only if) it is already imported."""
    torch = sys.modules.get("torch")
    if torch is None or not hasattr(torch, "Generator"):
        return None
    return torch


def _is_torch_generator(generator: object) -> bool:
    torch = _torch()
    return torch is not None and isinstance(generator, torch.Generator)


def _check(generator: object) -> None:
    if generator is None or _is_torch_generator(generator):
        return
    if isinstance(generator, np.random.Generator):
        return
    if isinstance(generator, (int, np.integer)) and not isinstance(generator, (bool, np.bool_)):
        return
    raise TypeError(
        "generator must be None, an int seed, a numpy.random.Generator or a torch.Generator, "
        f"got {type(generator).__name__}"
    )


def resolve_generator(generator: RandomSource) -> RandomSource:
    """Validate ``generator``; turn an int seed into a ``numpy.random.Generator``.

    Samplers call this once and keep the result (a loader keeps :func:`seed_stream`'s), so
    successive epochs advance one stream instead of replaying the same seed. None and
    Generators are returned unchanged.
    """
    _check(generator)
    return seed_stream(generator)


def seed_stream(generator: RandomSource) -> RandomSource:
    """An int seed as a ``numpy.random.Generator`` seeded with it; anything else unchanged, unchecked.

    For a ``DataLoader``, whose ``generator`` torch checks only when a seed is drawn from it:
    the loader keeps this once, so its base seeds advance one stream epoch after epoch.
    """
    if isinstance(generator, (int, np.integer)) and not isinstance(generator, (bool, np.bool_)):
        return np.random.default_rng(int(generator))
    return generator


def uses_torch(generator: RandomSource) -> bool:
    """Whether draws from ``generator`` go through torch (a torch.Generator, or None with torch imported)."""
    _check(generator)
    if generator is None:
        return _torch() is not None
    return _is_torch_generator(generator)


def _numpy_rng(generator: RandomSource) -> np.random.Generator:
    """The numpy Generator to draw from, for a source that does not use torch."""
    if generator is None:
        return np.random.default_rng()
    if isinstance(generator, np.random.Generator):
        return generator
    return np.random.default_rng(int(generator))


def randperm(n: int, generator: RandomSource = None) -> list[int]:
    """A random permutation of ``range(n)``; equals ``torch.randperm(n, generator=g).tolist()``."""
    if uses_torch(generator):
        torch = _torch()
        assert torch is not None
        return torch.randperm(n, generator=generator).tolist()
    return _numpy_rng(generator).permutation(n).tolist()


def randint(high: int, size: int, generator: RandomSource = None) -> list[int]:
    """``size`` ints drawn uniformly from ``[0, high)``.

    Equals ``torch.randint(high=high, size=(size,), dtype=torch.int64, generator=g).tolist()``.
    """
    if uses_torch(generator):
        torch = _torch()
        assert torch is not None
        return torch.randint(
            high=high, size=(size,), dtype=torch.int64, generator=generator
        ).tolist()
    return _numpy_rng(generator).integers(0, high, size=size, dtype=np.int64).tolist()


def multinomial(
    weights: Sequence[float] | np.ndarray | Any,
    num_samples: int,
    replacement: bool,
    generator: RandomSource = None,
) -> list[int]:
    """Indices drawn with probability proportional to ``weights`` (1-D).

    Equals ``torch.multinomial(torch.as_tensor(weights, dtype=torch.double), num_samples,
    replacement, generator=g).tolist()``; the numpy path raises torch's RuntimeErrors, and
    without replacement, like torch, takes zero-weight indices once the positive ones are used up.
    """
    if uses_torch(generator):
        torch = _torch()
        assert torch is not None
        tensor = torch.as_tensor(weights, dtype=torch.double)
        return torch.multinomial(tensor, num_samples, replacement, generator=generator).tolist()
    probs = _checked_probabilities(weights, num_samples, replacement)
    rng = _numpy_rng(generator)
    if replacement:
        return rng.choice(len(probs), size=num_samples, replace=True, p=probs).tolist()
    # Weighted sampling without replacement by exponential keys (Efraimidis-Spirakis): the
    # num_samples largest w/E are distributed as successive weighted draws, as torch's are.
    keys = probs / rng.standard_exponential(len(probs))
    return np.argsort(-keys, kind="stable")[:num_samples].tolist()


def _checked_probabilities(
    weights: Sequence[float] | np.ndarray | Any, num_samples: int, replacement: bool
) -> np.ndarray:
    """Validate weights as torch.multinomial does (same messages); return them normalised."""
    w = np.asarray(weights, dtype=np.float64)
    if w.ndim != 1:
        raise RuntimeError("prob_dist must be 1 or 2 dim")
    if w.size == 0:
        raise RuntimeError("cannot sample from an empty probability distribution")
    if num_samples <= 0:
        raise RuntimeError("cannot sample n_sample <= 0 samples")
    if not replacement and num_samples > w.size:
        raise RuntimeError(
            "cannot sample n_sample > prob_dist.size(-1) samples without replacement"
        )
    if not np.all(np.isfinite(w)) or np.any(w < 0):
        raise RuntimeError("probability tensor contains either `inf`, `nan` or element < 0")
    total = w.sum()
    if total <= 0:
        raise RuntimeError("invalid multinomial distribution (sum of probabilities <= 0)")
    return w / total


def draw_base_seed(generator: RandomSource = None) -> int:
    """A non-negative 63-bit seed, drawn as torch's DataLoader draws its base seed.

    With a torch.Generator, or None while torch is imported, this is exactly
    ``torch.empty((), dtype=torch.int64).random_(generator=g).item()`` and advances the same
    state. Otherwise it is drawn with numpy (fresh entropy for None).
    """
    if uses_torch(generator):
        torch = _torch()
        assert torch is not None
        return int(torch.empty((), dtype=torch.int64).random_(generator=generator).item())
    return int(_numpy_rng(generator).integers(0, _SEED_HIGH, dtype=np.int64))


def new_seed_for_sampler(generator: RandomSource = None) -> RandomSource:
    """The random source one pass of a RandomSampler draws from, made as torch makes it.

    A given generator is returned as it is (an int seed resolved by :func:`resolve_generator`).
    For None, torch's RandomSampler draws a seed from the global RNG and seeds a fresh
    ``torch.Generator`` with it; this does the same while torch is imported, and otherwise returns
    a numpy Generator seeded from fresh entropy.
    """
    if generator is not None:
        return resolve_generator(generator)
    torch = _torch()
    if torch is None:
        return np.random.default_rng()
    seed = int(torch.empty((), dtype=torch.int64).random_().item())
    fresh = torch.Generator()
    fresh.manual_seed(seed)
    return fresh
