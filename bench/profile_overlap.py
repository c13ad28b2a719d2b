"""Does ZeroAdamW's gradient reduce-scatter overlap backward compute, and (stage 3) does the prefetched all-gather of
the next bucket overlap the compute of the current one? The PyTorch profiler's answer, on one GPU.

    python bench/profile_overlap.py                    # one CUDA GPU, NCCL at world size 1, stage 2
    python bench/profile_overlap.py --stage 1 --trace  # also write the chrome trace next to the results
    python bench/profile_overlap.py --stage 3          # stage 3: also the all-gathers in forward and in backward

The benchmark GPT (bench/gpt_model.py; d_model 1024, 8 layers, 16 heads, seq 512, batch 8 by default) trains with
bf16 params + bf16 autocast under ZeroAdamW on a one-rank NCCL group, with ``communicator=NcclCommunicator`` so
that the path several GPUs take runs (staging, reduce-scatters on the communication stream during backward,
events, all-gathers in step()). After --warmup steps the profiler records one warm-up step and --steps steps.

Communication = kernels named "nccl*", and the copies and NCCL kernels launched inside the engine's profiler ranges
``zero_ext::reduce_scatter`` / ``zero_ext::all_gather`` (at one rank NCCL runs a reduce-scatter as a memcpy and an
in-place all-gather as nothing); compute = every other kernel, the collectives' epilogues included. Reported: how
much of the reduce-scatters' time had compute of the backward windows running on other streams (interval unions),
and how many started before backward ended; the same for the all-gathers against the optimizer step.
Verdict: PASS when >= 50% of the reduce-scatter time is overlapped. Results: ``results/profile_overlap_cuda.{md,json}``
(+ ``_trace.json`` with --trace). Exit status 0 PASS, 1 FAIL, 2 without a CUDA GPU, NCCL or CUDA build of zero_ext.

Stage 3 (``--stage 3``, ``module=model``, ``--prefetch``, ``--no-reshard``): the buckets are gathered around their use,
bucket k+1's all-gather prefetched while bucket k's modules compute. Each all-gather is put in the phase it was
launched in (forward: inside this script's ``zero_ext_bench.forward`` range; backward; step) and measured against
that phase's compute on other streams, as the reduce-scatters are against backward's. Stage 3's verdict also needs
>= 50% of the all-gather time overlapped in forward and in backward (the first bucket of each phase cannot be:
nothing computes before it), and at least one all-gather launched in each.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from dataclasses import asdict
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import harness  # noqa: E402
import torch  # noqa: E402
from gpt_model import GPT, MarkovData, add_model_args, model_config, num_params  # noqa: E402
from overlap_trace import (  # noqa: E402, F401  (re-exported: the tests read them from here)
    ALL_GATHER,
    BACKWARD,
    FORWARD,
    PHASES,
    PROFILER_LABELS,
    REDUCE_SCATTER,
    STEP,
    THRESHOLD,
    DeviceEvent,
    _stream_id,
    analyze_overlap,
    classify,
    collective_overlap,
    collectives_by_phase,
    extract,
    intersect,
    measure,
    prefetch_overlap,
    union,
    verdict,
)
from torch.profiler import record_function  # noqa: E402


# ------------------------------------------------------------------------------------------------ the GPU run
def _why_not_runnable() -> Optional[str]:
    if not torch.cuda.is_available():
        return f"needs a CUDA GPU (torch {torch.__version__}: torch.cuda.is_available() is False)"
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_nccl_available()):
        return f"needs NCCL (torch {torch.__version__} was built without it)"
    import zero_ext  # noqa: F401

    if not torch._C._dispatch_has_kernel_for_dispatch_key("zero_ext::fused_adamw_", "CUDA"):
        return "needs the CUDA build of zero_ext (run `bash scripts/gpu_session.sh build` first)"
    return None


def optimizer_kwargs(args, model: torch.nn.Module) -> dict[str, Any]:
    """ZeroAdamW's arguments for this run (stage 3: the model for its hooks, resharding and prefetch depth)."""
    kw = dict(lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1, max_grad_norm=1.0, bucket_size=args.bucket_size)
    if args.stage == 3:
        kw.update(module=model, reshard_after_forward=not args.no_reshard, prefetch=args.prefetch)
    return dict(kw, stage=args.stage)


def make_train_step(model, opt, batches: list, device_type: str) -> Callable[[int], torch.Tensor]:
    """One training step with the phases in this script's profiler ranges (forward, backward, optimizer step)."""

    def train_step(i: int) -> torch.Tensor:
        x, y = batches[i % len(batches)]
        with record_function(FORWARD), torch.autocast(device_type, dtype=torch.bfloat16):
            loss = model(x, y)
        with record_function(BACKWARD):
            loss.backward()
        with record_function(STEP):
            opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    return train_step


