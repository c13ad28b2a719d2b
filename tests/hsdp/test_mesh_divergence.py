"""Stage 3's divergence diagnosis on a mesh: the collectives of both groups (the node's gathers, the replicas'
reduce-scatters) wait with the same deadline, the phase checks run over every rank of the mesh, and every rank
raises RanksDiverged naming where each of the 4 ranks is."""

import time

import pytest
import torch
from distributed import discard_pool, run_on_ranks
from tiny_transformer import batch, build, loss_fn
from torch.distributed.device_mesh import init_device_mesh

from zero_ext import ZeroAdamW
from zero_ext.comm.divergence import RanksDiverged

TIMEOUT = 1.0


def _diverge(rank, world, scenario):
    model = build(torch.float32, unused_branch=True)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    opt = ZeroAdamW(model.named_parameters(), lr=1e-3, stage=3, module=model, bucket_size=1500, mesh=mesh,
                    collective_timeout=TIMEOUT)  # fmt: skip
    started = time.monotonic()
    try:
        for step in range(4):
            if step == 2 and scenario == "rank0_eval":
                if rank == 0:
                    with torch.no_grad():
                        loss_fn(model, batch(90, 0))
            if step == 2 and scenario == "module_on_one_rank":
                loss_fn(model, batch(91, rank), use_extra=(rank == world - 1)).backward()
            loss_fn(model, batch(step, rank)).backward()
            opt.step()
            opt.zero_grad()
    except RanksDiverged as e:
        return "raised", str(e), time.monotonic() - started
    return "finished", "", time.monotonic() - started


@pytest.mark.slow  # a fresh pool per test: a diverged group cannot be reused
@pytest.mark.parametrize("scenario", ["rank0_eval", "module_on_one_rank"])
def test_every_rank_of_the_mesh_raises(scenario):
    try:
        results = run_on_ranks(4, _diverge, scenario, timeout=90)
    finally:
        discard_pool(4)
    assert [outcome for outcome, _, _ in results] == ["raised"] * 4, results
    for _, message, seconds in results:
        for r in range(4):
            assert f"rank {r}: " in message, message
        assert seconds < 15 * TIMEOUT, f"raised after {seconds:.1f} s"
