"""Issue 25's regression test: tests/helpers/hurried_trainer.py, a DDP trainer ported to ZeroAdamW by swapping the
optimizer, run both ways on 2 gloo ranks at stages 1, 2 and 3. Every habit it keeps either trains as DDP +
torch.optim.AdamW does or fails on every rank within seconds, naming what to do:

- kept and matching DDP (losses and parameters, fp32, to TOL): per-rank seeding, tied weights, a frozen parameter,
  an lr schedule set by hand, ``require_backward_grad_sync`` with ``no_sync()``, a disabled GradScaler,
  ``clip_grad_norm_``, ``model.zero_grad(set_to_none=True)``, rank-0 evaluation with eval()/train() (at stage 3
  inside ``gathered_params()``), the broadcast save decision, ``checkpoint.read_extra`` on resume;
- refused: the DDP wrap (every stage), a rank-0 ``torch.save(optimizer.state_dict())`` when resuming from it;
  rank-0 evaluation outside ``gathered_params()`` at stage 3 (raises ``RanksDiverged`` on every rank, at the
  phase check of the next forward).
"""

import os

import pytest
import torch
from distributed import discard_pool, run_on_ranks
from hurried_trainer import Config, train

# DDP averages the gradients in another order than the engine's fp32 mean (pre-divided, bucketed differently): ~1
# fp32 ulp per gradient, which 9 Adam steps carry to the parameters (measured: at most 1.9e-7 apart, stages 1-3) and
# the losses (at most 2.4e-7 apart).
TOL = dict(rtol=1e-5, atol=1e-6)


def _both_ways(rank, world, stage, root):
    """DDP, then the port, from scratch and then resumed from each one's own checkpoint."""
    out = {}
    for mode in ("ddp", "zero"):
        out_dir = os.path.join(root, f"{mode}{stage}")
        if rank == 0:
            os.makedirs(out_dir, exist_ok=True)
        torch.distributed.barrier()
        first = train(rank, world, Config(mode=mode, stage=stage, out_dir=out_dir, eval_gathered=stage == 3))
        resumed = train(rank, world, Config(mode=mode, stage=stage, out_dir=out_dir, init_from="resume",
                                            max_iters=9, eval_gathered=stage == 3))  # fmt: skip
        out[mode] = (first, resumed)
    return out


def _close(a, b, what):
    torch.testing.assert_close(torch.tensor(a), torch.tensor(b), **TOL, msg=lambda m: f"{what}: {m}")


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_the_port_trains_as_ddp_does(tmp_path, stage):
    results = run_on_ranks(2, _both_ways, stage, str(tmp_path))
    for rank, out in enumerate(results):
        for run in (0, 1):  # from scratch, resumed
            ddp, zero = out["ddp"][run], out["zero"][run]
            where = f"rank {rank}, {'resumed' if run else 'first'} run"
            _close(ddp["train"], zero["train"], f"{where}: training losses")
            assert len(ddp["train"]) == (6 if run == 0 else 3)
            # DDP's original saves on rank 0 only; the port on every rank, at the iterations rank 0 decided
            assert zero["saved_at"] == results[0]["ddp"][run]["saved_at"], f"{where}: saved at other iterations"
            assert run or zero["saved_at"], "nothing saved: the resumed runs would start from scratch"
            if rank == 0:
                assert [e[0] for e in ddp["eval"]] == [e[0] for e in zero["eval"]]
                _close([e[1:] for e in ddp["eval"]], [e[1:] for e in zero["eval"]], f"{where}: evaluation")
            else:
                assert ddp["eval"] == zero["eval"] == []
            assert ddp["params"].keys() == zero["params"].keys()
            for name in ddp["params"]:
                torch.testing.assert_close(zero["params"][name], ddp["params"][name], **TOL,
                                           msg=lambda m: f"{where}: {name}: {m}")  # fmt: skip
    # every rank holds the same parameters
    for run in (0, 1):
        first, second = (out["zero"][run]["params"] for out in results)
        assert all(torch.equal(first[n], second[n]) for n in first)


def _wrapped(rank, world, stage, root):
    """The port as hurried as it gets (wrap, rank-0 torch.save, rank-0 evaluation outside gathered_params() kept). At
    stage 3 DDP's constructor is refused on every rank; at stages 1 and 2 a forward inside DDP is: rank 0's first is
    its evaluation, rank 1's its first training micro-step."""
    cfg = Config(mode="zero", stage=stage, out_dir=root, wrap_ddp=True, save="rank0_torch", eval_gathered=False)
    with pytest.raises(RuntimeError, match=r"DistributedDataParallel\. ZeroAdamW reduces the gradients itself"):
        train(rank, world, cfg)
    return True


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_the_ddp_wrap_is_refused_on_every_rank(tmp_path, stage):
    assert all(run_on_ranks(2, _wrapped, stage, str(tmp_path), timeout=60))


def _rank0_torch_save(rank, world, root):
    """The original's checkpoint: ``if master_process: torch.save({... "optimizer": optimizer.state_dict()})``. At
    stage 2 rank 0's state dict holds rank 0's shard only; resuming every rank from it is refused on every rank,
    naming zero_ext.checkpoint."""
    cfg = Config(mode="zero", stage=2, out_dir=root, save="rank0_torch", eval_gathered=False)
    first = train(rank, world, cfg)
    assert first["saved_at"] or rank != 0  # (rank 0 alone decides and saves)
    torch.distributed.barrier()
    cfg.init_from = "resume"
    with pytest.raises(ValueError, match=r"zero_ext\.checkpoint\.save.*every rank") as refused:
        train(rank, world, cfg)
    return str(refused.value)


def test_a_rank0_torch_save_of_the_optimizer_is_refused_on_resume(tmp_path):
    messages = run_on_ranks(2, _rank0_torch_save, str(tmp_path), timeout=60)
    assert "saved by rank 0, loaded on rank 1" in messages[1]
    assert "failed to load on rank(s) [1]" in messages[0]


def _eval_outside(rank, world, root):
    """At stage 3 the parameters are shards outside forward: rank 0's evaluation outside gathered_params() gathers
    them with collectives that rank 1, gone on to train (the hurried port has no collective in between), joins with
    its training forward's."""
    cfg = Config(mode="zero", stage=3, out_dir=root, save="rank0_torch", eval_gathered=False)
    with pytest.raises(RuntimeError, match=r"gathered_params"):
        train(rank, world, cfg)
    return True


def test_stage3_rank0_evaluation_outside_gathered_params_raises_on_every_rank(tmp_path):
    try:
        assert all(run_on_ranks(2, _eval_outside, str(tmp_path), timeout=20))
    finally:
        discard_pool(2)  # (a rank may still wait in a collective)
