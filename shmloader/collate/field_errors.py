"""Collate errors that name the field: :class:`CollateShapeError`, and torch's own errors, named.

Owns :class:`CollateShapeError` (the samples of one field differ in shape), which the main process
rebuilds from a worker's message with its facts, and :func:`name_field`. The torch-mode rules
(:mod:`shmloader.collate.torch_rules`) replay torch's own conversion (``torch.tensor``,
``torch.as_tensor``, ``torch.stack``, dtype promotion) so that torch's dtype inference and errors
are kept; those errors say neither which field of the sample failed nor which samples were mixed.
Runs wherever a batch is collated; imports nothing of torch.

Promises of :func:`name_field`: the exception keeps its class, its traceback and torch's words,
which still start the message; ``(at batch['x'])`` follows them, with the first entry whose type
differs from entry 0's when the field's samples are of mixed types. A message that already names
the field (the rules' own errors) is left as it is, and so is an exception whose first argument is
not a string.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Sequence
from typing import Any, TypeVar, cast

from shmloader.collate.context import CollateContext

__all__ = ["TORCH_ERRORS", "CollateShapeError", "name_field", "names_field", "type_name"]

TORCH_ERRORS = (TypeError, ValueError, RuntimeError, NotImplementedError, OverflowError)
"""What torch's conversion of a field's samples raises (:class:`SlotFull` is none of them)."""


R = TypeVar("R", bound=Callable[..., Any])


def names_field(rule: R) -> R:
    """``rule`` (a torch-mode leaf rule, which replays torch's own conversion), whose
    ``TORCH_ERRORS`` name the field (:func:`name_field`). Leaf rules only: a container's rule would
    cost a frame per nesting level (tests/test_collate_depth.py)."""

    @functools.wraps(rule)
    def named(batch: Sequence[Any], ctx: CollateContext) -> Any:
        try:
            return rule(batch, ctx)
        except TORCH_ERRORS as error:  # torch's own checks and conversion: its error, and the field
            name_field(error, batch, ctx)
            raise

    return cast(R, named)


def name_field(error: BaseException, batch: Sequence[Any], ctx: CollateContext) -> None:
    """Add the field (and the first entry of a type other than entry 0's) to ``error``'s message."""
    where = f"at {ctx.path}"
    args = error.args
    if not args or not isinstance(args[0], str) or where in args[0]:
        return
    error.args = (f"{args[0]} ({where}{mixed_entries(batch)})", *args[1:])


def mixed_entries(batch: Sequence[Any]) -> str:
    """``": entry 0 is a int, entry 2 a NoneType"``: the first entry whose type is not entry 0's,
    or "" when every entry's type is entry 0's."""
    first = type(batch[0])
    index = next((i for i, sample in enumerate(batch) if type(sample) is not first), None)
    if index is None:
        return ""
    return f": entry 0 is a {type_name(batch[0])}, entry {index} a {type_name(batch[index])}"


def type_name(obj: Any) -> str:
    """``numpy.ndarray``, ``torch.Tensor``, ``int``: a sample's type as an error names it."""
    tp = type(obj)
    return tp.__qualname__ if tp.__module__ == "builtins" else f"{tp.__module__}.{tp.__qualname__}"


# ----------------------------------------------------------------------------- ragged fields


class CollateShapeError(RuntimeError):
    """Samples at one field of a batch differ in shape, so they cannot be stacked.

    Raised where torch raises "stack expects each tensor to be equal size" (a RuntimeError).
    Attributes: ``path`` (the field, e.g. ``batch['image']``), ``shapes`` (the first sample's shape
    and the first differing one) and ``entries`` (their positions in the batch).

    Also built from one message, as the main process rebuilds a worker's exception (so ``except
    CollateShapeError`` catches a worker's too): the attributes are read back from the last such
    error the text quotes; where it quotes none, ``path`` is ``""``, ``shapes`` ``((), ())`` and
    ``entries`` ``(-1, -1)``.
    """

    def __init__(
        self, path: str, shapes: tuple[tuple[int, ...], tuple[int, ...]] | None = None,
        entries: tuple[int, int] | None = None,
    ) -> None:
        if shapes is None or entries is None:  # one message: a worker's error, rebuilt
            super().__init__(path)
            self.path, self.shapes, self.entries = _shape_error_facts(path)
            return
        first, other = shapes
        super().__init__(
            f"{_SHAPE_MESSAGE}, but got {list(first)} at entry "
            f"{entries[0]} and {list(other)} at entry {entries[1]}, at {path}. "
            "Make the samples of this field one shape, or pass a collate_fn that handles "
            "ragged samples."
        )
        self.path = path
        self.shapes = (tuple(first), tuple(other))
        self.entries = entries


_SHAPE_MESSAGE = "stack expects each tensor to be equal size"
_SHAPE_FACTS = re.compile(
    re.escape(_SHAPE_MESSAGE) + r", but got \[([\d, ]*)\] at entry (\d+) and \[([\d, ]*)\] at entry (\d+), "
    r"at (.+?)\. Make the samples"
)


def _shape_error_facts(text: str) -> tuple[str, tuple[tuple[int, ...], tuple[int, ...]], tuple[int, int]]:
    """(path, shapes, entries) of the last CollateShapeError message ``text`` quotes."""
    found = _SHAPE_FACTS.findall(text)
    if not found:
        return "", ((), ()), (-1, -1)
    first, entry0, other, entry1, path = found[-1]
    return path, (_dims(first), _dims(other)), (int(entry0), int(entry1))


def _dims(text: str) -> tuple[int, ...]:
    return tuple(int(d) for d in text.split(",") if d.strip())
