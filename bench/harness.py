"""What the benchmarks share: result files, timing statistics, processes and rendezvous, and the training recipes.

Scripts run as ``python bench/<script>.py`` (bench/ is then on sys.path). Nothing is installed. The engine tests
import only the model from bench/ (gpt_model.py, which tests/helpers/tiny_transformer.py builds at odd sizes) and have
their own gloo ranks (tests/helpers/distributed.py); only the tests of the benchmarks themselves import the rest.

- result files: :func:`write_results` writes ``<name>.json`` (:func:`meta` + the script's payload) and ``<name>.md``;
  both carry the device, date, commit, torch version and exact command, so every number in bench/README.md traces
  back to a run;
- timing: :func:`round_robin` interleaves contenders (load swings hit them alike); :func:`summary` gives the median,
  quartiles and range;
- processes: :func:`join_group` makes a process rank r of N (gloo on CPU, NCCL on GPUs); :func:`launch` runs a
  function on N fresh processes (so peak memory is per run);
- recipes: ``ddp`` (fp32 params, DDP, bf16 autocast, torch AdamW(fused=True)), ``zero1`` / ``zero2`` / ``zero3``
  (bf16 params, bf16 autocast, ZeroAdamW; stage 3 with ``module=model``), ``zero3_lean`` (stage 3 with
  ``param_remainders`` and the leanest ``moment_dtype`` the build accepts), built from the same weights by
  :func:`build`; :func:`model_state` is a rank's persistent model state, :func:`ledger_ok` the identity it
  satisfies. PyTorch's own peers (FSDP2, ZeroRedundancyOptimizer) and a naive ZeRO-3 live in ``peers.py``.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import pickle
import platform
import shlex
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import torch
import torch.distributed as dist
from gpt_model import GPT, GPTConfig, num_params

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
RESULTS = BENCH / "results"  # committed results: pass --out-dir bench/results to refresh them on purpose
OUT = BENCH / "out"  # untracked (.gitignore): where the main job writes by default
MIB = 2**20


# ------------------------------------------------------------------------------------------------ result files
def git_commit() -> str:
    """The commit the code ran at, with ``-dirty`` when tracked code differed from it (zero_ext/, bench/, csrc/; not
    the result files in bench/results/, which a session's earlier runs rewrite)."""
    try:
        run = dict(cwd=REPO, capture_output=True, text=True)
        sha = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], check=True, **run).stdout.strip()
        paths = ["zero_ext", "bench", "csrc", ":(exclude)bench/results"]
        dirty = subprocess.run(["git", "diff", "--quiet", "HEAD", "--", *paths], **run)
        return sha + ("-dirty" if dirty.returncode else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def kept_for_backward_numel(opt, modules: Sequence[torch.nn.Module], prefetch: int) -> int:
    """Elements (every rank's part) of the buckets ZeroAdamW stage 3 keeps from forward into backward instead of
    gathering them again: the first ``prefetch + 1`` distinct buckets of ``modules``' own parameters, in the order
    backward reaches the modules (e.g. ``gpt_model.backward_first``), each module's buckets in index order."""
    bucket_of, numel = {}, {}
    for g in opt.sharded_state.groups:
        for slot, p in zip(g.layout.slots, g.params):
            bucket_of[id(p)] = (g.index, slot.bucket)
        numel.update({(g.index, b.index): b.numel for b in g.layout.buckets})
    head: list = []
    for m in modules:
        for key in sorted({bucket_of[id(p)] for p in m.parameters(recurse=False) if id(p) in bucket_of}):
            if len(head) > prefetch:
                return sum(numel[k] for k in head)
            if key not in head:
                head.append(key)
    return sum(numel[k] for k in head)


def cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def device_description(device: torch.device) -> str:
    if device.type == "cuda":
        return f"{torch.cuda.device_count()}x {torch.cuda.get_device_name(device)} (CUDA {torch.version.cuda})"
    name = platform.processor() or platform.machine()
    try:
        name = next(ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return f"CPU: {name}, {cores()} cores"


def meta(device: torch.device) -> dict[str, Any]:
    """What a result file records about its run; call it at the start (the commit and load the run began with)."""
    try:
        import zero_ext

        isa = zero_ext.ops.cpu_isa()
    except Exception as e:  # the record must say why it is missing, not fail the run
        isa = f"unavailable ({e})"
    script = os.path.relpath(os.path.abspath(sys.argv[0]), os.getcwd())
    return {
        "device": device_description(device),
        "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC"),
        "commit": git_commit(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "zero_ext_cpu_isa": isa,
        "command": shlex.join(["python", script, *sys.argv[1:]]),  # as typed from the repository root
        # Other work on the machine slows every timing: the 1-minute load average when the run started.
        "load_avg_1m": round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None,
    }


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    out = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    return "\n".join(out + ["| " + " | ".join(str(c) for c in r) + " |" for r in rows])


def text_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    cells = [list(headers)] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = ["  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))) for r in cells]
    return "\n".join([lines[0], "  ".join("-" * w for w in widths), *lines[1:]])


def write_results(name: str, meta_: dict, payload: dict, markdown_body: str, out_dir: Path | str = RESULTS) -> list:
    """``<out_dir>/<name>.json`` (meta + payload) and ``<name>.md`` (meta + body); returns the paths."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    js, md = out_dir / f"{name}.json", out_dir / f"{name}.md"
    js.write_text(json.dumps({"meta": meta_, **payload}, indent=2) + "\n")
    m = meta_
    head = [
        f"- device: {m['device']}",
        f"- date: {m['date']}, commit `{m['commit']}`, torch {m['torch']}, python {m['python']}",
        f"- command: `{m['command']}`",
        f"- load average (1 min) at the start: {m.get('load_avg_1m')} (timings are noisy when it exceeds the cores)",
    ]
    md.write_text(f"# {name}\n\n" + "\n".join(head) + f"\n\n{markdown_body.rstrip()}\n")
    return [js, md]


def append_csv(path: Path, rows: list[dict[str, Any]]) -> Path:
    """Append ``rows`` to a CSV that keeps every earlier row; a new column widens the header (old rows: blank)."""
    import csv

    path = Path(path)
    old_rows, fields = [], []
    if path.exists():
        with path.open(newline="") as f:
            reader = csv.DictReader(f)
            fields, old_rows = list(reader.fieldnames or []), list(reader)
    for row in rows:
        fields += [k for k in row if k not in fields]
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields, restval="")
        writer.writeheader()
        writer.writerows(old_rows + rows)
    return path


def free_memory_bytes() -> int:
    """MemAvailable from /proc/meminfo (what a new allocation can get without swapping); 0 if unknown."""
    try:
        return next(int(ln.split()[1]) * 1024 for ln in open("/proc/meminfo") if ln.startswith("MemAvailable:"))
    except (OSError, StopIteration):
        return 0


# ------------------------------------------------------------------------------------------------ timing
def summary(times: Sequence[float]) -> dict[str, float]:
    """Median, quartiles and range of a list of times (seconds)."""
    times = list(times) * (2 if len(times) == 1 else 1)
    # The default ("exclusive") quartiles extrapolate beyond the data for fewer than 4 samples (tiny smoke runs).
    q = statistics.quantiles(times, n=4, method="exclusive" if len(times) >= 4 else "inclusive")
    return {"median_s": statistics.median(times), "q1_s": q[0], "q3_s": q[2], "min_s": min(times), "max_s": max(times)}


def timed(fn: Callable[[], Any], sync: Optional[Callable[[], None]] = None) -> float:
    """Seconds one call of ``fn`` takes (``sync``: e.g. torch.cuda.synchronize, before and after)."""
    if sync is not None:
        sync()
    start = time.perf_counter()
    fn()
    if sync is not None:
        sync()
    return time.perf_counter() - start


def round_robin(contenders: dict[str, Callable[[], Any]], warmup: int, reps: int, before=None) -> dict[str, list]:
    """``warmup + reps`` rounds, each calling every contender once in turn (``before()`` ahead of each call, e.g. a
    barrier), so machine noise hits them alike. Returns what each call returned in the last ``reps`` rounds."""
    out: dict[str, list] = {name: [] for name in contenders}
    for rep in range(warmup + reps):
        for name, fn in contenders.items():
            if before is not None:
                before()
            value = fn()
            if rep >= warmup:
                out[name].append(value)
    return out


def step_stats(run: dict) -> dict:
    """A training run's median step time after its warm-up steps, their range, and tokens/s at the median."""
    s = summary(run["step_times_s"][run["config"]["warmup"] :] or run["step_times_s"])
    return {**s, "tokens_per_s": run["config"]["global_batch"] * run["config"]["model"]["seq_len"] / s["median_s"]}


# ------------------------------------------------------------------------------------------------ processes
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def join_group(rank: int, world: int, port: int, device_type: str = "cpu", threads=None, timeout_s=None):
    """Make this process rank ``rank`` of ``world`` (rendezvous at 127.0.0.1:``port``): NCCL on GPU ``rank``, or
    gloo with ``threads`` torch threads (default: the cores shared between the ranks, not oversubscribed).
    Returns the rank's device."""
    kw = dict(init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    if timeout_s is not None:
        kw["timeout"] = _dt.timedelta(seconds=timeout_s)
    if device_type == "cuda":
        torch.cuda.set_device(rank)
        device = torch.device("cuda", rank)
        dist.init_process_group("nccl", device_id=device, **kw)
        return device
    torch.set_num_threads(threads or max(1, cores() // world))
    dist.init_process_group("gloo", **kw)
    return torch.device("cpu")


def _entry(rank: int, world: int, device_type: str, port: int, out_path: str, fn: Callable, args: tuple) -> None:
    # investigations/bench_collectives.py calls the flat collectives by their names deprecated in torch 2.13: one
    # warning per rank and call would bury the output.
    warnings.filterwarnings("ignore", message=r".*is deprecated\. Please use `torch\.distributed\.")
    device = join_group(rank, world, port, device_type)
    try:
        result = fn(rank, world, device, *args)
        if rank == 0:
            with open(out_path, "wb") as f:
                pickle.dump(result, f)
    finally:
        dist.destroy_process_group()


def launch(fn: Callable, world: int, device_type: str, *args) -> Any:
    """``fn(rank, world, device, *args)`` on ``world`` new processes; returns what rank 0 returned."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.pkl")
        # fork on CPU: the children inherit the imported torch instead of importing it again (seconds per
        # process on a small machine); CUDA cannot be forked once initialised, so GPUs get fresh processes.
        method = "spawn" if device_type == "cuda" else "fork"
        mp.start_processes(_entry, args=(world, device_type, free_port(), out, fn, args), nprocs=world,
                           start_method=method)  # fmt: skip
        with open(out, "rb") as f:
            return pickle.load(f)


def resolve_device(device: str) -> str:
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device is visible (torch.cuda.is_available() is False)")
    return device


def default_world(device: str) -> int:
    return torch.cuda.device_count() if device == "cuda" else 2


# ------------------------------------------------------------------------------------------------ recipes
RECIPES = ("ddp", "zero1", "zero2", "zero3", "zero3_lean")
# ZeroMuon at each stage: Muon (lr MUON_LR) on the blocks' matrices, AdamW (the run's lr) on the rest
MUON_RECIPES = ("muon1", "muon2", "muon3")
MUON_LR = 0.02
LABELS = {
    "ddp": "DDP + torch AdamW(fused), fp32 params",
    "zero1": "ZeroAdamW stage 1, bf16 params",
    "zero2": "ZeroAdamW stage 2, bf16 params",
    "zero3": "ZeroAdamW stage 3, bf16 params",
    "zero3_lean": "ZeroAdamW stage 3, bf16 params, param_remainders + {moments} moments",
    "muon1": "ZeroMuon stage 1, bf16 params, Muon + AdamW",
    "muon2": "ZeroMuon stage 2, bf16 params, Muon + AdamW",
    "muon3": "ZeroMuon stage 3, bf16 params, Muon + AdamW",
}
# The leanest moment dtypes first: zero3_lean takes the first one this build of ZeroAdamW accepts (issue 24).
LEAN_MOMENTS = ("int8", "bfloat16", "float32")


def recipe_stage(recipe: str) -> int:
    """The ZeroAdamW / ZeroMuon stage of a recipe ("zero3_lean" -> 3, "muon2" -> 2)."""
    return int(recipe.removeprefix("zero").removeprefix("muon")[0])


def moment_dtype_supported(name: str) -> bool:
    """Whether this build's ``ZeroAdamW(moment_dtype=getattr(torch, name), param_remainders=True)`` accepts bf16
    params (built on one process, no process group)."""
    import zero_ext

    if name == "float32":
        return True
    try:
        opt = zero_ext.ZeroAdamW([torch.nn.Parameter(torch.zeros(64, dtype=torch.bfloat16))], param_remainders=True,
                                 moment_dtype=getattr(torch, name))  # fmt: skip
    except (TypeError, ValueError, NotImplementedError, RuntimeError):
        return False
    opt.close()
    return True


def leanest_moment_dtype() -> str:
    """The first of :data:`LEAN_MOMENTS` this build of ZeroAdamW accepts (:func:`moment_dtype_supported`)."""
    return next(name for name in LEAN_MOMENTS if moment_dtype_supported(name))


def recipe_label(cfg: "RunConfig") -> str:
    return LABELS[cfg.recipe].format(moments=cfg.moment_dtype.replace("bfloat16", "bf16").replace("float32", "fp32"))


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
    bucket_size: Optional[int] = None  # ZeroAdamW's default when None
    param_dtype: str = "bfloat16"  # ZeroAdamW's param dtype (float32: the params are their own master)
    reshard_after_forward: bool = True  # stage 3 only
    prefetch: int = 1  # stage 3 only
    autocast: bool = True  # bf16 autocast for forward
    offload: Optional[str] = None  # ZeroAdamW's offload: None, "cpu" or "nvme"
    offload_dir: Optional[str] = None  # offload="nvme": where the state files go
    offload_window: Optional[int] = None  # offload="nvme": bytes of host window (the engine's default when None)
    param_remainders: bool = False  # ZeroAdamW: the fp32 master kept as the bf16 param + an int16 remainder
    moment_dtype: str = "float32"  # ZeroAdamW's moment_dtype, a torch dtype name ("float32", "bfloat16", "int8")
    progress: str = ""  # rank 0 shows a progress bar with this label ("": none)
    compile_backend: Optional[str] = None  # torch.compile the model (what forward calls) with this backend


def build(cfg: RunConfig, model_cfg: GPTConfig, device: torch.device):
    """The model (initialised in fp32 from ``cfg.seed`` and rounded to bf16, so that fp32 and bf16 recipes start
    from the same point), the module to call (the DDP wrapper or the model) and the optimizer."""
    import zero_ext

    torch.manual_seed(cfg.seed)
    model = GPT(model_cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.bfloat16().float())
    hyper = dict(lr=cfg.lr, betas=cfg.betas, weight_decay=cfg.weight_decay)
    if cfg.recipe == "ddp":
        model.to(device)
        ddp = torch.nn.parallel.DistributedDataParallel(model, device_ids=[device] if device.type == "cuda" else None)
        return model, ddp, torch.optim.AdamW(model.parameters(), **hyper, fused=True)
    if cfg.recipe not in RECIPES + MUON_RECIPES:
        raise ValueError(f"unknown recipe {cfg.recipe!r}; expected one of {RECIPES + MUON_RECIPES}")
    model.to(device=device, dtype=getattr(torch, cfg.param_dtype))
    stage = recipe_stage(cfg.recipe)
    # Stage 3 needs the model for its hooks; stages 1 and 2 run as before (no module=, as their results were taken).
    s3 = (
        dict(module=model, reshard_after_forward=cfg.reshard_after_forward, prefetch=cfg.prefetch) if stage == 3 else {}
    )
    off = {}
    if cfg.offload is not None:
        off = dict(offload=cfg.offload)
        if cfg.offload == "nvme":
            off.update(offload_dir=cfg.offload_dir, offload_window=cfg.offload_window)
    # The precision keywords only where they differ from the defaults (a build without moment_dtype still runs).
    precision = dict(param_remainders=True) if cfg.param_remainders else {}
    if cfg.moment_dtype != "float32":
        precision["moment_dtype"] = getattr(torch, cfg.moment_dtype)
    if cfg.recipe in MUON_RECIPES:
        named = list(model.named_parameters())
        matrices = [(n, p) for n, p in named if n.startswith("blocks.") and p.ndim == 2]
        rest = [(n, p) for n, p in named if all(p is not q for _, q in matrices)]
        groups = [{"params": matrices}, {"params": rest, "use_muon": False, **hyper, "eps": 1e-8}]
        opt = zero_ext.ZeroMuon(groups, lr=MUON_LR, weight_decay=cfg.weight_decay, stage=stage,
                                max_grad_norm=cfg.max_grad_norm, bucket_size=cfg.bucket_size, **s3, **off)  # fmt: skip
        return model, model, opt
    opt = zero_ext.ZeroAdamW(model.named_parameters(), **hyper, stage=stage, max_grad_norm=cfg.max_grad_norm,
                             bucket_size=cfg.bucket_size, **s3, **off, **precision)  # fmt: skip
    return model, model, opt


def forward_backward(cfg: RunConfig, model, net, x, y, device: torch.device, call=None) -> torch.Tensor:
    """``call``: what runs forward instead of ``net`` (``torch.compile(net)``)."""
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=cfg.autocast):
        loss = (net if call is None else call)(x, y)
    loss.backward()
    if net is not model:  # DDP: clip here; ZeroAdamW clips inside step()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.max_grad_norm)
    return loss


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def model_state(model, net, opt) -> dict[str, Any]:
    """This rank's persistent model state after a step (grads still allocated), by kind, with its formula.

    ZeroAdamW: ``memory_report()``; ``total + on_disk == formula + padding + staging + grad_shard_fp32 +
    offload_buffers - param_shard_not_kept`` exactly (the last: stage 3 rounds its fp32 master at each gather
    instead of keeping a bf16 shard; ``on_disk``: offload="nvme"'s state files, ``offload_buffers``: offload's
    landing ring, parameter staging and disk window); at stage 3
    also the gathered window (``window_bound``: bytes of gathered buckets it may hold at once, ``window_peak``: the
    most it held), which is not persistent and not in ``total``.
    DDP: params, ``.grad``, AdamW state and DDP's own gradient buckets (with the default
    ``gradient_as_bucket_view=False`` a second copy of the grads); ``core`` (all but the buckets and the step
    counters) is 16 bytes/param, ``formula`` the ZeRO formula with fp32 widths (4 + 4 + 8)."""
    import zero_ext

    if net is model:
        r = opt.memory_report()
        keys = ("padding", "staging", "grad_shard_fp32", "owned_numel", "window_bound", "window_peak",
                "param_shard_not_kept")  # fmt: skip
        return {"allocated": dict(r.allocated), "total": r.total, "formula": r.formula, "estimate": r.estimate,
                **{k: getattr(r, k) for k in keys}, "on_disk": r.bytes_on("disk"),
                "offload_buffers": r.offload_buffers, "where": dict(r.where)}  # fmt: skip
    params = list(model.parameters())
    states = [opt.state[p] for p in params if p in opt.state]
    buckets = sum(int(b) for b in str(net._get_ddp_logging_data().get("bucket_sizes", "")).split(",") if b)
    parts = {
        "params": sum(_nbytes(p) for p in params),
        "grads": sum(_nbytes(p.grad) for p in params if p.grad is not None),
        "exp_avg": sum(_nbytes(s["exp_avg"]) for s in states),
        "exp_avg_sq": sum(_nbytes(s["exp_avg_sq"]) for s in states),
        "step": sum(_nbytes(s["step"]) for s in states if isinstance(s.get("step"), torch.Tensor)),
        "ddp_buckets": 0 if net.gradient_as_bucket_view else buckets,
    }
    world = dist.get_world_size()
    formula = zero_ext.memory.estimate(
        num_params(model), world, 0, param_bytes=4, grad_bytes=4, optimizer_state_bytes=8
    )
    core = parts["params"] + parts["grads"] + parts["exp_avg"] + parts["exp_avg_sq"]
    return {"allocated": parts, "total": sum(parts.values()), "formula": formula, "estimate": formula, "core": core}


def ledger_ok(led: dict[str, Any]) -> bool:
    """The identity a :func:`model_state` must satisfy (DDP: 16 bytes/param; ZeroAdamW: its decomposition)."""
    if "core" in led:
        return led["core"] == led["formula"]
    extras = led["padding"] + led["staging"] + led["grad_shard_fp32"] - led.get("param_shard_not_kept", 0)
    extras += led.get("offload_buffers", 0)
    return led["formula"] + extras == led["total"] + led.get("on_disk", 0)
