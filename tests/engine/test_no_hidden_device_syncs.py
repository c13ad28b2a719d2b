"""What would make a GPU job wait for the device without saying so, checked on CPU: a gloo group serving CUDA
parameters (warned once, with the cost and the fix), and the checkpoint's gather of every rank's generators, which
must run on the communicator's CPU group (an NCCL group would pickle into CUDA tensors and synchronise)."""

import random
import warnings

import torch
from distributed import run_on_ranks

import zero_ext.comm.gloo as gloo
from zero_ext import ZeroAdamW
from zero_ext.comm import communicator_for
from zero_ext.integrations import rng


def test_gloo_with_cuda_parameters_warns_once_with_the_cost(monkeypatch):
    monkeypatch.setattr(gloo, "_warned_device_syncs", False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert gloo.warn_if_device_syncs(torch.device("cpu")) is False
        assert gloo.warn_if_device_syncs(torch.device("cuda", 0)) is True
        assert gloo.warn_if_device_syncs(torch.device("cuda", 1)) is True  # once per process
    assert len(caught) == 1, [str(w.message) for w in caught]
    message = str(caught[0].message)
    for words in ("cuda:0", "gloo", "every step() synchronises", 'init_process_group("nccl")', "cpu:gloo,cuda:nccl"):
        assert words in message, f"the warning does not say {words!r}: {message}"


def _communicators(rank, world):
    """A gloo group asked for a communicator for CUDA parameters (no GPU here: its side streams are stubbed out)."""
    saved = torch.cuda.Stream, gloo._warned_device_syncs
    torch.cuda.Stream = lambda device=None: None
    gloo._warned_device_syncs = False
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            cpu = communicator_for(None, torch.device("cpu"))
            cuda = communicator_for(None, torch.device("cuda", 0))
    finally:
        torch.cuda.Stream, gloo._warned_device_syncs = saved
    return type(cpu).__name__, type(cuda).__name__, [str(w.message) for w in caught]


def test_a_gloo_communicator_for_cuda_parameters_warns():
    for cpu, cuda, messages in run_on_ranks(2, _communicators):
        assert (cpu, cuda) == ("GlooCommunicator", "GlooCommunicator")
        assert len(messages) == 1 and "gloo" in messages[0], messages


def _gather_generators(rank, world):
    opt = ZeroAdamW(torch.nn.Linear(3, 2).parameters(), lr=1e-3)
    comm = opt.sharded_state.comm
    random.seed(100 + rank)
    torch.manual_seed(200 + rank)
    mine = rng.capture()
    # An NCCL group stands here: nothing may be gathered through it (gloo's cpu_group is the group it replaced).
    comm.group = object()
    states = rng.gather(comm)
    return [s["python"][1][:4] for s in states], mine["python"][1][:4], [s["cpu"].sum().item() for s in states]


def test_the_generators_are_gathered_on_the_cpu_group():
    results = run_on_ranks(2, _gather_generators)
    for rank, (python_states, mine, cpu_sums) in enumerate(results):
        assert python_states == results[0][0] and cpu_sums == results[0][2], "ranks gathered different states"
        assert python_states[rank] == mine, f"rank {rank}'s entry is not its own generator"
    assert results[0][0][0] != results[0][0][1], "both ranks' generators gathered as one"
