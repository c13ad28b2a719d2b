"""Stages 1 and 2 label their reduce-scatters with the phase they run in: a divergence message names each rank's
recent collectives as ``reduce_scatter ... , backward, step N`` (comm/divergence.py). The reducer no longer calls into
comm from a gradient hook to say so: the round's first reduce-scatter names the phase it opens (``phase=``)."""

from __future__ import annotations

import re

import pytest
import torch
from distributed import discard_pool, run_on_ranks

from zero_ext import RanksDiverged, ZeroAdamW


def _extra_backward(rank, world, stage):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    opt = ZeroAdamW(model.parameters(), lr=1e-3, stage=stage, bucket_size=200, collective_timeout=1.0)
    x = torch.randn(8, 16)
    try:
        for step in range(3):
            model(x).pow(2).mean().backward()
            if step == 1 and rank == world - 1:  # one more backward on the last rank: its reduce-scatters are extra
                model(x).pow(2).mean().backward()
                opt.step()  # (the others wait for these reductions in their step)
            opt.step()
            opt.zero_grad()
    except RanksDiverged as e:
        return str(e)
    return ""


@pytest.mark.parametrize("stage", [1, 2])
def test_reduce_scatters_are_labelled_backward(stage):
    try:
        messages = run_on_ranks(2, _extra_backward, stage, timeout=60)
    finally:
        discard_pool(2)
    assert any(messages), messages
    for message in filter(None, messages):
        labels = re.findall(r"reduce_scatter of \d+ elements \(bucket \(\d+, \d+\)\), ([^,]+), step", message)
        assert labels, message
        assert set(labels) == {"backward"}, message
