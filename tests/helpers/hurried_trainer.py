"""A small GPT trainer written the way single-file DDP trainers are, ported to ZeroAdamW in a hurry (issue 25): the
optimizer swapped, everything else kept. ``train(rank, world, Config(mode="ddp"))`` is the DDP + torch.optim.AdamW
original; ``Config(mode="zero", stage=s)`` the port. tests/trainer/test_hurried_trainer.py runs both on gloo ranks.

Its habits (each either works as under DDP or is refused on every rank, naming what to do):

- per-rank seeding (``torch.manual_seed(1337 + rank)``) before building the model: DDP and ZeroAdamW both start
  every rank from rank 0's weights, so only the batches differ;
- tied weights (``lm_head.weight = wte.weight``) and a frozen parameter (the position embedding);
- an lr schedule written by hand into ``optimizer.param_groups``; decay and no-decay param groups;
- gradient accumulation: ``model.require_backward_grad_sync`` set on every micro-step (DDP's flag; on the unwrapped
  model a plain attribute, ignored) and, in the port, ``optimizer.no_sync()`` on all but the last;
- a GradScaler built with ``enabled=False`` (bf16/fp32 code paths of fp16 trainers): scale, unscale_, step and
  update are then pass-throughs;
- ``torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)``;
- ``model.zero_grad(set_to_none=True)`` after the step;
- evaluation on rank 0 only (``if master_process: estimate_loss()``) with ``model.eval()`` / ``model.train()``
  around it; at stage 3 inside ``with optimizer.gathered_params():``, which every rank enters (``eval_gathered``);
- "save if the validation loss improved", a decision only rank 0 knows: the port broadcasts it, then every rank
  calls ``checkpoint.save`` (``save="zero"``); the original's rank-0 ``torch.save(optimizer.state_dict())``
  (``save="rank0_torch"``) is refused when the port resumes from it;
- resuming: the model's arguments read from the checkpoint before the model exists (``checkpoint.read_extra``);
- the DDP wrap (``wrap_ddp=True``): refused.
"""

from __future__ import annotations

import contextlib
import math
import os
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from zero_ext import ZeroAdamW, checkpoint


@dataclass
class Config:
    mode: str = "ddp"  # "ddp": DDP + torch.optim.AdamW; "zero": ZeroAdamW(stage=stage) in its place
    stage: int = 2
    out_dir: str = "out"
    init_from: str = "scratch"  # or "resume"
    max_iters: int = 6
    eval_interval: int = 3
    eval_iters: int = 2
    grad_accum_steps: int = 2
    batch_size: int = 3
    block_size: int = 12
    learning_rate: float = 1e-2
    warmup_iters: int = 2
    lr_decay_iters: int = 12
    min_lr: float = 1e-3
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    model_args: dict = field(default_factory=lambda: dict(vocab_size=41, block_size=12, n_layer=2, n_head=2, n_embd=32))
    # The habits a port has to change (the hurried port keeps DDP's: wrap, rank-0 torch.save, eval outside).
    wrap_ddp: bool = False
    save: str = "zero"  # "zero": decision broadcast, checkpoint.save on every rank; "rank0_torch": torch.save
    eval_gathered: bool = True


