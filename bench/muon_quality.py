"""Quality: the benchmark GPT trained with ZeroMuon (Muon on the blocks' matrices + AdamW on the rest) against
ZeroAdamW (AdamW on everything), same data, same seed, same starting weights, 2 ranks, stage 2.

    python bench/muon_quality.py                                  # 300 steps, d_model 128, 2 layers (CPU minutes)
    python bench/muon_quality.py --steps 300 --d-model 256 --layers 4

Writes muon_quality.{json,md,png} under bench/results: the loss curves in one chart (raw and a trailing average)
and the final losses (mean of the last 20 steps). Learning rates: AdamW 1e-3 (the main job's), Muon 0.02 with its
AdamW side at 1e-3 (the Muon recipes' usual split); weight decay 0.01 for AdamW, Muon's 0.1 default scaled by its lr
as torch does; gradient norm clipped at 1.0 everywhere.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import harness  # noqa: E402
import torch  # noqa: E402
from gpt_model import GPT, GPTConfig, MarkovData  # noqa: E402

FINAL = 20  # steps averaged for the final loss


def split(model):
    muon = [p for n, p in model.named_parameters() if n.startswith("blocks.") and p.ndim == 2]
    return muon, [p for p in model.parameters() if all(p is not m for m in muon)]


def train(rank, world, device, model_cfg, recipe, steps, batch, lr_adamw, lr_muon):
    import zero_ext

    torch.manual_seed(0)
    model = GPT(model_cfg).to(device)
    if recipe == "muon":
        muon, rest = split(model)
        groups = [{"params": muon}, {"params": rest, "use_muon": False, "lr": lr_adamw, "betas": (0.9, 0.95),
                                     "eps": 1e-8, "weight_decay": 0.01}]  # fmt: skip
        opt = zero_ext.ZeroMuon(groups, lr=lr_muon, stage=2, module=model, max_grad_norm=1.0)
    else:
        opt = zero_ext.ZeroAdamW(model.named_parameters(), lr=lr_adamw, betas=(0.9, 0.95), weight_decay=0.01,
                                 stage=2, module=model, max_grad_norm=1.0)  # fmt: skip
    data = MarkovData(model_cfg.vocab, model_cfg.seq_len)
    losses = []
    for step in range(steps):
        x, y = data.batch(step, batch * world, rank, world)
        loss = model(x.to(device), y.to(device))
        loss.backward()
        opt.step()
        opt.zero_grad()
        mean = loss.detach().clone()
        torch.distributed.all_reduce(mean)
        losses.append(float(mean) / world)
    opt.close()
    return {"losses": losses, "entropy_rate": data.entropy_rate()}


def chart(path, runs: dict, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    colors = {"adamw": "tab:blue", "muon": "tab:red"}
    labels = {"adamw": "ZeroAdamW (AdamW everywhere)", "muon": "ZeroMuon (Muon + AdamW)"}
    for name, run in runs.items():
        xs = list(range(1, len(run["losses"]) + 1))
        ax.plot(xs, run["losses"], color=colors[name], alpha=0.25, lw=0.8)
        avg = [statistics.fmean(run["losses"][max(0, i - 9) : i + 1]) for i in range(len(xs))]
        ax.plot(xs, avg, color=colors[name], lw=1.8, label=f"{labels[name]}: final {run['final']:.3f}")
    ax.axhline(runs["adamw"]["entropy_rate"], color="gray", ls=":", lw=1, label="entropy rate (best possible)")
    ax.set_xlabel("step")
    ax.set_ylabel("training loss (nats)")
    ax.set_yscale("log")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch", type=int, default=8, help="sequences per rank")
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--vocab", type=int, default=512)
    p.add_argument("--lr-adamw", type=float, default=1e-3)
    p.add_argument("--lr-muon", type=float, default=0.02)
    p.add_argument("--out-dir", default=str(harness.RESULTS))
    args = p.parse_args(argv)
    meta = harness.meta(torch.device("cpu"))
    model_cfg = GPTConfig(args.vocab, args.seq_len, args.d_model, args.layers, args.heads)
    runs = {}
    for recipe in ("adamw", "muon"):
        runs[recipe] = harness.launch(train, 2, "cpu", model_cfg, recipe, args.steps, args.batch, args.lr_adamw,
                                      args.lr_muon)  # fmt: skip
        runs[recipe]["final"] = statistics.fmean(runs[recipe]["losses"][-FINAL:])
        print(f"{recipe}: final loss {runs[recipe]['final']:.4f}")
    title = (f"GPT d_model {args.d_model}, {args.layers} layers, {args.steps} steps, 2 ranks, stage 2; "
             f"entropy rate {runs['adamw']['entropy_rate']:.3f}")  # fmt: skip
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    chart(out / "muon_quality.png", runs, title)
    rows = [[name, f"{run['final']:.4f}", f"{run['losses'][0]:.4f}"] for name, run in runs.items()]
    body = "\n".join([
        f"- {title}; lr AdamW {args.lr_adamw}, Muon {args.lr_muon}; final = mean of the last {FINAL} steps",
        "",
        harness.markdown_table(["run", "final loss", "first loss"], rows),
        "",
        "![loss curves](muon_quality.png)",
    ])  # fmt: skip
    harness.write_results("muon_quality", meta, {"runs": runs, "args": vars(args)}, body, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
