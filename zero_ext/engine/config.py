"""Every keyword option of ZeroAdamW and ZeroMuon, declared once: its name, type, default and documentation, in the
public signature's order. The optimizers' constructors take them (:func:`option_parameters` is their signature's
keyword-only part, :func:`unknown_option` refuses any other keyword in Python's words), their docstrings list them
(:func:`options_doc`), and :meth:`EngineConfig.checked` checks them once, before anything is built or any rank is
waited for (a clear ValueError naming the option): the builder, ``add_param_group`` and the engine read the frozen
result, and nothing changes it afterwards."""

from __future__ import annotations

import inspect
import textwrap
from dataclasses import MISSING, Field, dataclass, field, fields
from typing import Any, Callable, Mapping, Optional

import torch
import torch.distributed as dist

from ..comm import Communicator
from ..comm.mesh import check_mesh
from ..placement.offload import check_offload_options
from ..update.adamw import check_flag, check_moment_dtype
from ..update.registry import DEFAULT_RULE
from .gather_units import check_gather_units
from .options import check_collective_timeout, check_options, check_process_group, check_stage3_options
from .stages import Stage, stage_for


def option(default: Any, doc: str) -> Any:
    """A public keyword option: its default and the text its docstring entry says."""
    return field(default=default, metadata={"doc": doc})


