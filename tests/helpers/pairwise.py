"""Pairwise grids: for parametrize axes that act independently, every value of every axis and every pair of values
of two axes is run, not every combination (issue 47: the suite in 12 minutes).

    CASES = pairwise({"world": [1, 2, 3], "offload": [None, "cpu", "nvme"], "stage": [1, 2, 3]})
    @pytest.mark.parametrize("world,offload,stage", CASES)

A 3 x 3 x 3 grid becomes 9 rows (27 before); 5 x 2 x 3 becomes 15 (30). ``covered`` names rows another test already
runs: their pairs count as covered, so the grid adds only what they miss. Rows are picked greedily (each the
candidate covering most missing pairs, ties to the first in grid order), so the list is the same on every run and
every machine. ``missing_pairs`` is what a test of a grid checks: empty when every pair is covered.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence


def _pairs(row: Sequence, n: int) -> set[tuple]:
    return {(i, row[i], j, row[j]) for i, j in itertools.combinations(range(n), 2)}


def missing_pairs(axes: dict[str, Sequence], rows: Iterable[Sequence]) -> set[tuple]:
    """The (axis, value, axis, value) pairs of ``axes`` that no row of ``rows`` runs."""
    values = list(axes.values())
    n = len(values)
    need = {(i, a, j, b) for i, j in itertools.combinations(range(n), 2) for a in values[i] for b in values[j]}
    for row in rows:
        need -= _pairs(tuple(row), n)
    names = list(axes)
    return {(names[i], a, names[j], b) for i, a, j, b in need}


def pairwise(axes: dict[str, Sequence], covered: Iterable[Sequence] = ()) -> list[tuple]:
    """Rows (tuples in the order of ``axes``) that, with ``covered``, run every pair of values of two axes."""
    values = list(axes.values())
    n = len(values)
    if n < 3:  # with two axes or fewer, every pair is every combination
        done = {tuple(r) for r in covered}
        return [r for r in itertools.product(*values) if r not in done]
    need = set()
    for i, j in itertools.combinations(range(n), 2):
        need |= {(i, a, j, b) for a in values[i] for b in values[j]}
    for row in covered:
        need -= _pairs(tuple(row), n)
    candidates = list(itertools.product(*values))
    rows = []
    while need:
        best = max(candidates, key=lambda r: len(_pairs(r, n) & need))
        rows.append(best)
        need -= _pairs(best, n)
    return rows


def marked_slow(rows: Iterable[Sequence], slow_if) -> list:
    """``rows`` as pytest parameters, those for which ``slow_if(row)`` marked slow (out of `make test-fast`)."""
    import pytest

    return [pytest.param(*row, marks=pytest.mark.slow) if slow_if(row) else tuple(row) for row in rows]


def pairwise_params(axes: dict[str, Sequence], ids: dict[str, Sequence[str]] | None = None) -> list:
    """``pairwise(axes)`` as pytest parameters whose ids name each value (``ids[axis]``: one name per value)."""
    import pytest

    ids = ids or {}
    names = list(axes)

    def name(i: int, v) -> str:
        axis = names[i]
        return str(ids[axis][list(axes[axis]).index(v)]) if axis in ids else str(v)

    return [pytest.param(*row, id="-".join(name(i, v) for i, v in enumerate(row))) for row in pairwise(axes)]
