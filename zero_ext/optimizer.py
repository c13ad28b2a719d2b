"""ZeroAdamW: AdamW with its state and gradients sharded over data-parallel ranks (ZeRO stages 1 and 2)."""

from __future__ import annotations

import contextlib
import math
from typing import Any, Iterable, Optional

import torch
import torch.distributed as dist

from . import ops
from .buffers import FlatGroup, fingerprint
from .comm import _DONE, CommCounts, Communicator, Pending
from .memory import MemoryReport
from .reducer import GradReducer
from .state_dict import load_local_state_dict, local_state_dict

_SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _check_hyperparameters(where: str, lr, betas, eps, weight_decay) -> None:
    if isinstance(lr, torch.Tensor):
        if lr.numel() != 1:
            raise ValueError(f"{where}: `lr` must be a number or a one-element tensor, got shape {tuple(lr.shape)}")
    elif not (isinstance(lr, (int, float)) and math.isfinite(lr) and lr >= 0):
        raise ValueError(f"{where}: `lr` must be a finite number >= 0, got {lr!r}")
    if not (isinstance(betas, (tuple, list)) and len(betas) == 2):
        raise ValueError(f"{where}: `betas` must be a pair (beta1, beta2), got {betas!r}")
    for i, b in enumerate(betas):
        if not (isinstance(b, (int, float)) and 0.0 <= b < 1.0):
            raise ValueError(f"{where}: `betas[{i}]` must be in [0, 1), got {b!r}")
    if not (isinstance(eps, (int, float)) and math.isfinite(eps) and eps >= 0):
        raise ValueError(f"{where}: `eps` must be a finite number >= 0, got {eps!r}")
    if not (isinstance(weight_decay, (int, float)) and math.isfinite(weight_decay) and weight_decay >= 0):
        raise ValueError(f"{where}: `weight_decay` must be a finite number >= 0, got {weight_decay!r}")


