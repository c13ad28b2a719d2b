"""zero_ext.integrations.transformers: ZeroTrainer against transformers' own Trainer + DDP + torch AdamW on 2 gloo
ranks, with a tiny GPT2LMHeadModel built from a config (no downloads) and a synthetic dataset, fp32 params."""

import contextlib
import importlib
import os
import sys

import pytest
import torch
from distributed import run_on_ranks

try:
    import accelerate  # noqa: F401  (the Trainer needs it)
    import transformers
except ImportError:
    transformers = None

needs_hf = pytest.mark.skipif(
    transformers is None,
    reason="transformers/accelerate not installed: the Trainer integration is the optional extra zero_ext[hf] "
    '(pip install "zero_ext[hf]")',
)

STEPS, SAVE_AT, GLOBAL_BATCH, SAMPLES, SEQ = 8, 4, 4, 32, 16
_LAUNCH_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


class TokenDataset(torch.utils.data.Dataset):
    """Random token sequences, fixed by a seed; labels = inputs (the model shifts them)."""

    def __init__(self):
        g = torch.Generator().manual_seed(1234)
        self.tokens = torch.randint(0, 96, (SAMPLES, SEQ), generator=g)

    def __len__(self):
        return SAMPLES

    def __getitem__(self, i):
        return {"input_ids": self.tokens[i], "labels": self.tokens[i]}


@contextlib.contextmanager
def _launched_as(rank, world):
    """The environment torchrun gives a rank (the pool's process group already exists); accelerate's singletons
    and the environment are reset afterwards, so the pool's other tests see nothing of this one."""
    from accelerate.state import AcceleratorState, GradientState

    saved = {k: os.environ.get(k) for k in _LAUNCH_ENV}
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT="29500")  # fmt: skip
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    transformers.logging.set_verbosity_error()
    try:
        yield
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _config(dropout):
    from transformers import GPT2Config

    return GPT2Config(vocab_size=96, n_positions=SEQ, n_embd=32, n_layer=2, n_head=2, resid_pdrop=dropout,
                      embd_pdrop=dropout, attn_pdrop=dropout, bos_token_id=0, eos_token_id=0)  # fmt: skip


def _trainer(world, out, *, kind="zero", stage=2, dropout=0.1, save_steps=None, model=None, optimizers=None,
             zero_options=None, **overrides):  # fmt: skip
    from transformers import GPT2LMHeadModel, Trainer, TrainingArguments

    from zero_ext.integrations.transformers import ZeroTrainer

    torch.manual_seed(0)
    model = GPT2LMHeadModel(_config(dropout)) if model is None else model
    args = dict(output_dir=out, per_device_train_batch_size=GLOBAL_BATCH // world, max_steps=STEPS,
                learning_rate=3e-3, weight_decay=0.1, adam_beta2=0.95, warmup_steps=2, max_grad_norm=0.5,
                logging_steps=1, save_strategy="steps" if save_steps else "no", save_steps=save_steps or 500,
                report_to=[], disable_tqdm=True, use_cpu=True, seed=0, optim="adamw_torch",
                dataloader_num_workers=0)  # fmt: skip
    args = TrainingArguments(**{**args, **overrides})
    if kind == "ddp":
        return Trainer(model=model, args=args, train_dataset=TokenDataset())
    return ZeroTrainer(model=model, args=args, train_dataset=TokenDataset(), zero_stage=stage,
                       optimizers=optimizers or (None, None), zero_options=zero_options)  # fmt: skip


def _curve(trainer):
    """[(step, loss, grad_norm, learning_rate)] as the Trainer logged them."""
    keys = ("step", "loss", "grad_norm", "learning_rate")
    return [tuple(e[k] for k in keys) for e in trainer.state.log_history if "loss" in e]


