"""Wrote ckpt/ and expected.pt here, run at zero_ext f56809a (the dynamic int8 maps): python make_checkpoint.py ckpt
(one gloo rank, stage 2, int8 moments, 3 steps; expected.pt: the optimizer's state_dict() and the parameters)."""

import os
import sys
import tempfile

import torch
import torch.distributed as dist

from zero_ext import ZeroAdamW, checkpoint

out = sys.argv[1]
dist.init_process_group("gloo", init_method=f"file://{tempfile.mktemp()}", rank=0, world_size=1)
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(24, 40), torch.nn.GELU(), torch.nn.Linear(40, 8)).to(torch.bfloat16)
opt = ZeroAdamW(model.parameters(), lr=1e-2, stage=2, moment_dtype=torch.int8, module=model)
for step in range(3):
    x = torch.randn(16, 24, dtype=torch.bfloat16)
    loss = model(x).float().pow(2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
checkpoint.save(out, opt, extra={"step": 3})
sd = opt.state_dict()
torch.save(
    {
        "state": {k: {n: t.clone() for n, t in v.items() if torch.is_tensor(t)} for k, v in sd["state"].items()},
        "params": [p.detach().clone() for p in model.parameters()],
    },
    os.path.join(out, "..", "expected.pt"),
)
print("ok", sorted(os.listdir(out)))
dist.destroy_process_group()
os._exit(0)
