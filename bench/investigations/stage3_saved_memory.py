"""What stage 3 really keeps alive at the end of forward, measured on storages, against its declared window.

    python bench/investigations/stage3_saved_memory.py                # 2 gloo ranks
    python bench/investigations/stage3_saved_memory.py --worlds 2,3
    python bench/investigations/stage3_saved_memory.py --gather-units modules  # the finest window (before units)

For each model (``linear_stack``: 8 bf16 ``nn.Linear(1024, 1024)``, one layer per bucket, the issue's model;
``gpt``: the main job's GPT in bf16) and ``reshard_after_forward`` True / False, on the third step: the parameter
bytes autograd's saved tensors keep allocated when forward returns (every distinct storage a
``saved_tensors_hooks`` pack hook saw holding a parameter's values, weighed by the bytes it still holds),
``memory_report().window_peak`` / ``window_bound``, and the all-gather bytes of a step against 2 Psi (forward,
then backward) less the buckets kept for backward (Psi without resharding; with the reduce-scatter's Psi, a step
moves 3 Psi less those, or 2 Psi). Rank 0's figures; every rank's are alike.
Results: results/stage3_saved_memory.{json,md} (``--name`` to change). The engine measured is the ``zero_ext``
on ``PYTHONPATH`` (its checkout's commit is recorded), so an earlier checkout can be measured with this script.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import weakref

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # bench/: harness, gpt_model

import harness  # noqa: E402
import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
from gpt_model import GPT, GPTConfig, backward_first  # noqa: E402

import zero_ext  # noqa: E402
from zero_ext import ZeroAdamW  # noqa: E402

MIB = 2**20


def linear_stack() -> tuple[nn.Module, int, list]:
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(1024, 1024, bias=False) for _ in range(8)]).to(torch.bfloat16)
    return model, 1024 * 1024, list(reversed(list(model)))


def gpt() -> tuple[nn.Module, int, list]:
    torch.manual_seed(0)
    model = GPT(GPTConfig()).to(torch.bfloat16)
    return model, 2**18, backward_first(model)


MODELS = {"linear_stack": linear_stack, "gpt": gpt}


def saved_param_bytes(model: nn.Module, forward):
    """``forward()``'s result and the bytes of parameter storage its saved tensors still hold when it returns."""
    seen = []

    def pack(t):
        if t.untyped_storage()._cdata in {p.untyped_storage()._cdata for p in model.parameters()}:
            seen.append(weakref.ref(t))  # weak: the measurement keeps nothing alive itself
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = forward()
    alive = {}
    for ref in seen:
        t = ref()
        if t is not None:
            alive[t.untyped_storage()._cdata] = t.untyped_storage().nbytes()
    return out, sum(alive.values())


def measure(rank: int, world: int, device, name: str, reshard: bool, units: str = "auto") -> dict:
    model, bucket, first_in_backward = MODELS[name]()
    opt = ZeroAdamW(model.named_parameters(), lr=1e-3, stage=3, bucket_size=bucket, module=model,
                    reshard_after_forward=reshard, gather_units=units)  # fmt: skip
    g = torch.Generator().manual_seed(rank)
    for step in range(3):
        if name == "gpt":
            tokens = torch.randint(0, GPTConfig.vocab, (4, GPTConfig.seq_len + 1), generator=g)
            fwd = lambda: model(tokens[:, :-1], tokens[:, 1:])  # noqa: E731
        else:
            x = torch.randn(8, 1024, generator=g).to(torch.bfloat16)
            fwd = lambda: model(x).float().pow(2).mean()  # noqa: E731
        before = opt.comm_stats()
        loss, alive = saved_param_bytes(model, fwd)
        loss.backward()
        opt.step()
        opt.zero_grad()
        ag = opt.comm_stats()["all_gather_bytes"] - before["all_gather_bytes"]
    report = opt.memory_report()
    padded = sum(g.layout.numel for g in opt.sharded_state.groups) * 2  # bf16 bytes
    kept = 2 * harness.kept_for_backward_numel(opt, first_in_backward, 1) if reshard else 0
    return {
        "model": name, "world": world, "reshard_after_forward": reshard,
        "model_bytes": sum(p.numel() * 2 for p in model.parameters()),
        "buckets": sum(len(g.layout.buckets) for g in opt.sharded_state.groups),
        "saved_param_bytes_end_of_forward": alive,
        "window_peak": report.window_peak, "window_bound": report.window_bound,
        "all_gather_bytes_per_step": ag,
        "expected_all_gather_bytes": (2 if reshard else 1) * padded - kept,
    }  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--worlds", default="2")
    p.add_argument("--name", default="stage3_saved_memory")
    p.add_argument(
        "--gather-units",
        default="auto",
        choices=["auto", "modules"],
        help="ZeroAdamW's gather_units (auto: blocks gather as one; modules: the finest window)",
    )
    p.add_argument("--out-dir", default=str(harness.RESULTS))
    args = p.parse_args()
    meta = harness.meta(torch.device("cpu"))
    engine = os.path.dirname(os.path.dirname(os.path.abspath(zero_ext.__file__)))
    rev = subprocess.run(["git", "-C", engine, "rev-parse", "--short=12", "HEAD"], capture_output=True, text=True)
    meta["engine"] = f"{engine} at {rev.stdout.strip() or 'unknown'}"
    rows = []
    for world in [int(w) for w in args.worlds.split(",")]:
        for name in MODELS:
            for reshard in (True, False):
                rows.append(harness.launch(measure, world, "cpu", name, reshard, args.gather_units))
                print(rows[-1], flush=True)
    ok = all(
        r["saved_param_bytes_end_of_forward"] <= r["window_peak"] <= r["window_bound"]
        and r["all_gather_bytes_per_step"] == r["expected_all_gather_bytes"]
        for r in rows
    )
    table = harness.markdown_table(
        ["model", "N", "reshard", "model MiB", "buckets", "saved params alive at end of forward MiB",
         "window_peak MiB", "window_bound MiB", "all-gather MiB/step (expected)"],
        [[r["model"], r["world"], r["reshard_after_forward"], f"{r['model_bytes'] / MIB:.2f}", r["buckets"],
          f"{r['saved_param_bytes_end_of_forward'] / MIB:.2f}", f"{r['window_peak'] / MIB:.2f}",
          f"{r['window_bound'] / MIB:.2f}",
          f"{r['all_gather_bytes_per_step'] / MIB:.2f} ({r['expected_all_gather_bytes'] / MIB:.2f})"] for r in rows],
    )  # fmt: skip
    body = (
        f"Engine: `{meta['engine']}`. Parameter bytes autograd's saved tensors keep allocated when forward returns "
        "(weighed on their storages), against the window stage 3 declares; all-gather bytes of the third step "
        f"against 2 Psi less the buckets kept for backward (Psi without resharding). All within: **{ok}**.\n\n{table}\n"
    )
    harness.write_results(args.name, meta, {"ok": ok, "rows": rows}, body, args.out_dir)
    print(body)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
