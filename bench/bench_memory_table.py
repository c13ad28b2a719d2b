"""Persistent model-state bytes per parameter, per rank: DDP + AdamW against ZeroAdamW's three stages, for 1M, 10M and
100M parameters at N = 2, 4 and 8 gloo ranks. Each ZeroAdamW number is measured: the engine built for real on N
ranks, one training step taken, ``memory_report().total`` (every persistent tensor, staging pool and padding
included; stage 3's transient window of gathered buckets is shown apart). The formula column is
``zero_ext.memory.estimate`` (bf16 params: 2 + 2 + 12 bytes/param split by stage). DDP (fp32 params, gradients,
AdamW's two moments and DDP's own gradient buckets) does not depend on N and is measured at N = 2.

Checks, per row: stage 3 <= stage 2 <= stage 1 <= DDP.

``--model vocab``: instead, a model with a vocabulary table like Llama's (an embedding and an untied output layer of
32768 x 512 = 16.8M elements each, four times the largest default bucket, and 8 blocks of 512-wide attention and
MLP projections: 58.9M parameters), at N = 1, 2 and 8; each row also lists the staging pool and the largest bucket,
which issue 23 bounds by bytes (a parameter larger than a bucket is split across buckets), never by the table.

    python bench/bench_memory_table.py [--sizes 1,10,100] [--worlds 2,4,8] [--out-dir bench/results]
    python bench/bench_memory_table.py --model vocab --worlds 1,2,8 [--name memory_table_vocab_cpu]
"""

from __future__ import annotations

import argparse
import gc
import math

import torch
import torch.distributed as dist
from harness import MIB, RESULTS, launch, markdown_table, meta, model_state, write_results

from zero_ext import ZeroAdamW, memory

LAYERS = 8
VOCAB, WIDTH, HIDDEN = 32768, 512, 1376  # the vocabulary model: Llama's shape, scaled down (its table 128256 x 4096)


class VocabModel(torch.nn.Module):
    """Embedding, blocks of attention-sized (q, k, v, o) and MLP (gate, up, down) projections, untied output layer.
    Only the parameter shapes matter here: the blocks are chained linear maps."""

    def __init__(self, dtype: torch.dtype):
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, WIDTH, dtype=dtype)

        def linear(i, o):
            return torch.nn.Linear(i, o, bias=False, dtype=dtype)

        self.blocks = torch.nn.ModuleList(
            torch.nn.ModuleDict({**{k: linear(WIDTH, WIDTH) for k in "qkvo"}, "gate": linear(WIDTH, HIDDEN),
                                 "up": linear(WIDTH, HIDDEN), "down": linear(HIDDEN, WIDTH)})
            for _ in range(LAYERS)
        )  # fmt: skip
        self.head = linear(WIDTH, VOCAB)

    def forward(self, idx):
        x = self.embed(idx)
        for b in self.blocks:
            x = x + b["o"](b["q"](x) * b["k"](x) + b["v"](x))
            x = x + b["down"](torch.nn.functional.silu(b["gate"](x)) * b["up"](x))
        return self.head(x)


def build(params_m: float, dtype: torch.dtype) -> torch.nn.Module:
    torch.manual_seed(0)
    if params_m == 0:  # --model vocab
        return VocabModel(dtype)
    dim = int(math.sqrt(params_m * 1e6 / LAYERS))
    return torch.nn.Sequential(*[torch.nn.Linear(dim, dim, bias=False, dtype=dtype) for _ in range(LAYERS)])


def _step(model, net, opt) -> None:
    if isinstance(model, VocabModel):
        x = torch.randint(0, VOCAB, (1, 4))
    else:
        x = torch.randn(1, model[0].in_features, dtype=next(model.parameters()).dtype)
    net(x).float().pow(2).mean().backward()
    opt.step()


