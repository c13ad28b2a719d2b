"""Lightning's DDP recipe around the main job's GPT (bench/gpt_model.py), and the same with zero_ext: one line differs
(``strategy=``; see docs/lightning.md). Launch with torchrun, which Lightning joins (no processes of its own):

    torchrun --nproc_per_node=2 examples/lightning_gpt.py --zero-stage 2 --out runs/z2        # 0: Lightning's DDP
    torchrun --nproc_per_node=3 examples/lightning_gpt.py --zero-stage 2 --out runs/z2b --resume runs/z2/epoch=1.ckpt

It trains with gradient clipping, gradient accumulation, a warm-up LR schedule and a validation loop every epoch,
saves a checkpoint every epoch (``ModelCheckpoint``), then predicts on the validation set. tests/integrations/
test_integration_lightning.py runs :func:`train` under DDP and ZeroStrategy at stages 1-3 and compares them.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "bench"))
from gpt_model import GPT, GPTConfig, MarkovData  # noqa: E402

CONFIG = GPTConfig(vocab=64, seq_len=16, d_model=32, n_layers=2, n_heads=2)
GLOBAL_BATCH, TRAIN_SAMPLES, VAL_SAMPLES = 6, 48, 12  # divisible by 1, 2 and 3 devices


class GPTModule(L.LightningModule):
    def __init__(self, lr: float = 3e-3, warmup: int = 2):
        super().__init__()
        self.lr, self.warmup = lr, warmup
        self.gpt = GPT(CONFIG)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = self.gpt(x, y)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", self.gpt(x, y), sync_dist=True)

    def predict_step(self, batch, batch_idx):
        return self.gpt(batch[0])

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=self.lr, betas=(0.9, 0.95), weight_decay=0.1)
        warmup = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: min(1.0, (step + 1) / self.warmup))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": warmup, "interval": "step"}}


def loaders(devices: int):
    """Train and validation loaders of a fixed Markov-chain corpus; the global batch is the same at any device count
    (Lightning adds the distributed sampler)."""
    data = MarkovData(CONFIG.vocab, CONFIG.seq_len, seed=0)

    def dataset(step, n):
        x, y = data.batch(step, n, rank=0, world=1)
        return torch.utils.data.TensorDataset(x, y)

    per_device = GLOBAL_BATCH // devices
    train = torch.utils.data.DataLoader(dataset(0, TRAIN_SAMPLES), batch_size=per_device)
    val = torch.utils.data.DataLoader(dataset(1, VAL_SAMPLES), batch_size=per_device)
    return train, val


class LossLog(Callback):
    """This rank's training loss at every batch."""

    def __init__(self):
        self.losses = []

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        self.losses.append(float(outputs["loss"]))


def full_state_dict(trainer, module) -> dict[str, torch.Tensor]:
    """The module's weights, whole (stage 3: inside the optimizer's gathered_params(); collective)."""
    zero = getattr(trainer.strategy, "zero_optimizer", None)
    with zero.gathered_params() if zero is not None and zero.stage == 3 else contextlib.nullcontext():
        return {k: v.detach().clone() for k, v in module.state_dict().items()}


def train(zero_stage: int, devices: int, out: str, *, epochs: int = 2, precision: str = "32-true",
          resume: str | None = None, accelerator: str = "cpu") -> dict:  # fmt: skip
    """One run; returns this rank's results (losses, validation loss, final weights, predictions)."""
    L.seed_everything(0, verbose=False)
    module = GPTModule()
    if zero_stage == 0:
        strategy = "ddp"
    else:
        from zero_ext.integrations.lightning import ZeroStrategy

        strategy = ZeroStrategy(stage=zero_stage)  # the one line that differs from Lightning's DDP recipe
    losses = LossLog()
    trainer = L.Trainer(strategy=strategy, accelerator=accelerator, devices=devices, max_epochs=epochs,
                        precision=precision, gradient_clip_val=0.5, accumulate_grad_batches=2,
                        callbacks=[losses, ModelCheckpoint(dirpath=out, filename="{epoch}", save_top_k=-1)],
                        logger=False, enable_progress_bar=False, enable_model_summary=False)  # fmt: skip
    train_loader, val_loader = loaders(devices)
    trainer.fit(module, train_loader, val_loader, ckpt_path=resume)
    val_loss = float(trainer.callback_metrics["val_loss"])
    weights = full_state_dict(trainer, module)
    predictions = trainer.predict(module, val_loader)
    return {"losses": losses.losses, "val_loss": val_loss, "weights": weights, "predictions": predictions[0]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--zero-stage", type=int, default=2, help="0: Lightning's DDP; 1-3: ZeroStrategy(stage=...)")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--precision", default="32-true")
    parser.add_argument("--accelerator", default="cpu")
    parser.add_argument("--out", default="runs/lightning_gpt")
    parser.add_argument("--resume", default=None, help="a checkpoint of an earlier run (any device count)")
    args = parser.parse_args()
    devices = int(os.environ.get("WORLD_SIZE", "1"))
    result = train(args.zero_stage, devices, args.out, epochs=args.epochs, precision=args.precision,
                   resume=args.resume, accelerator=args.accelerator)  # fmt: skip
    if int(os.environ.get("RANK", "0")) == 0:
        print(f"final train loss {result['losses'][-1]:.4f}, val loss {result['val_loss']:.4f}")


if __name__ == "__main__":
    main()
