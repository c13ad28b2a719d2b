"""``moment_dtype=torch.bfloat16`` on CUDA (one GPU, NCCL world of one): the CUDA kernel's stochastic rounding and
the engine's CUDA paths (moments in device memory; offload="cpu" with pinned bf16 host moments) against the same
run on the CPU, bitwise. The loss is linear in the parameters (sum of parameter * a fixed tensor), so every
gradient is that tensor exactly on either device and the two runs see the same gradients bit for bit."""

import pytest
import torch

from zero_ext import ZeroAdamW

pytestmark = pytest.mark.cuda
HYPER = dict(lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
SIZES = [(97, 33), (1025,), (7,), (2**12 + 3,)]


def _run(device, stage, offload, steps=5):
    torch.manual_seed(0)
    params = [torch.nn.Parameter((torch.randn(s) * 0.02).to(torch.bfloat16).to(device)) for s in SIZES]
    weights = [[torch.randn(s, generator=torch.Generator().manual_seed(10 * k + i)).to(torch.bfloat16).to(device)
                for i, s in enumerate(SIZES)] for k in range(steps)]  # fmt: skip
    groups = [{"params": params[:2]}, {"params": params[2:], "amsgrad": True, "weight_decay": 0.0}]
    opt = ZeroAdamW(groups, **HYPER, stage=stage, bucket_size=1500, moment_dtype=torch.bfloat16, offload=offload)
    for k in range(steps):
        sum((p.float() * w.float()).sum() for p, w in zip(params, weights[k])).backward()
        opt.step()
        opt.zero_grad()
    out = [p.detach().cpu() for p in params], opt.state_dict()["state"]
    opt.close()
    return out


@pytest.mark.parametrize("stage,offload", [(1, None), (2, None), (2, "cpu")])
def test_cuda_rounds_as_the_cpu(nccl_world, stage, offload):
    cuda_params, cuda_state = _run(torch.device("cuda"), stage, offload)
    cpu_params, cpu_state = _run(torch.device("cpu"), stage, None)
    assert all(torch.equal(a, b) for a, b in zip(cuda_params, cpu_params))
    assert cuda_state.keys() == cpu_state.keys()
    for i, entry in cpu_state.items():
        for key, value in entry.items():
            if torch.is_tensor(value):
                assert torch.equal(cuda_state[i][key].cpu(), value), (i, key)
