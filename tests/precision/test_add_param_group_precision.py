"""opt.add_param_group() keeps the optimizer's precision options (issue 24): with ``param_remainders=True`` the added
group keeps its master as the bf16 parameter + a remainder (2 B per element, not a 4-byte fp32 master) and trains
bitwise like the fp32-master run; with ``moment_dtype=torch.bfloat16`` its moments are bf16. A group of fp32
parameters added under ``param_remainders=True`` is refused on every rank, changing nothing."""

import pytest
import torch
from distributed import run_on_ranks
from engine_reference import params_digest
from tiny_transformer import batch, loss_fn
from unfreezing import frozen_start, unfreeze


def _added_group_state(rank, world, stage, remainders, moment_dtype_name):
    moment_dtype = getattr(torch, moment_dtype_name)
    model, opt = frozen_start(
        torch.bfloat16, stage, rank, world, param_remainders=remainders, moment_dtype=moment_dtype
    )
    for step in range(3):
        if step == 1:
            unfreeze(model, opt)
        loss_fn(model, batch(step, rank)).backward()
        opt.step()
        opt.zero_grad()
    added = [g for g in opt.sharded_state.groups if g.group_index == 1]
    assert added, "the added param group has a flat group"
    kinds = {k.name: k.dtype for g in added for k in g.rule.kinds}
    by_kind = opt.memory_report().allocated
    with opt.gathered_params():
        digest = params_digest(model)
    opt.close()
    return digest, kinds, "remainder" in by_kind


@pytest.mark.parametrize("stage", [1, 3])
def test_the_added_group_keeps_the_precision_options(stage):
    plain = run_on_ranks(2, _added_group_state, stage, False, "float32")
    lean = run_on_ranks(2, _added_group_state, stage, True, "bfloat16")
    remainders = run_on_ranks(2, _added_group_state, stage, True, "float32")
    assert plain[0][1] == {"master": torch.float32, "exp_avg": torch.float32, "exp_avg_sq": torch.float32}
    assert lean[0][1] == {"remainder": torch.int16, "exp_avg": torch.bfloat16, "exp_avg_sq": torch.bfloat16}
    assert all(r[2] for r in lean + remainders)
    # param_remainders is bitwise the fp32 master, the added group included
    assert [r[0] for r in remainders] == [r[0] for r in plain]


def _fp32_group_refused(rank, world):
    model, opt = frozen_start(torch.bfloat16, 2, rank, world, param_remainders=True)
    model.blocks[0].float()  # the frozen block, cast to fp32 before it is added
    with pytest.raises(ValueError, match="param_remainders"):
        unfreeze(model, opt)
    assert len(opt.param_groups) == 1 and len({g.group_index for g in opt.sharded_state.groups}) == 1
    model.blocks[0].requires_grad_(False).to(torch.bfloat16)
    before = params_digest(model)
    loss_fn(model, batch(0, rank)).backward()
    opt.step()  # still trains, the group was not added
    assert params_digest(model) != before
    opt.close()
    return True


def test_an_fp32_group_is_refused_under_param_remainders():
    assert run_on_ranks(2, _fp32_group_refused) == [True, True]
