"""One optimizer step over N elements: zero_ext.ops.fused_adamw_ against every torch Adam/AdamW flavour.

    python bench/bench_optimizer_step.py [--sizes 20,22,24,26] [--reps 10] [--device cpu|cuda]

Contenders (one process, interleaved round-robin per size, so machine noise hits them alike):
  copy                   fp32 dst.copy_(src): the copy bandwidth measured in this run (8 bytes/element)
  zero_ext               fused_adamw_(fp32 master, m, v; bf16 grad; bf16 param_out)
  torch_pipeline         the torch mixed-precision pipeline, buffers preallocated: upcast the bf16 grad into
                         fp32, torch.optim.AdamW(fused=True) on the fp32 master, downcast to the bf16 param
  torch_adamw_{forloop,foreach,fused}, torch_adam_{forloop,foreach,fused}
                         torch.optim.AdamW / Adam on fp32 params and grads (Adam: weight decay is L2)
  deepspeed_cpu_adam / deepspeed_fused_adam   when DeepSpeed is importable (never required)

copy, zero_ext, torch_pipeline and torch_{fused,foreach} come from bench/bench_fused_adamw.py (imported).
"effective GB/s" credits every contender with the 28 bytes per element one AdamW update must move (fp32
master/param, m, v read + written: 24; the gradient read and, in mixed precision, the bf16 param written: 4),
so it is proportional to 1/time and comparable across contenders; "% of copy" divides it by the copy
bandwidth of the same run. Sizes are powers of two (2^28 is opt-in: it is skipped, with a message, when
the buffers of every contender would not fit in 70% of the available memory).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common  # noqa: E402
import torch  # noqa: E402
from bench_fused_adamw import HYPER, make_contenders, measure  # noqa: E402

USEFUL_BYTES = 28  # per element, see the module docstring
# Bytes per element each contender keeps alive (its own buffers), for the memory check.
BUFFER_BYTES = {
    "shared": 4 + 2,  # fp32 init + bf16 grad shared by bench_fused_adamw's contenders
    "copy": 8,
    "zero_ext": 14,
    "torch_pipeline": 22,
    "torch_fused": 16,
    "torch_foreach": 16 + 8,  # + foreach temporaries
    "torch_adamw_forloop": 16 + 8,
    "torch_adam_forloop": 16 + 8,
    "torch_adam_foreach": 16 + 8,
    "torch_adam_fused": 16,
    "deepspeed": 16,
}
RENAME = {"torch_fused": "torch_adamw_fused", "torch_foreach": "torch_adamw_foreach"}


def _torch_step(n: int, device: torch.device, cls, **kind):
    gen = torch.Generator(device="cpu").manual_seed(0)
    p = torch.randn(n, generator=gen).to(device).requires_grad_()
    p.grad = (torch.randn(n, generator=gen) * 1e-2).to(device)
    opt = cls(
        [p], lr=HYPER["lr"], betas=(HYPER["beta1"], HYPER["beta2"]), eps=HYPER["eps"],
        weight_decay=HYPER["weight_decay"], **kind,
    )  # fmt: skip
    return opt.step


def deepspeed_contenders(n: int, device: torch.device) -> tuple[dict, str]:
    """DeepSpeed's CPU Adam (CPU) or FusedAdam (CUDA) when DeepSpeed is importable; else why not."""
    try:
        if device.type == "cpu":
            from deepspeed.ops.adam import DeepSpeedCPUAdam as cls

            name = "deepspeed_cpu_adam"
        else:
            from deepspeed.ops.adam import FusedAdam as cls

            name = "deepspeed_fused_adam"
        return {name: _torch_step(n, device, cls, adamw_mode=True)}, f"{name} included"
    except Exception as e:  # ImportError, or its JIT build failing: optional, never required
        return {}, f"DeepSpeed not measured ({type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''})"