@dataclass(frozen=True)
class EngineConfig:
    """The options that shape the sharded state and its engine (ZeroAdamW's keywords, by the same names, in the
    signature's order), then what the optimizer class adds (its default update rule and the name messages give it)."""

    stage: int = option(
        2,
        "1 (shard optimizer state; a persistent flat grad buffer), 2 (also shard gradients; ``step()`` consumes "
        "them: the next backward starts from zero) or 3 (also shard the parameters: each rank keeps 1/N of "
        "them; a bucket is gathered just before a module that uses it runs and freed after; needs ``module=``). "
        "See :mod:`zero_ext.engine.param_gather`.",
    )
    process_group: Optional[dist.ProcessGroup] = option(
        None,
        "the data-parallel group (default: the world; a single process when torch.distributed is not initialised).",
    )
    bucket_size: Optional[int] = option(
        None,
        "elements per bucket. Default: the model in 8 buckets on NCCL, 4 on gloo (so that even a small model "
        "overlaps reduction with backward; gloo's per-collective cost is higher), clamped to [N * 2**14, "
        "max(2**22, N * 2**18)] (``planning.default_bucket_size``).",
    )
    reduce_dtype: torch.dtype = option(
        torch.float32,
        "dtype of the gradient mean: float32 (default; exact) or bfloat16/float16 (half the bytes on NCCL, "
        "low-precision sums). On gloo with float32, bf16/fp16 gradients travel in their own dtype and are "
        "summed in fp32 after the transfer (exact, half the bytes).",
    )
    grad_accum_dtype: Optional[torch.dtype] = option(
        None,
        "where stage 1 accumulates gradients between steps (``no_sync()`` micro-batches): None (default) in "
        "``param.grad``, in the param dtype, as torch does; ``torch.float32`` in an fp32 flat buffer "
        "(``param.grad`` is then freed as it arrives), as stage 2 accumulates in its fp32 grad shard, so that "
        "bf16 runs at both stages agree. Stages 2 and 3 always accumulate in fp32.",
    )
    max_grad_norm: Optional[float] = option(
        None,
        "clip the global gradient norm to this value (fused into the AdamW kernel); or call "
        ":meth:`clip_grad_norm_` before each ``step()``.",
    )
    module: Optional[torch.nn.Module] = option(
        None,
        "the model. Parameters are then named after it (its ``state_dict`` keys); a model wrapped in, or "
        "running inside, ``DistributedDataParallel`` is refused; checkpoints hold its whole state (frozen "
        "parameters, buffers, tied names), so a consolidated checkpoint loads with "
        "``load_state_dict(strict=True)``.",
    )
    sync_module_states: bool = option(
        True,
        "every rank starts from rank 0's values, as ``DistributedDataParallel`` does (True, the default): at "
        "construction rank 0 of the group broadcasts the parameters given (trainable and frozen) and, with "
        "``module=``, all of the model's parameters and buffers, before the shards and the fp32 master are "
        "built from them; so per-rank seeding (``torch.manual_seed(seed + rank)``) only varies the data. Each "
        "distinct tensor travels once (tied weights stay tied); ranks that already agree keep their bits. False "
        "skips the broadcast (every rank loaded the same weights). A model on the ``meta`` device "
        "(``param_init=``) is not broadcast: nothing is materialised yet, and its rule is identical seeds on "
        "every rank.",
    )
    reshard_after_forward: bool = option(
        True,
        "stage 3: free a gathered bucket after its last use in forward (True; backward gathers it again: 3 Psi "
        "communicated per step, less the ``prefetch + 1`` buckets backward needs first, which are kept) or keep "
        "it until its gradients are reduced (False: 2 Psi, every bucket gathered at the end of forward).",
    )
    prefetch: int = option(
        1,
        "stage 3: buckets gathered ahead of use, in the execution order of the previous step.",
    )
    gather_units: Any = option(
        "auto",
        "stage 3: which modules' forward hooks gather parameters (:mod:`zero_ext.engine.gather_units`). "
        '``"auto"`` (default): each parameterised element of an ``nn.ModuleList`` / ``ModuleDict`` / '
        "``Sequential`` (a transformer's blocks) gathers its whole subtree, and every other module owning "
        "parameters its own, so ``torch.compile(model)`` compiles each block as one graph (one graph break per "
        'block, in its caller); a tuple of module classes: their instances are the units; ``"modules"``: every '
        "module owning parameters (the finest window; torch.compile then breaks the graph at each).",
    )
    param_init: Optional[Callable[[torch.nn.Module], None]] = option(
        None,
        "stage 3, for a model built on the ``meta`` device (larger than one rank's memory): a function "
        "``init(module)`` that initialises one module's own parameters and buffers in place (like "
        "``reset_parameters``); only this rank's shard is ever materialised (see "
        ":mod:`zero_ext.construction.meta_init`). Seed torch identically on every rank first.",
    )
    param_device: Optional[torch.device] = option(
        None,
        "where a meta model's shards live (default: the current CUDA device, else the CPU).",
    )
    defer_all_gather_to: Optional[torch.nn.Module] = option(
        None,
        "the model, to let ``step()`` return without waiting for the parameter all-gather: forward hooks wait "
        "for each bucket just before it is used (implies ``module=``). Parameters read outside forward (an EMA "
        "update, logging) need ``finish_sync()`` first.",
    )
    staging_buffers: int = option(
        2,
        "initial size of the gradient staging pool (buckets in flight at once).",
    )
    communicator: Optional[Communicator] = option(
        None,
        "a :class:`zero_ext.comm.Communicator` to use instead of the one chosen from ``process_group`` (e.g. "
        "``NcclCommunicator`` on a one-rank group, to run the communicating path).",
    )
    mesh: Any = option(
        None,
        'beyond one node (HSDP): a 2-D ``torch.distributed.device_mesh.DeviceMesh`` with dims ``("replicate", '
        '"shard")`` (``init_device_mesh("cuda", (nodes, gpus_per_node), mesh_dim_names=("replicate", '
        '"shard"))``, FSDP2\'s convention), or ``"auto"`` (that mesh from torchrun\'s ``LOCAL_WORLD_SIZE``, said '
        "on rank 0). Gradients are reduce-scattered inside the node, then across nodes only ``1/S`` of them; "
        "parameters are gathered inside the node (stage 3's forward and backward never cross nodes); the "
        "optimizer state stays sharded over every rank. A 1-D mesh is its group (the default layout). See "
        "``docs/hsdp.md`` and :mod:`zero_ext.comm.hsdp`.",
    )
    replicate_state: bool = option(
        False,
        "with a 2-D ``mesh``: keep the optimizer state sharded over the node's ranks only and replicated across "
        "nodes (FSDP2's HSDP: the replicas all-reduce the reduced gradient shard, one collective latency fewer "
        "per bucket, ``R`` copies of master and moments). Default False: sharded over all ranks.",
    )
    inter_node_reduce_dtype: Optional[torch.dtype] = option(
        None,
        "with a 2-D ``mesh``: the node sums cross nodes as ``torch.bfloat16`` or as ``torch.int8`` blocks of 64 "
        "with an fp32 scale each, added in fp32 on arrival (the reduction inside the node stays fp32). Default "
        "None: fp32. Error model: ``docs/hsdp.md``, :mod:`zero_ext.comm.compress`.",
    )
    offload: Optional[str] = option(
        None,
        "where the optimizer state (the fp32 master and the moments) lives: None (default: on the params' "
        'device), ``"cpu"`` (host memory, pinned on CUDA, with the reduced-gradient shard; updated by the CPU '
        'kernel) or ``"nvme"`` (files in ``offload_dir``, streamed through ``offload_window`` bytes of host '
        "memory). Same results bit for bit as without; checkpoints cross freely. See "
        ":mod:`zero_ext.placement.offload`. The CPU update uses torch's intra-op threads: under torchrun set "
        "``OMP_NUM_THREADS`` to the cores per rank.",
    )
    offload_dir: Optional[str] = option(
        None,
        '``offload="nvme"``: a directory on a fast local disk, created with its parents when missing (each rank '
        "makes its own subdirectory, deleted by :meth:`close` or at exit; the files are working memory, not a "
        "checkpoint).",
    )
    offload_window: Optional[int] = option(
        None,
        '``offload="nvme"``: bytes of host memory per rank the state streams through (default '
        "``zero_ext.placement.offload.DEFAULT_WINDOW``, 128 MiB), split evenly between the flat groups; each "
        "share is at least one 4 KiB block per kind per slot, and a shard smaller than its share allocates only "
        "what it needs.",
    )
    param_remainders: bool = option(
        False,
        "bf16 parameters only: keep the fp32 master as the bf16 parameter itself (its high half) plus an int16 "
        "remainder (apex's ``store_param_remainders``), 2 bytes per owned element instead of 4. The master is "
        "exact and the parameter is its round to nearest even (:mod:`zero_ext.update.master_split`; the one bit "
        "a 16-bit remainder cannot hold, whether a tie was rounded down, is the sign bit of the second moment): "
        "training is bitwise the fp32 master's. State dicts and checkpoints hold the fp32 master and plain "
        "moments, so they load across the setting. At stage 3 without offload it saves nothing (the kept bf16 "
        "shard plus the remainder are the 4 bytes of the fp32 master, which is cast at each gather otherwise); "
        "with offload it saves 2 bytes per element of host memory. A parameter written in place between steps "
        "keeps its remainder: the master becomes the written value plus the old low bits (which still round to "
        "it), where the fp32 master would take the written value exactly.",
    )
    moment_dtype: torch.dtype = option(
        torch.float32,
        "the dtype AdamW's two moments (and amsgrad's running maximum) are stored in: ``torch.float32`` (the "
        "default; torch's moments to the bit) or ``torch.bfloat16`` (2 bytes each instead of 4; the update is "
        "the same fp32 arithmetic, the moments are stored with stochastic rounding whose random bits hash (a "
        "seed of the param group, the step, the element's index in the unsharded layout), so an element rounds "
        "alike at every stage, world size, bucket size and offload: those runs stay bitwise equal to each "
        "other, not to fp32 moments). State dicts and checkpoints hold fp32 moments (bf16 widens exactly; "
        "loading fp32 ones into bf16 rounds to nearest even), so either setting loads into the other. "
        "``torch.int8``: block-quantized 8-bit moments (the dynamic quantization of 8-bit Adam): one byte per "
        "element and one fp32 scale (the block's absmax) per 64 elements of a parameter, 1.0625 bytes each "
        "instead of 4; each step dequantizes, updates in fp32 and requantizes in one fused kernel. The blocks "
        "are the parameter's own 64-element blocks (int8 groups align parameters to 64 elements), so training "
        "is bitwise the same at every stage, world size, bucket size and offload. State dicts and checkpoints "
        "hold the dequantized fp32 moments; loading quantizes them (int8 -> int8 gives back the same codes).",
    )
    collective_timeout: Optional[float] = option(
        300.0,
        "seconds a collective of the engine may wait before the ranks compare, out of band (the process group's "
        "store), how far each got (default 300; None: never check). Ranks that stopped running the same modules "
        "(an evaluation or generation on one rank outside :meth:`gathered_params`, loops of different lengths, "
        "a rank skipping ``backward()`` or ``step()``) then raise "
        ":class:`zero_ext.comm.divergence.RanksDiverged` on every waiting rank, naming each rank's phase, "
        "module, bucket and step, instead of hanging; ranks that are merely slow keep waiting. A rank issuing "
        "no collective for twice this long while another waits is reported as diverged: 300 s (10 minutes in "
        "all, NCCL's own default timeout) leaves room for a long evaluation or checkpoint on one rank, and a "
        "hung job is explained within 5 minutes. Nothing is sent while collectives finish in time. See "
        ":mod:`zero_ext.comm.divergence`.",
    )
    default_rule: str = DEFAULT_RULE  # the update rule of a param group that names none (update.registry)
    name: str = "zero_ext.ZeroAdamW"  # the optimizer class, as every message names it

    @classmethod
    def checked(cls, defaults: Mapping[str, Any], **options) -> "EngineConfig":
        """The configuration of ``options``, every one checked (``defaults``: the param-group defaults, checked by the
        update rule); raises the first problem found, in the order the options are documented."""
        o = cls(**options)
        where = o.name
        check_offload_options(o.offload, o.offload_dir, o.offload_window, where)
        check_flag(where, "param_remainders", o.param_remainders)
        check_moment_dtype(where, o.moment_dtype)
        check_options(o.stage, defaults, o.max_grad_norm, o.bucket_size, o.staging_buffers, o.reduce_dtype,
                      o.grad_accum_dtype, o.default_rule, where)  # fmt: skip
        check_stage3_options(stage_for(o.stage), o.module, o.reshard_after_forward, o.prefetch, o.defer_all_gather_to,
                             where)  # fmt: skip
        check_gather_units(o.gather_units, where)
        check_process_group(o.process_group, o.communicator, where)
        check_mesh(o.mesh, o.process_group, o.communicator, o.replicate_state, where, o.inter_node_reduce_dtype)
        check_collective_timeout(o.collective_timeout, where)
        if o.defer_all_gather_to is not None and o.module is not None and o.defer_all_gather_to is not o.module:
            raise ValueError(f"{where}: `defer_all_gather_to` and `module` must be the same model")
        if o.module is None and o.defer_all_gather_to is not None:
            object.__setattr__(o, "module", o.defer_all_gather_to)  # (still being made: frozen from here on)
        return o

    @property
    def strategy(self) -> Stage:
        """The stage object: every stage-dependent choice of the builder and the engine."""
        return stage_for(self.stage)


