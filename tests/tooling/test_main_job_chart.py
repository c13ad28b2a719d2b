"""The main job chart's step-time scale: bars far above the others (ZeroMuon's bf16 Newton-Schulz on a CPU without
fast bf16 GEMMs: ~8x AdamW's step) are cut at the top so that the others stay readable; without such a gap the
scale is the tallest bar."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

from main_job_chart import OFF_SCALE, time_axis_top  # noqa: E402


def test_the_scale_is_the_tallest_bar_without_a_gap():
    assert time_axis_top([617, 612, 604, 714, 688]) == 714
    assert time_axis_top([100, 100 * OFF_SCALE]) == 100 * OFF_SCALE  # exactly the factor: still on the scale


def test_bars_beyond_a_gap_go_off_the_scale():
    tops = [817, 776, 674, 822, 804, 6701, 5853, 6277]  # bench/results/main_job_epyc.md's whisker tops
    assert time_axis_top(tops) == 1.5 * 822
    assert time_axis_top([50, 400, 420]) == 1.5 * 50  # the gap decides, not the count: one bar kept, two cut