def profile_run(args, device: torch.device, trace_path: Path) -> dict[str, Any]:
    """Build, warm up and profile; returns the run's facts (the trace is written to ``trace_path``)."""
    import zero_ext
    from zero_ext.comm import NcclCommunicator

    cfg = model_config(args)
    torch.manual_seed(args.seed)
    model = GPT(cfg).to(device=device, dtype=torch.bfloat16)
    # One rank with an NCCL communicator: the path several GPUs take (comm streams, events, staging).
    comm = NcclCommunicator(None, device)
    opt = zero_ext.ZeroAdamW(model.named_parameters(), **optimizer_kwargs(args, model), communicator=comm)
    data = MarkovData(cfg.vocab, cfg.seq_len, seed=args.seed)
    batches = [tuple(t.to(device) for t in data.batch(s, args.batch, 0, 1)) for s in range(4)]
    train_step = make_train_step(model, opt, batches, "cuda")

    for i in range(args.warmup):
        train_step(i)
    torch.cuda.synchronize(device)
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    schedule = torch.profiler.schedule(wait=0, warmup=1, active=args.steps, repeat=1)
    with torch.profiler.profile(activities=activities, schedule=schedule) as prof:
        for i in range(1 + args.steps):
            loss = train_step(args.warmup + i)
            torch.cuda.synchronize(device)  # every kernel of the step has run before the profiler moves on
            prof.step()
    prof.export_chrome_trace(str(trace_path))
    return {
        "num_params": num_params(model),
        "bucket_size": opt.bucket_size,
        "buckets": sum(len(g.layout.buckets) for g in opt.sharded_state.groups),
        "last_loss": float(loss.detach().float()),
        "comm_bytes_total": opt.comm_stats(),
        "nccl": ".".join(str(v) for v in torch.cuda.nccl.version()),
        "model": asdict(cfg),
    }


def report_markdown(args, run: dict[str, Any], ex: dict[str, Any], rep: dict[str, Any], line: str) -> str:
    def us(v):
        return "-" if v is None else f"{v:,.1f}"

    def row(label, r, against):
        started = "-" if r["started_in_window"] is None else f"{r['started_in_window']} of {r['count']}"
        frac = "-" if r["overlap_fraction"] is None else f"{100 * r['overlap_fraction']:.1f}%"
        streams = ", ".join(str(s) for s in r["streams"]) or "-"
        return [label, r["count"], us(r["time_us"]), us(r["overlapped_us"]), frac, started, streams, against]

    oc, m = rep["other_comm"], run["model"]
    headers = "collective|count|time us|overlapped us|overlapped|started in window|streams|compute counted"
    rows = [row("reduce-scatter", rep["reduce_scatter"], "backward window, other streams")]
    if rep.get("prefetch"):  # stage 3: gathered around use, not in step()
        rows += [row(f"all-gather launched in {ph}", r, f"{ph} window, other streams; {r['overlapped_count']} of "
                     f"{r['count']} overlapped at all") for ph, r in rep["prefetch"].items()]  # fmt: skip
    else:
        rows.append(row("all-gather", rep["all_gather"], "optimizer-step window, other streams"))
    rows.append(["other NCCL", oc["count"], us(oc["time_us"]), "-", "-", "-", "-", "-"])
    ms = lambda ws: ", ".join(f"{(b - a) / 1e3:.2f}" for a, b in ws or []) or "none found"  # noqa: E731
    facts = [
        f"GPT: Psi = {run['num_params']:,} params (d_model {m['d_model']}, {m['n_layers']} layers, {m['n_heads']} "
        f"heads, vocab {m['vocab']}), {args.batch} x {m['seq_len']} tokens per step, bf16 params + bf16 autocast",
        f"ZeroAdamW stage {args.stage}, bucket size {run['bucket_size']:,} elements -> {run['buckets']} buckets; "
        f"NCCL {run['nccl']}, world size 1, `communicator=NcclCommunicator(...)` (comm streams, events, staging)"
        + (
            f"; module=model, reshard_after_forward={not args.no_reshard}, prefetch={args.prefetch}; all-gathers "
            f"launched per phase: {ex['all_gathers_launched_in']}"
            if args.stage == 3
            else ""
        ),
        f"profiled: {args.steps} steps after {args.warmup} warm-up steps + 1 profiler warm-up step; CPU ranges "
        f"found: {ex['cpu_ranges']}; device events without a launch record: {ex['device_events_without_launch']}",
        f"forward windows (ms): {ms(ex.get('forward_windows'))}; backward windows (ms): "
        f"{ms(rep['backward_windows'])}; optimizer-step windows (ms): "
        f"{ms(rep['step_windows'])}; reduce-scatters launched inside backward: "
        f"{ex['reduce_scatters_launched_in_backward']} of {rep['reduce_scatter']['count']}",
    ]
    table = harness.markdown_table(headers.split("|"), rows)
    return "\n".join([*[f"- {f}" for f in facts], "", table, "", f"**{line}**", "", NOTE])


