"""Helpers shared by the engine tests: an unsharded torch.optim.AdamW reference fed the mean of every rank's
gradients, and comparisons of a ZeroAdamW against it."""

from __future__ import annotations

import gc
import hashlib
import os

import torch

from zero_ext.layout import Range

BF16_ULP = 2.0**-7  # relative spacing of bf16 values: one unit in the last place


def rank_grads(model, params, batches, loss_fn, **kw):
    """Every rank's gradients, computed locally with autograd.grad (no .grad, no optimizer hooks fire).
    Frozen params get None."""
    trainable = [p for p in params if p.requires_grad]
    out = []
    for b in batches:
        grads = iter(torch.autograd.grad(loss_fn(model, b, **kw), trainable, allow_unused=True))
        out.append([next(grads) if p.requires_grad else None for p in params])
    return out


def mean_grads(per_rank, like):
    """fp32 mean over ranks, as DDP averages: a rank without a gradient for a parameter contributes zeros; a
    parameter without a gradient on any rank gets None (torch's AdamW then leaves it alone)."""
    out = []
    for i, p in enumerate(like):
        if all(g[i] is None for g in per_rank):
            out.append(None)
            continue
        gs = [g[i].float() if g[i] is not None else torch.zeros(p.shape) for g in per_rank]
        out.append(sum(gs) / len(gs))
    return out


def set_mean_grads(ref_params, per_rank):
    """The reference's gradients: each parameter's ``.grad`` set to the mean of the ranks' (None where no rank has
    one, as for a frozen parameter). Returns the means."""
    means = mean_grads(per_rank, ref_params)
    for p, g in zip(ref_params, means):
        p.grad = g
    return means


def step_with_reference(model, opt, ref_params, ref_opt, batches, rank: int, loss_fn) -> None:
    """One training step of ``opt`` on this rank's batch (``batches[rank]``), and of the reference on the mean of
    every rank's gradients; then ``opt.zero_grad()``."""
    set_mean_grads(ref_params, rank_grads(model, list(model.parameters()), batches, loss_fn))
    ref_opt.step()
    loss_fn(model, batches[rank]).backward()
    opt.step()
    opt.zero_grad()


def reference(model, **hyper):
    """fp32 master copies of the model's params and a torch.optim.AdamW over them."""
    params = [p.detach().float().clone().requires_grad_(p.requires_grad) for p in model.parameters()]
    return params, torch.optim.AdamW([p for p in params if p.requires_grad], **hyper)


# A master that an update cancels to nearly zero (|x| ~ 1e-8 from operands ~1e-2) carries the operands' fp32 rounding,
# ~1e-10 absolute: torch's AdamW and the fused kernel round differently, and the bf16 of that tiny value can then be
# two of its own ulps apart (seen: 1.9e-8 vs 1.9e-8 + 2.3e-10). Absolute slack of one fp32 ulp at the weights' scale
# (2**-30 at |w| < 2**-6); FusedReference checks the same kernel bitwise, with no slack at all.
NEAR_ZERO = 2.0**-30


def check_against_reference(opt, model, ref_params, rank: int, ref_in_opt_order=None) -> None:
    """Params equal the reference master rounded to the param dtype (within one ulp of that dtype: torch's CPU
    AdamW and the fused kernel may round the fp32 master one ulp apart, which can move a bf16 rounding); this
    rank's fp32 master shard equals the reference master at torch's default fp32 tolerance. ``ref_params``
    follow ``model.parameters()``; ``ref_in_opt_order`` (default: the same list) follow the optimizer's param
    groups. :class:`FusedReference` is the bitwise check."""
    ref_in_opt_order = ref_params if ref_in_opt_order is None else ref_in_opt_order
    for (name, p), ref in zip(model.named_parameters(), ref_params):
        p = p.detach().cpu()
        if p.dtype == torch.float32:
            torch.testing.assert_close(p, ref.detach(), msg=lambda m: f"{name}: {m}")
        else:
            torch.testing.assert_close(
                p.float(), ref.detach().to(p.dtype).float(), rtol=BF16_ULP, atol=NEAR_ZERO, msg=lambda m: f"{name}: {m}"
            )
    for ref in opt.sharded_state.pieces():
        if ref.group.rule.master_is_param:
            continue
        mine = ref.group.state.read("master", ref.piece.shard_range).cpu()
        expected = ref_in_opt_order[ref.param_index].detach().reshape(-1)[ref.piece.start : ref.piece.end]
        torch.testing.assert_close(mine, expected)


def check_grad_shard_is_mean(opt, means, rank: int) -> None:
    """This rank's fp32 grad shard holds the ranks' mean gradient to the bit, as :func:`mean_grads` computes it
    (fp32 sum in rank order, divided by N): what the gloo path promises. ``means`` follow the optimizer's
    global parameter order. Waits for the reductions in flight first."""
    opt.finish_sync()
    for ref in opt.sharded_state.pieces():
        mine = ref.group.state.read("grad", ref.piece.shard_range).cpu()
        expected = means[ref.param_index].reshape(-1)[ref.piece.start : ref.piece.end]
        assert torch.equal(mine, expected), f"grad shard of parameter {ref.name} is not the exact mean"


