"""The collate context: what a collate rule is given, and the allocator contract.

Owns the types every rule module shares (``Alloc``, ``Stack``, ``SlotFull``, ``CollateRule``,
``CollateContext``) so that ``shmloader.collate`` (the lookup), ``collate.rules`` (numpy rules)
and ``collate.torch_rules`` (tensor rules) import it and not each other. Runs wherever a batch is
collated (workers; the main process with ``num_workers=0``). Imports nothing of torch.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

import numpy as np

__all__ = ["Alloc", "CollateContext", "CollateRule", "FindRule", "SlotFull", "Stack", "heap_alloc"]

Alloc = Callable[[tuple[int, ...], np.dtype], np.ndarray]
"""``alloc(shape, dtype)``: a writable, C-contiguous, uninitialised array; may raise SlotFull."""

Stack = Callable[[Sequence[Any], np.ndarray], np.ndarray]
"""``stack(batch, out)``: write equally shaped arrays into ``out`` along a new first axis; returns
``out``. ``rules.stack_into`` (one thread) by default; ``threads.ThreadedStack`` with ``num_workers=0``."""


class SlotFull(Exception):
    """Raised by an allocator when the batch does not fit the memory it may hand out.

    Defined here so collation stays engine-agnostic; collate never catches it (the worker then
    measures the batch and asks the main process for a larger slot).
    """


def heap_alloc(shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    """The default allocator: ordinary process memory (``np.empty``)."""
    return np.empty(shape, dtype)


class CollateRule(Protocol):
    """How one sample type becomes a batch: ``rule(batch, ctx) -> collated``.

    ``batch`` holds the samples of one field (one per batch entry; the first is of the rule's
    type). Write output arrays through ``ctx.alloc``; collate nested fields with
    ``ctx.collate(sub_batch, where)`` so their rules apply and errors name the field.
    """

    def __call__(self, batch: Sequence[Any], ctx: CollateContext) -> Any: ...


FindRule = Callable[[type, "Mapping[Any, CollateRule] | None", bool], CollateRule]
"""``find(sample_type, rules, to_torch)``: the rule for a sample type."""


class CollateContext:
    """What a rule may use: ``alloc``, ``stack``, ``to_torch``, ``rules``, ``path`` and :meth:`collate`
    (:meth:`enter` and :meth:`leave`: the same in two halves, a frame fewer per level of nesting)."""

    __slots__ = ("alloc", "stack", "to_torch", "rules", "_segments", "_find")

    def __init__(self, alloc: Alloc, to_torch: bool, rules: Mapping[Any, CollateRule] | None, find: FindRule,
                 stack: Stack | None = None):
        if stack is None:
            from shmloader.collate.rules import stack_into  # rules imports this module

            stack = stack_into
        self.alloc = alloc
        self.stack = stack
        self.to_torch = to_torch
        self.rules = rules
        self._segments: list[str] = []
        self._find = find  # the rule lookup (shmloader.collate.find_rule), passed in: no import cycle

    @property
    def path(self) -> str:
        """The field being collated, as an expression on the batch: ``batch['image'][0]``."""
        return "batch" + "".join(self._segments)

    def collate(self, batch: Sequence[Any], where: str = "") -> Any:
        """Collate a nested field; ``where`` extends the path: ``"['image']"``, ``"[0]"``, ``".x"``."""
        if not where:
            return self._find(type(batch[0]), self.rules, self.to_torch)(batch, self)
        self._segments.append(where)
        try:
            return self._find(type(batch[0]), self.rules, self.to_torch)(batch, self)
        finally:
            self._segments.pop()

    def enter(self, batch: Sequence[Any], where: str) -> CollateRule:
        """:meth:`collate` in two halves, for the built-in container rules: the rule of the nested
        field ``batch``, with ``where`` added to the path until :meth:`leave`. The container's rule
        calls that rule itself, so a level of nesting costs one frame, where ``collate`` costs two
        (torch's ``collate`` takes one for a list, two for a dict or tuple)."""
        rule = self._find(type(batch[0]), self.rules, self.to_torch)
        self._segments.append(where)
        return rule

    def leave(self) -> None:
        """The end of the field :meth:`enter` began: its ``where`` leaves the path."""
        self._segments.pop()
