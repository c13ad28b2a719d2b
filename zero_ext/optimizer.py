"""ZeroAdamW: AdamW with its state, gradients and (stage 3) parameters sharded over data-parallel ranks; the state
optionally in host memory or on disk (ZeRO-Offload / ZeRO-Infinity)."""

from __future__ import annotations

import contextlib
import inspect
import warnings
import weakref
from typing import Any, Callable, Iterable, Optional

import torch
from torch.utils.weak import WeakIdKeyDictionary

from . import memory
from .checkpoint.local_state_dict import load_local_state_dict, local_state_dict
from .construction.group_adder import GroupAdder
from .construction.meta_init import initialise_shards
from .construction.state_builder import StateBuilder
from .engine.config import OPTION_DEFAULTS, EngineConfig, option_parameters, options_doc, unknown_option
from .engine.engine import Engine
from .engine.runtime import BucketRuntimes
from .engine.sleep import Sleep, check_flag, check_include
from .placement.offload import warn_if_one_thread
from .state.sharded_state import ShardedState
from .torch_compat import no_copy
from .torch_compat.adamw_arguments import check_adamw_arguments
from .torch_compat.duplicates import dedupe_new_group, drop_duplicates
from .torch_compat.failed_construction import tell_other_ranks
from .torch_compat.param_ids import split_user_state, to_positions, to_torch_ids
from .torch_compat.state_dict_hooks import hooked_load_state_dict, hooked_state_dict
from .torch_compat.state_view import StateAttribute
from .update.registry import rule_for_group


def _cuda_graph_capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def document_options(cls: type) -> type:
    """``cls``'s docstring lists every keyword option in place of its ``<options>`` line (the text of their
    declaration, :mod:`zero_ext.engine.config`, in the signature's order)."""
    cls.__doc__ = cls.__doc__.replace("        <options>\n", options_doc() + "\n")
    return cls


def _declared_options(cls: type) -> type:
    """``cls`` documents the keyword options and its constructor's signature shows them keyword-only, with their
    defaults, after its own parameters (it takes them as ``**options``)."""
    init = cls.__init__
    own = [p for p in inspect.signature(init).parameters.values() if p.kind is not inspect.Parameter.VAR_KEYWORD]
    init.__signature__ = inspect.Signature(own + option_parameters())
    return document_options(cls)


