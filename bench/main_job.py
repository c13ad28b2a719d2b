"""The main job: train a small GPT with today's standard recipe, then with ZeroAdamW stages 1, 2 and 3.

    python bench/main_job.py                           # 2 gloo processes on CPU, or every visible GPU with NCCL
    python bench/main_job.py --out-dir bench/results   # refresh the committed results on purpose
    python bench/main_job.py --offload nvme --offload-window 131072 --name main_job_nvme   # state on disk

Recipes (same data, same seed, same starting weights, gradient norm clipped at 1.0), each in fresh processes:
  DDP + torch.optim.AdamW(fused=True), fp32 params, bf16 autocast   (16 bytes of model state per param)
  ZeroAdamW stage 1 / stage 2 / stage 3, bf16 params (fp32 master inside), bf16 autocast (stage 3: module=model,
  parameters gathered bucket by bucket around their use)
  zero3_lean: ZeroAdamW stage 3 with param_remainders=True and the leanest moment_dtype this build accepts (int8,
  else bf16, else fp32; the row's label says which): the headline bytes/param of issue 24, measured (--no-lean: not run)

On a CPU, a probe first times one of the job's GEMMs with bf16 operands as a bf16 GEMM and as an fp32 one, and
where the bf16 GEMM has no fast path (AVX2-only CPUs: ~40x slower) autocast's matmuls run as fp32 GEMMs on
bf16-rounded operands (main_job_compute.py); the job prints which and records it in main_job.json/.md.

Prints a table (per-rank model-state memory measured and from zero_ext.memory.estimate, stage 3's window of gathered
parameters, peak memory, step time, tokens/s, final loss), checks that the losses agree (stages 1, 2, 3 bitwise,
ZeRO, zero3_lean included, within --loss-tol of DDP; zero3_lean is not bitwise the stages' run unless its moments
are fp32), and writes main_job.{json,md,png} to --out-dir (default bench/out/, which git
ignores).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import hashlib
import math
import os
import sys
import threading
import time
from dataclasses import asdict
from pathlib import Path

import harness
import torch
import torch.distributed as dist
from gpt_model import GPT, MarkovData, add_model_args, backward_first, model_config, num_params
from harness import MIB, OUT, RunConfig, build, forward_backward, launch, model_state, recipe_label, recipe_stage
from main_job_chart import save_chart
from main_job_compute import describe, matmul_context, probe


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"], help="default: cuda if visible")
    p.add_argument("--world-size", type=int, default=None, help="processes (default: 2 on CPU, every GPU on CUDA)")
    p.add_argument("--stages", default="1,2,3", help="ZeroAdamW stages to run, comma-separated (default: 1,2,3)")
    p.add_argument("--no-baseline", action="store_true", help="skip the DDP + torch AdamW run")
    p.add_argument("--no-lean", action="store_true", help="skip zero3_lean (stage 3, remainders, leanest moments)")
    p.add_argument("--no-muon", action="store_true", help="skip the ZeroMuon rows (muon1/2/3 at the --stages)")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--batch", type=int, default=16, help="global batch in sequences (split over the ranks)")
    add_model_args(p)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--bucket-size",
        type=int,
        default=0,
        help="ZeroAdamW bucket size in elements (default 0: the engine's default, the model in 4 buckets on gloo\n"
        "and 8 on NCCL, clamped to [N * 2**16, max(2**22, N * 2**18)] elements)",
    )
    p.add_argument(
        "--loss-rtol",
        type=float,
        default=0.01,
        help="max |loss(ZeRO) - loss(DDP)| allowed at each step, as a fraction of DDP's loss at that step\n"
        "(default 0.01: the precision bench's 1 %% quality bar; see bench/README.md)",
    )
    p.add_argument(
        "--loss-tol",
        type=float,
        default=None,
        help="an absolute bound in nats instead of --loss-rtol",
    )
    p.add_argument(
        "--out-dir",
        default=str(OUT),
        help="where to write main_job.{json,md,png} (default: bench/out/, which git ignores);\n"
        "--out-dir bench/results refreshes the committed results on purpose",
    )
    p.add_argument(
        "--offload",
        default=None,
        choices=["cpu", "nvme"],
        help="ZeroAdamW's optimizer state in host memory (cpu) or in files (nvme); DDP is unchanged",
    )
    p.add_argument(
        "--offload-dir",
        default=str(OUT / "offload_state"),
        help="--offload nvme: where the state files go (default: bench/out/offload_state, on this disk)",
    )
    p.add_argument(
        "--offload-window",
        type=int,
        default=None,
        help="--offload nvme: bytes of host window the state streams through (default: the engine's, 64 MiB);\n"
        "the report checks that the state on disk is at least 100x the window when it is given",
    )
    p.add_argument(
        "--matmul",
        default="auto",
        choices=["auto", "bf16", "fp32"],
        help="how bf16 autocast's matmuls run on CPU: bf16 GEMMs, or fp32 GEMMs on bf16-rounded operands\n"
        "(default auto: a timed probe picks fp32 when bf16 GEMMs are > 4x slower; see main_job_compute.py)",
    )
    p.add_argument("--name", default="main_job", help="result file stem (default: main_job)")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.add_argument("--no-chart", action="store_true")
    args = p.parse_args(argv)
    args.device = harness.resolve_device(args.device)
    args.world_size = args.world_size or harness.default_world(args.device)
    if args.batch % args.world_size:
        p.error(f"--batch {args.batch} must be a multiple of --world-size {args.world_size}")
    args.stages = [int(s) for s in args.stages.split(",") if s]
    if not set(args.stages) <= {1, 2, 3}:
        p.error("--stages takes some of 1, 2, 3")
    if args.offload != "nvme" and args.offload_window is not None:
        p.error("--offload-window is for --offload nvme")
    return args


# ------------------------------------------------------------------------------------------------ one rank's run
def _anon_rss() -> int:
    """Resident anonymous memory (heap and anonymous mmaps; no shared-library pages), from /proc/self/statm."""
    with open("/proc/self/statm") as f:
        _, resident, shared = f.read().split()[:3]
    return (int(resident) - int(shared)) * os.sysconf("SC_PAGE_SIZE")


class PeakMemory:
    """Peak memory of this rank from now on, over what it holds now (just before the model is built). CUDA:
    ``torch.cuda.max_memory_allocated``. CPU (Linux): the peak resident *anonymous* memory, sampled every
    ``interval`` s by a thread: model state, activations, temporaries, allocator caching and gloo buffers, not the
    shared-library code the first steps page in (a peak shorter than the interval can be missed)."""

    def __init__(self, device: torch.device, interval: float = 0.002):
        self.device, self._stop = device, threading.Event()
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
            self.base = torch.cuda.memory_allocated(device)
            self.label = "torch.cuda.max_memory_allocated - allocated before the model"
            return
        self.label = f"peak resident anonymous memory (sampled every {interval * 1e3:g} ms) - same before the model"
        self.base = self._max = _anon_rss()
        self._thread = threading.Thread(target=self._sample, args=(interval,), daemon=True)
        self._thread.start()

    def _sample(self, interval: float) -> None:
        while not self._stop.wait(interval):
            self._max = max(self._max, _anon_rss())

    def stop(self) -> int:
        if self.device.type == "cuda":
            return torch.cuda.max_memory_allocated(self.device) - self.base
        self._stop.set()
        self._thread.join()
        return max(self._max, _anon_rss()) - self.base


def warm_up(cfg: RunConfig, device: torch.device, matmul: str = "bf16") -> None:
    """One step of the recipe on a tiny model, so that one-time costs (lazy imports, kernel and thread-pool set-up:
    ~70 MiB of heap for torch's fused AdamW on CPU) land before the memory baseline; then hand the freed heap back
    to the OS (glibc ``malloc_trim``) so that the baseline is what is in use."""
    tiny = model_config(argparse.Namespace(vocab=64, seq_len=16, d_model=32, layers=1, heads=2))
    model, net, opt = build(cfg, tiny, device)
    x = torch.randint(tiny.vocab, (2, tiny.seq_len), device=device)
    with matmul_context(matmul):
        forward_backward(cfg, model, net, x, x, device)
    opt.step()
    del model, net, opt
    gc.collect()
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def train(rank: int, world: int, device: torch.device, cfg: RunConfig, matmul: str = "bf16") -> dict:
    """Train for ``cfg.steps`` steps, autocast's matmuls as ``matmul`` GEMMs; rank 0's view of the run: losses
    (means over ranks), step times (the slowest rank's), model state (rank 0's, after the first step), peak memory
    (the largest rank's)."""
    c = cfg.model
    data = MarkovData(c.vocab, c.seq_len, seed=cfg.seed)
    batches = [tuple(t.to(device) for t in data.batch(s, cfg.global_batch, rank, world)) for s in range(cfg.steps)]
    warm_up(cfg, device, matmul)
    dist.barrier()
    peak = PeakMemory(device)
    model, net, opt = build(cfg, c, device)
    is_zero = net is model
    comm0 = opt.comm_stats() if is_zero else None
    bar = None
    if rank == 0 and cfg.progress:
        from tqdm import tqdm

        bar = tqdm(total=cfg.steps, desc=cfg.progress, unit="step", dynamic_ncols=True)
    losses, times, ledger, comm_steps = [], [], None, []
    for x, y in batches:
        t0 = time.perf_counter()
        with matmul_context(matmul):
            loss = forward_backward(cfg, model, net, x, y, device)
        opt.step()
        if ledger is None:  # model state as it stands after the first step (grads still allocated)
            ledger = model_state(model, net, opt)
        if is_zero:  # elements and bytes per collective in this step (reading counters: no communication)
            now = opt.comm_stats()
            comm_steps.append({k: v - comm0[k] for k, v in now.items()})
            comm0 = now
        opt.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - t0)
        losses.append(loss.detach().float())
        if bar is not None:
            bar.set_postfix(loss=f"{losses[-1].item():.4f}", refresh=False)
            bar.update(1)
    if bar is not None:
        bar.close()
    peak_t = torch.tensor([peak.stop()], dtype=torch.float64, device=device)
    dist.all_reduce(peak_t, op=dist.ReduceOp.MAX)
    loss_t = torch.stack(losses).to(device)
    dist.all_reduce(loss_t)
    loss_t /= world
    time_t = torch.tensor(times, dtype=torch.float64, device=device)
    dist.all_reduce(time_t, op=dist.ReduceOp.MAX)
    digest = hashlib.sha256()
    # Stage 3 keeps 1/N of every parameter between steps: read the full ones inside gathered_params() (collective).
    stage3 = is_zero and recipe_stage(cfg.recipe) == 3
    with opt.gathered_params() if stage3 else contextlib.nullcontext():
        for p in model.parameters():
            digest.update(p.detach().to("cpu").contiguous().view(torch.uint8).numpy().tobytes())
    out = {
        "recipe": cfg.recipe,
        "label": recipe_label(cfg) + (f", offload={cfg.offload!r}" if cfg.offload else ""),
        "world_size": world,
        "num_params": num_params(model),
        "losses": [float(v) for v in loss_t.cpu()],
        "step_times_s": [float(v) for v in time_t.cpu()],
        "peak_memory_bytes": int(peak_t[0]),
        "peak_memory_measure": peak.label,
        "param_digest": digest.hexdigest()[:16],
        "config": {**asdict(cfg), "model": asdict(c)},
        "model_state": ledger["allocated"],
        "model_state_total": ledger["total"],
        "estimate": ledger["estimate"],
    }
    if is_zero:
        out.update({k: ledger[k] for k in ("padding", "staging", "grad_shard_fp32", "owned_numel",
                                           "param_shard_not_kept")})  # fmt: skip
        out["formula_this_rank"] = ledger["formula"]
        out["comm_first_step"] = comm_steps[0]  # elements and bytes per collective (comm_stats())
        out["comm_by_step"] = comm_steps
        out["comm_total"] = {k: sum(c[k] for c in comm_steps) for k in comm_steps[0]}
        # Every parameter plus bucket padding: the padded Psi (the flat buffer at stages 1 and 2; stage 3 keeps
        # 1/N of it as its fp32 master).
        out["padded_numel"] = sum(g.layout.numel for g in opt.sharded_state.groups)
        # Stage 3 gathers these buckets once a step, not twice: kept from forward for backward, which needs them first.
        out["kept_for_backward_numel"] = (
            harness.kept_for_backward_numel(opt, backward_first(model), cfg.prefetch)
            if stage3 and cfg.reshard_after_forward
            else 0
        )
        if stage3:  # bytes of gathered buckets: the declared bound, the most held (not persistent)
            out["window_bound"] = ledger["window_bound"]
            out["window_peak"] = opt.memory_report().window_peak  # over the whole run
        out["skipped_steps"] = opt.skipped_steps
        if cfg.offload is not None:  # which bytes live where (memory_report().where), on disk and in host buffers
            out["offload"] = cfg.offload
            out["where"] = ledger["where"]
            out["on_disk"] = ledger["on_disk"]
            out["offload_buffers"] = ledger["offload_buffers"]
    by_rank = [None] * world  # every rank's total: the ranks differ only by who owns the padding
    dist.all_gather_object(by_rank, ledger["total"])
    out["model_state_total_by_rank"] = by_rank
    return out


# ------------------------------------------------------------------------------------------------ checks and report
def agreement(runs: dict, tol: float | None, rtol: float = 0.01) -> dict:
    """Every ZeroAdamW stage must be bitwise equal to the lowest one run (losses and final params); ZeRO vs DDP within
    ``tol`` nats or, without it, ``rtol`` of DDP's loss at each step. Relative, not a number of nats observed on one
    CPU (issue 46): ZeRO keeps bf16 parameters and gradients where DDP keeps fp32 ones under the same autocast, a
    gap whose size follows the loss and the machine's bf16 GEMMs; 1 % is the bar the precision bench holds every
    setting to."""
    checks = {}
    zero = [r for r in ("zero1", "zero2", "zero3") if r in runs]  # the same training run, bit for bit
    muon = [r for r in ("muon1", "muon2", "muon3") if r in runs]  # ZeroMuon's: the same run at every stage
    for same in (zero, muon):
        for other in same[1:]:
            a, b = runs[same[0]], runs[other]
            same_loss, same_params = a["losses"] == b["losses"], a["param_digest"] == b["param_digest"]
            checks[f"{same[0]}_vs_{other}_bitwise"] = {
                "ok": same_loss and same_params,
                "losses_bitwise_equal": same_loss,
                "final_params_bitwise_equal": same_params,
                "max_abs_loss_diff": max(abs(x - y) for x, y in zip(a["losses"], b["losses"])),
            }
    for r in zero + [r for r in ("zero3_lean",) if r in runs]:  # (ZeroMuon runs another optimizer: not vs DDP)
        run = runs[r]
        # (zero3_lean keeps fewer bytes on disk by design: the disk-vs-window check is the stages' own)
        if run.get("offload") == "nvme" and run["config"]["offload_window"] is not None and r in zero:
            # A model whose optimizer state does not fit the memory it may use: the state lives on disk and
            # streams through the window, which is what bounds the memory the optimizer state takes.
            window = run["config"]["offload_window"]
            checks[f"{r}_state_on_disk"] = {
                "ok": run["on_disk"] >= 100 * window,
                "on_disk_bytes": run["on_disk"],
                "window_bytes": window,
                "offload_buffers_bytes": run["offload_buffers"],
                "ratio": run["on_disk"] / window,
            }
        if "ddp" in runs:
            d = [abs(x - y) for x, y in zip(runs[r]["losses"], runs["ddp"]["losses"])]
            allowed = [tol if tol is not None else rtol * abs(x) for x in runs["ddp"]["losses"]]
            checks[f"{r}_vs_ddp"] = {
                "ok": all(x <= a for x, a in zip(d, allowed)),
                "tolerance_nats": min(allowed),  # the tightest step's
                "tolerance_by_step": allowed,
                "tolerance_rule": f"{tol} nats" if tol is not None else f"{rtol:.0%} of DDP's loss",
                "max_gap_over_tolerance": max(x / a for x, a in zip(d, allowed)),
                "max_abs_loss_diff": max(d),
                "final_abs_loss_diff": d[-1],
                "mean_abs_loss_diff": sum(d) / len(d),
            }
    return checks


HEADERS = [
    "recipe",
    "model state MiB/rank (measured)",
    "estimate MiB/rank",
    "bytes/param",
    "gathered window MiB/rank: bound (peak)",
    "peak MiB/rank",
    "step ms median (min-max)",
    "tokens/s",
    "final loss",
]


def render(runs: dict, checks: dict, meta_: dict, matmul: dict, entropy: float, args) -> tuple[str, str]:
    """The console text and the markdown body of the report."""
    rows, breakdown, verdicts = [], [], []
    for name, run in runs.items():
        s = harness.step_stats(run)
        rows.append(
            [
                run["label"],
                f"{run['model_state_total'] / MIB:.2f}",
                f"{run['estimate'] / MIB:.2f}",
                f"{run['model_state_total'] / run['num_params']:.2f}",
                f"{run['window_bound'] / MIB:.2f} ({run['window_peak'] / MIB:.2f})" if "window_bound" in run else "-",
                f"{run['peak_memory_bytes'] / MIB:.1f}",
                f"{s['median_s'] * 1e3:.0f} ({s['min_s'] * 1e3:.0f}-{s['max_s'] * 1e3:.0f})",
                f"{s['tokens_per_s']:.0f}",
                f"{run['losses'][-1]:.4f}",
            ]
        )
        line = f"{name}: " + ", ".join(f"{k} {v / MIB:.2f}" for k, v in run["model_state"].items()) + " MiB"
        if "formula_this_rank" in run:
            line += (
                f"; = formula {run['formula_this_rank'] / MIB:.2f} + padding {run['padding'] / MIB:.2f}"
                f" + staging {run['staging'] / MIB:.2f} + fp32 grad shard {run['grad_shard_fp32'] / MIB:.2f}"
            )
            if run.get("param_shard_not_kept"):
                line += f" - bf16 param shard not kept {run['param_shard_not_kept'] / MIB:.2f}"
            if "offload" in run:
                line += (
                    f" + offload buffers {run['offload_buffers'] / MIB:.2f} - on disk {run['on_disk'] / MIB:.2f}"
                    f" (offload={run['offload']!r}: "
                    + ", ".join(f"{k} {w}" for k, w in run["where"].items() if w != "device")
                    + ")"
                )
        if "window_bound" in run:
            line += (
                f"; gathered window (not persistent, not in the total): bound {run['window_bound'] / MIB:.2f}, "
                f"peak {run['window_peak'] / MIB:.2f}"
            )
        breakdown.append(line)
    for name, c in checks.items():
        v = "PASS" if c["ok"] else "FAIL"
        if name.endswith("state_on_disk"):
            verdicts.append(
                f"{v} {name.removesuffix('_state_on_disk')} optimizer state on disk {c['on_disk_bytes'] / MIB:.2f} MiB/rank = "
                f"{c['ratio']:.0f}x the {c['window_bytes'] / 2**10:.0f} KiB host window (>= 100x); host buffers "
                f"in all (window + gradient landing + parameter staging) {c['offload_buffers_bytes'] / MIB:.2f} MiB"
            )
        elif name.endswith("bitwise"):
            a, b = name.removesuffix("_bitwise").split("_vs_")
            who = "ZeroMuon " if a.startswith("muon") else ""
            verdicts.append(
                f"{v} {who}stage {a[-1]} vs stage {b[-1]} bitwise: losses equal={c['losses_bitwise_equal']}, "
                f"final params equal={c['final_params_bitwise_equal']}"
            )
        else:
            verdicts.append(
                f"{v} {name.removesuffix('_vs_ddp')} vs DDP: max |dloss| {c['max_abs_loss_diff']:.4f} nats (final "
                f"{c['final_abs_loss_diff']:.4f}, mean {c['mean_abs_loss_diff']:.4f}) within "
                f"{c['tolerance_rule']} at every step ({min(c['tolerance_by_step']):.4f}-"
                f"{max(c['tolerance_by_step']):.4f} nats; worst step at {c['max_gap_over_tolerance']:.0%} of it)"
            )
    first = next(iter(runs.values()))
    head = (
        f"{first['num_params']:,} params (Psi), {first['world_size']} ranks, {args.steps} steps, global batch "
        f"{args.batch} x {args.seq_len} tokens; step time = slowest rank, median after "
        f"{first['config']['warmup'] if args.steps > first['config']['warmup'] else 0} warm-up steps\n"
        f"compute: {describe(matmul['matmul'])}; {matmul_reason(matmul)}{isa_note(meta_)}"
    )
    notes = [
        "model state = persistent params + grads + optimizer state per rank, measured after the first step "
        "(DDP: param/grad/AdamW-state tensors plus DDP's gradient buckets; ZeroAdamW: memory_report()).",
        "gathered window (stage 3): bytes of gathered bf16 buckets held at once, the bound memory_report() declares "
        "and the most held during the run (peak); transient, not part of the persistent model state.",
        "estimate = zero_ext.memory.estimate(Psi, N, stage): DDP row with fp32 widths (4+4+8 bytes), "
        "ZeRO rows with bf16 params/grads + 12 bytes fp32 master/exp_avg/exp_avg_sq (zero3_lean: its update rule's "
        "bytes per element, e.g. 10 with remainders and fp32 moments, 6 with bf16 moments).",
        f"peak = {first['peak_memory_measure']} (max over ranks): at this model size mostly activations, "
        "temporaries and runtime buffers, not model state"
        + (
            " (with fp32 GEMMs also the fp32 copies of their operands that backward keeps)."
            if matmul["matmul"] == "fp32"
            else "."
        ),
        f"loss: mean over ranks of the global batch; best possible {entropy:.3f} nats (Markov chain entropy rate), "
        f"ln(vocab) = {math.log(args.vocab):.3f}.",
        *muon_note(runs),
    ]
    text = "\n".join([head, "", harness.text_table(HEADERS, rows), "", *breakdown, "", *verdicts, "", *notes])
    md = "\n".join(
        [
            head,
            "",
            harness.markdown_table(HEADERS, rows),
            "",
            "Model state by kind (MiB per rank, rank 0):",
            "",
            *[f"- {b}" for b in breakdown],
            "",
            "Checks:",
            "",
            *[f"- {v}" for v in verdicts],
            "",
            *[f"- {n}" for n in notes],
            f"- wall time of the whole job: {meta_.get('wall_time_s', '?')} s (from the interpreter's start to the "
            "chart drawn, imports and process starts included)",
        ]
    )
    return text, md


def muon_note(runs: dict) -> list[str]:
    """ZeroMuon's loss against ZeroAdamW's (another optimizer: compared, not checked against a tolerance)."""
    muon = next((r for r in ("muon1", "muon2", "muon3") if r in runs), None)
    adamw = next((r for r in ("zero1", "zero2", "zero3") if r in runs), None)
    if muon is None:
        return []
    line = (
        f"ZeroMuon rows: Muon (lr {harness.MUON_LR}) on the blocks' matrices, AdamW (the run's lr) on embedding, "
        f"positions, norms and biases; final loss {runs[muon]['losses'][-1]:.4f}"
    )
    if adamw is not None:
        line += f" against ZeroAdamW's {runs[adamw]['losses'][-1]:.4f}"
    return [line + " (bench/muon_quality.py runs the longer comparison)."]


def choose_matmul(args) -> dict:
    """How autocast's matmuls run: bf16 GEMMs on CUDA; on CPU, ``--matmul`` or else the probe's decision."""
    if args.device == "cuda":
        return {"matmul": "bf16", "decided_by": "cuda (no probe)"}
    if args.matmul != "auto":
        return {"matmul": args.matmul, "decided_by": "--matmul"}
    tokens = args.batch // args.world_size * args.seq_len  # one rank's MLP input, on the threads a rank gets
    return probe(tokens, args.d_model, threads=max(1, harness.cores() // args.world_size))


def matmul_reason(m: dict) -> str:
    if m["decided_by"] != "probe":
        return f"chosen by {m['decided_by']}"
    return (
        f"probe: a {' x '.join(map(str, m['shape']))} GEMM on {m['threads']} thread(s) took {m['bf16_gemm_ms']:.2f} "
        f"ms as bf16, {m['fp32_gemm_ms']:.2f} ms as fp32 ({m['bf16_over_fp32']:.1f}x; fp32 GEMMs above "
        f"{m['threshold']:g}x)"
    )


def expected_duration(args, matmul: str) -> str:
    """What the default job took where it was measured (bench/README.md, results/main_job*.md)."""
    if args.device == "cuda":
        return "default size: a minute or two on GPUs"
    if matmul == "fp32":
        return "default size: ~1-2 min on 2 CPU cores"
    return "default size: ~1 min on 2 CPU cores whose bf16 GEMMs are fast, ~20 min where they are not"


# What a run on this CPU can be told to leave out (bench/README.md: a CPU without bf16 instructions is emulated with
# ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2 MKL_ENABLE_INSTRUCTIONS=AVX2): recorded with the results.
ISA_ENV = ("ONEDNN_MAX_CPU_ISA", "ATEN_CPU_CAPABILITY", "MKL_ENABLE_INSTRUCTIONS")


def isa_note(meta_: dict) -> str:
    env = " ".join(f"{k}={v}" for k, v in meta_.get("isa_env", {}).items())
    return f"; torch CPU capability {meta_['torch_cpu_capability']}" + (f", environment {env}" if env else "")


def process_age_s(fallback: float) -> float:
    """Seconds since this process started (Linux /proc), else ``fallback``."""
    try:
        with open("/proc/self/stat") as f:
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as f:
            return float(f.read().split()[0]) - start_ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return fallback


def offload_options(args) -> dict:
    if args.offload is None:
        return {}
    if args.offload == "cpu":
        return {"offload": "cpu"}
    Path(args.offload_dir).mkdir(parents=True, exist_ok=True)
    return {"offload": "nvme", "offload_dir": args.offload_dir, "offload_window": args.offload_window}


def _shown(path: Path) -> str:
    rel = os.path.relpath(path)
    return str(path) if rel.startswith("..") else rel


def main(argv=None) -> int:
    args = parse_args(argv)
    t_start = time.perf_counter()
    meta_ = harness.meta(torch.device(args.device))  # at the start: the commit that ran
    recipes = ([] if args.no_baseline else ["ddp"]) + [f"zero{s}" for s in args.stages]
    lean = None if args.no_lean or 3 not in args.stages else harness.leanest_moment_dtype()
    recipes += ["zero3_lean"] if lean else []
    recipes += [] if args.no_muon else [f"muon{s}" for s in args.stages]
    world, out = args.world_size, Path(args.out_dir)
    with torch.device("meta"):
        psi = num_params(GPT(model_config(args)))
    matmul = choose_matmul(args)
    meta_["matmul"] = matmul["matmul"]
    meta_["torch_cpu_capability"] = torch.backends.cpu.get_cpu_capability()
    meta_["isa_env"] = {k: os.environ[k] for k in ISA_ENV if k in os.environ}
    print(
        f"main job: {len(recipes)} recipes x {args.steps} steps of a {psi:,}-param GPT on {world} "
        f"{'GPUs (NCCL)' if args.device == 'cuda' else 'CPU processes (gloo)'}, each recipe in fresh processes "
        f"({expected_duration(args, matmul['matmul'])}); results go to {_shown(out)}/",
        flush=True,
    )
    print(f"compute: {describe(matmul['matmul'])}; {matmul_reason(matmul)}{isa_note(meta_)}", flush=True)
    entropy = MarkovData(args.vocab, args.seq_len, seed=args.seed).entropy_rate()
    print(
        f"GPT d={args.d_model} layers={args.layers} heads={args.heads} vocab={args.vocab} seq={args.seq_len}; "
        f"global batch {args.batch} x {args.seq_len} tokens; data: Markov chain, best possible loss "
        f"{entropy:.3f} nats",
        flush=True,
    )
    runs = {}
    for i, recipe in enumerate(recipes, 1):
        tag = f"[{i}/{len(recipes)}] {recipe}"
        off = f", offload={args.offload!r}" if args.offload and recipe != "ddp" else ""
        precision = dict(param_remainders=True, moment_dtype=lean) if recipe == "zero3_lean" else {}
        label = recipe_label(RunConfig(recipe=recipe, **precision))
        print(f"{tag}: {label}{off}: starting {world} processes", flush=True)
        cfg = RunConfig(
            recipe=recipe,
            model=model_config(args),
            steps=args.steps,
            global_batch=args.batch,
            lr=args.lr,
            seed=args.seed,
            bucket_size=args.bucket_size or None,
            progress="" if args.no_progress else tag,
            **(offload_options(args) if recipe != "ddp" else {}),
            **precision,
        )
        runs[recipe] = launch(train, world, args.device, cfg, matmul["matmul"])
    checks = agreement(runs, args.loss_tol, args.loss_rtol)
    written = []
    if not args.no_chart:
        out.mkdir(parents=True, exist_ok=True)
        written.append(save_chart(runs, checks, entropy, meta_, out / f"{args.name}.png"))
    # From the interpreter's start (imports included) to here: what `make run` waits for, but for writing two files.
    meta_["wall_time_s"] = round(process_age_s(time.perf_counter() - t_start), 1)
    text, markdown = render(runs, checks, meta_, matmul, entropy, args)
    print(text)
    payload = {"entropy_rate": entropy, "matmul": matmul, "checks": checks, "runs": runs}
    written = harness.write_results(args.name, meta_, payload, markdown, out) + written
    print("wrote " + ", ".join(_shown(p) for p in written))
    print(f"total wall time {meta_['wall_time_s']:.1f} s ({describe(matmul['matmul'])})")
    return 0 if all(c["ok"] for c in checks.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
