"""What can be shown on CPU about the CUDA path: the deferred all-gather race (reproduced with a gather that lands
late), torch.compile of a training step with opt.step() inside, CUDA-graph capture refused, and every Triton
launch run under its tensor's device."""

import contextlib

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from distributed import run_on_ranks
from engine_reference import params_digest
from tiny_transformer import batch, build, loss_fn

import zero_ext.optimizer as optimizer_module
from zero_ext import ZeroAdamW
from zero_ext.comm import GlooCommunicator, Pending

HYPER = dict(lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
VOCAB, DIM = 37, 24


class LateGather(GlooCommunicator):
    """A gather that lands only when waited for (a slow network): until then, the other ranks' slices of the
    parameters hold their values of the previous step. Anything that reads a parameter without waiting for its
    bucket reads stale values, deterministically."""

    def start_all_gather(self, output, input, bucket=None):
        landing = torch.empty_like(output)
        inner = super().start_all_gather(landing, input.clone(), bucket)
        return Pending(epilogue=lambda: (inner.wait(), output.copy_(landing)), tensors=(output, landing))


class FunctionalRoot(nn.Module):
    """The root reads a submodule's weight without calling the submodule (an embedding and a tied head), and a
    parameter of its own: no pre-hook of `wte` ever runs."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(3)
        self.wte = nn.Embedding(VOCAB, DIM)
        self.scale = nn.Parameter(torch.ones(DIM))
        self.mix = nn.Linear(DIM, DIM)

    def forward(self, tokens):
        x = F.embedding(tokens, self.wte.weight) * self.scale
        return F.linear(torch.tanh(self.mix(x)), self.wte.weight)


def _functional_loss(model, tokens):
    logits = model(tokens[:, :-1])
    return F.cross_entropy(logits.float().reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))


MODELS = {"functional_root": FunctionalRoot, "gpt": lambda: build(torch.bfloat16)}


def _deferred_gather_race(rank, world, stage, model_name):
    runs = []
    for defer in (False, True):
        model = MODELS[model_name]()
        comm = LateGather(None, torch.device("cpu")) if defer else None
        opt = ZeroAdamW(model.named_parameters(), **HYPER, stage=stage, bucket_size=700, communicator=comm,
                        defer_all_gather_to=model if defer else None)  # fmt: skip
        losses = []
        for step in range(4):
            loss = _functional_loss(model, batch(step, rank))
            losses.append(loss.item())
            loss.backward()
            opt.step()
            opt.zero_grad()
        opt.finish_sync()
        runs.append((losses, params_digest(model)))
    assert runs[0] == runs[1], "a parameter was read before its all-gather landed"
    return runs[1][1]


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("stage", [1, 2])
@pytest.mark.parametrize("model_name", list(MODELS))
def test_deferred_all_gather_never_reads_a_parameter_in_flight(world, stage, model_name):
    assert len(set(run_on_ranks(world, _deferred_gather_race, stage, model_name))) == 1


def _compiled_training_step(rank, world, compile_model):
    runs = []
    for compiled in (False, True):
        model = build(torch.float32)
        opt = ZeroAdamW(model.named_parameters(), **HYPER, stage=2, bucket_size=1500, max_grad_norm=1.0,
                        defer_all_gather_to=model)  # fmt: skip
        net = torch.compile(model, backend="aot_eager") if compiled and compile_model else model

        def train_step(tokens):
            loss = loss_fn(net, tokens)
            loss.backward()
            opt.step()
            opt.zero_grad()
            return loss.detach()

        step_fn = torch.compile(train_step, backend="aot_eager") if compiled else train_step
        losses = [step_fn(batch(step, rank)) for step in range(4)]
        opt.finish_sync()
        runs.append((torch.stack(losses), [p.detach().clone() for p in model.parameters()]))
    torch.testing.assert_close(runs[1][0], runs[0][0])
    for a, b in zip(runs[1][1], runs[0][1]):
        torch.testing.assert_close(a, b)
    return True


@pytest.mark.slow
@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("compile_model", [False, True], ids=["step_fn", "step_fn_and_model"])
def test_torch_compile_of_a_training_step_matches_eager(world, compile_model):
    assert all(run_on_ranks(world, _compiled_training_step, compile_model, timeout=300))


def test_cuda_graph_capture_is_refused(monkeypatch):
    model = build(torch.float32)
    opt = ZeroAdamW(model.named_parameters(), **HYPER)
    loss_fn(model, batch(0, 0)).backward()
    before = [p.detach().clone() for p in model.parameters()]
    monkeypatch.setattr(optimizer_module, "_cuda_graph_capturing", lambda: True)
    with pytest.raises(RuntimeError, match="cannot be captured in a CUDA graph"):
        opt.step()
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    monkeypatch.undo()
    opt.step()  # outside capture it works
    assert opt.step_count == 1


def test_capture_check_asks_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    assert optimizer_module._cuda_graph_capturing()
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    assert not optimizer_module._cuda_graph_capturing()


# ---------------------------------------------------------------------------------------------- device guards
def test_device_guard_makes_the_tensors_device_current(monkeypatch):
    from zero_ext.kernels._launch import device_guard

    entered = []

    class Recorder(contextlib.AbstractContextManager):
        def __init__(self, device):
            self.device = device

        def __enter__(self):
            entered.append(self.device)

        def __exit__(self, *exc):
            return False

    class FakeCudaTensor:
        device = torch.device("cuda", 1)

    monkeypatch.setattr(torch.cuda, "device", Recorder)
    with device_guard(FakeCudaTensor()):
        pass
    assert entered == [torch.device("cuda", 1)]
    with device_guard(torch.zeros(1)):  # CPU: nothing to guard
        pass
    assert entered == [torch.device("cuda", 1)]


@pytest.mark.triton_cpu
@pytest.mark.parametrize("launcher", ["cast_scale", "accumulate_"])
def test_every_triton_launch_runs_under_its_tensors_device(monkeypatch, launcher):
    pytest.importorskip("triton")
    import sys

    from zero_ext.kernels import accumulate_, cast_scale

    # The modules (the package attributes of the same names are the functions).
    cast_scale_module = sys.modules["zero_ext.kernels.cast_scale"]
    accumulate_module = sys.modules["zero_ext.kernels.accumulate"]

    guarded = []

    def recording_guard(t):
        guarded.append(t)
        return contextlib.nullcontext()

    for module in (cast_scale_module, accumulate_module):
        monkeypatch.setattr(module, "device_guard", recording_guard)
    x = torch.randn(97)
    if launcher == "cast_scale":
        out = torch.empty(97, dtype=torch.bfloat16)
        cast_scale(x, 0.5, out=out)
        assert len(guarded) == 1 and guarded[0] is out
    else:
        acc = torch.zeros(97)
        accumulate_(acc, x, 2.0)
        assert len(guarded) == 1 and guarded[0] is acc
