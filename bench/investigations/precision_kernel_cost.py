"""What each precision setting's fused step costs on the CPU, against the default, on one shard: the default
(fp32 master, exp_avg, exp_avg_sq; bf16 grad and param_out), ``param_remainders``, bf16 moments (with and without
remainders), int8 moments and int8 moments with remainders, each the kernel the engine calls for it, round robin in one process.

    python bench/investigations/precision_kernel_cost.py [--numel 16777216] [--reps 9] [--out-dir bench/results]

Writes precision_kernel_cost.{json,md}.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from harness import RESULTS, cores, markdown_table, meta, round_robin, summary, write_results  # noqa: E402

from zero_ext import ops
from zero_ext.ops import int8 as ops_int8  # noqa: E402
from zero_ext.update import blockwise_int8

HYPER = dict(lr=1e-3, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1)


def contenders(n: int) -> dict:
    g = torch.Generator().manual_seed(0)
    grad = (torch.randn(n, generator=g) * 1e-2).to(torch.bfloat16)
    master = torch.randn(n, generator=g) * 0.02
    param = master.to(torch.bfloat16)
    blocks = blockwise_int8.num_blocks(n)
    step = [0]

    def fp32_state(dtype):
        return torch.zeros(n, dtype=dtype), torch.zeros(n, dtype=dtype)

    m32, v32 = fp32_state(torch.float32)
    m16, v16 = fp32_state(torch.bfloat16)
    m_r, v_r = fp32_state(torch.float32)
    rem = torch.zeros(n, dtype=torch.int16)
    m_rb, v_rb = fp32_state(torch.bfloat16)
    rem_b = torch.zeros(n, dtype=torch.int16)
    m8, v8 = fp32_state(torch.int8)
    s_m, s_v = torch.zeros(blocks), torch.zeros(blocks)
    m8r, v8r = fp32_state(torch.int8)
    s_mr, s_vr = torch.zeros(blocks), torch.zeros(blocks)
    rem8 = torch.zeros(n, dtype=torch.int16)
    masters = {k: master.clone() for k in ("default", "bf16")}
    params = {k: param.clone() for k in ("default", "bf16", "remainders", "remainders_bf16", "int8", "int8_remainders")}
    master8 = master.clone()

    def timed(fn):
        def run():
            step[0] += 1
            t0 = time.perf_counter()
            fn(float(step[0]))
            return time.perf_counter() - t0

        return run

    return {
        "default": timed(lambda s: ops.fused_adamw_(masters["default"], grad, m32, v32, step=s, param_out=params["default"], **HYPER)),
        "remainders": timed(lambda s: ops.fused_adamw_(params["remainders"], grad, m_r, v_r, step=s, remainder=rem, **HYPER)),
        "bf16_moments": timed(lambda s: ops.fused_adamw_(masters["bf16"], grad, m16, v16, step=s, param_out=params["bf16"],
                                                         rounding_seed=7, element_offset=0, **HYPER)),
        "remainders_bf16": timed(lambda s: ops.fused_adamw_(params["remainders_bf16"], grad, m_rb, v_rb, step=s,
                                                            remainder=rem_b, rounding_seed=7, element_offset=0,
                                                            **HYPER)),
        "int8_moments": timed(lambda s: ops_int8.fused_adamw_int8_(master8, grad, m8, s_m, v8, s_v, step=s,
                                                                   param_out=params["int8"], **HYPER)),
        "int8_remainders": timed(lambda s: ops_int8.fused_adamw_int8_(params["int8_remainders"], grad, m8r, s_mr, v8r,
                                                                      s_vr, step=s, remainder=rem8, **HYPER)),
    }  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--numel", type=int, default=1 << 24)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--out-dir", default=str(RESULTS))
    ap.add_argument("--name", default="precision_kernel_cost")
    args = ap.parse_args()
    torch.set_num_threads(cores())
    info = meta(torch.device("cpu"))
    raw = round_robin(contenders(args.numel), args.warmup, args.reps)
    base = raw["default"]
    rows, payload = [], {"numel": args.numel, "threads": torch.get_num_threads(), "results": {}}
    for name, times in raw.items():
        ratios = sorted(t / b for t, b in zip(times, base))
        ratio = ratios[len(ratios) // 2]
        s = summary(times)
        payload["results"][name] = {**s, "ratio_to_default_per_round": ratio}
        rows.append([name, f"{s['median_s'] * 1e3:.1f}", f"{s['min_s'] * 1e3:.1f}-{s['max_s'] * 1e3:.1f}",
                     f"{s['median_s'] * 1e9 / args.numel:.2f}", f"{ratio:.2f}"])  # fmt: skip
    body = markdown_table(["setting", "step ms (median)", "min-max", "ns/element", "/ default (per round)"], rows)
    body += (
        f"\n\nOne fused step over a {args.numel:,}-element shard on the CPU ({torch.get_num_threads()} threads, ISA "
        f"{ops.cpu_isa()}), bf16 gradient; the kernel the engine calls for each setting: default = fp32 master and "
        "moments writing the bf16 param; remainders = bf16 param + int16 remainder as the master; bf16 moments with "
        "stochastic rounding; int8 = codes + one fp32 scale per 64 elements (dequantize, update, requantize), with an "
        "fp32 master or with remainders. Round robin, median of "
        f"{args.reps} rounds after {args.warmup} warm-up; the last column is the median of each round's ratio.\n"
    )
    print(body)
    write_results(args.name, info, payload, body, Path(args.out_dir))


if __name__ == "__main__":
    main()