@_declared_options
class ZeroAdamW(torch.optim.Optimizer):
    """AdamW whose optimizer state (and, in stage 2, gradients) is sharded across data-parallel ranks.

    Replaces ``DDP(model)`` + ``torch.optim.AdamW``: the optimizer owns gradient reduction. After
    ``loss.backward()`` on every rank and ``step()``, every rank holds the parameters ``torch.optim.AdamW``
    would produce on an fp32 master copy from the mean of the ranks' gradients, rounded to the param dtype.

    Args:
        params: parameters, ``(name, parameter)`` pairs (``model.named_parameters()``: names then appear in
            checkpoints), or param-group dicts with per-group ``lr``, ``betas``, ``eps``, ``weight_decay``,
            ``amsgrad``, ``maximize``. A param group may name another registered update rule with ``"rule"``
            (:mod:`zero_ext.update.registry`; its own hyperparameters in the group); the others are AdamW's.
            Params may be fp32 (their own master copy), bf16 or fp16; all on one device. Params with
            ``requires_grad=False`` are left alone; one made trainable later makes ``step()`` raise (it has no
            shard). To unfreeze gradually, leave frozen parameters out and add them with :meth:`add_param_group`.
        lr, betas, eps, weight_decay, amsgrad, maximize: ``torch.optim.AdamW``'s, with its meaning (the update
            rule, :mod:`zero_ext.update.adamw`: torch's operation order, its moments to the bit). ``amsgrad`` keeps a
            fourth fp32 kind of state (torch's running maximum of the second moment) and is fixed per param group at
            construction; ``maximize`` may change between steps.
        foreach, capturable, differentiable, fused: ``torch.optim.AdamW``'s implementation selectors, accepted so
            that ``ZeroAdamW(**adamw_kwargs)`` works and kept in the param groups; the update is always one fused
            kernel. ``differentiable=True`` is refused (the step is not an autograd graph).
        <options>

    The sharded state (flat groups, shards, counters) is :attr:`sharded_state`, the seam that
    :mod:`zero_ext.checkpoint`, :mod:`zero_ext.checkpoint.local_state_dict` and :mod:`zero_ext.memory` read.
    """

    # torch.amp.GradScaler then hands itself to step() instead of unscaling .grad and skipping step() on the ranks
    # that found an inf (at stage 1 a rank skipping alone would leave the others waiting in step's collectives; at
    # stages 2 and 3 .grad is empty and the scaler fails with "No inf checks were recorded"): step() refuses it.
    _step_supports_amp_scaling = True

    default_rule = "adamw"  # the update rule of a param group without "rule" (zero_ext.update.registry)

    def __init__(
        self,
        params: Iterable,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        amsgrad: bool = False,
        *,
        maximize: bool = False,
        foreach: Optional[bool] = None,
        capturable: bool = False,
        differentiable: bool = False,
        fused: Optional[bool] = None,
        **options: Any,
    ):
        # decoupled_weight_decay: in torch.optim.AdamW's groups, always True (False, Adam's L2 decay, is refused)
        defaults = dict(lr=lr, betas=tuple(betas) if isinstance(betas, (tuple, list)) else betas, eps=eps,
                        weight_decay=weight_decay, amsgrad=amsgrad, maximize=maximize, foreach=foreach,
                        capturable=capturable, differentiable=differentiable, fused=fused,
                        decoupled_weight_decay=True)  # fmt: skip

        def check_arguments() -> None:  # torch.optim.AdamW's checks and words first
            check_adamw_arguments(lr, betas, eps, weight_decay, foreach=foreach, capturable=capturable,
                                  differentiable=differentiable, fused=fused)  # fmt: skip

        self._construct(params, defaults, check_arguments, options)

    @classmethod
    def _name(cls) -> str:
        """How messages name this optimizer: ``zero_ext.ZeroAdamW``, ``zero_ext.ZeroMuon``."""
        return f"zero_ext.{cls.__name__}"

    def _construct(self, params: Iterable, defaults: dict, check_arguments: Callable[[], None], given: dict) -> None:
        """Construction after the rule's defaults are known (ZeroAdamW's, or a subclass's: ``zero_ext.ZeroMuon``):
        ``check_arguments`` raises for the rule's bad arguments; ``given``: the keyword options passed (the others
        take their declared defaults, :mod:`zero_ext.engine.config`)."""
        unknown = unknown_option(given, f"{type(self).__name__}.__init__")
        if unknown is not None:
            raise unknown
        options = {**OPTION_DEFAULTS, **given}
        stage, process_group, communicator = options["stage"], options["process_group"], options["communicator"]
        collective_timeout, module = options["collective_timeout"], options["module"]
        # 1. every argument checked, before anything is built; one that fails on some ranks only fails every rank
        # (torch_compat/failed_construction.py)
        try:
            check_arguments()
            config = EngineConfig.checked(defaults, default_rule=self.default_rule, name=self._name(), **options)
            module = config.module
            # 2. torch's param groups (each group's hyperparameters checked as it is added)
            self._constructing = True
            super().__init__(params, defaults)
            self._constructing = False
        except (TypeError, ValueError, RuntimeError):
            tell_other_ranks(process_group, communicator, collective_timeout)
            raise
        max_grad_norm, reduce_dtype, offload = options["max_grad_norm"], options["reduce_dtype"], options["offload"]
        param_init = options["param_init"]
        self.stage, self.max_grad_norm, self.reduce_dtype, self.offload = stage, max_grad_norm, reduce_dtype, offload
        # 3. every rank plans its flat groups and agrees on them (collective; a failure anywhere fails every rank)
        builder = StateBuilder(self.param_groups, config)
        self.bucket_size = builder.bucket_size
        # 4. the sharded state: parameters re-pointed into flat buffers, optimizer state allocated
        _take_over(builder.trainable, self)
        state = builder.build()
        warn_if_one_thread(offload)
        # 5. the engine around it (gradient reduction, parameter gathers, the step; the divergence watch)
        self._config, self._offload_directory = config, builder.directory  # (add_param_group builds more groups)
        self._engine = Engine(config, state)
        if builder.on_meta:
            initialise_shards(state, module, param_init, builder.device)
        # 6. hooks on the model, and the parameters registered as this optimizer's
        self._engine.attach()
        _own(builder.trainable, self)

    def close(self) -> None:
        """Detach from the model: finish the communication in flight and remove every hook this optimizer put on
        the parameters and the model. A ZeroAdamW built later over the same parameters closes this one itself.
        A closed optimizer cannot step."""
        if self._closed:
            return
        self.reload_states()  # (offloaded: the model gets its parameters back first)
        self._engine.close()

    @property
    def _closed(self) -> bool:
        engine = self.__dict__.get("_engine")  # (None: construction failed before the engine was built)
        return engine is None or engine.closed

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(
                f"{self._name()}: this optimizer was closed (close(), or a newer {type(self).__name__} took over its "
                "parameters); use the newer one"
            )

    # ------------------------------------------------------------------ construction
    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a param group, as torch does (its missing hyperparameters are the optimizer's defaults): a new flat
        group of its parameters, sharded and stepped like the others from the next ``step()`` (their step counts
        start at 0), and in checkpoints from then on (:mod:`zero_ext.construction.group_adder`). Collective: every
        rank adds the same group, between steps (not inside forward, backward or ``gathered_params()``); a group that
        is invalid on some rank or differs between ranks raises on every rank, nothing changed. The way to unfreeze:
        build the optimizer from the trainable parameters only, then ``p.requires_grad_(True)`` for a block and
        ``opt.add_param_group({"params": block.parameters(), "lr": lr / 10})`` on every rank."""
        if getattr(self, "_constructing", False):
            super().add_param_group(param_group)  # (torch's warning for a parameter listed twice)
            g = self.param_groups[-1]
            drop_duplicates(g)  # one entry per parameter (torch.optim would update it once per entry)
            where = f"{self._name()}: param group {len(self.param_groups) - 1}"
            rule_for_group(torch.float32, g, default=self.default_rule).check_group(where, g)
            return
        self._check_open()
        self._engine.refuse_if_asleep("add_param_group()")
        dedupe_new_group(param_group, stacklevel=2)
        self.finish_sync()
        # collective; raises on every rank
        adder = GroupAdder(self, self.sharded_state, self._config, param_group, self._engine.busy())
        added = adder.build(self._offload_directory)
        self._engine.extend(added, adder.names)
        _own([p for _, p in adder.members], self)
        self.param_groups.append(adder.group)

    @property
    def bucket_runtimes(self) -> BucketRuntimes:
        """The engine's in-flight state (:mod:`zero_ext.engine.runtime`): every bucket's runtime (its gradient and
        parameter phases) and the gradient staging pool. Extended in place by :meth:`add_param_group`; read, never
        assign."""
        return self._engine.runtimes

    @property
    def sharded_state(self) -> ShardedState:
        """This rank's sharded state: flat groups, shards, counters and the communicator (data only:
        :mod:`zero_ext.state.sharded_state`).
        Call :meth:`finish_sync` before reading its buffers."""
        return self._engine.state

    # ------------------------------------------------------------------ training
    @contextlib.contextmanager
    def no_sync(self):
        """Accumulate gradients over micro-batches without reducing them (like ``DDP.no_sync``).

        Stage 1 skips communication inside the context and accumulates in ``param.grad`` (the param dtype); the
        first backward after it (or ``step()``) reduces the accumulated sum. Stage 2 has no full-size buffer to
        accumulate in, so it still reduces every backward pass and accumulates the means in the fp32 grad shard.
        On a 2-D ``mesh`` stages 2 and 3 reduce inside the node only and hold the node's sums (1/S of the gradients,
        in ``reduce_dtype``); they cross nodes once, with the first backward after the context (or at ``step()``).
        """
        with self._engine.no_sync():
            yield

    def finish_sync(self) -> None:
        """Finish every gradient reduction and parameter gather in flight (the current stream waits for them; no
        host synchronisation on CUDA). Needed before reading parameters outside forward when
        ``defer_all_gather_to`` is set, or the shards of :attr:`sharded_state`. At stages 1 and 2 this rank's fp32
        master then follows parameters changed in place since the last step (:mod:`zero_ext.state.param_edits`)."""
        self._engine.refuse_if_asleep("finish_sync() (or what calls it: state_dict(), opt.state, ...)")
        self._engine.finish_sync()

    @contextlib.contextmanager
    def gathered_params(self, modifier_rank: Optional[int] = None):
        """Full parameters on every rank inside the context, at any stage (collective: every rank enters it).

        At stage 3 every bucket is gathered for the duration (the whole model in memory); at stages 1 and 2 the
        parameters are full anyway. A forward inside issues no collective (at stage 3 nor does it change the gather
        schedule; a backward through it raises), so one rank may evaluate or generate alone:
        ``with opt.gathered_params(): if rank == 0: evaluate()``. For reading (evaluation, export, logging) or, with
        ``modifier_rank``, for editing: on exit that rank's parameters are copied to every rank and written back to
        the shards; the fp32 master follows every element whose value changed (unchanged ones keep their fp32
        bits)."""
        self._check_open()
        self._engine.refuse_if_asleep("gathered_params()")
        world = self.sharded_state.comm.process_count  # a rank of the job (on a mesh, not the layout's)
        if modifier_rank is not None and not (isinstance(modifier_rank, int) and 0 <= modifier_rank < world):
            raise ValueError(f"{self._name()}.gathered_params: `modifier_rank` must be a rank in [0, {world}), "
                             f"got {modifier_rank!r}")  # fmt: skip
        self.finish_sync()
        with self._engine.gathered(modifier_rank):
            yield

    def wait_for_params(self) -> None:
        """Make the current stream wait for every parameter all-gather still in flight (``defer_all_gather_to``)."""
        self._engine.settle()

    @torch.no_grad()
    @torch.compiler.disable
    def step(self, closure=None, grad_scaler=None):
        """One AdamW step on the mean of the ranks' gradients, with torch's semantics: a parameter with no gradient
        on any rank is left alone (no decay, no moment update, its own step count unchanged); a step with no
        gradient at all does nothing. A ``.grad`` assigned by hand (``p.grad = g``, with or without a backward) is
        applied as torch applies it, as the mean over the ranks like any gradient: assign it on every rank (a rank
        that assigns none for that parameter counts as zero, as a rank whose backward gave it none); the tensor stays
        ``.grad``, unwritten, until ``zero_grad()`` (:mod:`zero_ext.engine.reducer`). Every rank fails together: a check that fails on one rank (e.g. a bad ``lr``)
        raises on every rank before anything changes anywhere (see :mod:`zero_ext.engine.step`). ``grad_scaler`` is what
        ``torch.amp.GradScaler.step`` passes: fp16 loss scaling is not supported (bf16 needs none), so it raises."""
        self._check_open()
        self._engine.refuse_step_if_asleep("step()", is_step=True)  # offload_states(): every rank raises
        if grad_scaler is not None:
            raise ValueError(
                f"{self._name()}.step: torch.amp.GradScaler (fp16 loss scaling) is not supported; train with bf16 "
                "parameters or autocast(dtype=torch.bfloat16), which need no loss scaling (a non-finite gradient "
                "still skips the step on every rank, see opt.skipped_steps). Nothing was changed"
            )
        if _cuda_graph_capturing():
            raise RuntimeError(
                f"{self._name()}.step() cannot be captured in a CUDA graph: it issues collectives on side streams "
                "and keeps host-side bookkeeping. Capture the forward/backward only and call step() outside the graph."
            )
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._engine.step(self.param_groups)
        return loss

    @torch.no_grad()
    @torch.compiler.disable
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip the gradients about to be applied to a global L2 norm of ``max_norm`` and return their norm before
        clipping, as ``torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)`` would (a 0-d tensor on the
        device; no host sync). The scaling happens inside the next ``step()``'s fused kernel; the gradients
        themselves (sharded, not in ``.grad``) are not rewritten. Collective: call it on every rank, after
        backward, before ``step()``. ``torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)`` works too, at
        every stage (also collective): after a synchronised backward each ``.grad`` is a placeholder of the sharded
        mean gradient whose norm and in-place scaling the engine implements (:mod:`zero_ext.engine.grad_placeholders`)."""
        self._check_open()
        self._engine.refuse_step_if_asleep("clip_grad_norm_()", is_step=False)
        if norm_type != 2.0:
            raise ValueError(f"{self._name()}.clip_grad_norm_: only `norm_type=2.0` is supported, got {norm_type!r}")
        if not (isinstance(max_norm, (int, float)) and max_norm > 0):
            raise ValueError(f"{self._name()}.clip_grad_norm_: `max_norm` must be a number > 0, got {max_norm!r}")
        return self._engine.clip_grad_norm_(self.param_groups, max_norm)

    clip_grad_norm = clip_grad_norm_  # the name trainers look for on sharded optimizers

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero the gradients, like torch: with ``set_to_none`` (the default) every ``param.grad`` becomes None;
        stage 1's next gradient is then copied into the parameter's slot of the flat grad buffer (no pass over
        the whole buffer now, no read-add-write later) and ``param.grad`` points at that slot again. Without
        it stage 1 zeroes the buffer in place and ``param.grad`` stays a view of it. Stage 2's ``param.grad``
        is None (after a backward pass: a placeholder, see :meth:`clip_grad_norm_`); its gradients live in the
        fp32 grad shard, which ``step()`` already consumed (zeroed); ``zero_grad()`` zeroes it too (gradients
        accumulated since the last step are dropped; with ``set_to_none=False`` their parameters keep a zero
        gradient, which the next ``step()`` applies as torch does: decay and moments move). ``model.zero_grad()``
        or ``p.grad = None`` between backward and ``step()`` drops those gradients at every stage, as in torch."""
        self._check_open()
        self._engine.refuse_if_asleep("zero_grad()")
        self._engine.zero_grad(set_to_none)

    # ------------------------------------------------------------------ introspection
    @property
    def grad_norm(self) -> Optional[torch.Tensor]:
        """The global gradient norm (before clipping) of the last ``step()``, as a 0-d tensor on the device."""
        return self._engine.grad_norm

    @property
    def skipped_steps(self) -> int:
        """How many steps were skipped because a gradient was inf or nan (reading it synchronises)."""
        return int(self.sharded_state.skipped.item())

    @property
    def step_count(self) -> int:
        """Updates applied so far (skipped steps excluded; reading it synchronises)."""
        return int(self.sharded_state.step_count.item())

    def comm_stats(self) -> dict[str, int]:
        """Elements and bytes this rank has passed to each collective since construction (one rank
        communicates nothing: its gradients go straight to the grad shard and its all-gather is in place):
        ``{kind}_elements`` and ``{kind}_bytes`` for ``reduce_scatter``, ``all_gather``, ``all_reduce``; and the wire
        bytes this rank sent by link, ``{kind}_intra_node_bytes`` / ``{kind}_inter_node_bytes`` with the totals
        ``intra_node_bytes`` and ``inter_node_bytes`` (a ring's ``(g-1)/g`` of each buffer, twice for an all-reduce;
        a group counts as inter-node when it spans nodes: a mesh's replicate group, or a 1-D group larger than
        torchrun's ``LOCAL_WORLD_SIZE``; a mesh's reduce-scatter over every rank counts its part to peers in the
        rank's own node as intra-node). See ``docs/hsdp.md``."""
        return self.sharded_state.comm.counts.as_dict()

    def memory_report(self) -> memory.MemoryReport:
        """Every persistent byte on this rank by kind; see :class:`zero_ext.memory.MemoryReport`."""
        engine = self._engine
        mesh = self.sharded_state.mesh  # a 2-D mesh's (R, S), or None for the 1-D layout
        out = memory.report(
            self.sharded_state, staging=engine.staging, window=engine.gather_window(),
            mesh=mesh.shape if mesh.replicate is not None else None, replicate_state=mesh.replicate_state,
        )  # fmt: skip
        out.optimizer = type(self).__name__
        return out

    # ------------------------------------------------------------------ RL colocation: sleep and wake
    @property
    def _sleep(self) -> Sleep:
        sleep = self.__dict__.get("_sleep_state")
        if sleep is None:
            sleep = self.__dict__["_sleep_state"] = Sleep(self._engine)
        return sleep

    def offload_states(self, include=None, pin_memory: bool = True, non_blocking: bool = False) -> None:
        """Move what the optimizer owns on the device to host memory and give the memory back (DeepSpeed's
        ``engine.offload_states``), for an inference engine sharing the GPU between training phases. Local (no
        collective; call it on every rank), idempotent (twice is once), between steps (not inside forward, backward
        or ``gathered_params()``).

        ``include``: None (everything) or group names (:mod:`zero_ext.engine.sleep`): ``"optim_states"`` (master,
        moments, every kind of state), ``"grads"`` (grad shard, stage 1's gradient buffer, staging pool, landing
        ring), ``"params"`` (the flat parameter buffer; stage 3: the shards). State that ``offload="cpu"`` / ``"nvme"``
        keeps in host memory or on disk stays where it is. Host buffers are made at the first call (pinned on CUDA
        with ``pin_memory``) and reused by every later one. On CUDA the freed blocks are returned to the driver
        with ``torch.cuda.empty_cache()`` before the call returns, so ``torch.cuda.memory_allocated()`` and
        ``memory_reserved()`` both drop and another process can allocate them; ``non_blocking=True`` queues the
        copies on a side stream and returns (the blocks are not reused before the copies read them; the cache is then
        emptied by a later blocking call or your own ``torch.cuda.empty_cache()``). On a CPU-only run the "device" is
        host memory too: the optimizer's buffers are freed (their storages hold 0 bytes) and the values kept in
        separate host buffers, with the same rules.

        Until :meth:`reload_states`, ``step()`` and everything else that would read a parked byte raises naming
        ``reload_states()``; ``.grad`` is None; stages 1-2 parameters read their host copy (a forward with
        ``module=`` raises); :meth:`named_full_params` works."""
        self._check_open()
        groups = check_include(include, self._name())
        pin = check_flag("offload_states", "pin_memory", pin_memory, self._name())
        nb = check_flag("offload_states", "non_blocking", non_blocking, self._name())
        self._sleep.offload(groups, pin, nb)

    def reload_states(self, non_blocking: bool = False) -> None:
        """Bring back everything :meth:`offload_states` moved, bit for bit (DeepSpeed's ``engine.reload_states``);
        local, idempotent. ``non_blocking=True``: the host-to-device copies are queued on a side stream that the
        current stream waits for, so work queued after the call reads the reloaded values (no host wait)."""
        nb = check_flag("reload_states", "non_blocking", non_blocking, self._name())
        sleep = self.__dict__.get("_sleep_state")
        if sleep is not None:
            sleep.reload(nb)

    def states_device(self) -> dict[str, str]:
        """Where each group of :meth:`offload_states` is now: ``{"optim_states": ..., "grads": ..., "params": ...}``,
        each ``"device"`` (some byte on the parameters' device), ``"host"`` or ``"disk"``."""
        return self._sleep.where()

    def named_full_params(self, module: Optional[torch.nn.Module] = None, *, buffers: bool = False):
        """Yield ``(name, tensor)`` for every parameter of the model, whole, in its dtype, under every name
        ``model.state_dict()`` gives it (names from ``module=`` at construction, or from ``module`` here; without
        either, the optimizer's own names), streamed bucket by bucket: what vLLM's ``model.load_weights()`` takes.
        ``buffers=True`` adds the persistent buffers (the whole ``state_dict``). Works while offloaded; never changes
        training. Stages 1-2: views of the parameters (read them, do not write them). Stage 3: collective, every rank
        iterates to the end; one bucket (or one split parameter) gathered at a time beyond what the caller holds.
        See :mod:`zero_ext.engine.full_params`."""
        self._check_open()
        if module is not None and not isinstance(module, torch.nn.Module):
            raise TypeError(
                f"{self._name()}.named_full_params: `module` must be a torch.nn.Module, got {type(module).__name__}"
            )
        check_flag("named_full_params", "buffers", buffers, self._name())
        return self._engine.named_full_params(module, buffers)

    # ------------------------------------------------------------------ state
    # opt.state[p]: this rank's piece of p's state, read-only (zero_ext.torch_compat.state_view)
    state = StateAttribute()
    # a copy would share the model's hooks, the flat buffers and the process group, or lack them: refused
    __deepcopy__, __copy__ = no_copy.deepcopy_refused, no_copy.copy_refused
    __getstate__, __reduce_ex__ = no_copy.getstate_refused, no_copy.reduce_refused

    def state_dict(self) -> dict[str, Any]:
        """This rank's shard in torch.optim's format (:mod:`zero_ext.checkpoint.local_state_dict`; parameter ids by
        identity, as torch numbers them: :mod:`zero_ext.torch_compat.param_ids`), with torch's state-dict pre and
        post hooks run around it (:mod:`zero_ext.torch_compat.state_dict_hooks`); ``opt.state``'s keys that are
        not parameters are in its ``"state"`` as they are."""

        def make() -> dict[str, Any]:
            self.finish_sync()
            sd = to_torch_ids(local_state_dict(self.sharded_state, self.param_groups), self.param_groups)
            sd["state"].update(self.state.user_entries())  # keys that are not parameters, as torch keeps them
            return sd

        return hooked_state_dict(self, make)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a dict from :meth:`state_dict` saved by the same rank of the same layout (use
        ``zero_ext.checkpoint`` to load at another world size). Collective: every rank must call it; a dict that
        fails to load on any rank (a load pre hook raising included) changes nothing on any rank. The saved param
        groups replace the optimizer's as in torch (``param_names`` kept when the dict has none); torch's load pre
        and post hooks run around it."""

        def load(sd: Any, failed: Optional[BaseException]) -> None:
            self.finish_sync()
            sd, user = split_user_state(sd)  # keys that are no parameter's: opt.state's own, as torch loads them
            sd = to_positions(sd, self.param_groups)
            load_local_state_dict(self.sharded_state, self.param_groups, sd, failed)
            self.state.load_user_entries(user)

        hooked_load_state_dict(self, state_dict, load)


# parameter -> a weak reference to the optimizer that trains it, by identity (a weak key: a parameter dropped by the
# model takes its entry with it); nothing is stamped on the parameter
_OWNERS: "WeakIdKeyDictionary" = WeakIdKeyDictionary()


def _own(params: Iterable[torch.Tensor], optimizer: "ZeroAdamW") -> None:
    for p in params:
        _OWNERS[p] = weakref.ref(optimizer)


def _take_over(params, new: "ZeroAdamW") -> None:
    """Close any earlier, still open ZeroAdamW over these parameters (re-running a cell that builds the optimizer
    would otherwise leave two sets of hooks reducing every gradient twice)."""
    earlier = []
    for p in params:
        ref = _OWNERS.get(p)
        old = ref() if ref is not None else None
        if old is not None and old is not new and not old._closed and old not in earlier:
            earlier.append(old)
    for old in earlier:
        warnings.warn(
            f"{new._name()}: these parameters belonged to an earlier {type(old).__name__}, which is now closed (its "
            "hooks removed); use the new optimizer",
            stacklevel=3,
        )
        old.close()
