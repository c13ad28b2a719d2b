"""The overlap analysis of bench/profile_overlap.py on synthetic device timelines (CPU only; exact microseconds)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import profile_overlap as po  # noqa: E402

COMPUTE, SIDE, NCCL = 7, 13, 21  # stream ids
RS = "ncclDevKernel_ReduceScatter_Sum_f32_RING_LL"
AG = "ncclDevKernel_AllGather_RING_LL"


def _rs(events, windows):
    return po.analyze_overlap(events, windows)["reduce_scatter"]


def test_interval_union_and_intersection():
    assert po.union([(5, 8), (0, 2), (1, 3), (8, 9), (4, 4)]) == [(0, 3), (5, 9)]
    assert po.intersect([(0, 3), (5, 9)], [(2, 6), (8, 20)]) == [(2, 3), (5, 6), (8, 9)]
    assert po.measure(po.union([(0, 10), (5, 15), (20, 21)])) == 16


@pytest.mark.parametrize(
    "name, kind",
    [
        ("ncclDevKernel_ReduceScatter_Sum_f32_RING_LL", "reduce_scatter"),
        ("ncclKernel_ReduceScatter_RING_LL_Sum_bfloat16", "reduce_scatter"),
        ("NCCLDEVKERNEL_REDUCE_SCATTER_SUM", "reduce_scatter"),
        ("ncclKernel_AllGather_RING_LL_Sum_int8_t", "all_gather"),
        ("ncclDevKernel_AllGather_RING_LL", "all_gather"),
        ("ncclDevKernel_AllReduce_Sum_f32_RING_LL", "other_comm"),
        ("ncclDevKernel_SendRecv", "other_comm"),
        ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64", "compute"),
        ("void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float>>", "compute"),
        ("cast_scale_kernel", "compute"),
        ("Memcpy DtoD (Device -> Device)", "compute"),
    ],
)
def test_names_are_classified(name, kind):
    assert po.classify((name, NCCL, 0.0, 1.0)) == kind


def test_a_known_collective_overrides_the_name():
    # At one rank NCCL's reduce-scatter is a memcpy: the launch range, not the name, makes it a reduce-scatter.
    assert po.classify(("Memcpy DtoD (Device -> Device)", NCCL, 0, 1, "reduce_scatter")) == "reduce_scatter"
    assert po.classify(po.DeviceEvent("gemm", COMPUTE, 0, 1, "all_gather")) == "all_gather"


def test_full_overlap():
    events = [("gemm", COMPUTE, 0, 100), (RS, NCCL, 10, 30), (RS, NCCL, 50, 70)]
    r = _rs(events, [(0, 100)])
    assert (r["count"], r["time_us"], r["overlapped_us"], r["overlap_fraction"]) == (2, 40, 40, 1.0)
    assert r["started_in_window"] == 2 and r["streams"] == [NCCL]
    assert [e["overlapped_us"] for e in r["events"]] == [20, 20]


def test_partial_overlap():
    events = [("gemm", COMPUTE, 0, 100), (RS, NCCL, 90, 130), (RS, NCCL, 140, 150)]
    r = _rs(events, [(0, 100)])
    assert (r["count"], r["time_us"], r["overlapped_us"], r["overlap_fraction"]) == (2, 50, 10, 0.2)
    assert r["started_in_window"] == 1
    assert [e["overlapped_us"] for e in r["events"]] == [10, 0]


def test_no_overlap():
    # Starts exactly when backward's last kernel ends: after backward, not overlapped.
    events = [("gemm", COMPUTE, 0, 100), (RS, NCCL, 100, 120)]
    r = _rs(events, [(0, 100)])
    assert (r["count"], r["time_us"], r["overlapped_us"], r["overlap_fraction"]) == (1, 20, 0, 0.0)
    assert r["started_in_window"] == 0
    assert po.analyze_overlap(events, [(0, 100)])["reduce_scatter_started_before_backward_end"] is False


def test_concurrent_compute_on_two_streams_counts_once():
    # Compute on 7 (0-60) and 13 (40-100) overlap each other during 40-60; the reduce-scatter 20-80 sees compute all
    # along: 60 us, not 40 + 40.
    events = [("gemm", COMPUTE, 0, 60), ("gemm", SIDE, 40, 100), (RS, NCCL, 20, 80)]
    r = _rs(events, [(0, 100)])
    assert (r["time_us"], r["overlapped_us"], r["overlap_fraction"]) == (60, 60, 1.0)


def test_overlapping_collectives_count_once():
    # Two reduce-scatters on two streams overlapping each other: their time is the union (10-50: 40 us).
    events = [("gemm", COMPUTE, 0, 40), (RS, NCCL, 10, 30), (RS, NCCL + 1, 20, 50)]
    r = _rs(events, [(0, 40)])
    assert (r["count"], r["time_us"], r["overlapped_us"], r["overlap_fraction"]) == (2, 40, 30, 0.75)


def test_compute_on_the_collectives_own_stream_is_not_overlap():
    # A kernel on the NCCL stream cannot run beside the collective; only the 5 us on stream 7 count.
    events = [("accumulate", NCCL, 0, 50), ("gemm", COMPUTE, 20, 25), (RS, NCCL, 10, 30)]
    r = _rs(events, [(0, 50)])
    assert (r["time_us"], r["overlapped_us"], r["overlap_fraction"]) == (20, 5, 0.25)


def test_only_compute_inside_the_backward_windows_counts():
    # Two steps; the second collective runs beside compute that is outside both backward windows (e.g. forward).
    events = [
        ("gemm", COMPUTE, 0, 100),
        (RS, NCCL, 80, 90),
        ("gemm", COMPUTE, 200, 300),
        (RS, NCCL, 250, 260),
        ("gemm", COMPUTE, 400, 500),
    ]
    r = _rs(events, [(0, 100), (400, 500)])
    assert (r["count"], r["time_us"], r["overlapped_us"], r["overlap_fraction"]) == (2, 20, 10, 0.5)
    assert r["started_in_window"] == 1
    unclipped = po.collective_overlap(events, "reduce_scatter", None)
    assert unclipped["overlapped_us"] == 20 and unclipped["started_in_window"] is None


def test_all_gather_against_the_step_window_and_other_nccl():
    events = [
        ("gemm", COMPUTE, 0, 100),
        (RS, NCCL, 90, 110),
        ("fused_adamw_kernel", COMPUTE, 200, 260),
        (AG, NCCL, 230, 270),
        ("ncclDevKernel_AllReduce_Sum_f32", NCCL, 190, 195),
    ]
    rep = po.analyze_overlap(events, [(0, 100)], [(200, 260)])
    ag = rep["all_gather"]
    assert (ag["count"], ag["time_us"], ag["overlapped_us"], ag["overlap_fraction"]) == (1, 40, 30, 0.75)
    assert ag["started_in_window"] == 1
    assert rep["other_comm"] == {"count": 1, "time_us": 5}
    assert rep["compute"] == {"count": 2, "time_us": 160, "streams": [COMPUTE]}
    rs = rep["reduce_scatter"]
    assert (rs["time_us"], rs["overlapped_us"], rs["overlap_fraction"]) == (20, 10, 0.5)


def test_verdict():
    rep = po.analyze_overlap([("gemm", COMPUTE, 0, 100), (RS, NCCL, 60, 100), (RS, NCCL, 120, 130)], [(0, 100)])
    assert po.verdict(rep) == "PASS: reduce-scatter overlaps backward (80% of its time)"
    rep = po.analyze_overlap([("gemm", COMPUTE, 0, 100), (RS, NCCL, 90, 110)], [(0, 100)])
    assert po.verdict(rep) == "PASS: reduce-scatter overlaps backward (50% of its time)"
    rep = po.analyze_overlap([("gemm", COMPUTE, 0, 100), (RS, NCCL, 95, 115)], [(0, 100)])
    assert po.verdict(rep) == "FAIL: reduce-scatter overlaps backward for only 25% of its time (< 50%)"
    assert po.verdict(po.analyze_overlap([("gemm", COMPUTE, 0, 100)], [(0, 100)])).startswith("FAIL: no reduce")


def _x(cat, name, ts, dur, **args):
    return {"ph": "X", "cat": cat, "name": name, "pid": 1, "tid": args.pop("tid", 1), "ts": ts, "dur": dur,
            "args": args}  # fmt: skip


def _synthetic_trace():
    cpu = [
        _x("user_annotation", po.BACKWARD, 1000, 500),
        _x("user_annotation", po.REDUCE_SCATTER, 1200, 10, tid=2),  # in a hook, on autograd's thread
        _x("user_annotation", po.STEP, 1600, 100),
        _x("user_annotation", po.ALL_GATHER, 1650, 10),
        _x("gpu_user_annotation", po.BACKWARD, 0, 99999),  # the device-side copy of a range: ignored
        _x("cuda_runtime", "cudaLaunchKernel", 1100, 2, tid=2, correlation=1),
        _x("cuda_driver", "cuLaunchKernel", 1150, 2, tid=2, correlation=2),  # Triton
        _x("cuda_runtime", "cudaMemcpyAsync", 1205, 2, tid=2, correlation=3),  # NCCL's one-rank reduce-scatter
        _x("cuda_runtime", "cudaLaunchKernel", 1207, 2, tid=2, correlation=4),  # its epilogue, inside the range
        _x("cuda_runtime", "cudaMemcpyAsync", 1300, 2, tid=2, correlation=5),  # an unrelated copy
        _x("cuda_runtime", "cudaLaunchKernel", 1620, 2, correlation=6),
        _x("cuda_runtime", "cudaLaunchKernel", 1651, 2, correlation=7),
    ]
    device = [
        _x("kernel", "gemm_bwd", 2000, 300, stream=COMPUTE, correlation=1),
        _x("kernel", "cast_scale_kernel", 2300, 20, stream=COMPUTE, correlation=2),
        _x("gpu_memcpy", "Memcpy DtoD (Device -> Device)", 2100, 15, stream=NCCL, correlation=3),
        _x("kernel", "accumulate_kernel", 2400, 50, stream=SIDE, correlation=4),
        _x("gpu_memcpy", "Memcpy HtoD (Pageable -> Device)", 2000, 5, stream=COMPUTE, correlation=5),
        _x("kernel", "fused_adamw_kernel", 3000, 80, stream=COMPUTE, correlation=6),
        _x("kernel", "ncclDevKernel_AllGather_RING_LL", 3050, 40, stream=NCCL, correlation=7),
        _x("kernel", "orphan_kernel", 5000, 1, stream=COMPUTE, correlation=99),
    ]
    return {"traceEvents": cpu + device + [{"ph": "M", "name": "process_name"}]}


def test_extract_from_a_chrome_trace():
    """Launch correlation decides the collective and the phase (inside a collective's range only copies and NCCL
    kernels are the collective: the epilogue kernel is compute); backward's window is its compute stream's span."""
    ex = po.extract(_synthetic_trace())
    kinds = {e.name: po.classify(e) for e in ex["events"]}
    assert kinds == {
        "gemm_bwd": "compute",
        "cast_scale_kernel": "compute",
        "Memcpy DtoD (Device -> Device)": "reduce_scatter",
        "accumulate_kernel": "compute",
        "fused_adamw_kernel": "compute",
        "ncclDevKernel_AllGather_RING_LL": "all_gather",
        "orphan_kernel": "compute",
    }
    # The side-stream accumulate (ends 2450) does not stretch the window past backward's compute (2000-2320).
    assert ex["backward_windows"] == [(2000.0, 2320.0)]
    assert ex["step_windows"] == [(3000.0, 3080.0)]
    assert ex["cpu_ranges"] == {"forward": 0, "backward": 1, "step": 1, "reduce_scatter": 1, "all_gather": 1}
    assert ex["forward_windows"] == [] and ex["all_gathers_launched_in"] == {"forward": 0, "backward": 0, "step": 1}
    assert ex["reduce_scatters_launched_in_backward"] == 1
    assert ex["device_events_without_launch"] == 1
    # The unrelated host-to-device copy (launched outside the collective ranges) is neither compute nor comm.
    assert "Memcpy HtoD (Pageable -> Device)" not in kinds

    rep = po.analyze_overlap(ex["events"], ex["backward_windows"], ex["step_windows"])
    assert (rep["reduce_scatter"]["time_us"], rep["reduce_scatter"]["overlapped_us"]) == (15, 15)
    assert (rep["all_gather"]["time_us"], rep["all_gather"]["overlapped_us"]) == (40, 30)


def test_stream_ids_from_args_or_the_trace_row():
    assert po._stream_id({"args": {"stream": 7}, "tid": 99}) == 7
    assert po._stream_id({"args": {}, "tid": "stream 21 "}) == 21
    assert po._stream_id({"tid": 13}) == 13


def test_the_report_files(tmp_path, capsys):
    """The report the GPU run writes, from the synthetic trace: verdict, table, and JSON that round-trips."""
    args = po.build_parser().parse_args(["--out-dir", str(tmp_path), "--name", "overlap_test"])
    run = {"num_params": 1234, "bucket_size": 4096, "buckets": 3, "last_loss": 5.0, "nccl": "2.27.3",
           "comm_bytes_total": {"reduce_scatter_bytes": 10}, "model": {"vocab": 512, "seq_len": 512, "d_model": 1024,
           "n_layers": 8, "n_heads": 16}}  # fmt: skip
    meta = {"device": "test", "date": "today", "commit": "abc", "torch": torch.__version__, "python": "3",
            "command": "python bench/profile_overlap.py"}  # fmt: skip
    assert po.write_report(args, meta, run, po.extract(_synthetic_trace()), None) == 0
    md = (tmp_path / "overlap_test.md").read_text()
    assert "**PASS: reduce-scatter overlaps backward (100% of its time)**" in md
    assert "| reduce-scatter | 1 | 15.0 | 15.0 | 100.0% | 1 of 1 | 21 | backward window, other streams |" in md
    assert "| all-gather | 1 | 40.0 | 30.0 | 75.0% | 1 of 1 | 21 | optimizer-step window, other streams |" in md
    result = json.loads((tmp_path / "overlap_test.json").read_text())
    assert result["ok"] is True and result["meta"]["device"] == "test" and result["trace"] is None
    assert result["report"]["reduce_scatter"]["events"][0]["overlapped_us"] == 15
    assert result["reduce_scatters_launched_in_backward"] == 1 and result["verdict"].startswith("PASS")
    assert "PASS: reduce-scatter" in capsys.readouterr().out


def test_the_cpu_ranges_of_a_real_profile_are_found(tmp_path):
    """The record_function ranges the script relies on, as torch's profiler exports them (CPU activity only)."""
    x = torch.randn(16, 16, requires_grad=True)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(2):
            loss = (x @ x).sum()
            with torch.profiler.record_function(po.BACKWARD):
                loss.backward()
            with torch.profiler.record_function(po.STEP):
                x.data.add_(x.grad, alpha=-0.1)
    path = tmp_path / "trace.json"
    prof.export_chrome_trace(str(path))
    ex = po.extract(json.loads(path.read_text()))
    assert ex["cpu_ranges"] == {"forward": 0, "backward": 2, "step": 2, "reduce_scatter": 0, "all_gather": 0}
    assert ex["events"] == [] and ex["backward_windows"] == []


