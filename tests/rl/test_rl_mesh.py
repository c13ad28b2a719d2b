"""The RL detour on a 2-D mesh (HSDP, 2 x 2 over 4 gloo ranks): offload, weights streamed with named_full_params (a
kept stage-3 chunk sliced by its own layout, from the host copy), reload, and training bitwise the same as without the
detour, with the state sharded over every rank and replicated over the replicas (``replicate_state``)."""

from __future__ import annotations

import pytest
import torch
from distributed import run_on_ranks
from tiny_transformer import batch, build, loss_fn

from zero_ext import ZeroAdamW


def _run(rank, stage, replicate, detour):
    from mesh_runs import make_mesh

    mesh = make_mesh((2, 2))
    model = build(torch.bfloat16)
    opt = ZeroAdamW(model.parameters(), lr=3e-3, stage=stage, module=model, bucket_size=1500, mesh=mesh,
                    replicate_state=replicate)  # fmt: skip
    for step in range(4):
        loss_fn(model, batch(step, rank)).backward()
        opt.step()
        opt.zero_grad()
        if detour and step in (0, 2):
            opt.offload_states()
            engine = build(torch.bfloat16, seed=3)
            engine.load_state_dict(dict(opt.named_full_params()), strict=True)
            opt.reload_states()
            with opt.gathered_params():  # the streamed weights are the model's
                assert all(torch.equal(engine.state_dict()[k], v) for k, v in model.state_dict().items())
    with opt.gathered_params():
        params = [p.detach().clone() for p in model.parameters()]
    sd = opt.state_dict()
    state = [v.clone() for s in sd["state"].values() for v in s.values() if torch.is_tensor(v)]
    opt.close()
    return params, state


def _compare(rank, world, stage, replicate):
    plain = _run(rank, stage, replicate, False)
    detoured = _run(rank, stage, replicate, True)
    assert all(torch.equal(a, b) for a, b in zip(plain[0], detoured[0]))
    assert len(plain[1]) == len(detoured[1]) and all(torch.equal(a, b) for a, b in zip(plain[1], detoured[1]))
    return True


@pytest.mark.slow
@pytest.mark.parametrize(
    "stage, replicate",
    [(1, False), (1, True), (2, False), (2, True), (3, False), (3, True)],
)
def test_detour_on_a_mesh(stage, replicate):
    assert run_on_ranks(4, _compare, stage, replicate, timeout=300) == [True] * 4


def _detour_only(rank, world, stage, replicate):
    _run(rank, stage, replicate, True)  # (asserts the streamed weights are the model's at each detour)
    return True


@pytest.mark.slow
def test_chunked_stage3_streams_the_models_weights():
    assert run_on_ranks(4, _detour_only, 3, False, timeout=300) == [True] * 4
