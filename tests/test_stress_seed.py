"""stress/soak.py's ``--seed``: it has one, fixed by default, and it is what orders the shuffle.

A soak run's figures are reproducible only if its shuffle order is: the seed must reach the loader
(the same seed, the same order; another seed, another order) and be printed with the figures.
The loaders here have no workers, so nothing is started.
"""

from __future__ import annotations

import argparse

from test_docs_commands import load_script


def _order(argv: list[str]) -> list[int]:
    soak = load_script("stress/soak.py")
    args: argparse.Namespace = soak.build_parser().parse_args([*argv, "--workers", "0", "--samples", "32"])
    loader = soak.make_loader(args)
    try:
        return [int(label) for _ in range(2) for batch in loader for label in batch["label"]]
    finally:
        loader.close()


def test_soak_has_a_fixed_default_seed() -> None:
    soak = load_script("stress/soak.py")
    assert soak.build_parser().parse_args([]).seed == 0


def test_soak_seed_orders_the_shuffle() -> None:
    first = _order(["--seed", "3"])
    assert sorted(first[:32]) == sorted(first[32:]) == list(range(32))
    assert _order(["--seed", "3"]) == first  # two epochs, the same two orders
    assert _order(["--seed", "4"]) != first
    assert _order([]) == _order(["--seed", "0"])


def test_soak_figures_name_the_seed() -> None:
    soak = load_script("stress/soak.py")
    args = soak.build_parser().parse_args(["--seed", "7"])
    assert "seed 7" in soak.settings(args)
