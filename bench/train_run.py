"""One rank's training run of the GPT under one recipe, and what it measures.

Recipes:
  ``ddp``   today's standard: fp32 params, ``DistributedDataParallel``, bf16 autocast,
            ``torch.optim.AdamW(fused=True)`` (16 bytes of model state per param, + DDP's gradient buckets).
  ``zero1`` bf16 params, bf16 autocast, ``zero_ext.ZeroAdamW(stage=1)`` (fp32 master inside), no DDP.
  ``zero2`` the same with ``stage=2``.

Every recipe starts from the same weights (initialised in fp32 from the seed, then rounded to bf16 so that
the bf16 and fp32 runs start from the same point), sees the same batches and clips the gradient norm at
the same value.
"""

from __future__ import annotations

import ctypes
import gc
import hashlib
import os
import threading
import time
from dataclasses import asdict, dataclass, field

import torch
import torch.distributed as dist
from gpt_model import GPT, GPTConfig, MarkovData, num_params

RECIPES = ("ddp", "zero1", "zero2")
LABELS = {
    "ddp": "DDP + torch AdamW(fused), fp32 params",
    "zero1": "ZeroAdamW stage 1, bf16 params",
    "zero2": "ZeroAdamW stage 2, bf16 params",
}


@dataclass
class RunConfig:
    recipe: str = "zero2"
    model: GPTConfig = field(default_factory=GPTConfig)
    steps: int = 30
    warmup: int = 3  # steps left out of the step-time median
    global_batch: int = 16  # sequences per step, all ranks together
    lr: float = 1e-3
    weight_decay: float = 0.1
    betas: tuple = (0.9, 0.95)
    max_grad_norm: float = 1.0
    seed: int = 0
    bucket_size: int | None = None  # ZeroAdamW's default when None
    param_dtype: str = "bfloat16"  # ZeroAdamW recipes' param dtype (float32: the params are their own master)
    progress: bool = True


def _proc_status_kib(key: str) -> int:
    for line in open("/proc/self/status"):
        if line.startswith(key + ":"):
            return int(line.split()[1])
    raise KeyError(key)


def _anon_rss() -> int:
    """Resident anonymous memory (heap and anonymous mmaps; no shared-library pages), from /proc/self/statm."""
    with open("/proc/self/statm") as f:
        _, resident, shared = f.read().split()[:3]
    return (int(resident) - int(shared)) * _PAGE


_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


class PeakMemory:
    """Peak memory of this rank during the run, over what it held just before the model was built.

    CUDA: ``torch.cuda.max_memory_allocated`` (tensors only: model state + activations + temporaries).
    CPU (Linux): the peak of the resident *anonymous* memory (``statm`` resident - shared), sampled every
    ``interval`` seconds by a thread: model state, activations, temporaries, allocator caching and gloo
    buffers, not the shared-library code the first steps page in. A peak shorter than the interval can be
    missed. ``hwm_delta`` is the kernel's exact peak RSS (``VmHWM``, reset via ``/proc/self/clear_refs``)
    minus the RSS before the model; it also counts library code paged in during the run (~100+ MiB).
    """

    def __init__(self, device: torch.device, interval: float = 0.002):
        self.device = device
        self._stop = threading.Event()
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
            self.base = torch.cuda.memory_allocated(device)
            self.label = "torch.cuda.max_memory_allocated - allocated before the model"
            return
        self.label = f"peak resident anonymous memory (sampled every {interval * 1e3:g} ms) - same before the model"
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset VmHWM to the current VmRSS
        self.rss_base = _proc_status_kib("VmRSS") * 1024
        self.base = self._max = _anon_rss()
        self._thread = threading.Thread(target=self._sample, args=(interval,), daemon=True)
        self._thread.start()

    def _sample(self, interval: float) -> None:
        while not self._stop.wait(interval):
            self._max = max(self._max, _anon_rss())

    def stop(self) -> dict:
        if self.device.type == "cuda":
            return {"peak": torch.cuda.max_memory_allocated(self.device) - self.base}
        self._stop.set()
        self._thread.join()
        self._max = max(self._max, _anon_rss())
        return {"peak": self._max - self.base, "hwm_delta": _proc_status_kib("VmHWM") * 1024 - self.rss_base}


