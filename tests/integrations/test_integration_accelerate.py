"""zero_ext.integrations.accelerate: ZeroAccelerator against accelerate's own Accelerator (DDP + torch AdamW) on gloo
ranks, through the example examples/accelerate_loop.py (accelerate's minimal loop with accumulate(model) over 2
batches, clip_grad_norm_, a warm-up scheduler, save_state after epoch 0).

Three launches in all: torchrun on 2 ranks trains DDP and stages 1-3; torchrun on 1 rank and `accelerate launch` on 3
resume each from another run's epoch-0 state (the zero_ext ones across stages too) and are compared with DDP resumed
the same way."""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torchrun_scripts import torchrun

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("accelerate") is None,
    reason="accelerate not installed: the integration is the optional extra zero_ext[accelerate]",
)
# DDP and ZeroAdamW compute the same mean gradient and AdamW update up to the order of the reduction (a few fp32 ulps,
# ~1e-7 relative), which 8 steps of Adam's normalised update keep far inside 1e-5 (the bar).
FP32 = dict(rtol=1e-5, atol=1e-5)

_SCRIPT = """
import os, sys, json
import torch
sys.path.insert(0, {examples!r})
import accelerate_loop
from accelerate.state import AcceleratorState, GradientState

for name, stage, resume in json.loads({runs!r}):
    result = accelerate_loop.train(stage, os.path.join({root!r}, name), resume=resume, cpu=True)
    if int(os.environ["RANK"]) == 0:
        torch.save(result, os.path.join({root!r}, name + ".pt"))
    AcceleratorState._reset_state(reset_partial_state=True)  # the next run builds its own accelerator
    GradientState._reset_state()
print("ALL RUNS DONE", flush=True)
"""

KINDS = {"ddp": 0, "z1": 1, "z2": 2, "z3": 3}
SOURCE = {"ddp": "ddp", "z1": "z3", "z2": "z1", "z3": "z2"}  # whose epoch-0 state each resumes from


def _script(root: Path, runs: list) -> str:
    return _SCRIPT.format(examples=str(ROOT / "examples"), runs=json.dumps(runs), root=str(root))


def _check(proc) -> None:
    assert "ALL RUNS DONE" in proc.stdout, proc.stdout[-4000:] + proc.stderr[-8000:]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    root = tmp_path_factory.mktemp("accelerate")
    _check(torchrun(_script(root, [(k, s, None) for k, s in KINDS.items()]), root / "runs_2.py", 2))
    resumed = lambda world: [(f"{k}_resumed{world}", s, str(root / SOURCE[k] / "epoch0")) for k, s in KINDS.items()]  # noqa: E731
    _check(torchrun(_script(root, resumed(1)), root / "runs_1.py", 1))
    (root / "runs_3.py").write_text(_script(root, resumed(3)))
    # `accelerate launch`: its multi-process launcher (torch's elastic agent underneath; `--cpu` would take the MPI
    # path), the accelerator itself on the CPU (cpu=True in the script)
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes=3", "--num_machines=1",
           "--mixed_precision=no", "--dynamo_backend=no", str(root / "runs_3.py")]  # fmt: skip
    _check(subprocess.run(cmd, capture_output=True, text=True, timeout=600))
    return {p.stem: torch.load(p, weights_only=False) for p in root.glob("*.pt")}


def _assert_same(zero, ddp):
    torch.testing.assert_close(torch.tensor(zero["losses"]), torch.tensor(ddp["losses"]), **FP32)
    torch.testing.assert_close(torch.tensor(zero["norms"]), torch.tensor(ddp["norms"]), **FP32)
    assert zero["weights"].keys() == ddp["weights"].keys()
    for k in ddp["weights"]:
        torch.testing.assert_close(zero["weights"][k], ddp["weights"][k], **FP32, msg=lambda m: f"{k}: {m}")


@pytest.mark.slow
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_matches_ddp(results, stage):
    ddp, zero = results["ddp"], results[f"z{stage}"]
    assert ddp["wrapper"] == "DistributedDataParallel" and ddp["optimizer"] == "AdamW"
    assert zero["wrapper"] == "Sequential" and zero["optimizer"] == "ZeroAdamW"  # no DDP wrapper
    assert len(ddp["losses"]) == 16 and len(ddp["norms"]) == 8  # 2 epochs x 8 batches, accumulated in pairs
    _assert_same(zero, ddp)


@pytest.mark.slow
@pytest.mark.parametrize("world", [1, 3])
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_resume_at_another_process_count_matches_ddp(results, stage, world):
    ddp = results[f"ddp_resumed{world}"]
    assert len(ddp["norms"]) == 4  # epoch 1 only
    _assert_same(results[f"z{stage}_resumed{world}"], ddp)


def test_accelerator_refuses_bad_options():
    from zero_ext.integrations.accelerate import ZeroAccelerator

    with pytest.raises(ValueError, match="`stage` must be 1, 2 or 3"):
        ZeroAccelerator(stage=0)
    with pytest.raises(ValueError, match=r"may not set \['module'\]"):
        ZeroAccelerator(stage=2, zero_options={"module": None})
