"""opt.add_param_group() after construction (issue 25): progressive unfreezing. A model with its first block frozen
trains, the block is unfrozen and added as a new group with its own lr, and training goes on like torch.optim.AdamW
given the same add_param_group (tolerance), and bitwise like an unsharded run of the engine's own kernel (per-group
lr, per-parameter step counts), on 1, 2 and 3 gloo ranks, stages 1-3, with and without offload. Checkpoints carry
the group across world sizes, stages and offload; errors are agreed on every rank and change nothing."""

import pytest
import torch
from distributed import run_on_ranks
from engine_reference import check_against_reference, offload_kwargs, params_digest, rank_grads, state_shards
from tiny_transformer import batch, build, loss_fn

from zero_ext import ZeroAdamW, checkpoint, ops

HYPER = dict(lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
BUCKET = 1500
WINDOW = 3 * 14 * 1024 * 2  # test_offload's smallest nvme window


def _frozen_start(dtype, stage, rank, world, offload=None, root=None, tag="run", defer=False, **kw):
    """The documented path's start: block 0 frozen, the optimizer built from the trainable parameters only."""
    model = build(dtype)
    model.blocks[0].requires_grad_(False)
    if defer:
        kw["defer_all_gather_to"] = model
    trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    extra = offload_kwargs(offload, root, rank, tag, WINDOW) if offload else {}
    opt = ZeroAdamW(trainable, **HYPER, stage=stage, bucket_size=BUCKET, module=model, **extra, **kw)
    return model, opt


def _unfreeze(model, opt):
    model.blocks[0].requires_grad_(True)
    opt.add_param_group({"params": model.blocks[0].parameters(), "lr": HYPER["lr"] / 10})


class KernelReference:
    """Unsharded, bitwise: every trainable parameter's fp32 master and moments and its own step count, updated one
    parameter at a time by the engine's kernel (``zero_ext.ops.fused_adamw_``) from the fp32 mean of the ranks'
    gradients (sum in rank order / N: exact on gloo), each with its param group's lr; ``model`` holds the masters
    rounded to the parameter dtype (its gradients are the ones the engine's ranks compute)."""

    def __init__(self, dtype):
        self.model = build(dtype)
        self.model.requires_grad_(False)
        self.named = dict(self.model.named_parameters())
        self.state: dict[str, list] = {}
        self.lr: dict[str, float] = {}

    def add_group(self, names, lr):
        for n in names:
            self.named[n].requires_grad_(True)
            self.state[n] = [self.named[n].detach().float().reshape(-1).clone(), None, None, 0]
            self.state[n][1:3] = [torch.zeros_like(self.state[n][0]), torch.zeros_like(self.state[n][0])]
            self.lr[n] = lr

    def step(self, batches):
        names = list(self.state)
        params = [self.named[n] for n in names]
        per_rank = rank_grads(self.model, params, batches, loss_fn)
        for i, n in enumerate(names):
            mean = sum(g[i].float() for g in per_rank) / len(per_rank)
            s = self.state[n]
            s[3] += 1
            beta1, beta2 = HYPER["betas"]
            ops.fused_adamw_(s[0], mean.reshape(-1).contiguous(), s[1], s[2], lr=self.lr[n], beta1=beta1, beta2=beta2,
                             eps=HYPER["eps"], weight_decay=HYPER["weight_decay"], step=s[3])  # fmt: skip
            with torch.no_grad():
                self.named[n].copy_(s[0].view(self.named[n].shape))

    def check(self, opt, model):
        for (name, p), (_, ref) in zip(model.named_parameters(), self.model.named_parameters()):
            assert torch.equal(p.detach(), ref.detach()), f"{name}: {int((p.detach() != ref.detach()).sum())} differ"
        kinds = ("master", "exp_avg", "exp_avg_sq")
        steps = {e["name"]: e["step"] for e in _param_steps(opt)}
        for ref in opt.sharded_state.pieces():
            full = self.state[ref.name]
            for i, kind in enumerate(kinds):
                mine = ref.group.state.read(kind, ref.piece.shard_range).cpu()
                assert torch.equal(mine, full[i][ref.piece.start : ref.piece.end]), f"{ref.name} {kind}"
            assert steps[ref.name] == full[3], f"{ref.name} step {steps[ref.name]} != {full[3]}"


def _param_steps(opt):
    state = opt.sharded_state
    counts = state.step_counts.values()
    return [{"name": state.names[gidx], "step": counts[gidx]} for _, gidx, _ in state.members()]


def _block0(model):
    return [n for n, _ in model.named_parameters() if n.startswith("blocks.0.")]


def _world_batches(step, world):
    return [batch(step, r) for r in range(world)]


def _train(model, opt, kref, step, rank, world):
    kref.step(_world_batches(step, world))
    loss_fn(model, batch(step, rank)).backward()
    opt.step()
    opt.zero_grad()


# ---------------------------------------------------------------------------------------------------------- training
def _trains_like_torch(rank, world, stage, dtype_name, offload, root, defer=False):
    dtype = getattr(torch, dtype_name)
    model, opt = _frozen_start(dtype, stage, rank, world, offload, root, defer=defer)
    kref = KernelReference(dtype)
    kref.add_group([n for n, p in model.named_parameters() if p.requires_grad], HYPER["lr"])
    # torch's AdamW, given the same groups, on fp32 copies fed the mean gradients
    ref_model = build(dtype).float()  # fp32 copies of the rounded start
    ref_named = dict(ref_model.named_parameters())
    first = [n for n, p in model.named_parameters() if p.requires_grad]
    torch_opt = torch.optim.AdamW([ref_named[n] for n in first], **HYPER)
    ref_params = list(ref_model.parameters())

    def torch_step(step):
        # on the kernel reference's model: bitwise the engine's parameters (checked), and full at stage 3 too
        ref_grads = rank_grads(kref.model, list(kref.model.parameters()), _world_batches(step, world), loss_fn)
        for i, p in enumerate(ref_params):
            gs = [g[i] for g in ref_grads]
            p.grad = None if gs[0] is None else sum(g.float() for g in gs) / len(gs)
        torch_opt.step()

    for step in range(2):
        torch_step(step)
        _train(model, opt, kref, step, rank, world)
    before = opt.memory_report()

    _unfreeze(model, opt)
    kref.add_group(_block0(model), HYPER["lr"] / 10)
    torch_opt.add_param_group({"params": [ref_named[n] for n in _block0(model)], "lr": HYPER["lr"] / 10})
    assert len(opt.param_groups) == len(torch_opt.param_groups) == 2
    for key in ("betas", "eps", "weight_decay", "amsgrad", "maximize", "foreach", "fused"):
        assert opt.param_groups[1][key] == torch_opt.param_groups[1][key], key  # torch's defaults, filled as torch does
    assert opt.param_groups[1]["lr"] == HYPER["lr"] / 10
    assert opt.param_groups[1]["param_names"] == _block0(model)
    assert any(g.group_index == 1 for g in opt.sharded_state.groups)
    after = opt.memory_report()  # the new group's parameters and state counted
    assert after.num_params == before.num_params + sum(p.numel() for p in model.blocks[0].parameters())
    assert after.total > before.total

    for step in range(2, 5):
        torch_step(step)
        _train(model, opt, kref, step, rank, world)
    names = [n for n, _ in model.named_parameters()]
    in_opt_order = [ref_named[n] for n in first + _block0(model)]
    with opt.gathered_params():  # (stage 3: the parameters full)
        kref.check(opt, model)  # bitwise: params, this rank's master and moments, every step count
        check_against_reference(opt, model, [ref_named[n] for n in names], rank, ref_in_opt_order=in_opt_order)
        digest = params_digest(model)
    assert opt.step_count == 5
    return digest


@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_an_added_group_trains_like_torch(world, stage):
    digests = run_on_ranks(world, _trains_like_torch, stage, "bfloat16", None, None)
    assert len(set(digests)) == 1


@pytest.mark.parametrize(("stage", "offload"), [(1, "cpu"), (2, "cpu"), (3, "cpu"), (2, "nvme"), (3, "nvme")])
def test_an_added_group_trains_with_offload(tmp_path, stage, offload):
    digests = run_on_ranks(2, _trains_like_torch, stage, "bfloat16", offload, str(tmp_path))
    assert len(set(digests)) == 1


def test_an_added_fp32_group_trains_like_torch():
    digests = run_on_ranks(2, _trains_like_torch, 2, "float32", None, None)
    assert len(set(digests)) == 1


@pytest.mark.parametrize("stage", [1, 2])
def test_an_added_group_trains_with_deferred_gathers(stage):
    digests = run_on_ranks(2, _trains_like_torch, stage, "bfloat16", None, None, True)
    assert len(set(digests)) == 1


# -------------------------------------------------------------------------------------------------------- checkpoints
SAVE_WORLD, SAVE_STAGE = 2, 2


def _replay(kref, model, upto, world):
    """The kernel reference through the saved run: 2 steps, block 0 added with lr/10, steps 2 .. upto - 1."""
    for step in range(upto):
        if step == 2:
            kref.add_group(_block0(model), HYPER["lr"] / 10)
        kref.step(_world_batches(step, world))


def _save_run(rank, world, path):
    model, opt = _frozen_start(torch.bfloat16, SAVE_STAGE, rank, world)
    kref = KernelReference(torch.bfloat16)
    kref.add_group([n for n, p in model.named_parameters() if p.requires_grad], HYPER["lr"])
    for step in range(4):
        if step == 2:
            _unfreeze(model, opt)
            kref.add_group(_block0(model), HYPER["lr"] / 10)
        _train(model, opt, kref, step, rank, world)
    checkpoint.save(path, opt, extra={"step": 4})
    kref.check(opt, model)


def _load_run(rank, world, stage, offload, root, path):
    model, opt = _frozen_start(torch.bfloat16, stage, rank, world, offload, root, tag="load")
    before = state_shards(opt)
    # Without the group: refused on every rank, naming the group's parameters and telling what to do; nothing changed
    with pytest.raises(
        checkpoint.CheckpointError, match=r"param group\(s\) \[1\] \(parameters \['blocks\.0\.ln1\.weight'"
    ):
        checkpoint.load(path, opt)
    with pytest.raises(checkpoint.CheckpointError, match=r"opt\.add_param_group"):
        checkpoint.load(path, opt)
    assert all(torch.equal(a, b) for a, b in zip(before, state_shards(opt))) and opt.step_count == 0
    _unfreeze(model, opt)
    opt.param_groups[1]["lr"] = 1.0  # restored from the checkpoint
    assert checkpoint.load(path, opt) == {"step": 4}
    assert opt.param_groups[1]["lr"] == HYPER["lr"] / 10 and opt.step_count == 4
    kref = KernelReference(torch.bfloat16)
    kref.add_group([n for n, _ in model.named_parameters() if n not in _block0(model)], HYPER["lr"])
    _replay(kref, model, 4, SAVE_WORLD)
    with opt.gathered_params():
        kref.check(opt, model)  # right after load: bitwise the saved state, step counts included
    for step in range(4, 6):  # and on, at this world size, stage and offload
        _train(model, opt, kref, step, rank, world)
    with opt.gathered_params():
        kref.check(opt, model)
        return params_digest(model)


@pytest.fixture(scope="module")
def saved_with_group(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("ck") / "run")
    run_on_ranks(SAVE_WORLD, _save_run, path)
    return path


@pytest.mark.parametrize(("world", "stage", "offload"), [(1, 1, None), (3, 3, "cpu"), (2, 1, "nvme"), (3, 2, None)])
def test_a_checkpoint_carries_the_added_group(saved_with_group, tmp_path, world, stage, offload):
    digests = run_on_ranks(world, _load_run, stage, offload, str(tmp_path), saved_with_group)
    assert len(set(digests)) == 1


def _fewer_groups(rank, world, path):
    """A checkpoint saved before the group was added does not load into an optimizer that has it."""
    model, opt = _frozen_start(torch.bfloat16, 2, rank, world)
    checkpoint.save(path, opt)
    _unfreeze(model, opt)
    with pytest.raises(checkpoint.CheckpointError, match=r"its param group\(s\) \[1\] are not in the checkpoint"):
        checkpoint.load(path, opt)


def test_a_checkpoint_without_the_group_is_refused(tmp_path):
    run_on_ranks(2, _fewer_groups, str(tmp_path / "ck"))


def test_consolidate_includes_the_added_group(saved_with_group, tmp_path):
    from zero_ext.checkpoint.consolidate import adamw_state_dict

    checkpoint.consolidate(saved_with_group, tmp_path)
    sd = adamw_state_dict(tmp_path)
    assert len(sd["param_groups"]) == 2 and sd["param_groups"][1]["lr"] == HYPER["lr"] / 10
    block0 = sd["param_groups"][1]["params"]
    assert len(block0) == len(_block0(build())) and all(sd["state"][i]["step"].item() == 2 for i in block0)
    assert all(sd["state"][i]["step"].item() == 4 for i in sd["param_groups"][0]["params"])


def _local_state_dict(rank, world, stage):
    """opt.state_dict() after the group was added loads into an optimizer that added it too (same layout), every
    count included (those of parameters this rank owns nothing of too: rank 0's go into checkpoints)."""
    runs = []
    for _ in range(2):
        model, opt = _frozen_start(torch.bfloat16, stage, rank, world)
        kref = KernelReference(torch.bfloat16)
        kref.add_group([n for n, p in model.named_parameters() if p.requires_grad], HYPER["lr"])
        runs.append((model, opt, kref))
    (model, opt, kref), (model2, opt2, _) = runs
    for step in range(4):
        if step == 2:
            _unfreeze(model, opt)
            kref.add_group(_block0(model), HYPER["lr"] / 10)
        _train(model, opt, kref, step, rank, world)
    sd = opt.state_dict()
    with pytest.raises(ValueError, match=r"saved 2 param groups, this optimizer has 1; .*add_param_group"):
        opt2.load_state_dict(sd)
    _unfreeze(model2, opt2)
    opt2.load_state_dict(sd)
    assert _param_steps(opt2) == _param_steps(opt)
    for step in range(4, 6):
        for m, o in ((model, opt), (model2, opt2)):
            loss_fn(m, batch(step, rank)).backward()
            o.step()
            o.zero_grad()
    assert all(torch.equal(a, b) for a, b in zip(state_shards(opt), state_shards(opt2)))
    with opt.gathered_params(), opt2.gathered_params():
        assert params_digest(model) == params_digest(model2)


@pytest.mark.parametrize("stage", [1, 3])
def test_the_local_state_dict_carries_the_added_group(stage):
    run_on_ranks(3, _local_state_dict, stage)


# ------------------------------------------------------------------------------------------------------------- errors
def _refused_everywhere(opt, model, call, match):
    """``call`` raises ``match`` on this rank; nothing changed: param groups, shards, parameters."""
    groups, shards = [dict(g) for g in opt.param_groups], state_shards(opt)
    with opt.gathered_params():
        digest = params_digest(model)
    with pytest.raises(ValueError, match=match):
        call()
    assert [dict(g) for g in opt.param_groups] == groups
    assert all(torch.equal(a, b) for a, b in zip(shards, state_shards(opt)))
    with opt.gathered_params():
        assert params_digest(model) == digest


def _errors(rank, world, stage):
    model, opt = _frozen_start(torch.bfloat16, stage, rank, world)
    kref = KernelReference(torch.bfloat16)
    kref.add_group([n for n, p in model.named_parameters() if p.requires_grad], HYPER["lr"])
    _train(model, opt, kref, 0, rank, world)
    block = model.blocks[0]
    add = opt.add_param_group
    # block 0 still frozen: named
    _refused_everywhere(
        opt, model, lambda: add({"params": block.parameters()}), r"'blocks\.0\.ln1\.weight' has requires_grad=False"
    )
    block.requires_grad_(True)
    # a parameter already in a group, named with its group
    _refused_everywhere(
        opt, model, lambda: add({"params": [block.fc.weight, model.pos]}), r"'pos' is already in param group 0"
    )
    _refused_everywhere(opt, model, lambda: add({"params": [block.fc.weight, block.fc.weight]}), "listed twice")
    _refused_everywhere(opt, model, lambda: add({"params": []}), "has no parameters")
    _refused_everywhere(opt, model, lambda: add({"params": {block.fc.weight}}), "is a set")
    _refused_everywhere(opt, model, lambda: add({"params": [block.fc.weight * 2]}), "not a leaf")
    stray = torch.nn.Parameter(torch.zeros(3, dtype=torch.bfloat16))
    _refused_everywhere(opt, model, lambda: add({"params": [stray]}), "is not a parameter of `module`")
    double = torch.nn.Parameter(torch.zeros(3, dtype=torch.float64))
    _refused_everywhere(opt, model, lambda: add({"params": [double]}), "has dtype torch.float64")
    elsewhere = torch.nn.Parameter(torch.zeros(3, dtype=torch.bfloat16, device="meta"))
    _refused_everywhere(
        opt, model, lambda: add({"params": [elsewhere]}), "is on meta, the optimizer's parameters on cpu"
    )
    # any bad hyperparameter (torch's defaults fill the others)
    _refused_everywhere(opt, model, lambda: add({"params": block.parameters(), "lr": -1.0}), r"param group 1.*lr")
    _refused_everywhere(opt, model, lambda: add({"params": block.parameters(), "betas": (0.9, 1.5)}), "betas")
    _refused_everywhere(opt, model, lambda: add({"params": block.parameters(), "eps": -1.0}), "eps")
    if world > 1:
        # a group that differs between ranks, or is invalid on one rank only: every rank raises
        lr = HYPER["lr"] / (10 if rank == 0 else 20)
        _refused_everywhere(opt, model, lambda: add({"params": block.parameters(), "lr": lr}), "differs between ranks")
        params = list(block.parameters()) if rank == 0 else [*block.parameters(), model.pos]
        _refused_everywhere(
            opt, model, lambda: add({"params": params}), r"failed on rank\(s\) \[1, 2\]|already in param group 0"
        )
    if stage == 3:
        with opt.gathered_params():
            with pytest.raises(ValueError, match="while parameters are gathered"):
                add({"params": block.parameters()})
    assert len(opt.param_groups) == 1
    # then the valid group is added and trains on (nothing half-done before)
    add({"params": block.parameters(), "lr": HYPER["lr"] / 10})
    kref.add_group(_block0(model), HYPER["lr"] / 10)
    _train(model, opt, kref, 1, rank, world)
    with opt.gathered_params():
        kref.check(opt, model)


@pytest.mark.parametrize(("world", "stage"), [(1, 2), (3, 1), (3, 3)])
def test_errors_are_agreed_and_change_nothing(world, stage):
    run_on_ranks(world, _errors, stage)


# --------------------------------------------------------------------------------------------- when it is called
def _between_backward_and_step(rank, world, stage, grad_accum_dtype):
    """Added after backward, before step(): the gradients already reduced are applied by that step (the new
    parameters have none yet: they do not move, as with torch); stage 1's .grad stays what it was."""
    model, opt = _frozen_start(torch.bfloat16, stage, rank, world, grad_accum_dtype=grad_accum_dtype)
    kref = KernelReference(torch.bfloat16)
    kref.add_group([n for n, p in model.named_parameters() if p.requires_grad], HYPER["lr"])
    _train(model, opt, kref, 0, rank, world)
    loss_fn(model, batch(1, rank)).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9)  # placeholders with a (no-op) scaling recorded
    _unfreeze(model, opt)
    opt.step()
    opt.zero_grad()
    kref.step(_world_batches(1, world))
    kref.add_group(_block0(model), HYPER["lr"] / 10)
    _train(model, opt, kref, 2, rank, world)
    with opt.gathered_params():
        kref.check(opt, model)