def _release_free_heap() -> None:
    """Give freed heap back to the OS (glibc ``malloc_trim``) so the baseline RSS is what is in use."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def ddp_model_state(model, ddp, opt) -> dict[str, int]:
    """Bytes of params, grads, AdamW state and DDP's own gradient buckets on this rank (after a step)."""
    params = list(model.parameters())
    states = [opt.state[p] for p in params if p in opt.state]
    # DDP's reducer keeps one flat gradient bucket per ~25 MB of params; unless gradient_as_bucket_view=True
    # the param.grad tensors are separate copies, so the buckets are extra model-state memory.
    buckets = sum(int(b) for b in str(ddp._get_ddp_logging_data().get("bucket_sizes", "")).split(",") if b)
    return {
        "params": sum(_nbytes(p) for p in params),
        "grads": sum(_nbytes(p.grad) for p in params if p.grad is not None),
        "exp_avg": sum(_nbytes(s["exp_avg"]) for s in states),
        "exp_avg_sq": sum(_nbytes(s["exp_avg_sq"]) for s in states),
        "step": sum(_nbytes(s["step"]) for s in states if isinstance(s.get("step"), torch.Tensor)),
        "ddp_buckets": 0 if ddp.gradient_as_bucket_view else buckets,
    }


def _param_digest(model) -> str:
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().to("cpu").contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


def build(cfg: RunConfig, model_cfg: GPTConfig, device: torch.device):
    """The model (from ``cfg.seed``), the module to call (DDP wrapper or the model) and the optimizer."""
    import zero_ext

    torch.manual_seed(cfg.seed)
    model = GPT(model_cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.bfloat16().float())  # the same starting point for fp32 and bf16 recipes
    if cfg.recipe == "ddp":
        model.to(device)
        ddp = torch.nn.parallel.DistributedDataParallel(model, device_ids=[device] if device.type == "cuda" else None)
        opt = torch.optim.AdamW(
            model.parameters(), lr=cfg.lr, betas=cfg.betas, weight_decay=cfg.weight_decay, fused=True
        )
        return model, ddp, opt
    if cfg.recipe in ("zero1", "zero2"):
        model.to(device=device, dtype=getattr(torch, cfg.param_dtype))
        opt = zero_ext.ZeroAdamW(
            model.named_parameters(),
            lr=cfg.lr,
            betas=cfg.betas,
            weight_decay=cfg.weight_decay,
            stage=int(cfg.recipe[-1]),
            max_grad_norm=cfg.max_grad_norm,
            bucket_size=cfg.bucket_size,
        )
        return model, model, opt
    raise ValueError(f"unknown recipe {cfg.recipe!r}; expected one of {RECIPES}")


def forward_backward(cfg: RunConfig, model, net, opt, x, y, device) -> torch.Tensor:
    with torch.autocast(device.type, dtype=torch.bfloat16):
        loss = net(x, y)
    loss.backward()
    if net is not model:  # DDP: clip here; ZeroAdamW clips inside step()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.max_grad_norm)
    return loss


def warm_up(cfg: RunConfig, device: torch.device) -> None:
    """One step of the recipe on a tiny model, so that one-time costs (lazy imports, kernel and thread-pool
    initialisation: ~70 MiB of heap for torch's fused AdamW on CPU) land before the memory baseline."""
    tiny = GPTConfig(vocab=64, seq_len=16, d_model=32, n_layers=1, n_heads=2)
    model, net, opt = build(cfg, tiny, device)
    x = torch.randint(tiny.vocab, (2, tiny.seq_len), device=device)
    forward_backward(cfg, model, net, opt, x, x, device)
    opt.step()
    opt.zero_grad(set_to_none=True)
    del model, net, opt
    gc.collect()