def _weights(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _train(rank, world, out, kind, stage, dropout=0.1, save_steps=None, resume=None, overrides=None):
    """One training run; returns (logged curve, the model's wrapper type, rank 0's final weights)."""
    with _launched_as(rank, world):
        trainer = _trainer(world, out, kind=kind, stage=stage, dropout=dropout, save_steps=save_steps,
                           **(overrides or {}))  # fmt: skip
        trainer.train(resume_from_checkpoint=resume)
        wrapped = type(trainer.model_wrapped).__name__
        if kind == "zero":
            trainer.zero_optimizer.close()
        return _curve(trainer), wrapped, _weights(trainer.model) if rank == 0 else None


def _save_model(rank, world, out, stage):
    """Train, then save_model on every rank (the Trainer's convention); rank 0 reloads it with from_pretrained, and
    the consolidated zero_ext checkpoint of step SAVE_AT too."""
    from transformers import GPT2LMHeadModel

    from zero_ext import checkpoint

    with _launched_as(rank, world):
        trainer = _trainer(world, out, stage=stage, dropout=0.0, save_steps=SAVE_AT)
        trainer.train()
        trainer.save_model(os.path.join(out, "final"))
        trainer.zero_optimizer.close()
        if rank != 0:
            return None
        trained = _weights(trainer.model)
        loaded = _weights(GPT2LMHeadModel.from_pretrained(os.path.join(out, "final")))
        ck = os.path.join(out, f"checkpoint-{SAVE_AT}")
        checkpoint.consolidate(os.path.join(ck, "zero_ext"), os.path.join(out, "consolidated"))
        consolidated = _weights(GPT2LMHeadModel.from_pretrained(os.path.join(out, "consolidated")))
        at_save = _weights(GPT2LMHeadModel.from_pretrained(ck))
        return trained, loaded, consolidated, at_save, sorted(os.listdir(ck))


def _refusals(rank, world, out):
    from transformers import GPT2LMHeadModel

    from zero_ext import ZeroAdamW

    with _launched_as(rank, world):
        with pytest.raises(ValueError, match=r"`zero_stage` must be 1, 2 or 3, got 4"):
            _trainer(world, out, stage=4)
        with pytest.raises(ValueError, match=r"`zero_options` may not set \['lr'\]"):
            _trainer(world, out, zero_options={"lr": 1.0})
        with pytest.raises(ValueError, match="`optim` must name plain AdamW"):
            _trainer(world, out, optim="sgd")
        with pytest.raises(ValueError, match="bf16_full_eval"):
            _trainer(world, out, bf16_full_eval=True)
        model = GPT2LMHeadModel(_config(0.0))
        with pytest.raises(ValueError, match="`optimizers` must hold a zero_ext.ZeroAdamW"):
            _trainer(world, out, model=model, optimizers=(torch.optim.AdamW(model.parameters()), None))
        without_module = ZeroAdamW(model.parameters())
        with pytest.raises(ValueError, match="must be built with `module=` the Trainer's model"):
            _trainer(world, out, model=model, optimizers=(without_module, None))
        opt = ZeroAdamW(model.parameters(), lr=1e-3, module=model)  # closes the one above (a warning)
        trainer = _trainer(world, out, model=model, optimizers=(opt, None), max_steps=2)
        trainer.train()
        assert trainer.zero_optimizer is opt and opt.step_count == 2
        opt.close()
        trainer = _trainer(world, out)
        trainer.create_optimizer()
        with pytest.raises(ValueError, match="clips the global norm of all its parameters"):
            trainer.accelerator.clip_grad_norm_(list(trainer.model.parameters())[:1], 1.0)
        trainer.zero_optimizer.close()
    return True


# ---------------------------------------------------------------------------------------------------------- tests
# Tolerance of the logged losses and grad norms against DDP + torch AdamW: measured at most 1.2e-7 relative (1 fp32
# ulp at 4.3) over 8 steps with clipping, dropout and a warmup/decay schedule; 1e-6 leaves 8 ulps for another CPU's
# summation order. The weights use torch's default fp32 assert_close, as the engine's own tests do.
RTOL = 1e-6


@pytest.mark.slow
@needs_hf
@pytest.mark.parametrize("accumulate", [1, 2], ids=["no-accumulation", "accumulate-2"])
def test_loss_and_grad_norm_match_ddp_and_torch_adamw(tmp_path, accumulate):
    """The same model, data order, dropout, schedule and max_grad_norm (active at every step) through transformers'
    Trainer (which wraps the model in DDP and steps torch AdamW) and through ZeroTrainer at stages 3, 2 and 1 (no
    wrapper): the logged losses, grad norms and learning rates agree, and so do the final weights."""
    overrides = {"gradient_accumulation_steps": accumulate}
    if accumulate > 1:
        overrides["per_device_train_batch_size"] = GLOBAL_BATCH // 2 // accumulate
    ref, ref_wrapped, ref_weights = run_on_ranks(2, _train, str(tmp_path / "ddp"), "ddp", None, 0.1, None, None,
                                                 overrides)[0]  # fmt: skip
    assert ref_wrapped == "DistributedDataParallel"
    for stage in (3, 2, 1):
        results = run_on_ranks(2, _train, str(tmp_path / f"zero{stage}"), "zero", stage, 0.1, None, None, overrides)
        curve, wrapped, weights = results[0]
        assert wrapped == "GPT2LMHeadModel", "ZeroTrainer must not wrap the model"
        assert curve == results[1][0], "every rank logs the same curve"
        assert [c[0] for c in curve] == [r[0] for r in ref] == list(range(1, STEPS + 1))
        for (step, loss, norm, lr), (_, ref_loss, ref_norm, ref_lr) in zip(curve, ref):
            where = f"stage {stage}, step {step}"
            assert norm > 0.5, f"{where}: max_grad_norm=0.5 must clip at every step"
            assert loss == pytest.approx(ref_loss, rel=RTOL, abs=0), where
            assert norm == pytest.approx(ref_norm, rel=RTOL, abs=0), where
            assert lr == ref_lr, where
        for k in ref_weights:
            torch.testing.assert_close(weights[k], ref_weights[k], msg=lambda m: f"stage {stage}, {k}: {m}")


@pytest.mark.slow
@needs_hf
def test_resume_at_the_same_world_size_continues_bitwise(tmp_path):
    """Saved at 2 ranks (stage 2, with dropout), resumed at 2 ranks and stage 1: the optimizer shards, scheduler and
    every rank's random generators come back, so steps SAVE_AT+1.. repeat the uninterrupted run bit for bit."""
    out = str(tmp_path / "run")
    full, _, full_weights = run_on_ranks(2, _train, out, "zero", 2, 0.1, SAVE_AT)[0]
    ck = os.path.join(out, f"checkpoint-{SAVE_AT}")
    resumed, _, weights = run_on_ranks(2, _train, str(tmp_path / "resumed"), "zero", 1, 0.1, None, ck)[0]
    assert [c[0] for c in resumed] == list(range(1, STEPS + 1))
    assert resumed[SAVE_AT:] == full[SAVE_AT:]
    for k in full_weights:
        assert torch.equal(weights[k], full_weights[k]), k


@pytest.mark.slow
@needs_hf
def test_resume_at_another_world_size(tmp_path):
    """Saved at 2 ranks, resumed at 1 (the same global batch of 4): the curve continues to fp32 rounding. Not bitwise:
    one rank averages the loss and gradients of 4 samples at once where two ranks averaged two means of 2 (another
    summation order). No dropout: its masks depend on which rank sees which sample."""
    out = str(tmp_path / "run")
    full, _, full_weights = run_on_ranks(2, _train, out, "zero", 2, 0.0, SAVE_AT)[0]
    ck = os.path.join(out, f"checkpoint-{SAVE_AT}")
    resumed, _, weights = run_on_ranks(1, _train, str(tmp_path / "resumed"), "zero", 2, 0.0, None, ck)[0]
    assert [c[0] for c in resumed] == list(range(1, STEPS + 1))
    for (step, loss, norm, lr), (_, ref_loss, ref_norm, ref_lr) in zip(resumed[SAVE_AT:], full[SAVE_AT:]):
        assert loss == pytest.approx(ref_loss, rel=RTOL, abs=0), step
        assert norm == pytest.approx(ref_norm, rel=RTOL, abs=0), step
        assert lr == ref_lr, step
    for k in full_weights:
        torch.testing.assert_close(weights[k], full_weights[k])


@pytest.mark.slow
@needs_hf
def test_save_model_loads_with_from_pretrained(tmp_path):
    out = str(tmp_path / "run")
    trained, loaded, consolidated, at_save, files = run_on_ranks(2, _save_model, out, 2)[0]
    assert trained.keys() == loaded.keys()
    for k in trained:
        assert torch.equal(loaded[k], trained[k]), k
    # The Trainer's weights at the checkpoint and the consolidated optimizer checkpoint beside them are one model.
    for k in at_save:
        assert torch.equal(consolidated[k], at_save[k]), k
    assert "zero_ext" in files and "model.safetensors" in files and "trainer_state.json" in files
    assert not [f for f in files if f.startswith(("optimizer", "scheduler", "rng_state"))], files


@pytest.mark.slow
@needs_hf
def test_unsupported_setups_are_refused(tmp_path):
    assert run_on_ranks(1, _refusals, str(tmp_path))


def test_without_transformers_zero_trainer_names_the_extra(monkeypatch):
    """The module imports without transformers (as every zero_ext module does); ZeroTrainer says what to install."""
    monkeypatch.setitem(sys.modules, "transformers", None)
    monkeypatch.delitem(sys.modules, "zero_ext.integrations.transformers", raising=False)
    module = importlib.import_module("zero_ext.integrations.transformers")
    with pytest.raises(ImportError, match=r"pip install \"zero_ext\[hf\]\""):
        module.ZeroTrainer
    with pytest.raises(ImportError, match=r"pip install \"zero_ext\[hf\]\""):
        module.ZeroSeq2SeqTrainer
    with pytest.raises(ImportError, match=r"zero_ext\[hf\]"):
        exec("from zero_ext.integrations.transformers import ZeroTrainer", {})
