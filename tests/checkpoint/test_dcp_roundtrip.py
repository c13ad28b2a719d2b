"""zero_ext.checkpoint.get_state_dict / set_state_dict with torch.distributed.checkpoint, both directions:
ZeroAdamW at stages 1-3 on N ranks -> dcp.save (and dcp.async_save) -> ZeroAdamW at every stage on M ranks (bitwise the
uninterrupted run) and FSDP2 + torch.optim.AdamW on M ranks (loaded with torch's own get_state_dict / dcp.load /
set_state_dict), and FSDP2 on N ranks -> ZeroAdamW at every stage on M ranks, for N, M in 1, 2, 3 gloo ranks.

The gradients are exact under any mean (dcp_runs.py), so a zero_ext run resumed anywhere must end bitwise where the
uninterrupted one does. zero_ext and torch's AdamW round the same formula differently by about one ulp
(DESIGN.md, Numerics), so a run that crosses between them is compared at torch's default fp32 tolerance, as the
parity tests compare ZeroAdamW with torch.optim.AdamW (tests/engine/test_engine_parity.py).

Every source is saved (12 runs); the resumes are every pair of values of source world x source kind x target world x
target stage (tests/helpers/pairwise.py), FSDP2's checkpoints also resumed at another world size than their own,
and for FSDP2 as the target every pair of source world x source stage x target world: 25 resumes of the 135 of the
whole grid (issue 47), each checked as before."""

import pytest
import torch
from dcp_runs import (
    fsdp_full,
    fsdp_load,
    fsdp_model,
    fsdp_save,
    fsdp_steps,
    model_for,
    reference_run,
    zero_full,
    zero_load,
    zero_optimizer,
    zero_save,
    zero_steps,
)
from distributed import run_on_ranks
from pairwise import pairwise

SAVED_AT, STOP = 3, 5  # steps before the checkpoint, steps in all
STAGES = (1, 2, 3)


def _save_runs(rank, world, root):
    """Every uninterrupted run on this world size, each saving at SAVED_AT: ZeroAdamW at each stage (stage 2 through
    dcp.async_save, stepping while the files are written) and FSDP2."""
    finals = {}
    for stage in STAGES:
        model = model_for(torch.float32)
        opt = zero_optimizer(model, stage)
        zero_steps(model, opt, 0, SAVED_AT)
        zero_save(model, opt, f"{root}/zero-n{world}-s{stage}", use_async=stage == 2)
        zero_steps(model, opt, SAVED_AT, STOP)
        finals[f"zero-n{world}-s{stage}"] = zero_full(model, opt)
    model, opt = fsdp_model()
    fsdp_steps(model, opt, 0, SAVED_AT)
    fsdp_save(model, opt, f"{root}/fsdp-n{world}")
    fsdp_steps(model, opt, SAVED_AT, STOP)
    finals[f"fsdp-n{world}"] = fsdp_full(model)
    return finals


def _resume_runs(rank, world, root, resumes):
    """Each (source checkpoint, target) of ``resumes`` resumed on this world size: target "zero-s<stage>" by ZeroAdamW
    at that stage, "fsdp" by FSDP2."""
    out = {}
    for source, target in resumes:
        if target == "fsdp":
            model, opt = fsdp_model()
            fsdp_load(model, opt, f"{root}/{source}")
            fsdp_steps(model, opt, SAVED_AT, STOP)
            out[(source, target)] = fsdp_full(model)
        else:
            model = model_for(torch.float32)
            opt = zero_optimizer(model, int(target[-1]))
            zero_load(model, opt, f"{root}/{source}")
            zero_steps(model, opt, SAVED_AT, STOP)
            out[(source, target)] = zero_full(model, opt)
    return out if rank == 0 else None


WORLDS = (1, 2, 3)
# Which world saved, what saved (ZeroAdamW at a stage, or FSDP2), which world resumes and at which stage act
# independently: every pair of their values (which resume FSDP2's checkpoints only on their own world size: three
# rows across world sizes added); FSDP2 resumes zero_ext checkpoints of every pair of world and stage.
TO_ZERO = pairwise({"source_world": WORLDS, "source": ["zero-s1", "zero-s2", "zero-s3", "fsdp"],
                    "target_world": WORLDS, "target": ["zero-s1", "zero-s2", "zero-s3"]})  # fmt: skip
TO_ZERO += [(1, "fsdp", 2, "zero-s3"), (2, "fsdp", 3, "zero-s1"), (3, "fsdp", 1, "zero-s2")]  # pairwise: same world
TO_FSDP = pairwise({"source_world": WORLDS, "source": ["zero-s1", "zero-s2", "zero-s3"], "target_world": WORLDS})
RESUMES = [(n, src, m, dst) for n, src, m, dst in TO_ZERO] + [(n, src, m, "fsdp") for n, src, m in TO_FSDP]


def _checkpoint(kind: str, world: int) -> str:
    """The folder name of the checkpoint ``kind`` ("zero-s<stage>" or "fsdp") saved on ``world`` ranks."""
    return f"zero-n{world}-s{kind[-1]}" if kind.startswith("zero") else f"fsdp-n{world}"


@pytest.mark.slow
def test_round_trips_both_directions_every_stage_1_to_3_ranks(tmp_path):
    root = str(tmp_path)
    finals = {}
    for n in WORLDS:
        finals.update(run_on_ranks(n, _save_runs, root)[0])
    reference = reference_run(STOP)
    zero_run = finals["zero-n1-s1"]
    for name, params in finals.items():
        assert set(params) == set(reference), name
        for key, value in params.items():
            if name.startswith("zero"):  # the uninterrupted zero_ext runs: one result, bitwise
                assert torch.equal(value, zero_run[key]), f"{name}: {key} differs from zero-n1-s1"
            torch.testing.assert_close(value, reference[key], msg=lambda m: f"{name} {key} vs torch AdamW: {m}")
    for m in WORLDS:
        mine = [(_checkpoint(src, n), dst) for n, src, world, dst in RESUMES if world == m]
        resumed = run_on_ranks(m, _resume_runs, root, mine)[0]
        assert sorted(resumed) == sorted(mine)
        for (source, target), params in resumed.items():
            what = f"{source} -> {target} on {m} rank(s)"
            for key, value in params.items():
                if source.startswith("zero") and target.startswith("zero"):
                    assert torch.equal(value, zero_run[key]), f"{what}: {key} is not bitwise the uninterrupted run's"
                else:
                    torch.testing.assert_close(value, finals[source][key], msg=lambda msg: f"{what}: {key}: {msg}")
