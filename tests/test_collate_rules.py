"""Collate rules: passed-in, registered, ABC/tuple keys, precedence, caching, the recursion helper."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import pytest
from test_collate import RecordingAlloc, in_buffer

from shmloader.collate import (
    CollateContext,
    CollateShapeError,
    collate,
    register_collate_rule,
    registered_collate_rules,
    unregister_collate_rule,
)

# ----------------------------------------------------------------------------------- rules


class Box:
    def __init__(self, value: Any) -> None:
        self.value = value


class SubBox(Box):
    pass


def box_rule(batch: Sequence[Box], ctx: CollateContext) -> Any:
    return ("boxes", ctx.collate([b.value for b in batch], ".value"))


def test_rule_passed_in_handles_its_type_and_subclasses() -> None:
    kind, values = collate([Box(1), SubBox(2)], rules={Box: box_rule})
    assert kind == "boxes" and list(values) == [1, 2]
    kind, _ = collate([SubBox(1)], rules={Box: box_rule})
    assert kind == "boxes"
    with pytest.raises(TypeError):
        collate([Box(1)])


def test_rules_take_precedence_over_builtins_and_exact_type_over_mro() -> None:
    rules = {int: lambda batch, ctx: "int rule", bool: lambda batch, ctx: "bool rule"}
    assert collate([1, 2], rules=rules) == "int rule"
    assert collate([True], rules=rules) == "bool rule"
    assert collate([{"a": 1}], rules=rules) == {"a": "int rule"}


def test_rules_keyed_by_abc_or_tuple_match_by_issubclass() -> None:
    seen: list[str] = []

    def mapping_rule(batch: Sequence[Any], ctx: CollateContext) -> Any:
        seen.append(ctx.path)
        return "mapping"

    assert collate([[{"k": 1}]], rules={Mapping: mapping_rule}) == ["mapping"]
    assert seen == ["batch[0]"]
    assert collate([1.5], rules={(float, complex): lambda b, c: "number"}) == "number"


def test_rule_errors_from_ctx_collate_carry_the_path() -> None:
    with pytest.raises(CollateShapeError) as info:
        collate([Box(np.zeros(1)), Box(np.zeros(2))], rules={Box: box_rule})
    assert info.value.path == "batch.value"


def test_rule_gets_the_allocator_and_mode() -> None:
    def rule(batch: Sequence[Box], ctx: CollateContext) -> np.ndarray:
        assert ctx.to_torch is False
        out = ctx.alloc((len(batch),), np.dtype(np.int32))
        out[:] = [b.value for b in batch]
        return out

    alloc = RecordingAlloc()
    out = collate([Box(7), Box(8)], alloc, rules={Box: rule})
    assert in_buffer(out, alloc) and list(out) == [7, 8]


def test_registered_rules_apply_until_unregistered_and_yield_to_passed_rules() -> None:
    register_collate_rule(Box, box_rule)
    try:
        assert Box in registered_collate_rules()
        assert collate([SubBox(3)])[0] == "boxes"
        assert collate([Box(3)], rules={Box: lambda b, c: "passed"}) == "passed"
    finally:
        unregister_collate_rule(Box)
    assert Box not in registered_collate_rules()
    with pytest.raises(TypeError):
        collate([Box(1)])


class CountingRules(dict):
    reads = 0

    def get(self, key: Any, default: Any = None) -> Any:
        self.reads += 1
        return super().get(key, default)


def test_passed_rules_are_looked_up_once_per_type_until_the_registry_changes() -> None:
    rules, batch = CountingRules({Box: box_rule}), [(Box(1), 2.0, {"k": np.zeros(2)})] * 3
    collate(batch, rules=rules)
    first, rules.reads = rules.reads, 0
    collate(batch, rules=rules)
    assert first > 0 and rules.reads == 0
    register_collate_rule(SubBox, lambda b, c: None)
    unregister_collate_rule(SubBox)
    collate(batch, rules=rules)
    assert rules.reads == first
    assert collate([Box(1)], rules={Box: lambda b, c: "another mapping"}) == "another mapping"


def test_register_refuses_non_callables() -> None:
    with pytest.raises(TypeError, match="collate rule must be callable"):
        register_collate_rule(Box, "not a function")  # type: ignore[arg-type]


