"""get_state_dict copies nothing that the optimizer keeps as fp32 memory, even a parameter whose elements lie in two
buckets (its master at stages 1 and 2 is the fp32 parameters' flat buffer, one slice per bucket): each piece is a
view of the parameter's storage, and what the pieces hold is the parameter's elements in order."""

import pytest
import torch
from distributed import run_on_ranks

import zero_ext.checkpoint as zc
from zero_ext import ZeroAdamW


def _pieces_are_views(rank, world, stage):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(30, 30), torch.nn.Linear(30, 7))
    opt = ZeroAdamW(model.parameters(), lr=1e-2, stage=stage, bucket_size=400)  # 930 + 217 elements: cut
    model(torch.randn(4, 30)).sum().backward()
    opt.step()
    msd, osd = zc.get_state_dict(model, opt)
    cut = 0
    for name, p in model.named_parameters():
        pieces = msd[name].pieces()
        cut += len(pieces) > 1
        flat = p.detach().reshape(-1)
        for (start, end), values in pieces:
            assert values._is_view(), f"{name}[{start}:{end}] is a copy"
            assert values.untyped_storage().data_ptr() == p.untyped_storage().data_ptr(), name
            assert torch.equal(values, flat[start:end]), name
        for kind in ("exp_avg", "exp_avg_sq"):
            assert all(v._is_view() for _, v in osd["state"][name][kind].pieces()), (name, kind)
    return cut


@pytest.mark.parametrize("stage", [1, 2])
def test_pieces_across_buckets_are_views_not_copies(stage):
    cut = run_on_ranks(1, _pieces_are_views, stage)[0]
    assert cut >= 1  # some parameter did lie in two buckets (else this test checks nothing)
