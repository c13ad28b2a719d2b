"""Stage 3 and offload ("cpu", "nvme") through NCCL on 2 and 3 GPUs, launched with torchrun, against the unsharded
torch.optim.AdamW fed the mean of every rank's gradients (tests/helpers/engine_reference.py). Written ahead: they skip
unless the machine has that many GPUs (the GPU machines lent so far have one; test_engine_cuda_offload.py covers
offload at one rank there, test_engine_cuda_paths.py stage 1 and 2 on two GPUs).

What they would catch, none of which one GPU can show:
- the 1/N prescale of the gradients before NCCL sums them, at N = 3 where 1/N is not a power of two (a mean off by
  more than rounding, or a prescale applied twice or not at all, fails the reference check at once);
- a rank's shard of the reduced gradient landing in the wrong place or too early on its way to the host (offload),
  the norm statistics of offloaded state summed over the host group, and the host-to-device copies of each rank's
  new parameters before their all-gather;
- stage 3's gathers and frees on several ranks (with and without resharding after forward, with offload): every
  stage 3 run must equal its stage 2 twin bit for bit (same kernels, same collectives on the same buckets), and
  every rank must hold the same parameters.
The same script also runs here on two gloo ranks (test_the_script_runs_on_cpu_ranks), so that it cannot rot unseen."""

import subprocess
import textwrap

import pytest
import torch
from distributed import skip_unless_gpus
from torchrun_scripts import HELPERS, torchrun

# name -> (ZeroAdamW options, the stage 2 run it equals bit for bit; None: checked against the reference itself)
VARIANTS = {
    "stage2": (dict(stage=2), None),
    "cpu": (dict(stage=2, offload="cpu"), None),
    "nvme": (dict(stage=2, offload="nvme"), None),
    "stage3": (dict(stage=3), "stage2"),
    "stage3_keep": (dict(stage=3, reshard_after_forward=False), "stage2"),
    "stage3_cpu": (dict(stage=3, offload="cpu"), "cpu"),
    "stage3_nvme": (dict(stage=3, offload="nvme"), "nvme"),
}

_SCRIPT = textwrap.dedent(
    """
    import os, sys, torch, torch.distributed as dist
    sys.path.insert(0, {helpers!r})
    from engine_reference import check_against_reference, params_digest, rank_grads, reference, set_mean_grads
    from engine_reference import state_shards
    from tiny_transformer import batch, build, loss_fn
    from torchrun_scripts import init_ranks
    from zero_ext import ZeroAdamW

    HYPER = dict(lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    device = init_ranks({backend!r})


    def cpu_copy(model):
        copy = build(torch.bfloat16)
        copy.load_state_dict({{k: v.cpu() for k, v in model.state_dict().items()}})
        return copy


    variants = {variants!r}
    models, opts, refs = {{}}, {{}}, {{}}
    for name, (kw, twin) in variants.items():
        kw = dict(kw)
        models[name] = model = build(torch.bfloat16).to(device)
        if kw.get("offload") == "nvme":
            kw.update(offload_dir=os.path.join({root!r}, f"{{name}}-rank{{rank}}"), offload_window=3 * 14 * 1024 * 2)
            os.makedirs(kw["offload_dir"])
        if kw["stage"] == 3:
            kw.update(module=model)
        opts[name] = ZeroAdamW(model.named_parameters(), **HYPER, bucket_size=1200, max_grad_norm=1.0, **kw)
        if twin is None:
            refs[name] = reference(build(torch.bfloat16), **HYPER)
    for step in range(4):
        batches = [batch(step, r).to(device) for r in range(world)]
        for name, (ref_params, ref_opt) in refs.items():  # the mean of every rank's gradient, at these parameters
            per_rank = rank_grads(models[name], list(models[name].parameters()), batches, loss_fn)
            set_mean_grads(ref_params, [[g.cpu() for g in grads] for grads in per_rank])
            torch.nn.utils.clip_grad_norm_(ref_params, 1.0)
            ref_opt.step()
        for name in variants:
            loss_fn(models[name], batches[rank]).backward()
            opts[name].step()
            opts[name].zero_grad()
        for name, (ref_params, _) in refs.items():
            check_against_reference(opts[name], models[name], ref_params, rank)
        for name, (_, twin) in variants.items():
            if twin is None:
                continue
            with opts[name].gathered_params():
                for (pname, a), b in zip(models[name].named_parameters(), models[twin].parameters()):
                    assert torch.equal(a, b), f"step {{step}}: {{name}} differs from {{twin}} in {{pname}}"
            for i, (a, b) in enumerate(zip(state_shards(opts[name]), state_shards(opts[twin]))):
                assert torch.equal(a, b), f"step {{step}}: {{name}}'s state tensor {{i}} differs from {{twin}}'s"
    digests = []
    for name in variants:
        with opts[name].gathered_params():
            digests.append(params_digest(cpu_copy(models[name]))[:16])
        opts[name].close()
    dist.destroy_process_group()
    # one write(2) per rank: the ranks share torchrun's stdout pipe, and print's pieces interleaved there once
    # ("...,<rank 0's digest><rank 1's digest>,..."); a single write under PIPE_BUF bytes is atomic
    os.write(1, ("ok " + ",".join(digests) + "\\n").encode())
    """
)


def run_ranks(world: int, root, backend: str = "nccl") -> subprocess.CompletedProcess:
    """torchrun with ``world`` ranks of the script above (``backend="gloo"``: on CPU, to try the script itself)."""
    script = _SCRIPT.format(helpers=HELPERS, variants=VARIANTS, root=str(root), backend=backend)
    return torchrun(script, root / "ranks.py", world)


@pytest.mark.cuda
@pytest.mark.parametrize("world", [2, 3])
def test_stage3_and_offload_through_nccl_match_the_reference(world, tmp_path):
    skip_unless_gpus(world)
    proc = run_ranks(world, tmp_path)
    assert proc.returncode == 0 and proc.stdout.count("ok") == world, proc.stdout[-2000:] + proc.stderr[-4000:]
    outcomes = {line.split()[1] for line in proc.stdout.splitlines() if line.startswith("ok")}
    assert len(outcomes) == 1, f"the ranks hold different parameters: {outcomes}"


@pytest.mark.slow
def test_the_script_runs_on_cpu_ranks(tmp_path):
    """The same script on two gloo ranks: it runs nowhere else until a machine with two GPUs is lent, so this keeps it
    from rotting (an API it calls changed, a check that no longer holds). On gloo every variant is bitwise the same."""
    proc = run_ranks(2, tmp_path, backend="gloo")
    assert proc.returncode == 0 and proc.stdout.count("ok") == 2, proc.stdout[-2000:] + proc.stderr[-4000:]
    outcomes = {line.split()[1] for line in proc.stdout.splitlines() if line.startswith("ok")}
    assert len(outcomes) == 1 and len(set(outcomes.pop().split(","))) == 1, outcomes


def test_the_skip_names_the_gpus_needed_and_found(monkeypatch):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(pytest.skip.Exception, match=r"^needs 3 GPUs, found 1$"):
        skip_unless_gpus(3)
    skip_unless_gpus(1)  # enough: no skip