NOTE = (
    "- overlapped = time during which compute kernels ran on another stream (interval unions). At one rank NCCL runs "
    "a reduce-scatter as a device-to-device memcpy and an in-place all-gather as nothing (expect 0 all-gathers): "
    "this shows that the stream and event ordering lets bucket k's reduce-scatter run while backward computes on; a "
    "multi-GPU reduce-scatter is longer and competes for SMs (measure it at N > 1). Stage 3 gathers each bucket "
    "from the rank's shard into a separate buffer (not in place), so at one rank its all-gathers are device-to-device "
    "copies inside the `zero_ext::all_gather` range; a prefetched one can run beside the current bucket's compute."
)


def write_report(args, meta: dict[str, Any], run: dict[str, Any], ex: dict[str, Any], trace: Optional[Path]) -> int:
    """Analyse the extracted events, print and write ``<out_dir>/<name>.{md,json}``; 0 on PASS, 1 on FAIL."""
    rep = analyze_overlap(ex["events"], ex["backward_windows"], ex["step_windows"])
    if args.stage == 3:
        rep["prefetch"] = prefetch_overlap(ex["events"], ex["forward_windows"], ex["backward_windows"])
    line = verdict(rep)
    body = report_markdown(args, run, ex, rep, line)
    print(body)
    payload = dict(config={k: v for k, v in vars(args).items() if k != "out_dir"}, run=run, report=rep)
    payload.update({k: ex[k] for k in ("cpu_ranges", "device_events_without_launch")})
    payload.update(reduce_scatters_launched_in_backward=ex["reduce_scatters_launched_in_backward"])
    payload.update(all_gathers_launched_in=ex.get("all_gathers_launched_in"))
    payload.update(threshold=THRESHOLD, verdict=line, ok=line.startswith("PASS"), trace=trace and str(trace))
    written = harness.write_results(args.name, meta, payload, body, args.out_dir)
    print("wrote " + ", ".join(str(w) for w in written + ([trace] if trace is not None else [])))
    return 0 if payload["ok"] else 1


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    add_model_args(p)
    p.set_defaults(seq_len=512, d_model=1024, layers=8, heads=16)
    p.add_argument("--batch", type=int, default=8, help="sequences per step")
    p.add_argument("--stage", type=int, default=2, choices=[1, 2, 3])
    p.add_argument("--prefetch", type=int, default=1, help="stage 3: buckets gathered ahead of use (default 1)")
    p.add_argument("--no-reshard", action="store_true", help="stage 3: reshard_after_forward=False")
    p.add_argument("--bucket-size", type=int, default=None, help="ZeroAdamW bucket size (default: the engine's)")
    p.add_argument("--warmup", type=int, default=5, help="steps before the profiler starts")
    p.add_argument("--steps", type=int, default=3, help="profiled steps")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--trace", action="store_true", help="also write the chrome trace to the results directory")
    p.add_argument("--out-dir", default=str(harness.RESULTS))
    p.add_argument("--name", default="profile_overlap_cuda", help="result file stem")
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = build_parser()
    args = p.parse_args(argv)
    if args.steps < 1 or args.warmup < 0:
        p.error("--steps must be >= 1 and --warmup >= 0")
    why = _why_not_runnable()
    if why is not None:
        print(f"bench/profile_overlap.py: {why}; nothing was measured.", file=sys.stderr)
        return 2
    import torch.distributed as dist

    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    meta = harness.meta(device)  # at the start: the commit that ran
    with tempfile.TemporaryDirectory() as tmp:
        trace_path = out_dir / f"{args.name}_trace.json" if args.trace else Path(tmp) / "trace.json"
        dist.init_process_group("nccl", store=dist.FileStore(os.path.join(tmp, "store"), 1), rank=0, world_size=1)
        try:
            run = profile_run(args, device, trace_path)
        finally:
            dist.destroy_process_group()
        with open(trace_path) as f:
            ex = extract(json.load(f))
    return write_report(args, meta, run, ex, trace_path if args.trace else None)


if __name__ == "__main__":
    sys.exit(main())