# ---------------------------------------------------------------------------------------------------------- model
class Block(nn.Module):
    def __init__(self, n_embd: int, n_head: int):
        super().__init__()
        self.n_head = n_head
        self.ln_1 = nn.LayerNorm(n_embd)
        # No bias (as nanoGPT's bias=False): the key bias's gradient is zero up to rounding (softmax ignores a shift
        # that is the same for every key), and Adam turns that rounding noise into lr-sized steps whose signs depend
        # on the order of the sums (2.8e-5 apart after 6 steps, DDP vs ZeroAdamW; one DDP against another alike).
        self.c_attn = nn.Linear(n_embd, 3 * n_embd, bias=False)
        self.c_proj = nn.Linear(n_embd, n_embd)
        self.ln_2 = nn.LayerNorm(n_embd)
        self.mlp = nn.Sequential(nn.Linear(n_embd, 4 * n_embd), nn.GELU(), nn.Linear(4 * n_embd, n_embd))

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.c_attn(self.ln_1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, c)
        x = x + self.c_proj(y)
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, vocab_size: int, block_size: int, n_layer: int, n_head: int, n_embd: int):
        super().__init__()
        self.wte = nn.Embedding(vocab_size, n_embd)
        self.wpe = nn.Embedding(block_size, n_embd)
        self.wpe.weight.requires_grad_(False)  # a frozen parameter (fixed positions)
        self.h = nn.ModuleList(Block(n_embd, n_head) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(n_embd)
        self.lm_head = nn.Linear(n_embd, vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight  # tied
        self.apply(self._init_weights)

    @staticmethod
    def _init_weights(m):
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, mean=0.0, std=0.02)
        if isinstance(m, nn.Linear) and m.bias is not None:
            nn.init.zeros_(m.bias)

    def forward(self, idx, targets):
        pos = torch.arange(idx.shape[1])
        x = self.wte(idx) + self.wpe(pos)
        for block in self.h:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


def configure_optimizers(model, cfg: Config, betas=(0.9, 0.95)):
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": cfg.weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    if cfg.mode == "zero":  # the one line a port must change
        return ZeroAdamW(groups, lr=cfg.learning_rate, betas=betas, stage=cfg.stage, module=model)
    return torch.optim.AdamW(groups, lr=cfg.learning_rate, betas=betas)


# ---------------------------------------------------------------------------------------------------------- data
def dataset(split: str, vocab_size: int, length: int = 2000) -> torch.Tensor:
    """A learnable token stream from a seeded generator: a Markov chain whose next token is one of three."""
    g = torch.Generator().manual_seed(0 if split == "train" else 1)
    table = torch.randint(vocab_size, (vocab_size, 3), generator=torch.Generator().manual_seed(7))
    choice = torch.randint(3, (length,), generator=g)
    out = torch.empty(length, dtype=torch.long)
    out[0] = 0
    for i in range(1, length):
        out[i] = table[out[i - 1], choice[i]]
    return out


def get_batch(data: dict, split: str, cfg: Config):
    d = data[split]
    ix = torch.randint(len(d) - cfg.block_size, (cfg.batch_size,))  # torch's global generator, seeded per rank
    x = torch.stack([d[i : i + cfg.block_size] for i in ix])
    y = torch.stack([d[i + 1 : i + 1 + cfg.block_size] for i in ix])
    return x, y


def get_lr(it: int, cfg: Config) -> float:
    if it < cfg.warmup_iters:
        return cfg.learning_rate * (it + 1) / (cfg.warmup_iters + 1)
    ratio = min(1.0, (it - cfg.warmup_iters) / (cfg.lr_decay_iters - cfg.warmup_iters))
    return cfg.min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (cfg.learning_rate - cfg.min_lr)


# ---------------------------------------------------------------------------------------------------------- train
def train(rank: int, world: int, cfg: Config) -> dict:
    """One run; returns the losses each rank saw (``train``), rank 0's evaluations (``eval``), the iterations it
    saved at and the final parameters (full, by name)."""
    ddp = world > 1
    master_process = rank == 0
    zero = cfg.mode == "zero"
    ckpt_path = os.path.join(cfg.out_dir, "ckpt.pt" if not zero or cfg.save == "rank0_torch" else "ckpt")
    torch.manual_seed(1337 + rank)  # per-rank seeding; the wrapper (or the optimizer) broadcasts rank 0's weights
    data = {split: dataset(split, cfg.model_args["vocab_size"]) for split in ("train", "val")}

    iter_num, best_val_loss, model_args, ckpt = 0, 1e9, dict(cfg.model_args), None
    if cfg.init_from == "resume":
        if zero and cfg.save == "zero":
            model_args = checkpoint.read_extra(ckpt_path)["model_args"]  # before anything is built
        else:
            ckpt = torch.load(ckpt_path, map_location="cpu", weights_only=False)
            model_args = ckpt["model_args"]
    model = GPT(**model_args)
    if ckpt is not None:
        model.load_state_dict(ckpt["model"])
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    optimizer = configure_optimizers(model, cfg)
    if cfg.init_from == "resume":
        if ckpt is not None:
            optimizer.load_state_dict(ckpt["optimizer"])
            iter_num, best_val_loss = ckpt["iter_num"], ckpt["best_val_loss"]
        else:
            extra = checkpoint.load(ckpt_path, optimizer)
            iter_num, best_val_loss = extra["iter_num"], extra["best_val_loss"]
    if ddp and (not zero or cfg.wrap_ddp):
        model = nn.parallel.DistributedDataParallel(model)
    raw_model = model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model

    @torch.no_grad()
    def estimate_loss():
        out = {}
        model.eval()
        for split in ("train", "val"):
            losses = torch.zeros(cfg.eval_iters)
            for k in range(cfg.eval_iters):
                X, Y = get_batch(data, split, cfg)
                losses[k] = model(X, Y).item()
            out[split] = losses.mean().item()
        model.train()
        return out

    def save():
        state = {"model_args": model_args, "iter_num": iter_num, "best_val_loss": best_val_loss}
        if zero and cfg.save == "zero":
            checkpoint.save(ckpt_path, optimizer, extra=state)
        elif master_process:
            state.update(model=raw_model.state_dict(), optimizer=optimizer.state_dict())
            torch.save(state, ckpt_path)

    result = {"train": [], "eval": [], "saved_at": []}
    X, Y = get_batch(data, "train", cfg)
    while True:
        lr = get_lr(iter_num, cfg)
        for param_group in optimizer.param_groups:
            param_group["lr"] = lr

        if iter_num % cfg.eval_interval == 0:
            decision = [None, best_val_loss]  # (improved, best validation loss)
            gathered = optimizer.gathered_params() if zero and cfg.eval_gathered else contextlib.nullcontext()
            with gathered:  # (every rank enters it; only rank 0 evaluates)
                if master_process:
                    losses = estimate_loss()
                    result["eval"].append((iter_num, losses["train"], losses["val"]))
                    decision = [losses["val"] < best_val_loss, min(losses["val"], best_val_loss)]
            if zero and cfg.save == "zero":  # the decision must reach every rank: every rank saves
                dist.broadcast_object_list(decision, src=0)
            improved, best_val_loss = decision
            if improved and iter_num > 0:
                save()
                result["saved_at"].append(iter_num)
        if iter_num >= cfg.max_iters:
            break

        for micro_step in range(cfg.grad_accum_steps):
            last = micro_step == cfg.grad_accum_steps - 1
            if ddp:
                model.require_backward_grad_sync = last
            accumulating = optimizer.no_sync() if zero and not last else contextlib.nullcontext()
            with accumulating:
                loss = model(X, Y) / cfg.grad_accum_steps
                X, Y = get_batch(data, "train", cfg)
                scaler.scale(loss).backward()
        if cfg.grad_clip != 0.0:
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        scaler.step(optimizer)
        scaler.update()
        model.zero_grad(set_to_none=True)
        result["train"].append(loss.item() * cfg.grad_accum_steps)
        iter_num += 1

    full = optimizer.gathered_params() if zero else contextlib.nullcontext()
    with full:
        result["params"] = {n: p.detach().clone() for n, p in raw_model.named_parameters()}
    if zero:
        optimizer.close()
    return result