# The public keyword options, in the signature's order (the fields with a documentation entry).
OPTIONS: tuple[Field, ...] = tuple(f for f in fields(EngineConfig) if "doc" in f.metadata)
OPTION_DEFAULTS: dict[str, Any] = {f.name: f.default for f in OPTIONS}
assert all(f.default is not MISSING for f in OPTIONS)


def option_parameters() -> list[inspect.Parameter]:
    """The options as the keyword-only parameters of a constructor's signature (name, default, annotation)."""
    return [inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=f.default, annotation=f.type)
            for f in OPTIONS]  # fmt: skip


def unknown_option(options: Mapping[str, Any], qualname: str) -> Optional[TypeError]:
    """Python's own error for the first keyword of ``options`` that is no option (``qualname``: the constructor's, as
    ``ZeroAdamW.__init__``), or None."""
    for name in options:
        if name not in OPTION_DEFAULTS:
            return TypeError(f"{qualname}() got an unexpected keyword argument {name!r}")
    return None


def options_doc(indent: str = "        ") -> str:
    """The options' entries of a Google-style ``Args:`` section (``name: text``, continuation lines indented)."""
    out = []
    for f in OPTIONS:
        text = textwrap.fill(f"{f.name}: {f.metadata['doc']}", 116 - len(indent), break_on_hyphens=False,
                             break_long_words=False, initial_indent="", subsequent_indent="    ")  # fmt: skip
        out.append(textwrap.indent(text, indent))
    return "\n".join(out)
