"""tests/helpers/pairwise.py: the pruned grids keep every value of every axis and every pair of values of two axes,
the same rows on every run, fewer rows than the product."""

import itertools

import pytest
from pairwise import missing_pairs, pairwise, pairwise_params

AXES = [
    {"world": [1, 2, 3], "offload": [None, "cpu", "nvme"], "stage": [1, 2, 3]},
    {"precision": ["fp32", "bf16", "int8", "rem", "ams"], "offload": [None, "cpu"], "stage": [1, 2, 3]},
    {"a": [0, 1], "b": [0, 1], "c": [0, 1], "d": [0, 1, 2, 3]},
    {"world": [2, 3], "settings": [(True, 0), (True, 2), (False, 1)], "dtype": ["bf16", "fp32"]},
]


@pytest.mark.parametrize("axes", AXES, ids=lambda a: "x".join(str(len(v)) for v in a.values()))
def test_every_pair_and_every_value_fewer_rows(axes):
    rows = pairwise(axes)
    assert not missing_pairs(axes, rows)
    for i, values in enumerate(axes.values()):
        assert {r[i] for r in rows} == set(values)
    product = list(itertools.product(*axes.values()))
    assert len(rows) < len(product) and set(rows) <= set(product) and len(set(rows)) == len(rows)
    assert rows == pairwise(axes)  # deterministic: the same test ids on every run


def test_missing_pairs_finds_a_dropped_row():
    axes = AXES[0]
    rows = pairwise(axes)
    for dropped in rows:  # every row of the grid is needed by some pair (greedy: each added one new pair)
        assert missing_pairs(axes, [r for r in rows if r != dropped]), dropped


def test_covered_rows_count_and_are_not_repeated():
    axes = AXES[0]
    quick = [(2, None, s) for s in (1, 2, 3)] + [(1, "cpu", 2), (1, "nvme", 2)]
    rows = pairwise(axes, covered=quick)
    assert not missing_pairs(axes, rows + quick) and not set(rows) & set(quick)
    assert len(rows) < len(pairwise(axes))


def test_two_axes_are_their_product():
    axes = {"a": [1, 2], "b": ["x", "y", "z"]}
    assert pairwise(axes) == list(itertools.product([1, 2], ["x", "y", "z"]))


def test_params_carry_named_ids():
    params = pairwise_params(AXES[3], ids={"settings": ["r0", "r2", "k1"]})
    assert [p.values for p in params] == pairwise(AXES[3])
    assert all(p.id.count("-") == 2 and p.id.split("-")[1] in {"r0", "r2", "k1"} for p in params)