def full_params(model, opt) -> list:
    """Copies of the model's full parameters (gathered at stage 3; ``gathered_params`` is a no-op at stages 1, 2)."""
    with opt.gathered_params():
        return [p.detach().clone() for p in model.parameters()]


def state_shards(opt) -> list:
    """Copies of this rank's whole shards of every kind of state (the master and the moments of each group's update
    rule), flat group by flat group, on the host, read through the documented seam (``state_dict()`` would first
    let the master follow changed parameters)."""
    return [g.state.read(k, Range(0, g.layout.shard_numel)).cpu().clone() for g in opt.sharded_state.groups
            for k in g.rule.saved_kind_names]  # fmt: skip


def params_digest(model) -> str:
    """A hash of every parameter's bits, to show all ranks hold identical params."""
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


class FusedReference:
    """The unsharded run with the same kernel: fp32 master, exp_avg, exp_avg_sq of every parameter, updated by
    ``zero_ext.ops.fused_adamw_`` one parameter at a time from the mean gradients. The kernel is element-wise, so
    sharding must not change a single bit: where the engine's mean gradient is exact (gloo), its master, moments
    and params equal this reference bitwise."""

    def __init__(self, model, **hyper):
        self.hyper = dict(hyper)
        params = [p for p in model.parameters() if p.requires_grad]
        self.dtypes = [p.dtype for p in params]
        self.master = [p.detach().float().clone().reshape(-1) for p in params]
        self.exp_avg = [torch.zeros_like(m) for m in self.master]
        self.exp_avg_sq = [torch.zeros_like(m) for m in self.master]
        self.steps = 0

    def step(self, means) -> None:
        from zero_ext import ops

        self.steps += 1
        beta1, beta2 = self.hyper["betas"]
        for m, a, v, g in zip(self.master, self.exp_avg, self.exp_avg_sq, means):
            ops.fused_adamw_(m, g.reshape(-1).float().contiguous(), a, v, lr=self.hyper["lr"], beta1=beta1, beta2=beta2,
                             eps=self.hyper["eps"], weight_decay=self.hyper["weight_decay"], step=self.steps)  # fmt: skip

    def check(self, opt, model) -> None:
        """The engine's params, and this rank's master and moments, equal the reference bitwise."""
        for (name, p), m, dtype in zip(model.named_parameters(), self.master, self.dtypes):
            expected = m.view(p.shape).to(dtype)
            assert torch.equal(p.detach().cpu(), expected), (
                f"{name}: {int((p.cpu() != expected).sum())} elements differ"
            )
        kinds = {"master": self.master, "exp_avg": self.exp_avg, "exp_avg_sq": self.exp_avg_sq}
        for ref in opt.sharded_state.pieces():
            for kind, full in kinds.items():
                mine = ref.group.state.read(kind, ref.piece.shard_range).cpu()
                assert torch.equal(mine, full[ref.param_index][ref.piece.start : ref.piece.end]), f"{ref.name} {kind}"


def offload_kwargs(offload, root: str, rank: int, tag: str, window: int) -> dict:
    """ZeroAdamW's offload keywords for a test run: nvme state in a directory of its own under ``root`` (one per
    rank and run ``tag``) streamed through ``window`` bytes."""
    if offload != "nvme":
        return dict(offload=offload)
    directory = os.path.join(root, f"{tag}-rank{rank}")
    os.makedirs(directory, exist_ok=True)
    return dict(offload="nvme", offload_dir=directory, offload_window=window)


def _live_storages() -> dict[int, torch.UntypedStorage]:
    """Every distinct CPU tensor storage alive in this process (found by the garbage collector, not the engine's
    bookkeeping), by address."""
    gc.collect()
    seen = {}
    for obj in gc.get_objects():
        if isinstance(obj, torch.Tensor) and obj.device.type == "cpu":
            try:
                s = obj.untyped_storage()
                ptr = s.data_ptr()
            except RuntimeError:  # a .grad placeholder (grad_placeholders.py): no storage, no bytes
                continue
            if ptr not in seen or s.nbytes() > seen[ptr].nbytes():
                seen[ptr] = s
    return seen


def live_storage_bytes() -> int:
    """Bytes of every distinct CPU tensor storage alive in this process."""
    return sum(s.nbytes() for s in _live_storages().values())


class LiveStorages:
    """The storages alive when made, held alive until dropped, so that :meth:`born_bytes` counts exactly the bytes
    of storages made since and still alive. A difference of two totals would also count whatever else the process
    freed in between (garbage of an earlier run collected late, a finished collective's buffers): issue 46's
    memory smoke test read 15 KB too few in a full suite run and passed alone."""

    def __init__(self):
        self._before = _live_storages()

    def born_bytes(self) -> int:
        return sum(s.nbytes() for ptr, s in _live_storages().items() if ptr not in self._before)
