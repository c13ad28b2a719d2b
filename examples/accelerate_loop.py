"""accelerate's minimal training loop (its quick tour: prepare, backward, step) with a small model, and the same with
zero_ext: one line differs (the accelerator; see docs/accelerate.md). Launch with ``accelerate launch`` or torchrun:

    torchrun --nproc_per_node=2 examples/accelerate_loop.py --zero-stage 2 --out runs/acc   # 0: accelerate's DDP
    torchrun --nproc_per_node=3 examples/accelerate_loop.py --zero-stage 2 --resume runs/acc/epoch0

On top of the quick tour it accumulates gradients over 2 batches (``accumulate(model)``), clips their norm
(``clip_grad_norm_``), warms the learning rate up, and saves its state after the first epoch (``save_state``);
``--resume`` loads that state (``load_state``, at any number of processes) and trains the second epoch.
tests/integrations/test_integration_accelerate.py runs :func:`train` under accelerate's DDP and ZeroAccelerator at
stages 1-3 and compares them.
"""

from __future__ import annotations

import argparse
import os

import torch
from accelerate import Accelerator
from accelerate.utils import set_seed

GLOBAL_BATCH, SAMPLES, FEATURES = 6, 48, 16  # divisible by 1, 2 and 3 processes


def make_model() -> torch.nn.Module:
    return torch.nn.Sequential(
        torch.nn.Linear(FEATURES, 64), torch.nn.GELU(), torch.nn.LayerNorm(64), torch.nn.Linear(64, 1)
    )


def dataset() -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(SAMPLES, FEATURES, generator=g)
    y = (x[:, :4].sum(-1, keepdim=True) - x[:, 4:8].prod(-1, keepdim=True)).tanh()
    return torch.utils.data.TensorDataset(x, y)


def train(zero_stage: int, out: str, *, resume: str | None = None, mixed_precision: str = "no",
          cpu: bool = not torch.cuda.is_available()) -> dict:  # fmt: skip
    """Epochs 0 and 1, saving the state after epoch 0; or, with ``resume``, that state loaded and epoch 1. Returns
    this process's losses, gradient norms and final weights."""
    set_seed(0)
    options = dict(gradient_accumulation_steps=2, mixed_precision=mixed_precision, cpu=cpu)
    if zero_stage == 0:
        accelerator = Accelerator(**options)
    else:
        from zero_ext.integrations.accelerate import ZeroAccelerator

        accelerator = ZeroAccelerator(stage=zero_stage, **options)  # the one line that differs from accelerate's loop
    model = make_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / 4))
    loader = torch.utils.data.DataLoader(dataset(), batch_size=GLOBAL_BATCH // accelerator.num_processes)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)

    losses, norms = [], []
    first = 0
    if resume is not None:
        accelerator.load_state(resume)
        first = 1
    for epoch in range(first, 2):
        for x, y in loader:
            with accelerator.accumulate(model):
                loss = torch.nn.functional.mse_loss(model(x).float(), y)
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    norms.append(float(accelerator.clip_grad_norm_(model.parameters(), 0.5)))
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
            losses.append(float(loss.detach()))
        if epoch == 0:
            accelerator.save_state(os.path.join(out, "epoch0"))
    state = accelerator.get_state_dict(model)
    weights = {k: v.detach().clone() for k, v in state.items()}
    return {
        "losses": losses,
        "norms": norms,
        "weights": weights,
        "wrapper": type(model).__name__,
        "optimizer": type(optimizer.optimizer).__name__,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--zero-stage", type=int, default=2, help="0: accelerate's DDP; 1-3: ZeroAccelerator(stage=)")
    parser.add_argument("--mixed-precision", default="no")
    parser.add_argument("--out", default="runs/accelerate_loop")
    parser.add_argument("--resume", default=None, help="a save_state folder of an earlier run (any process count)")
    args = parser.parse_args()
    result = train(args.zero_stage, args.out, resume=args.resume, mixed_precision=args.mixed_precision)
    if int(os.environ.get("RANK", "0")) == 0:
        print(f"final loss {result['losses'][-1]:.5f}, last grad norm {result['norms'][-1]:.5f}")


if __name__ == "__main__":
    main()