def _labelled_collectives(rank, world):
    """Every collective the engine launches is inside a profiler range named after it (how the overlap check
    finds the device work a collective launched)."""
    from tiny_transformer import batch, build, loss_fn

    from zero_ext import ZeroAdamW

    model = build(torch.bfloat16)
    opt = ZeroAdamW(model.named_parameters(), stage=2, bucket_size=1000)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        loss_fn(model, batch(0, rank)).backward()
        opt.step()
    names = {e.name for e in prof.events()}
    return all(po.PROFILER_LABELS[k] in names for k in ("reduce_scatter", "all_gather", "all_reduce"))


def test_collectives_are_labelled_for_the_profiler():
    from distributed import run_on_ranks

    assert all(run_on_ranks(2, _labelled_collectives))


def test_without_cuda_it_exits_2_with_a_message(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert po.main(["--out-dir", str(tmp_path)]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


# ------------------------------------------------------------------------------------------------ stage 3: prefetch
def _stage3_timeline(prefetched: bool = True):
    """Three buckets, forward then backward. Prefetched: bucket k+1's gather (NCCL stream) runs while bucket k's
    kernels compute; the first gather of each phase has nothing beside it. Not prefetched: each gather runs alone,
    between the buckets' compute."""
    ev = []
    for phase, t0 in (("forward", 0), ("backward", 1000)):
        t = t0
        ev.append(po.DeviceEvent("Memcpy DtoD", NCCL, t, t + 10, "all_gather", phase))  # bucket 0: waited for
        t += 10
        for k in range(3):
            if prefetched and k < 2:  # bucket k+1 gathered during bucket k's compute
                ev.append(po.DeviceEvent("Memcpy DtoD", NCCL, t + 5, t + 15, "all_gather", phase))
            ev.append(po.DeviceEvent(f"gemm_{phase}_{k}", COMPUTE, t, t + 100, None, phase))
            t += 100
            if not prefetched and k < 2:
                ev.append(po.DeviceEvent("Memcpy DtoD", NCCL, t, t + 10, "all_gather", phase))
                t += 10
        if phase == "backward":
            ev.append(po.DeviceEvent(RS, NCCL, t - 50, t - 20, None, phase))
    return ev, [(0, 320)], [(1000, 1320)]


def test_prefetched_all_gathers_overlap_forward_and_backward():
    events, fwd, bwd = _stage3_timeline(prefetched=True)
    pre = po.prefetch_overlap(events, fwd, bwd)
    for phase in ("forward", "backward"):
        r = pre[phase]
        # 3 gathers of 10 us; the first waited for alone, the two prefetched ones entirely beside compute
        assert (r["count"], r["time_us"], r["overlapped_us"], r["overlapped_count"]) == (3, 30, 20, 2), phase
        assert r["overlap_fraction"] == pytest.approx(2 / 3)
    rep = po.analyze_overlap(events, bwd)
    rep["prefetch"] = pre
    assert po.verdict(rep) == (
        "PASS: reduce-scatter overlaps backward (100% of its time); all-gathers overlap forward (67%, 2 of 3); "
        "all-gathers overlap backward (67%, 2 of 3)"
    )


def test_gathers_one_after_another_fail_the_stage3_verdict():
    events, fwd, bwd = _stage3_timeline(prefetched=False)
    rep = po.analyze_overlap(events, bwd)
    rep["prefetch"] = pre = po.prefetch_overlap(events, fwd, bwd)
    assert pre["forward"]["overlapped_us"] == 0 and pre["forward"]["overlapped_count"] == 0
    assert po.verdict(rep) == (
        "FAIL: reduce-scatter overlaps backward (100% of its time), but the all-gathers launched in forward overlap "
        "its compute for only 0% of their time (< 50%)"
    )


def test_a_phase_without_gathers_fails_the_stage3_verdict():
    # reshard_after_forward=False gathers nothing in backward: nothing was prefetched there
    events, fwd, bwd = _stage3_timeline(prefetched=True)
    events = [e for e in events if not (e.collective == "all_gather" and e.phase == "backward")]
    rep = po.analyze_overlap(events, bwd)
    rep["prefetch"] = po.prefetch_overlap(events, fwd, bwd)
    assert po.verdict(rep).endswith("but no all-gather was launched in backward (nothing prefetched)")


def test_gathers_are_measured_against_their_own_phase():
    # A gather launched in forward that runs beside backward's compute does not count for forward.
    events = [
        po.DeviceEvent("gemm_f", COMPUTE, 0, 100, None, "forward"),
        po.DeviceEvent("gemm_b", COMPUTE, 200, 300, None, "backward"),
        po.DeviceEvent("Memcpy DtoD", NCCL, 250, 260, "all_gather", "forward"),
    ]
    pre = po.prefetch_overlap(events, [(0, 100)], [(200, 300)])
    assert (pre["forward"]["count"], pre["forward"]["overlapped_us"]) == (1, 0)
    assert pre["backward"]["count"] == 0


def _stage3_trace():
    """A chrome trace of one stage-3 step: the forward range holds a waited gather and a prefetched one."""
    cpu = [
        _x("user_annotation", po.FORWARD, 100, 300),
        _x("user_annotation", po.ALL_GATHER, 110, 5),
        _x("user_annotation", po.ALL_GATHER, 130, 5),
        _x("user_annotation", po.BACKWARD, 500, 300),
        _x("user_annotation", po.ALL_GATHER, 510, 5, tid=2),
        _x("user_annotation", po.REDUCE_SCATTER, 700, 5, tid=2),
        _x("user_annotation", po.STEP, 900, 50),
        _x("cuda_runtime", "cudaMemcpyAsync", 111, 1, correlation=1),
        _x("cuda_runtime", "cudaLaunchKernel", 120, 1, correlation=2),
        _x("cuda_runtime", "cudaMemcpyAsync", 131, 1, correlation=3),
        _x("cuda_runtime", "cudaLaunchKernel", 140, 1, correlation=4),
        _x("cuda_runtime", "cudaMemcpyAsync", 511, 1, tid=2, correlation=5),
        _x("cuda_runtime", "cudaLaunchKernel", 520, 1, tid=2, correlation=6),
        _x("cuda_runtime", "cudaMemcpyAsync", 701, 1, tid=2, correlation=7),
        _x("cuda_runtime", "cudaLaunchKernel", 910, 1, correlation=8),
    ]
    device = [
        _x("gpu_memcpy", "Memcpy DtoD (Device -> Device)", 1000, 10, stream=NCCL, correlation=1),
        _x("kernel", "gemm_fwd_0", 1010, 100, stream=COMPUTE, correlation=2),
        _x("gpu_memcpy", "Memcpy DtoD (Device -> Device)", 1020, 10, stream=NCCL, correlation=3),
        _x("kernel", "gemm_fwd_1", 1110, 100, stream=COMPUTE, correlation=4),
        _x("gpu_memcpy", "Memcpy DtoD (Device -> Device)", 1300, 10, stream=NCCL, correlation=5),
        _x("kernel", "gemm_bwd", 1310, 200, stream=COMPUTE, correlation=6),
        _x("gpu_memcpy", "Memcpy DtoD (Device -> Device)", 1400, 20, stream=NCCL, correlation=7),
        _x("kernel", "fused_adamw_kernel", 1600, 50, stream=COMPUTE, correlation=8),
    ]
    return {"traceEvents": cpu + device}


def test_extract_puts_every_event_in_its_phase():
    ex = po.extract(_stage3_trace())
    assert ex["cpu_ranges"] == {"forward": 1, "backward": 1, "step": 1, "reduce_scatter": 1, "all_gather": 3}
    assert ex["forward_windows"] == [(1010.0, 1210.0)] and ex["backward_windows"] == [(1310.0, 1510.0)]
    assert ex["all_gathers_launched_in"] == {"forward": 2, "backward": 1, "step": 0}
    assert [(e.name, e.phase) for e in ex["events"] if e.collective is None] == [
        ("gemm_fwd_0", "forward"), ("gemm_fwd_1", "forward"), ("gemm_bwd", "backward"), ("fused_adamw_kernel", "step")
    ]  # fmt: skip
    pre = po.prefetch_overlap(ex["events"], ex["forward_windows"], ex["backward_windows"])
    assert (pre["forward"]["time_us"], pre["forward"]["overlapped_us"], pre["forward"]["overlapped_count"]) == (
        20,
        10,
        1,
    )
    assert (pre["backward"]["time_us"], pre["backward"]["overlapped_us"]) == (10, 0)


def test_the_stage3_report_files(tmp_path):
    args = po.build_parser().parse_args(["--out-dir", str(tmp_path), "--name", "s3", "--stage", "3"])
    run = {"num_params": 1234, "bucket_size": 4096, "buckets": 3, "last_loss": 5.0, "nccl": "2.27.3",
           "comm_bytes_total": {}, "model": {"vocab": 512, "seq_len": 512, "d_model": 1024, "n_layers": 8,
           "n_heads": 16}}  # fmt: skip
    meta = {"device": "test", "date": "today", "commit": "abc", "torch": torch.__version__, "python": "3",
            "command": "python bench/profile_overlap.py --stage 3"}  # fmt: skip
    assert po.write_report(args, meta, run, po.extract(_stage3_trace()), None) == 1  # backward's gather is alone
    md = (tmp_path / "s3.md").read_text()
    assert "| all-gather launched in forward | 2 | 20.0 | 10.0 | 50.0% | 1 of 2 | 21 |" in md  # 1st: before compute
    assert "| all-gather launched in backward | 1 | 10.0 | 0.0 | 0.0% | 0 of 1 | 21 |" in md
    assert "module=model, reshard_after_forward=True, prefetch=1" in md
    result = json.loads((tmp_path / "s3.json").read_text())
    assert result["ok"] is False and "launched in backward overlap its compute for only 0%" in result["verdict"]
    assert result["all_gathers_launched_in"] == {"forward": 2, "backward": 1, "step": 0}


def _stage3_phases(rank, world):
    """Stage 3 on CPU (gloo), through the GPU script's own optimizer arguments and training step: where the engine
    launches its collectives, read from a CPU-only profile."""
    import tempfile

    from tiny_transformer import GPT, GPTConfig

    from zero_ext import ZeroAdamW

    args = po.build_parser().parse_args(["--stage", "3"])
    cfg = GPTConfig(64, 16, 32, 2, 2)
    torch.manual_seed(0)
    model = GPT(cfg).bfloat16()
    opt = ZeroAdamW(model.named_parameters(), **dict(po.optimizer_kwargs(args, model), bucket_size=2048))
    g = torch.Generator().manual_seed(rank)
    tokens = [torch.randint(cfg.vocab, (2, cfg.seq_len + 1), generator=g) for _ in range(2)]
    step = po.make_train_step(model, opt, [(t[:, :-1], t[:, 1:]) for t in tokens], "cpu")
    step(0)  # the first step learns the order the modules run in (prefetch follows it)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        step(1)
    with tempfile.TemporaryDirectory() as tmp:
        path = f"{tmp}/trace.json"
        prof.export_chrome_trace(path)
        with open(path) as f:
            return po.collectives_by_phase(json.load(f)), sum(len(g.layout.buckets) for g in opt.sharded_state.groups)


def test_stage3_gathers_in_forward_and_backward_on_cpu():
    from distributed import run_on_ranks

    args = po.build_parser().parse_args(["--stage", "3"])
    for found, buckets in run_on_ranks(2, _stage3_phases):
        ag, rs = found["all_gather"], found["reduce_scatter"]
        assert buckets > 2
        # every bucket gathered once before forward uses it and again before backward (reshard_after_forward), but
        # the prefetch + 1 that backward needs first (the root's `pos`, the tied head's embedding), which forward
        # keeps; none in step(), none twice (the root's bucket used to be prefetched again after the embedding).
        kept = args.prefetch + 1
        assert (ag["forward"], ag["step"], ag["elsewhere"]) == (buckets, 0, 0), found
        assert ag["backward"] == buckets - kept, found
        assert rs["backward"] == buckets and rs["step"] == rs["forward"] == 0, found