@pytest.mark.parametrize(("stage", "grad_accum_dtype"), [(1, None), (1, torch.float32), (2, None), (3, None)])
def test_added_between_backward_and_step(stage, grad_accum_dtype):
    run_on_ranks(2, _between_backward_and_step, stage, grad_accum_dtype)


def test_the_added_group_launches_in_the_models_order():
    """Block 0's buckets launch after those of the parameters registered after it (block 1, ln_f: their gradients
    come first in backward); by their optimizer indices, the largest, they would launch first and hold back every
    other reduction until the end of backward."""
    model, opt = _frozen_start(torch.bfloat16, 2, 0, 1)
    _unfreeze(model, opt)
    order = sorted(opt.sharded_state.runtime.values(), key=lambda rt: rt.order)
    added = [k for k, rt in enumerate(order) if rt.group.group_index == 1]
    later = [k for k, rt in enumerate(order) if all(rt.group.names[i] not in ("embed.weight", "pos") for i in
             rt.bucket.slots) and rt.group.group_index == 0]  # fmt: skip
    assert added and later and max(later) < min(added)


def _clip_then_add(rank, world, stage, how):
    """A clipping recorded before the group is added (``opt.clip_grad_norm_``, or torch's function on the .grad
    placeholders) is applied by the step after it, as without the new group (which has no gradient yet)."""
    runs = []
    for adds in (True, False):
        model, opt = _frozen_start(torch.bfloat16, stage, rank, world)
        for step in range(2):
            loss_fn(model, batch(step, rank)).backward()
            if step == 1:
                if how == "opt":
                    norm = opt.clip_grad_norm_(0.05)
                else:
                    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
                assert norm > 0.1  # the clipping scales
                if adds:
                    _unfreeze(model, opt)
            opt.step()
            opt.zero_grad()
        runs.append((model, opt))
    (added, opt), (plain, opt_plain) = runs
    shards = state_shards(opt_plain)
    assert all(torch.equal(a, b) for a, b in zip(shards, state_shards(opt)[: len(shards)]))
    with opt.gathered_params(), opt_plain.gathered_params():
        assert params_digest(added) == params_digest(plain)  # block 0 unchanged: no gradient when it was added


@pytest.mark.parametrize(("stage", "how"), [(1, "opt"), (2, "opt"), (1, "torch"), (3, "torch")])
def test_a_clipping_recorded_before_adding_applies(stage, how):
    run_on_ranks(2, _clip_then_add, stage, how)
