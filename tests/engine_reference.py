"""Helpers shared by the engine tests: an unsharded torch.optim.AdamW reference fed the mean of every rank's
gradients, and comparisons of a ZeroAdamW against it."""

from __future__ import annotations

import hashlib

import torch

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
    """fp32 mean over ranks; a missing gradient (unused parameter) counts as zero."""
    out = []
    for i, p in enumerate(like):
        gs = [g[i].float() if g[i] is not None else torch.zeros(p.shape) for g in per_rank]
        out.append(sum(gs) / len(gs))
    return out


def reference(model, **hyper):
    """fp32 master copies of the model's params and a torch.optim.AdamW over them."""
    params = [p.detach().float().clone().requires_grad_(p.requires_grad) for p in model.parameters()]
    return params, torch.optim.AdamW([p for p in params if p.requires_grad], **hyper)


def check_against_reference(opt, model, ref_params, rank: int, ref_in_opt_order=None) -> None:
    """Params equal the reference master rounded to the param dtype (within one ulp of that dtype, for the
    rounding of fp32 means summed in a different order); this rank's fp32 master shard equals the
    reference master at torch's default fp32 tolerance. ``ref_params`` follow ``model.parameters()``;
    ``ref_in_opt_order`` (default: the same list) follow the optimizer's param groups."""
    ref_in_opt_order = ref_params if ref_in_opt_order is None else ref_in_opt_order
    for (name, p), ref in zip(model.named_parameters(), ref_params):
        if p.dtype == torch.float32:
            torch.testing.assert_close(p.detach(), ref.detach(), msg=lambda m: f"{name}: {m}")
        else:
            torch.testing.assert_close(
                p.detach().float(),
                ref.detach().to(p.dtype).float(),
                rtol=BF16_ULP,
                atol=0,
                msg=lambda m: f"{name}: {m}",
            )
    for fg, indices in zip(opt._flat_groups, opt._global_indices):
        if fg.master is None:
            continue
        for piece in fg.layout.owned_pieces(rank):
            mine = fg.master[piece.shard_offset : piece.shard_offset + piece.end - piece.start]
            ref = ref_in_opt_order[indices[piece.index]].detach().reshape(-1)[piece.start : piece.end]
            torch.testing.assert_close(mine, ref)


def check_grad_shard_is_mean(opt, means, rank: int) -> None:
    """This rank's fp32 grad shard holds the ranks' mean gradient to the bit, as :func:`mean_grads` computes it
    (fp32 sum in rank order, divided by N): what the gloo path promises. ``means`` follow the optimizer's
    global parameter order. Waits for the reductions in flight first."""
    opt._reducer.finish()
    for fg, indices in zip(opt._flat_groups, opt._global_indices):
        for piece in fg.layout.owned_pieces(rank):
            mine = fg.grad_shard[piece.shard_offset : piece.shard_offset + piece.end - piece.start]
            ref = means[indices[piece.index]].reshape(-1)[piece.start : piece.end]
            assert torch.equal(mine, ref), f"grad shard of parameter {indices[piece.index]} is not the exact mean"


def params_digest(model) -> str:
    """A hash of every parameter's bits, to show all ranks hold identical params."""
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()