def measure(rank: int, world: int, device, params_m: float, with_ddp: bool) -> dict:
    out = {}
    for stage in (1, 2, 3):
        model = build(params_m, torch.bfloat16)
        opt = ZeroAdamW(model.parameters(), stage=stage, module=model)
        _step(model, model, opt)
        report = opt.memory_report()
        out[f"zero{stage}"] = {"total": report.total, "formula": report.formula, "window_bound": report.window_bound,
                               "staging": report.staging, "grad_shard_fp32": report.grad_shard_fp32,
                               "padding": report.padding, "psi": report.num_params,
                               "largest_bucket": max(b.numel for _, b in opt.sharded_state.buckets()),
                               "largest_param": max(p.numel() for p in model.parameters())}  # fmt: skip
        opt.close()
        del model, opt
        gc.collect()
    if with_ddp:
        model = build(params_m, torch.float32)
        net = torch.nn.parallel.DistributedDataParallel(model)
        opt = torch.optim.AdamW(model.parameters())
        _step(model, net, opt)
        led = model_state(model, net, opt)
        out["ddp"] = {"total": led["total"], "formula": led["formula"]}
        del model, net, opt
    dist.barrier()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="1,10,100", help="millions of parameters")
    ap.add_argument("--worlds", default="2,4,8")
    ap.add_argument("--out-dir", default=str(RESULTS))
    ap.add_argument("--model", choices=("linears", "vocab"), default="linears")
    ap.add_argument("--name", default=None, help="result file stem (default memory_table_cpu, or _vocab_cpu)")
    args = ap.parse_args()
    vocab = args.model == "vocab"
    name = args.name or ("memory_table_vocab_cpu" if vocab else "memory_table_cpu")
    info = meta(torch.device("cpu"))
    rows, payload, ok_all = [], [], True
    for size in [0.0] if vocab else (float(s) for s in args.sizes.split(",")):
        ddp = None
        for world in (int(w) for w in args.worlds.split(",")):
            r = launch(measure, world, "cpu", size, ddp is None)
            ddp = ddp or r["ddp"]
            psi = r["zero1"]["psi"]
            per = {k: r[k]["total"] / psi for k in ("zero1", "zero2", "zero3")}
            per["ddp"] = ddp["total"] / psi
            ok = per["zero3"] <= per["zero2"] <= per["zero1"] <= per["ddp"]
            ok_all &= ok
            formula = {s: float(memory.estimate(psi, world, s)) / psi for s in (1, 2, 3)}
            payload.append({"params": psi, "world": world, "bytes_per_param": per, "formula_bytes_per_param": formula,
                            "ddp": ddp, **{k: r[k] for k in ("zero1", "zero2", "zero3")}, "ordered": ok})  # fmt: skip
            rows.append([f"{psi / 1e6:.1f}M", world, f"{per['ddp']:.2f}",
                         *(f"{per[f'zero{s}']:.2f} ({formula[s]:.2f})" for s in (1, 2, 3)),
                         f"{r['zero3']['window_bound'] / MIB:.1f}", "PASS" if ok else "FAIL"])  # fmt: skip
            if vocab:
                z2 = r["zero2"]
                rows[-1][-1:-1] = [f"{z2['staging'] / MIB:.1f}", f"{z2['largest_bucket'] / 2**20:.2f}M",
                                   f"{z2['largest_param'] / 2**20:.2f}M"]  # fmt: skip
            print(rows[-1], flush=True)
    extra = ["stage 2 staging (MiB)", "largest bucket (elements)", "largest parameter (elements)"] if vocab else []
    body = markdown_table(
        ["params", "N", "DDP + AdamW", "stage 1 (formula)", "stage 2 (formula)", "stage 3 (formula)",
         "stage 3 window bound (MiB, transient)", *extra, "stage 3 <= 2 <= 1 <= DDP"],
        rows,
    )  # fmt: skip
    body += (
        "\n\nBytes per parameter of persistent model state on each rank (rank 0), measured with "
        "`memory_report().total` after one step of "
        + ("the vocabulary model (see the script)" if vocab else "a stack of 8 square linear layers")
        + " (bf16 params for ZeroAdamW, "
        "fp32 for DDP, whose row also counts its gradient buckets, a second copy of the gradients with the default "
        "`gradient_as_bucket_view=False`). In parentheses the ZeRO formula (`zero_ext.memory.estimate`); the "
        "difference is the fp32 grad shard (exact averaging), the staging pool (at most two buckets in flight, "
        "bounded: the default bucket is clamped, see `default_bucket_size`) and padding. Stage 3's gathered window "
        "is transient and not in its column.\n\n"
        f"All rows ordered: {'PASS' if ok_all else 'FAIL'}\n"
    )
    write_results(name, info, {"rows": payload, "all_ordered": ok_all}, body, args.out_dir)
    print(f"wrote {args.out_dir}/{name}.json, .md; all ordered: {ok_all}")


if __name__ == "__main__":
    main()