def contenders_for(n: int, device: torch.device, with_deepspeed: bool) -> tuple[dict, str]:
    base = make_contenders(n, device)
    out = {RENAME.get(k, k): v for k, v in base.items()}
    fused_ok = {"cpu": True, "cuda": True}[device.type]
    out["torch_adamw_forloop"] = _torch_step(n, device, torch.optim.AdamW, foreach=False)
    out["torch_adam_forloop"] = _torch_step(n, device, torch.optim.Adam, foreach=False)
    out["torch_adam_foreach"] = _torch_step(n, device, torch.optim.Adam, foreach=True)
    if fused_ok:
        out["torch_adam_fused"] = _torch_step(n, device, torch.optim.Adam, fused=True)
    ds_note = "DeepSpeed skipped (--no-deepspeed)"
    if with_deepspeed:
        ds, ds_note = deepspeed_contenders(n, device)
        out.update(ds)
    return out, ds_note


def fits(n: int, device: torch.device) -> tuple[bool, str]:
    need = n * sum(BUFFER_BYTES.values())
    if device.type == "cuda":
        free = torch.cuda.mem_get_info(device)[0]
    else:
        free = common.free_memory_bytes()
    ok = need <= 0.7 * free
    return ok, f"needs ~{need / 2**30:.1f} GiB, {free / 2**30:.1f} GiB available"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--sizes", default="20,22,24,26", help="log2 of the element counts (2^20 .. 2^28)")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--no-deepspeed", action="store_true")
    p.add_argument("--out-dir", default=str(common.RESULTS))
    p.add_argument("--name", default=None, help="result file stem (default optimizer_step_<device>)")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    sizes = [int(s) for s in args.sizes.split(",")]

    meta = common.meta(device)  # at the start: the commit that ran
    headers = ["n", "contender", "median ms", "spread ms (min-max)", "effective GB/s", "% of copy", "vs zero_ext"]
    rows, results, skipped, ds_note = [], [], [], ""
    for log2 in sizes:
        n = 2**log2
        ok, why = fits(n, device)
        if not ok:
            msg = f"2^{log2}: skipped, {why}"
            print(msg, flush=True)
            skipped.append(msg)
            continue
        contenders, ds_note = contenders_for(n, device, not args.no_deepspeed)
        times = measure(contenders, device, args.warmup, args.reps)
        del contenders
        copy_gbs = 8 * n / statistics.median(times["copy"]) / 1e9
        ours = statistics.median(times["zero_ext"])
        for name, t in times.items():
            med = statistics.median(t)
            gbs = (8 if name == "copy" else USEFUL_BYTES) * n / med / 1e9
            row = [
                f"2^{log2}",
                name,
                f"{med * 1e3:.3f}",
                f"{min(t) * 1e3:.3f}-{max(t) * 1e3:.3f}",
                f"{gbs:.1f}",
                f"{100 * gbs / copy_gbs:.0f}%",
                f"{med / ours:.2f}x" if name != "copy" else "-",
            ]
            rows.append(row)
            results.append({"numel": n, "contender": name, "times_s": t, "median_s": med, "gb_per_s": gbs,
                            "pct_of_copy": 100 * gbs / copy_gbs})  # fmt: skip
            print(" | ".join(row), flush=True)
    notes = [
        f"{args.reps} repetitions after {args.warmup} warm-up, interleaved round-robin; median and min-max.",
        f"effective GB/s = {USEFUL_BYTES} bytes/element / median time (copy: 8 bytes/element); "
        "'vs zero_ext' = median time / zero_ext's median time (> 1: slower than zero_ext).",
        f"torch threads: {torch.get_num_threads()}; zero_ext CPU ISA: {meta['zero_ext_cpu_isa']}.",
        ds_note,
        *skipped,
    ]
    print("\n".join(notes))
    body = "\n".join([common.markdown_table(headers, rows), "", *[f"- {n}" for n in notes if n]])
    name = args.name or f"optimizer_step_{device.type}"
    written = common.write_results(name, meta, {"results": results, "notes": notes}, body, args.out_dir)
    print("wrote " + ", ".join(str(w) for w in written))
    return 0


if __name__ == "__main__":
    sys.exit(main())
