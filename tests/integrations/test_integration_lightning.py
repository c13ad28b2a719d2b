"""zero_ext.integrations.lightning: ZeroStrategy against Lightning's own strategy="ddp" (torch AdamW) on gloo ranks,
through the example examples/lightning_gpt.py (a LightningModule around bench/gpt_model.py's GPT: gradient clipping,
accumulation over 2 batches, a warm-up LR schedule, validation every epoch, ModelCheckpoint every epoch, predict).

Three torchrun launches in all (launches are the cost): 2 ranks train DDP and stages 1-3 in fp32 and in bf16-mixed;
1 and 3 ranks then resume each fp32 run from its epoch-0 checkpoint (the zero_ext ones across stages too) and are
compared with DDP resumed the same way."""

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torchrun_scripts import torchrun

ROOT = Path(__file__).resolve().parents[2]
needs_lightning = pytest.mark.skipif(
    importlib.util.find_spec("lightning") is None,
    reason="lightning not installed: the integration is the optional extra zero_ext[lightning]",
)
pytestmark = [needs_lightning]

# fp32: DDP and ZeroAdamW compute the same mean gradient and the same AdamW update up to the order of the reduction
# (a few ulps of fp32, ~1e-7 relative), which Adam's normalised update carries into the weights at lr x that; 8
# optimizer steps stay far inside 1e-5 (the bar).
FP32 = dict(rtol=1e-5, atol=1e-5)
# bf16-mixed: the same fp32 differences can move an activation across a bf16 rounding boundary (2^-8 relative), so
# the runs agree to a few bf16 ulps of the values compared, not to fp32's.
BF16 = dict(rtol=2**-6, atol=2**-6)

_SCRIPT = """
import os, sys, json
import torch
import torch.distributed as dist
sys.path.insert(0, {examples!r})
import lightning_gpt

dist.init_process_group("gloo")
world = dist.get_world_size()
for name, stage, precision, resume in json.loads({runs!r}):
    out = os.path.join({root!r}, name)
    result = lightning_gpt.train(stage, world, out, precision=precision, resume=resume)
    if dist.get_rank() == 0:
        torch.save(result, os.path.join({root!r}, name + ".pt"))
print("ALL RUNS DONE", flush=True)
"""


def _launch(root: Path, world: int, runs: list) -> None:
    import json

    script = _SCRIPT.format(examples=str(ROOT / "examples"), runs=json.dumps(runs), root=str(root))
    proc = torchrun(script, root / f"runs_{world}.py", world)
    assert "ALL RUNS DONE" in proc.stdout, proc.stdout[-4000:] + proc.stderr[-8000:]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    root = tmp_path_factory.mktemp("lightning")
    kinds = {"ddp": 0, "z1": 1, "z2": 2, "z3": 3}
    first = [(k, s, "32-true", None) for k, s in kinds.items()]
    first += [(k + "_bf16", s, "bf16-mixed", None) for k, s in kinds.items()]
    _launch(root, 2, first)
    # resumed from epoch 0 of a 2-rank run: each zero_ext stage from another stage's checkpoint, DDP from its own
    source = {"ddp": "ddp", "z1": "z3", "z2": "z1", "z3": "z2"}
    for world in (1, 3):
        runs = [(f"{k}_resumed{world}", s, "32-true", str(root / source[k] / "epoch=0.ckpt")) for k, s in kinds.items()]
        _launch(root, world, runs)
    return {p.stem: torch.load(p, weights_only=False) for p in root.glob("*.pt")}, root


def _assert_same(zero, ddp, tol):
    torch.testing.assert_close(torch.tensor(zero["losses"]), torch.tensor(ddp["losses"]), **tol)
    torch.testing.assert_close(zero["val_loss"], ddp["val_loss"], **tol)
    assert zero["weights"].keys() == ddp["weights"].keys()
    for k in ddp["weights"]:
        torch.testing.assert_close(zero["weights"][k], ddp["weights"][k], **tol, msg=lambda m: f"{k}: {m}")
    torch.testing.assert_close(zero["predictions"], ddp["predictions"], **tol)


@pytest.mark.slow
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_fp32_matches_ddp(results, stage):
    runs, _ = results
    assert len(runs["ddp"]["losses"]) == 16  # 2 epochs x 8 batches of 3 per rank (accumulated in pairs)
    _assert_same(runs[f"z{stage}"], runs["ddp"], FP32)


@pytest.mark.slow
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_bf16_mixed_matches_ddp(results, stage):
    runs, _ = results
    _assert_same(runs[f"z{stage}_bf16"], runs["ddp_bf16"], BF16)


@pytest.mark.slow
@pytest.mark.parametrize("world", [1, 3])
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_resume_at_another_world_size_matches_ddp(results, stage, world):
    runs, _ = results
    ddp = runs[f"ddp_resumed{world}"]
    assert len(ddp["losses"]) == 8  # epoch 1 only: 48 samples in global batches of 6
    _assert_same(runs[f"z{stage}_resumed{world}"], ddp, FP32)


@pytest.mark.slow
def test_checkpoint_is_a_directory_of_shards(results):
    """Rank 0's Lightning dict (no optimizer state in it) beside the zero_ext shards of every rank."""
    _, root = results
    ckpt = root / "z2" / "epoch=1.ckpt"
    assert (ckpt / "lightning.ckpt").is_file() and (ckpt / "zero_ext").is_dir()
    saved = torch.load(ckpt / "lightning.ckpt", weights_only=False)
    assert saved["optimizer_states"] == [{"zero_ext": "zero_ext"}]
    assert saved["state_dict"].keys() == torch.load(root / "ddp.pt", weights_only=False)["weights"].keys()


def test_strategy_refuses_bad_options():
    from zero_ext.integrations.lightning import ZeroStrategy

    with pytest.raises(ValueError, match="`stage` must be 1, 2 or 3"):
        ZeroStrategy(stage=4)
    with pytest.raises(ValueError, match=r"may not set \['lr'\]"):
        ZeroStrategy(stage=2, lr=1e-3)


def test_only_adamw_is_converted():
    from zero_ext.integrations.optimizer_swap import zero_adamw_like

    model = torch.nn.Linear(4, 4)
    with pytest.raises(TypeError, match="must be a torch.optim.AdamW"):
        zero_adamw_like(torch.optim.SGD(model.parameters(), lr=0.1), module=model, stage=2, options={}, where="t")
    with pytest.raises(TypeError, match="must be a torch.optim.AdamW"):
        zero_adamw_like(torch.optim.Adam(model.parameters()), module=model, stage=2, options={}, where="t")


def test_integrations_import_no_framework():
    """Importing zero_ext (and the shared integration module) imports neither Lightning nor accelerate."""
    code = ("import sys, zero_ext, zero_ext.integrations.optimizer_swap; "
            "bad = [m for m in ('lightning', 'pytorch_lightning', 'accelerate') if m in sys.modules]; "
            "assert not bad, bad")  # fmt: skip
    subprocess.run([sys.executable, "-c", code], check=True, cwd="/")