def train(rank: int, world: int, device: torch.device, cfg: RunConfig) -> dict:
    """Train for ``cfg.steps`` steps; returns rank 0's view of the run (losses are means over ranks)."""
    import zero_ext

    c = cfg.model
    data = MarkovData(c.vocab, c.seq_len, seed=cfg.seed)
    batches = [data.batch(s, cfg.global_batch, rank, world) for s in range(cfg.steps)]
    batches = [(x.to(device), y.to(device)) for x, y in batches]
    warm_up(cfg, device)
    _release_free_heap()
    dist.barrier()
    peak = PeakMemory(device)
    model, net, opt = build(cfg, c, device)
    ddp = net if net is not model else None

    bar = None
    if rank == 0 and cfg.progress:
        from tqdm import tqdm

        bar = tqdm(total=cfg.steps, desc=f"{cfg.recipe:<5} x{world}", unit="step", dynamic_ncols=True)
    losses, times, state_bytes, report, comm_first = [], [], None, None, None
    comm0 = opt.comm_stats() if ddp is None else None
    for step, (x, y) in enumerate(batches):
        t0 = time.perf_counter()
        loss = forward_backward(cfg, model, net, opt, x, y, device)
        opt.step()
        if step == 0:  # model state as it stands after the first step (grads still allocated)
            if ddp is not None:
                state_bytes = ddp_model_state(model, ddp, opt)
            else:
                report = opt.memory_report()
                comm_first = {k: v - comm0[k] for k, v in opt.comm_stats().items()}
        opt.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - t0)
        losses.append(loss.detach().float())
        if bar is not None:
            bar.update(1)
            bar.set_postfix(loss=f"{losses[-1].item():.4f}")
    if bar is not None:
        bar.close()
    peak_bytes = peak.stop()

    # Losses: the mean over ranks (the global-batch loss). Step time: the slowest rank's, per step.
    loss_t = torch.stack(losses).to(device)
    dist.all_reduce(loss_t)
    loss_t /= world
    time_t = torch.tensor(times, dtype=torch.float64, device=device)
    dist.all_reduce(time_t, op=dist.ReduceOp.MAX)
    peak_t = torch.tensor([peak_bytes["peak"], peak_bytes.get("hwm_delta", 0)], dtype=torch.float64, device=device)
    dist.all_reduce(peak_t, op=dist.ReduceOp.MAX)

    psi = num_params(model)
    out = {
        "recipe": cfg.recipe,
        "label": LABELS[cfg.recipe],
        "world_size": world,
        "num_params": psi,
        "losses": [float(v) for v in loss_t.cpu()],
        "step_times_s": [float(v) for v in time_t.cpu()],
        "peak_memory_bytes": int(peak_t[0]),
        "peak_rss_hwm_delta_bytes": int(peak_t[1]) if device.type == "cpu" else None,
        "peak_memory_measure": peak.label,
        "param_digest": _param_digest(model),
        "config": {**asdict(cfg), "model": asdict(c)},
    }
    if ddp is not None:
        out["model_state"] = state_bytes
        out["model_state_total"] = sum(state_bytes.values())
        # ZeRO's formula for this recipe: fp32 params (4) + fp32 grads (4) + fp32 exp_avg, exp_avg_sq (8).
        out["estimate"] = zero_ext.memory.estimate(psi, world, 0, param_bytes=4, grad_bytes=4, optimizer_state_bytes=8)
        out["estimate_paper_mixed_precision"] = zero_ext.memory.estimate(psi, world, 0)
    else:
        out["model_state"] = dict(report.allocated)
        out["model_state_total"] = report.total
        out["estimate"] = report.estimate
        out["formula_this_rank"] = report.formula
        out["padding"] = report.padding
        out["staging"] = report.staging
        out["grad_shard_fp32"] = report.grad_shard_fp32
        out["owned_numel"] = report.owned_numel
        out["memory_table"] = report.table()
        out["comm_first_step"] = comm_first  # elements and bytes per collective (comm_stats())
        out["comm_total"] = {k: v - comm0[k] for k, v in opt.comm_stats().items()}
        # The flat param buffer holds every parameter plus bucket padding: its size is the padded Psi.
        out["padded_numel"] = report.allocated["params"] // 2
        out["skipped_steps"] = opt.skipped_steps
    # Every rank's ledger, so a reader can see the ranks differ only by who owns the padding.
    gathered = [None] * world
    dist.all_gather_object(gathered, out["model_state_total"])
    out["model_state_total_by_rank"] = gathered
    return out