class ZeroAdamW(torch.optim.Optimizer):
    """AdamW whose optimizer state (and, in stage 2, gradients) is sharded across data-parallel ranks.

    Replaces ``DDP(model)`` + ``torch.optim.AdamW``: the optimizer owns gradient reduction. After
    ``loss.backward()`` on every rank and ``step()``, every rank holds the parameters ``torch.optim.AdamW``
    would produce on an fp32 master copy from the mean of the ranks' gradients, rounded to the param dtype.

    Args:
        params: parameters, ``(name, parameter)`` pairs (``model.named_parameters()``: names then appear in
            checkpoints), or param-group dicts with per-group ``lr``, ``betas``, ``eps``, ``weight_decay``.
            Params may be fp32 (their own master copy), bf16 or fp16; all on one device. Params with
            ``requires_grad=False`` are left alone.
        stage: 1 (shard optimizer state; a persistent flat grad buffer) or 2 (also shard gradients).
        process_group: the data-parallel group (default: the world; a single process when torch.distributed
            is not initialised).
        bucket_size: elements per bucket. Default: an eighth of the trainable parameters on NCCL, a quarter on
            gloo (so that even a small model gets several buckets to overlap with backward, and the staging
            pool stays small; gloo's per-collective cost is higher), clamped
            to [world_size * 2**16, max(2**22, world_size * 2**18)] (large models: 16 MiB fp32 buckets, at
            least 1 MiB per rank per collective).
        reduce_dtype: dtype of the gradient reduce-scatter: float32 (default; exact fp32 mean) or the
            param dtype (half the bytes, low-precision sums). On gloo with float32, bf16/fp16 gradients
            already travel in their own dtype and are summed in fp32 after the transfer (exact, half the bytes).
        max_grad_norm: clip the global gradient norm to this value (fused into the AdamW kernel).
        defer_all_gather_to: a module; when given, ``step()`` returns without waiting for the parameter
            all-gather, and forward pre-hooks on the module's submodules wait for each parameter's bucket
            just before it is used.
        staging_buffers: initial size of the gradient staging pool (buckets in flight at once).
    """

    def __init__(
        self,
        params: Iterable,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        *,
        stage: int = 2,
        process_group: Optional[dist.ProcessGroup] = None,
        bucket_size: Optional[int] = None,
        reduce_dtype: torch.dtype = torch.float32,
        max_grad_norm: Optional[float] = None,
        defer_all_gather_to: Optional[torch.nn.Module] = None,
        staging_buffers: int = 2,
    ):
        if stage not in (1, 2):
            raise ValueError(f"zero_ext.ZeroAdamW: `stage` must be 1 or 2, got {stage!r}")
        _check_hyperparameters("zero_ext.ZeroAdamW", lr, betas, eps, weight_decay)
        if max_grad_norm is not None and not (isinstance(max_grad_norm, (int, float)) and max_grad_norm > 0):
            raise ValueError(f"zero_ext.ZeroAdamW: `max_grad_norm` must be a number > 0 or None, got {max_grad_norm!r}")
        if bucket_size is not None and not (isinstance(bucket_size, int) and bucket_size > 0):
            raise ValueError(
                f"zero_ext.ZeroAdamW: `bucket_size` must be a positive int (elements), got {bucket_size!r}"
            )
        if not (isinstance(staging_buffers, int) and staging_buffers >= 1):
            raise ValueError(f"zero_ext.ZeroAdamW: `staging_buffers` must be an int >= 1, got {staging_buffers!r}")
        if dist.is_initialized():
            if dist.get_rank(process_group) < 0:
                raise ValueError(
                    f"zero_ext.ZeroAdamW: `process_group` does not include this process (global rank {dist.get_rank()})"
                )
        elif process_group is not None:
            raise ValueError("zero_ext.ZeroAdamW: `process_group` given but torch.distributed is not initialised")

        self._constructing = True
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay)
        super().__init__(params, defaults)
        self._constructing = False
        self.stage = stage
        self.max_grad_norm = max_grad_norm

        # Local checks that could differ between ranks are collected, not raised, so that every rank gets
        # to the layout exchange below and all ranks fail together instead of some hanging.
        error = self._check_groups()
        device = self._device if error is None else torch.device("cpu")
        self._comm = Communicator(process_group, device) if dist.is_initialized() else _SingleProcess(device)
        world, rank = self._comm.world_size, self._comm.rank
        if reduce_dtype not in (torch.float32, torch.bfloat16, torch.float16):
            error = error or f"`reduce_dtype` must be float32, bfloat16 or float16, got {reduce_dtype}"
        self.reduce_dtype = reduce_dtype
        if bucket_size is None:
            trainable = sum(p.numel() for g in self.param_groups for p in g["params"] if p.requires_grad)
            # NCCL: 8 buckets, so backward hides all but the last. gloo: 4, because there every collective
            # costs a fixed ~0.5-1 ms of thread hand-offs on cores that backward keeps busy; measured on the
            # 3.3M-param benchmark GPT at 2 ranks, 8 buckets took 1.05x DDP's step, 2-4 buckets 0.92-1.01x
            # (bench/results/engine_step_cpu.md, Findings; per-collective costs: bench_collectives.py).
            per_model = 4 if self._comm.reduce_scatter_by_all_to_all else 8
            bucket_size = min(max(2**22, world * 2**18), max(world * 2**16, -(-trainable // per_model)))
        self.bucket_size = bucket_size

        # Plan the flat groups (one per param group and dtype) and compare the plan across ranks before
        # allocating anything or re-pointing any parameter: a failed construction leaves the model untouched.
        plan: list[tuple[int, list[tuple[int, torch.Tensor]]]] = []
        descriptions = [f"stage={stage} reduce={reduce_dtype} bucket={self.bucket_size} error={error is not None}"]
        if error is None:
            for gi in range(len(self.param_groups)):
                for dtype in _SUPPORTED_DTYPES:
                    members = [(i, p) for i, p in self._trainable(gi) if p.dtype == dtype]
                    if members:
                        plan.append((gi, members))
                        descriptions.append(f"group={gi} dtype={dtype} shapes={[tuple(p.shape) for _, p in members]}")
        everyone = self._comm.all_gather_object_ints(fingerprint(descriptions))
        if error is not None:
            raise ValueError(f"zero_ext.ZeroAdamW: {error}")
        if len(set(everyone)) != 1:
            differ = [r for r, f in enumerate(everyone) if f != everyone[0]]
            raise RuntimeError(
                "zero_ext.ZeroAdamW: the model or optimizer settings differ between ranks (layout fingerprints "
                f"{everyone}; ranks {differ} differ from rank 0). Every rank must build the same model with the same "
                "param groups, dtypes, stage, bucket_size and reduce_dtype."
            )
        self._flat_groups = [FlatGroup([p for _, p in m], gi, world, rank, self.bucket_size) for gi, m in plan]
        self._global_indices = [[i for i, _ in m] for _, m in plan]
        self._group_of_flat = [gi for gi, _ in plan]

        self._reducer = GradReducer(
            self._flat_groups, self._global_indices, self._names, self._comm, stage, reduce_dtype, staging_buffers
        )
        dev = self._device
        self._step_count = torch.zeros((), dtype=torch.float32, device=dev)
        self._skipped = torch.zeros((), dtype=torch.float32, device=dev)
        self._found_inf = torch.zeros((), dtype=torch.float32, device=dev)
        self._grad_norm = torch.zeros((), dtype=torch.float32, device=dev)
        self._clip_coef = torch.ones((), dtype=torch.float32, device=dev)
        self._norm_stats = torch.zeros(2, dtype=torch.float32, device=dev)
        self._max_norm = torch.tensor(float(max_grad_norm or 0.0), dtype=torch.float32, device=dev)
        self._has_stepped = False
        self._gathers: dict[tuple[int, int], Pending] = {}
        self._prehook_handles = []
        if defer_all_gather_to is not None:
            self._install_forward_prehooks(defer_all_gather_to)

    # ------------------------------------------------------------------ construction
    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if not getattr(self, "_constructing", False):
            raise NotImplementedError(
                "zero_ext.ZeroAdamW: param groups are fixed at construction (they define the sharded flat-buffer "
                "layout); build a new optimizer instead"
            )
        super().add_param_group(param_group)
        g = self.param_groups[-1]
        _check_hyperparameters(
            f"zero_ext.ZeroAdamW: param group {len(self.param_groups) - 1}",
            g["lr"],
            g["betas"],
            g["eps"],
            g["weight_decay"],
        )

    def _trainable(self, gi: int):
        base = sum(len(g["params"]) for g in self.param_groups[:gi])
        return [(base + i, p) for i, p in enumerate(self.param_groups[gi]["params"]) if p.requires_grad]

    def _check_groups(self) -> Optional[str]:
        """Names every parameter and validates devices, dtypes and duplicates; returns an error or None."""
        self._names: dict[int, str] = {}
        seen: dict[int, str] = {}
        devices = set()
        index = 0
        for gi, group in enumerate(self.param_groups):
            names = group.get("param_names")
            group_devices = set()
            for i, p in enumerate(group["params"]):
                name = names[i] if names else f"param_groups[{gi}].params[{i}]"
                self._names[index] = name
                index += 1
                if id(p) in seen:
                    return f"parameter {name!r} is listed twice (also as {seen[id(p)]!r})"
                seen[id(p)] = name
                if p.requires_grad:
                    if p.dtype not in _SUPPORTED_DTYPES:
                        return f"parameter {name!r} has dtype {p.dtype}; expected float32, bfloat16 or float16"
                    if p.is_sparse:
                        return f"parameter {name!r} is sparse; only dense parameters are supported"
                    group_devices.add(p.device)
            if len(group_devices) > 1:
                return f"param group {gi} has parameters on different devices {sorted(map(str, group_devices))}"
            devices |= group_devices
        if len(devices) > 1:
            return f"parameters are on different devices {sorted(map(str, devices))}; all must be on one device"
        if not devices:
            return "no trainable parameters (every parameter has requires_grad=False)"
        self._device = devices.pop()
        return None

    def _install_forward_prehooks(self, module: torch.nn.Module) -> None:
        where = {}
        for fi, fg in enumerate(self._flat_groups):
            for slot, p in zip(fg.layout.slots, fg.params):
                where[id(p)] = (fi, slot.bucket)
        for m in module.modules():
            keys = sorted({where[id(p)] for p in m.parameters(recurse=False) if id(p) in where})
            if keys:
                self._prehook_handles.append(m.register_forward_pre_hook(lambda _m, _a, keys=keys: self._wait(keys)))

    def _wait(self, keys) -> None:
        for key in keys:
            pending = self._gathers.pop(key, None)
            if pending is not None:
                pending.wait()

    # ------------------------------------------------------------------ training
    @contextlib.contextmanager
    def no_sync(self):
        """Accumulate gradients over micro-batches without reducing them (like ``DDP.no_sync``).

        Stage 1 skips communication inside the context; the first backward after it (or ``step()``) reduces
        the accumulated sum. Stage 2 has no full-size buffer to accumulate in, so it still reduces every
        backward pass and accumulates the shards in fp32; the result is the same.
        """
        previous = self._reducer.sync_enabled
        self._reducer.sync_enabled = False
        try:
            yield
        finally:
            self._reducer.sync_enabled = previous

    def wait_for_params(self) -> None:
        """Make the current stream wait for every parameter all-gather still in flight (``defer_all_gather_to``)."""
        self._wait(list(self._gathers))

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for gi, g in enumerate(self.param_groups):
            _check_hyperparameters(
                f"zero_ext.ZeroAdamW: param group {gi}", g["lr"], g["betas"], g["eps"], g["weight_decay"]
            )
        self.wait_for_params()
        self._reducer.finish()

        # Global gradient norm and non-finite check over all shards, on device.
        stats = self._norm_stats
        stats.zero_()
        for fg in self._flat_groups:
            sumsq, nonfinite = ops.sum_squares(fg.grad_shard)
            stats[0] += sumsq
            stats[1] += nonfinite
        self._comm.all_reduce(stats).wait()
        torch.sqrt(stats[0], out=self._grad_norm)
        torch.clamp(stats[1], max=1.0, out=self._found_inf)
        grad_scale = 1.0
        if self.max_grad_norm is not None:
            # torch.nn.utils.clip_grad_norm_'s coefficient: max_norm / (norm + 1e-6), at most 1.
            torch.add(self._grad_norm, 1e-6, out=self._clip_coef)
            torch.div(self._max_norm, self._clip_coef, out=self._clip_coef)
            self._clip_coef.clamp_(max=1.0)
            grad_scale = self._clip_coef
        self._step_count.add_(1.0).sub_(self._found_inf)
        self._skipped.add_(self._found_inf)

        # AdamW bucket by bucket, each bucket's all-gather overlapping the next bucket's update.
        for fi, fg in enumerate(self._flat_groups):
            group = self.param_groups[self._group_of_flat[fi]]
            beta1, beta2 = group["betas"]
            for bucket in fg.layout.buckets:
                ops.fused_adamw_(
                    fg.master_of(bucket),
                    fg.shard_of(fg.grad_shard, bucket),
                    fg.shard_of(fg.exp_avg, bucket),
                    fg.shard_of(fg.exp_avg_sq, bucket),
                    lr=group["lr"],
                    beta1=beta1,
                    beta2=beta2,
                    eps=group["eps"],
                    weight_decay=group["weight_decay"],
                    step=self._step_count,
                    grad_scale=grad_scale,
                    param_out=None if fg.master_is_param else fg.param_slice(bucket),
                    found_inf=self._found_inf,
                )
                self._gathers[(fi, bucket.index)] = self._comm.all_gather(
                    fg.bucket_view(fg.param_buffer, bucket), fg.param_slice(bucket)
                )
        self._has_stepped = True
        self._reducer.stepped_since_zero_grad = True
        if not self._prehook_handles:
            self.wait_for_params()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero the gradients, like torch: with ``set_to_none`` (the default) every ``param.grad`` becomes None;
        stage 1's next gradient is then copied into the parameter's slot of the flat grad buffer (no pass over
        the whole buffer now, no read-add-write later) and ``param.grad`` points at that slot again. Without
        it stage 1 zeroes the buffer in place and ``param.grad`` stays a view of it. Stage 2's ``param.grad``
        is always None between backward passes. The fp32 grad shard is zeroed either way."""
        self._reducer.zero_grad(set_to_none)

    # ------------------------------------------------------------------ introspection
    @property
    def grad_norm(self) -> Optional[torch.Tensor]:
        """The global gradient norm (before clipping) of the last ``step()``, as a 0-d tensor on the device."""
        return self._grad_norm if self._has_stepped else None

    @property
    def skipped_steps(self) -> int:
        """How many steps were skipped because a gradient was inf or nan (reading it synchronises)."""
        return int(self._skipped.item())

    @property
    def step_count(self) -> int:
        """Updates applied so far (skipped steps excluded; reading it synchronises)."""
        return int(self._step_count.item())

    def comm_stats(self) -> dict[str, int]:
        """Elements and bytes this rank has passed to each collective since construction (one rank
        communicates nothing: its gradients go straight to the grad shard and its all-gather is in place)."""
        return self._comm.counts.as_dict()

    def memory_report(self) -> MemoryReport:
        """Every persistent byte on this rank by kind; see :class:`zero_ext.memory.MemoryReport`."""
        world, rank = self._comm.world_size, self._comm.rank
        report = MemoryReport(self.stage, world, 0, 0)
        alloc: dict[str, int] = {k: 0 for k in ("params", "grads", "master", "exp_avg", "exp_avg_sq", "grad_shard")}
        for fg, grad_buffer in zip(self._flat_groups, self._reducer.grad_buffers):
            tensors = fg.persistent_tensors()
            if grad_buffer is not None:
                tensors["grads"] = grad_buffer
            for kind, t in tensors.items():
                alloc[kind] += t.numel() * t.element_size()
            pw = fg.param_buffer.element_size()
            gw = pw  # the formula's gradients have the param dtype
            sw = 8 if fg.master_is_param else 12
            psi, full = fg.layout.real_numel, fg.layout.numel
            owned, shard = fg.layout.owned_real_numel(rank), fg.layout.shard_numel
            report.num_params += psi
            report.owned_numel += owned
            report.formula += pw * psi + (gw * psi if self.stage == 1 else gw * owned) + sw * owned
            full_buffers = 2 if self.stage == 1 else 1  # params (+ grads in stage 1)
            shard_bytes = sw + 4  # fp32 optimizer states + fp32 grad shard
            report.padding += full_buffers * pw * (full - psi) + shard_bytes * (shard - owned)
            report.grad_shard_fp32 += 4 * owned - (0 if self.stage == 1 else gw * owned)
            report.widths = {"param_bytes": pw, "grad_bytes": gw, "optimizer_state_bytes": sw}
        report.staging = self._reducer.staging_bytes()
        alloc["staging"] = report.staging
        report.allocated = {k: v for k, v in alloc.items() if v or k != "master"}
        return report

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """This rank's shard in torch.optim's format: see :mod:`zero_ext.state_dict`."""
        self.wait_for_params()
        self._reducer.finish()
        return local_state_dict(self)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a dict from :meth:`state_dict` saved by the same rank of the same layout (use
        ``zero_ext.checkpoint`` to load at another world size). Collective: every rank must call it."""
        self.wait_for_params()
        self._reducer.finish()
        load_local_state_dict(self, state_dict)


class _SingleProcess:
    """The Communicator of a single process when torch.distributed is not initialised: world size 1."""

    world_size, rank = 1, 0

    def __init__(self, device: torch.device):
        self.device = device
        self.stream = None
        self.counts = CommCounts()

    def scratch_numel(self, input_numel: int) -> int:
        return 0

    reduce_scatter_by_all_to_all = False

    def reduce_scatter(self, output, input, then=None, scratch=None, divide_by=1) -> Pending:
        # Only reached with GradReducer.direct_at_one_rank switched off (tests): count it as a collective.
        self.counts.add("reduce_scatter", input)
        output.copy_(input)
        if then is not None:
            then()
        return _DONE

    def all_gather(self, output, input) -> Pending:
        if output.data_ptr() != input.data_ptr():  # in place (the engine's case) there is nothing to do
            output.copy_(input)
        return _DONE

    def all_reduce(self, tensor, op=None) -> Pending:
        return _DONE

    def all_gather_object_ints(self, value: int) -> list[int]:
        return [value]
