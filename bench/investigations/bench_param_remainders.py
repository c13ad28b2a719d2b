"""The fused AdamW kernel with ``param_remainders`` (bf16 param + int16 remainder as the master) against the default
fp32 master with a bf16 param_out, on one shard, interleaved round-robin in one process; and the bytes per
parameter each saves on the device, in host memory and on disk for every stage and offload, from memory_report()
of the benchmark GPT on one rank (tests/precision/test_param_remainders.py checks that the ledger's differences are
those of the live storages).

    python bench/investigations/bench_param_remainders.py                 # CPU, 2^24 elements
    python bench/investigations/bench_param_remainders.py --device cuda   # on a GPU machine

Bytes per element the update moves: fp32 master 28 (master r/w 8, m r/w 8, v r/w 8, bf16 grad 2, bf16 param w 2);
remainders 26 (param r/w 4, remainder r/w 4, m and v 16, grad 2). Writes bench/results/param_remainders_<device>.*.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # bench/: harness, gpt_model

import harness  # noqa: E402
import torch  # noqa: E402
from gpt_model import GPT, GPTConfig  # noqa: E402

from zero_ext import ZeroAdamW, ops
from zero_ext.update import master_split  # noqa: E402
from zero_ext.update.adamw import AdamW  # noqa: E402

HYPER = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1, step=3)
BYTES = {"fp32_master": 28, "remainders": 26}


def saved_bytes(device: torch.device) -> list[list]:
    """[offload, stage, params, B/param saved on the device, host, disk] (fp32 master minus remainders)."""
    rows = []
    for offload in (None, "cpu", "nvme"):
        for stage in (1, 2, 3):
            media = {}
            for remainders in (False, True):
                model = GPT(GPTConfig(d_model=128, n_layers=2)).to(device, torch.bfloat16)
                kw = dict(offload=offload)
                scratch = tempfile.mkdtemp(prefix="zero_ext_bench_")
                if offload == "nvme":
                    kw.update(offload_dir=scratch, offload_window=1 << 20)
                opt = ZeroAdamW(model.parameters(), stage=stage, param_remainders=remainders, module=model, **kw)
                r = opt.memory_report()
                media[remainders] = [r.bytes_on(m) for m in ("device", "host", "disk")]
                n = r.num_params
                opt.close()
                shutil.rmtree(scratch, ignore_errors=True)
            rows.append([offload, stage, n, *(f"{(a - b) / n:.2f}" for a, b in zip(media[False], media[True]))])
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--log2-numel", type=int, default=24)
    parser.add_argument("--reps", type=int, default=9)
    args = parser.parse_args()
    device = torch.device(harness.resolve_device(args.device))
    meta = harness.meta(device)
    n = 1 << args.log2_numel
    sync = torch.cuda.synchronize if device.type == "cuda" else None
    master = torch.randn(n, device=device)
    param, remainder, tie = master_split.split(master)
    grad = torch.randn(n, device=device).to(torch.bfloat16)
    moments = [(torch.randn(n, device=device) * 0.1, torch.rand(n, device=device) * 0.01) for _ in range(2)]
    moments[1] = (moments[1][0], master_split.with_tie(moments[1][1], tie))  # the tie bit in exp_avg_sq's sign
    out = torch.empty(n, dtype=torch.bfloat16, device=device)
    contenders = {
        "fp32_master": lambda: harness.timed(
            lambda: ops.fused_adamw_(master, grad, *moments[0], param_out=out, **HYPER), sync
        ),
        "remainders": lambda: harness.timed(
            lambda: ops.fused_adamw_(param, grad, *moments[1], remainder=remainder, **HYPER), sync
        ),
    }
    times = harness.round_robin(contenders, warmup=2, reps=args.reps)
    rows, payload = [], {"numel": n, "results": {}}
    base = harness.summary(times["fp32_master"])["median_s"]
    for name, ts in times.items():
        s = harness.summary(ts)
        gbs = BYTES[name] * n / s["median_s"] / 1e9
        payload["results"][name] = {**s, "bytes_per_element": BYTES[name], "gb_per_s": gbs}
        rows.append([name, f"{s['median_s'] * 1e3:.2f}", f"{s['q1_s'] * 1e3:.2f}-{s['q3_s'] * 1e3:.2f}",
                     BYTES[name], f"{gbs:.1f}", f"{s['median_s'] / base:.3f}"])  # fmt: skip
    state = {r: AdamW(torch.bfloat16, param_remainders=r).bytes_per_element() for r in (False, True)}
    payload["state_bytes_per_element"] = {"fp32_master": float(state[False]), "remainders": float(state[True])}
    body = (
        f"One fused AdamW step over 2^{args.log2_numel} elements (bf16 grad), {args.reps} interleaved rounds "
        f"after 2 warm-up rounds; medians and quartiles in ms.\n\n"
        + harness.markdown_table(["kernel", "median ms", "q1-q3 ms", "B/elem moved", "GB/s", "x fp32 master"], rows)
        + f"\n\nOptimizer state per owned element: fp32 master {state[False]} B, remainders {state[True]} B "
        "(the bf16 parameter is the master's high half).\n"
    )
    saved = saved_bytes(device)
    payload["saved_bytes_per_param"] = [
        dict(zip(("offload", "stage", "params", "device", "host", "disk"), r)) for r in saved
    ]
    headers = ["offload", "stage", "params", "device B/param", "host B/param", "disk B/param"]
    body += (
        "\nBytes per parameter that param_remainders=True saves (fp32 master run minus remainders run, one rank, "
        "memory_report(); negative: more):\n\n" + harness.markdown_table(headers, saved) + "\n"
    )
    print(harness.text_table(["kernel", "median ms", "q1-q3 ms", "B/elem", "GB/s", "x fp32"], rows))
    print(harness.text_table(headers, saved))
    for path in harness.write_results(f"param_remainders_{device.type}", meta, payload, body):
        print("wrote", path)


if __name__ == "__main__":
    main()
