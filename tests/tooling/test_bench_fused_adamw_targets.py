"""bench/bench_fused_adamw.py's arithmetic, with made-up times (no GPU needed): bytes per element, GB/s, % of the
copy bandwidth (a large-buffer copy, read + write bytes), and the CUDA target (>= 85% of that copy, PASS/FAIL on
every row, zero_ext's verdict at every size) beside the CPU's (the in-place roofline at the largest size)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import bench_fused_adamw as bench  # noqa: E402

N = 2**26
COPY_NUMEL = 2**28  # a 1 GiB fp32 buffer
COPY_GBS = 3000.0


def _seconds(bytes_per_element: int, numel: int, gb_per_s: float) -> float:
    return bytes_per_element * numel / (gb_per_s * 1e9)


def _times(fraction: dict) -> dict:
    """Three equal times per contender, each at ``fraction`` of the copy bandwidth (default 0.5)."""
    names = [*bench.ROOFLINES, *bench.CORE]
    return {n: [_seconds(bench.credited_bytes(n), N, fraction.get(n, 0.5) * COPY_GBS)] * 3 for n in names}


def _copy_bw() -> dict:
    return bench.copy_bandwidth([_seconds(8, COPY_NUMEL, COPY_GBS)] * 3, COPY_NUMEL, N, threads=1)


def test_bytes_per_element_of_the_mixed_precision_update():
    # bf16 grad read 2, fp32 master / exp_avg / exp_avg_sq read + write 3 x 8, bf16 param write 2
    assert bench.credited_bytes("zero_ext") == 2 + 3 * 8 + 2 == 28
    assert bench.credited_bytes("copy") == 8 and bench.credited_bytes("torch_foreach") == 80


def test_the_copy_bandwidth_counts_read_and_write_bytes():
    bw = _copy_bw()
    assert bw["gb_per_s"] == pytest.approx(COPY_GBS) and bw["buffer_bytes"] == 2**30


def test_cuda_rows_pass_at_85_percent_of_the_copy_bandwidth():
    copy_bw = _copy_bw()
    rows, roofline = bench.summarize(_times({"zero_ext": 0.90, "torch_fused": 0.84}), N, copy_bw, "cuda")
    by = {r["contender"]: r for r in rows}
    assert by["zero_ext"]["bytes_per_element"] == 28
    assert by["zero_ext"]["gb_per_s"] == pytest.approx(0.9 * COPY_GBS)
    assert by["zero_ext"]["pct_of_copy_bw"] == pytest.approx(90) and by["zero_ext"]["target"] == "PASS"
    assert by["torch_fused"]["target"] == "FAIL" and by["torch_pipeline"]["target"] == "FAIL"
    lines = bench.verdicts(rows, roofline, [copy_bw], "cuda")
    assert lines[0].startswith("PASS: zero_ext at 2^26: 2700 GB/s (28 B/element) = 90% of the copy bandwidth")
    assert "target >= 85%" in lines[0] and lines[1].startswith("PASS: zero_ext 1.80x the torch")


def test_cuda_verdicts_at_every_size():
    rows, bws = [], []
    for fraction in (0.80, 0.95):  # the smaller size misses, the larger passes
        bws.append(_copy_bw())
        size_rows, roofline = bench.summarize(_times({"zero_ext": fraction}), N, bws[-1], "cuda")
        rows += size_rows
    lines = bench.verdicts(rows, roofline, bws, "cuda")
    assert [line.split(":")[0] for line in lines] == ["FAIL", "PASS", "PASS"], lines


def test_cpu_keeps_its_roofline_target_and_no_row_target():
    copy_bw = _copy_bw()
    times = _times({"scale_inplace": 1.2, "zero_ext": 1.1})  # a CPU's copy understates (write-allocate)
    rows, roofline = bench.summarize(times, N, copy_bw, "cpu")
    assert roofline == "scale_inplace" and {r["target"] for r in rows} == {""}
    lines = bench.verdicts(rows, roofline, [copy_bw], "cpu")
    assert len(lines) == 2 and lines[0].startswith("PASS: zero_ext at 92% of the roofline (scale_inplace")
    assert "110% of the copy bandwidth" in lines[0]


def _precision_times(fraction: dict) -> dict:
    """The core contenders and every --precision row, each at ``fraction`` of the copy bandwidth (default 0.5)."""
    names = [*bench.ROOFLINES, *bench.CORE, *(bench.PRECISION + s for s in bench.precision_settings.TARGETS)]
    return {n: [_seconds(bench.credited_bytes(n), N, fraction.get(n, 0.5) * COPY_GBS)] * 3 for n in names}


def test_precision_rows_are_credited_with_what_each_setting_moves():
    assert bench.credited_bytes("zero_ext_int8_moments") == 16.25
    assert bench.credited_bytes("zero_ext_remainders") == 26 and bench.credited_bytes("zero_ext_bf16_moments") == 20


def test_precision_rows_on_cuda_each_against_the_copy_bandwidth_and_the_default_time():
    copy_bw = _copy_bw()
    # int8 at 90% of the copy bandwidth moves 16.25 of the default's 28 bytes: 0.56x its time at the default's 0.9
    times = _precision_times({"zero_ext": 0.90, "zero_ext_int8_moments": 0.90, "zero_ext_bf16_moments": 0.60})
    rows, roofline = bench.summarize(times, N, copy_bw, "cuda")
    by = {r["contender"]: r for r in rows}
    assert by["zero_ext_int8_moments"]["target"] == "PASS" and by["zero_ext_bf16_moments"]["target"] == "FAIL"
    lines = {
        line.split(": ")[1].split(" at ")[0]: line for line in bench.verdicts(rows, roofline, [copy_bw], "cuda")[2:]
    }
    assert set(lines) == set(bench.precision_settings.TARGETS)
    assert (
        lines["int8_moments"].startswith("PASS: int8_moments at 2^26")
        and "= 90% of the copy bandwidth" in lines["int8_moments"]
    )
    assert "PASS: 0.58x the default step's time (target <= 0.75)" in lines["int8_moments"]
    # bf16 at 60%: 20/28 of the bytes at 2/3 of the default's rate -> 1.07x its time: both targets fail
    assert lines["bf16_moments"].startswith("FAIL") and "FAIL: 1.07x the default step's time" in lines["bf16_moments"]


def test_precision_rows_on_cpu_against_80_percent_of_the_roofline():
    copy_bw = _copy_bw()
    times = _precision_times({"add_inplace": 1.0, "zero_ext_remainders": 0.81, "zero_ext_int8_moments": 0.30})
    rows, roofline = bench.summarize(times, N, copy_bw, "cpu")
    lines = bench.verdicts(rows, roofline, [copy_bw], "cpu")
    remainders = next(line for line in lines if ": remainders at" in line)
    int8 = next(line for line in lines if ": int8_moments at" in line)
    assert remainders.startswith("PASS") and "81% of the roofline (target >= 80%)" in remainders
    assert int8.startswith("FAIL") and "30% of the roofline" in int8
