"""A ZeroAdamW holds hooks on the model, flat buffers the parameters point into and a process group: it cannot be
copied or pickled. copy.deepcopy, copy.copy and pickle refuse it with a message naming what to do, on every rank,
and the optimizer goes on working. Stages 1-3 on 2 gloo ranks."""

import copy
import pickle

import pytest
from compat_training import build, make, train
from distributed import run_on_ranks

STAGES = [1, 2, 3]


def _copies_refused(rank, world, stage):
    model = build()
    opt = make(model, stage)
    train(model, opt, rank, 1)
    for attempt in (copy.deepcopy, copy.copy, pickle.dumps, lambda o: o.__getstate__(), lambda o: o.__reduce_ex__(2)):
        with pytest.raises(TypeError, match=r"cannot be copied.*state_dict\(\).*zero_ext\.checkpoint\.save"):
            attempt(opt)
    train(model, opt, rank, 1, start=1)
    assert opt.step_count == 2


@pytest.mark.parametrize("stage", STAGES)
def test_deepcopy_and_pickle_are_refused_clearly(stage):
    run_on_ranks(2, _copies_refused, stage)
