"""Engine: what `fxspeed.compile` returns, for every mode.

The engine owns the model's live tensors, the optimizer, the loss scaler and the compiled
programs, and interprets them; the compiler (injected by `fxspeed.compile`, so the runtime
never imports the compiler or the passes) decides everything else. Two program shapes:

    one stage   (Config.pipeline == 1)  the joint step graph, rewritten for data parallelism
                and ZeRO inside the graph; a step runs it once per Config.grad_accum slice
    pipeline    (Config.pipeline > 1)   per stage: forward, backward (or backward_input +
                backward_weight) programs; a step runs this rank's action list (F, B, I, W,
                SEND/RECV, REDUCE, STEP) with runtime/runner.py

Everything around the programs is shared: binding of graph inputs, the optimizer over this
rank's tensors (FlatParameters for ZeRO-1/2/3 over the mesh's dp group), fp16 unscale and skip,
clipping by the global norm, the lr schedule, state_dict / save / load (through
runtime/checkpoint.py: one format that reshards across meshes), export.

Ranks come from the mesh (fxspeed/mesh.py): rank g = (dp_index * pp + position) * tp + tp_index.
Under a pipeline every rank of one pipeline passes the same batch (its replica's batch).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import numbers
import os
import time
import weakref
from typing import Any, Callable, Iterator, Protocol, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.utils._pytree as pytree

from fxspeed.config import Config
from fxspeed.devices import DeviceSpec
from fxspeed.errors import ConfigError, FxspeedError, short_repr
from fxspeed.global_state import refuse_autocast
from fxspeed.ir import Bucket, IOSpec, Program, StepSignature
from fxspeed.ir.program import graphs_draw_random
from fxspeed.ir.batch import (batch_digest, describe_input_key, input_key, key_change, split_batch, split_inputs,
                              tensor_leaves)
from fxspeed.ir.schedule import GATHER, B, F, I, RECV_B, RECV_F, SEND_F, STEP, W, Action, Schedule
from fxspeed.mesh import (Mesh, check_agreement, check_same_everywhere, check_same_in_replica, check_same_model,
                          broadcast_into, module_generators, own_stream, share_generators, start_alike,
                          comm_device, expect_all_ranks, fingerprint, note_failure_for_peers, peers_gone)
from fxspeed.planner import costs_reader, finish_plan
from fxspeed.planner.estimate import offload_chunk_bytes, staging_on_device, warn_over_budget
from fxspeed.planner.plan import Plan
from fxspeed.runtime.deferred_init import DeferredInit
from fxspeed.runtime.executor import StepExecutor
from fxspeed.runtime.flat_parameters import FlatParameters, gather_into
from fxspeed.runtime.host_memory import release_freed_host_memory
from fxspeed.runtime.host_tier import DeviceLink, host_tier_on_cpu
from fxspeed.runtime.kernels.collectives import exchange_scatter
from fxspeed.runtime.loss_scale import DynamicLossScaler
from fxspeed.runtime.module_state_dict import (extra_states, is_loadable, loads_through_module, persistent_buffers,
                                               pointing_at, run_load_post_hooks, set_extra_states)
from fxspeed.runtime.offloaded_optimizer import OffloadedAdam
from fxspeed.runtime.offloaded_activations import ActivationOffload
from fxspeed.runtime.offloaded_activations import register as register_activations
from fxspeed.runtime.offloaded_parameters import register
from fxspeed.runtime.python_state import ModuleState, function_scalars, warn_python_state_changed
from fxspeed.runtime.optimizer import OptimizerSpec, WeightDecay, build_optimizer, lr_lambda, undecayed_parameters
from fxspeed.runtime.runner import PipelineRuntime
from fxspeed.runtime.step_in_backward import InBackwardSteps, in_layout_of
from fxspeed.runtime.step_in_backward import register as register_steps
from fxspeed.planner.placement import TP_PLAN_NOTE
from fxspeed.runtime.tensor_parallel import TensorParallelParameters

log = logging.getLogger("fxspeed")
RETRACE_WARN_AFTER = 8
_c10d = torch.ops._c10d_functional


class CompilerLike(Protocol):
    """What the engine needs from fxspeed.compiler.Compiler."""

    options: Any  # this rank's PassOptions (the engine reads parameter_store)

    def step(self, model: nn.Module, args: tuple, kwargs: dict, *, train: bool, analyze: Any = None,
             grad_accum_role: str = "whole", bucket_layout: Sequence[Sequence[str]] = ()) -> Any: ...

    def program(self, model: nn.Module, micro_args: tuple, micro_kwargs: dict, *, train: bool,
                positions: Sequence[int] = (), split_points: Sequence[str] | None = None,
                analyze: Any = None) -> Any: ...

    def inference(self, model: nn.Module, tokens: int, copies: str = "packed") -> Any: ...  # an InferenceProgram (fxspeed.serve)


class _WaitForGathers:
    """The module's forward pre-hook (and state_dict pre-hook) under ZeRO-1/2 on several ranks:
    engine.synchronize() first. It holds the engine weakly (the module must not keep a dropped
    engine, and its gathers, alive) and pickles as a no-op, so `torch.save(model)` still works."""

    def __init__(self, engine: "Engine", state_dict: bool = False) -> None:
        self._engine: Callable[[], Engine | None] = weakref.ref(engine)
        self._state_dict = state_dict

    def __call__(self, module: nn.Module, *args: Any) -> None:
        if self._state_dict and args[-1]:  # keep_vars=True: the engine's own reads, which wait where they must
            return
        engine = self._engine()
        if engine is not None:
            engine.synchronize()

    def __getstate__(self) -> dict:
        return {"state_dict": self._state_dict}

    def __setstate__(self, state: dict) -> None:
        # a copy of the module (deepcopy, pickle, torch.load) is no engine's: its hook waits for nothing
        self._engine = lambda: None
        self._state_dict = state.get("state_dict", False)


def _remove_handles(handles: list[Any]) -> None:
    for h in handles:
        h.remove()


def _restart(name: str) -> str:
    """What to do once the ranks are out of step, after `name` failed on one of them."""
    if name in ("generate", "stream"):
        return "End every rank and serve again (fxspeed.serve on every rank)"
    return "End every rank and restart from the last checkpoint (engine.load)"


def _normal_tensors(fn: Callable) -> Callable:
    """Run `fn` outside torch.inference_mode whatever the caller is in: optimizer states, buffers
    and loss scales made under it are inference tensors that no later step outside it could
    update in place (a step under it, then one outside, failed half-stepped)."""
    @functools.wraps(fn)
    def outside(*args: Any, **kwargs: Any) -> Any:
        with torch.inference_mode(False):
            return fn(*args, **kwargs)
    return outside


def check_pipeline_config(config: Config, n_devices: int) -> None:
    P, T = config.pipeline, config.tensor
    if n_devices % (P * T):
        lo = max(P * T, n_devices - n_devices % (P * T))
        both = f"Config.pipeline={P}" + (f" x Config.tensor={T}" if T > 1 else "")
        raise ConfigError(f"{both} with devices={n_devices}: devices must be a multiple of the pipeline degree"
                          + (" x the tensor degree" if T > 1 else "") + f" (x data-parallel replicas); use "
                          f"devices={lo} or {lo + P * T}, or degrees whose product divides {n_devices}")
    if config.grad_accum != 1:
        raise ConfigError(f"Config.grad_accum={config.grad_accum!r} with pipeline={P}: not supported with pipeline "
                          "parallelism; use grad_accum=1 (raise Config.microbatches instead)")


class Engine:
    """Trains `model` in place: its parameters are the ones the optimizer updates.

    Data parallel / ZeRO: the trainable parameters live in flat buckets laid out by the
    gradient-reduction pass (zero 0-2 keep the model's Parameters as views into them, ZeRO-3
    keeps only this rank's shards). Pipeline: a rank keeps only the weights of its stages
    (others are freed), in per-stage buckets over its replicas when there are several.
    """

    def __init__(self, model: nn.Module, devices: Sequence[DeviceSpec], config: Config, loss_fn: Any,
                 compiler: CompilerLike, mesh: Mesh, deferred: DeferredInit | None = None):
        """`deferred`: `model` was built on the meta device; its values are made as the layout is
        built (one bucket at a time under ZeRO / master weights)."""
        self.model = model
        self._deferred = deferred
        if deferred is not None:
            deferred.materialize_buffers()
        self.devices = list(devices)
        self.config = config
        self.loss_fn = loss_fn
        self.compiler = compiler
        self.mesh = mesh
        self.dist = mesh.ctx
        self.pipelined = config.pipeline > 1
        self.M = config.microbatches
        # Every name of every tensor: a tied weight is one Parameter reachable under two names,
        # and the trace may refer to it by either.
        self._params = dict(model.named_parameters(remove_duplicate=False))
        self._buffers = dict(model.named_buffers(remove_duplicate=False))
        self._kinds: list[tuple[str, torch.dtype, torch.device]] | None = None  # the parameters' dtypes/devices
        self._unique = list(model.parameters())
        self._canonical = _canonical_names(model)  # id(Parameter) -> its first name
        self._names_of: dict[int, list[str]] = {}  # id(Parameter) -> every name it has
        for name, p in self._params.items():
            self._names_of.setdefault(id(p), []).append(name)
        self._undecayed = undecayed_parameters(model, self._params, config.no_weight_decay) \
            if config.weight_decay and config.no_weight_decay else None  # ids of Parameters weight decay skips
        self._flat: FlatParameters | None = None
        self._accumulated: dict[int, torch.Tensor] = {}  # grad_accum: the step's earlier slices' flat buckets
        # Tensor parallel: Parameters cut to this tp rank's slice after the first compile.
        self._tp = TensorParallelParameters(mesh.group("tp"), mesh.coords()["tp"], mesh.tp) if mesh.tp > 1 else None
        self._tp_unsharded_said = False
        self.optimizer: torch.optim.Optimizer | None = None
        self.lr_scheduler: Any = None
        self.plan: Plan | None = None
        self.stats: dict[str, Any] = {"steps": 0, "compiles": 0, "skipped_steps": 0}
        self.scaler: DynamicLossScaler | None = None
        self._activations: ActivationOffload | None = None  # Config.offload="activations"/"all"
        self._link: DeviceLink | None = None  # optimizer / parameter offload from a device: its host tier
        self._device = deferred.device if deferred is not None else next((p.device for p in self._unique),
                                                                          torch.device("cpu"))
        self._scale = torch.ones((), dtype=torch.float32, device=self._device)  # the graph's loss_scale input
        if config.precision == "fp16":
            self.scaler = DynamicLossScaler(config.loss_scale or 2.0**16, config.loss_scale_window,
                                            config.loss_scale_backoff, config.loss_scale_growth,
                                            self.dist.group if self.dist.active else None)
            self.stats["loss_scale"] = float(self.scaler.scale)
        # One stage: compiled programs by batch signature.
        self._executors: dict[tuple, StepExecutor] = {}
        self._in_backward: InBackwardSteps | None = None
        self._half_stepped = ""  # why training may not go on (a program failed mid-step); "" = it may
        self._grad_norm: torch.Tensor | None = None  # the last clipped step's global norm (before clipping)
        self._out_of_step = ""  # why no step may run: this rank failed while its peers were in collectives
        self._first_fetch = -1  # parameter offload: the bucket the train program reads first
        # Pipeline: the program, this rank's runner, what it owns.
        self.schedule: Schedule | None = None
        self.programs: list = []
        self._key: tuple | None = None
        self._runtime: PipelineRuntime | None = None
        self._eval_runtime: PipelineRuntime | None = None
        # the pipeline eval program's random draws: (held generators, this rank's stages draw, any stage draws)
        self._eval_draws: tuple[list[torch.Generator], bool, bool] = ([], False, False)
        self._freed_shapes: dict[int, tuple[int, ...]] = {}
        self._holders: dict[int, set[int]] = {}  # id(Parameter) -> the pipeline positions whose stages read it
        self._requires_grad: list[tuple[str, bool]] | None = None  # at compile, by name
        self._release_hook: Any = None  # set when this rank's module holds 0-size Parameters
        self._wait_hook: Any = None  # ZeRO-1/2: a direct call or state_dict() of the module waits for the step's gathers
        self._module_state = ModuleState(model)  # the last _python_state's modules part, per train/eval
        self._owned: list[nn.Parameter] = []
        self._tied: list[tuple[Any, nn.Parameter]] = []  # (group over the positions holding it, weight)
        self._counted: list[nn.Parameter] = []
        self._counted_buckets: list[int] = []
        self._stage_buckets: dict[int, list[int]] = {}
        self._weight_users: dict[int, set[int]] | None = None  # ZeRO-3 pipeline: bucket -> stages reading it
        self._whole: dict[int, set[int]] = {}  # buckets GATHER made whole -> stages still to RELEASE them
        self._late_buckets: list[int] = []
        self._pending: list[tuple[int, Callable[[], torch.Tensor]]] = []  # bucket, wait-and-return its reduction
        self._grad_divisor = 1.0
        self._p2p_latency = 0.0
        self._serving: Any = None  # fxspeed.serve: the ServingLoop generate/stream delegate to
        if self.dist.active:
            check_same_model(self.dist, model, config, devices)
            if start_alike(self.dist, model) and self.rank == 0:
                log.warning("fxspeed: the ranks built %s with different weights (no common torch.manual_seed before "
                            "building it?); every rank now starts from rank 0's, as DDP and DeepSpeed do",
                            type(model).__name__)

    @property
    def module(self) -> nn.Module:
        """The user's model (DeepSpeed's `engine.module`). Under ZeRO-3, master weights or tensor
        parallelism it holds no whole weights between steps: call it inside `engine.gathered()`."""
        return self.model

    # --- the mesh ----------------------------------------------------------------------------
    @property
    def rank(self) -> int:
        """This process's global rank."""
        return self.dist.rank

    @property
    def world_size(self) -> int:
        """The number of ranks (processes) the engine runs on."""
        return self.dist.world

    @property
    def dp_rank(self) -> int:
        """This rank's data-parallel replica: `local_batch(batch, engine.dp_rank, engine.dp_size)`."""
        return self.mesh.coords()["dp"]

    @property
    def dp_size(self) -> int:
        """The number of data-parallel replicas (ranks / (pipeline x tensor))."""
        return self.mesh.dp

    @property
    def position(self) -> int:
        """This rank's pipeline position (0 without a pipeline)."""
        return self.mesh.coords()["pp"]

    @property
    def pipe_ranks(self) -> list[int]:
        """The global ranks of this rank's pipeline, by position."""
        return self.mesh.ranks("pp")

    @property
    def stages(self) -> list[int]:
        """The stages this rank runs (one, or Config.pipeline_chunks under the interleaved schedule)."""
        if not self.pipelined:
            return [0]
        return [s for s, r in enumerate(self.schedule.placement) if r == self.position] if self.schedule else []

    # --- compile: one stage --------------------------------------------------------------------
    def _executor(self, args: tuple, kwargs: dict, train: bool, role: str = "whole") -> StepExecutor:
        """The program for this batch signature, compiled on first use. `role`: a grad_accum
        slice's part in a step that reduces once ("local" / "last"; see _accumulates_locally)."""
        # A train step traces the modules in the modes they are in (a frozen BatchNorm stays in
        # eval, as in eager), so the modes are part of what a trace assumed; eval is all-eval.
        key = (train, input_key(args, kwargs), self._python_state(train), role)
        if self.dist.active:
            # Every step: a rank meeting a new shape alone would otherwise trace and run
            # collectives the others never join.
            self._check_step_everywhere(key)
        ex = self._executors.get(key)
        if ex is not None:
            return ex
        self.synchronize()  # tracing reads the weights
        self._check_parameters_unchanged()
        wants_grad = [i for i, t in enumerate(split_inputs(args, kwargs)[0])
                      if isinstance(t, torch.Tensor) and t.requires_grad] if train else []
        if wants_grad:
            log.warning("fxspeed: batch value(s) %s require grad; train_step computes the parameters' gradients only, "
                        "so their .grad stays None (eager backward would fill it). Take input gradients with "
                        "torch.autograd on the eager model", wants_grad)
        if train and not self.model.training:
            log.warning("fxspeed: %s is in eval mode; train_step trains it that way, as eager would (dropout off, "
                        "BatchNorm on running statistics). Call model.train() first to train in training mode",
                        type(self.model).__name__)
        want_plan = train and self.plan is None
        # ZeRO-3 keeps only shards between steps, tensor parallelism slices; tracing needs the full
        # parameters once.
        # The flat buffers hold the first program's buckets; a new trace (another batch shape) may
        # compute the gradients in another order (a tp layout solved for its shapes), so it is
        # bucketed as they are laid out.
        layout = [b.names for b in self._flat.buckets] if train and self._flat is not None else []
        with self._full_weights():
            compiled = self.compiler.step(self.model, args, kwargs, train=train, grad_accum_role=role,
                                          analyze=costs_reader(self.config, self.devices) if want_plan else None,
                                          bucket_layout=layout)
        after = self._python_state(train)
        if after != key[2]:
            warn_python_state_changed(self.model, key[2][0], after[0])
            # Keyed under what the next step will see, or every step would trace again.
            key = (train, key[1], after, role)
        cap = compiled.captured
        if want_plan:  # before the state: the optimizer follows the plan's offload choice
            self.plan = finish_plan(compiled.costs, model_name=type(self.model).__name__, config=self.config,
                                    devices=self.devices, passes=[r.to_dict() for r in compiled.records],
                                    tp=self.config.tensor)
            self._note_mesh()
            warn_over_budget(self.plan)
            if self._tp is not None:
                from fxspeed.planner.placement import describe_placements

                self.plan.tp_placements, self.plan.tp_communication = describe_placements(
                    cap.gm, cap.signature, self.mesh.group_name("tp"))
                self.plan.notes.append(TP_PLAN_NOTE)
        if self._tp is not None:
            # a model built on meta: each sliced Parameter's init group is made whole and cut at once
            self._apply_tp_layout(cap.signature)
            if not (train and self.optimizer is None):
                self._materialize_all()  # (else _setup_state makes the rest, bucket by bucket under ZeRO)
        if train and self.optimizer is None:
            self._setup_state(cap.signature)
        elif train and self._flat is not None and _layout(cap.signature.buckets) != _layout(self._flat.buckets):
            raise self._bucket_layout_changed(cap.signature.buckets)
        working = cap.signature.working_dtype is not None
        if train:
            self._first_fetch = cap.signature.first_fetch
            if self.config.offloads_activations:
                self._activation_store().reserve(cap.signature.offloaded_activations)
        ex = StepExecutor(Program(cap.gm, cap.signature, train=train, out_spec=cap.out_spec, out_type=cap.out_type),
                          functools.partial(self._bind, working=working))
        # Found once per program, not by a walk over every module at each step that draws: a
        # generator put in the place of one (module.gen = torch.Generator()) changes the step key
        # (runtime/python_state.py), so the step is traced again and this is read again.
        ex.held_generators = module_generators(self.model) if ex.draws_random else []
        self._executors[key] = ex
        self._count_compile()
        return ex

    def _bucket_layout_changed(self, buckets: list[Bucket]) -> FxspeedError:
        """A new trace's gradients do not fill the buckets the engine laid out at its first step:
        forward took another branch (a Python attribute, a new batch shape) that leaves some
        parameters without a gradient, or gives some one it lacked."""
        now = {n for b in buckets for n in b.names}
        first = {n for b in self._flat.buckets for n in b.names}
        lost, gained = sorted(first - now), sorted(now - first)
        if not lost and not gained:
            return FxspeedError("a new batch shape produced a different gradient bucket layout; please report this "
                                "with the model and shapes")
        said = "; ".join(f"{what}: {', '.join(names[:4])}{' ...' if len(names) > 4 else ''}"
                         for what, names in (("no gradient now", lost), ("a gradient now, none at the first step",
                                                                           gained)) if names)
        return FxspeedError(
            f"{type(self.model).__name__}'s forward now leaves other parameters without a gradient than at its first "
            f"step ({said}): it took another branch (a Python attribute or the batch's shape). The gradient buckets "
            "(data parallelism, master weights, offload) are laid out once, for the parameters the first step trained. Keep every parameter "
            "in the graph on every step (e.g. add 0 * the skipped module's output sum to the loss: its gradient is "
            "then 0, and weight decay or momentum still move it), freeze the ones that sit out "
            "(requires_grad=False before fxspeed.compile), or compile an engine per branch")

    def _setup_state(self, sig: StepSignature) -> None:
        if sig.buckets:
            canonical = {b_name: self._params[b_name] for b in sig.buckets for b_name in b.names}
            gather_group = None
            if sig.waits_for_parameters:
                # Deferred post-step gathers get their own group (same ranks): on the main one the
                # next step's batch-signature check and loss mean would queue behind all of them.
                gather_group = self.mesh.new_group_along("dp")
            work_dtype = getattr(torch, sig.working_dtype) if sig.working_dtype else None
            # Optimizer offload under master weights: the fp32 masters go to the file with the
            # moments (built empty here, filled once the optimizer's file exists).
            elsewhere = work_dtype is not None and self.config.offloads_optimizer
            in_files = self.config.offloads_parameters
            self._flat = FlatParameters(canonical, sig.buckets, rank=self.dp_rank, world=self.dp_size,
                                        zero=self.config.zero, group=self.mesh.group("dp"),
                                        gather_group=gather_group, work_dtype=work_dtype, masters_elsewhere=elsewhere,
                                        working_in_files=in_files, device=self._device,
                                        materialize=self._deferred.materialize if self._deferred else None)
            if in_files:
                # ZeRO-Infinity's parameter tier: the working shards go to files before anything
                # writes them (fill), and the programs read them from there by the store's name.
                files = self._flat.offload_working(self._offload_root("parameters"), f"rank{self.rank}",
                                                   link=self._host_link())
                register(self.compiler.options.parameter_store, files)
            tensors = self._flat.optimizer_tensors()
            self._counted_buckets = list(range(len(sig.buckets)))
            if self._flat.released:
                self._guard_released_module(list(canonical.values()), self._flat_where(),
                                            " or wrap the call in `with engine.gathered():` (on every rank)")
            elif self._flat.zero in (1, 2) and self._flat.world > 1 and self._wait_hook is None:
                # train_step returns while the updated weights are still being gathered into the
                # module's Parameters: a direct call (a validation loss) read a mix of old and new
                # weights, and `torch.save(model.state_dict())` could save one. Both wait for them
                # first, as eval_step and engine.state_dict() do. Every submodule too: `model.encoder(x)`
                # or `model.head.state_dict()` read the same buckets (a check of a flag once waited).
                # First among the module's hooks: one of the user's registered before compile may
                # read the weights (torch's weight_norm computes `weight` in a forward pre-hook).
                self._wait_hook = []
                for m in self.model.modules():
                    if isinstance(m, torch.jit.ScriptModule):
                        continue  # torch refuses hooks there (a scripted submodule called directly does not wait)
                    forward = m.register_forward_pre_hook(_WaitForGathers(self), prepend=True)
                    self._module_state.ignore(forward)  # the engine's own hook: no new trace for it
                    saved = m.register_state_dict_pre_hook(_WaitForGathers(self, state_dict=True))
                    m._state_dict_pre_hooks.move_to_end(saved.id, last=False)  # (torch has no prepend= for these)
                    self._wait_hook += [forward, saved]
                # a dropped engine takes them off (they would stay on every submodule as no-ops)
                weakref.finalize(self, _remove_handles, list(self._wait_hook))
        else:
            self._materialize_all()
            tensors = [p for p in self._unique if p.requires_grad]
        self._owned = [p for p in self._unique if p.requires_grad]
        self._counted = list(self._owned)
        self._build_optimizer(tensors)
        if self._flat is not None and self._flat.files is not None and isinstance(self.optimizer, OffloadedAdam):
            self.optimizer.working_sink = self._flat.files.write_piece
        if self._flat is not None and self._flat.masters_elsewhere:
            self._flat.fill(self.optimizer)
        self._materialize_all()  # what no bucket holds: frozen Parameters
        if self._flat is not None and self._flat.released and self._device.type == "cpu":
            release_freed_host_memory()  # the module's fp32 Parameters, now empty

    def _materialize_all(self) -> None:
        """A model built on the meta device: every tensor still without values gets them now."""
        if self._deferred is not None and not self._deferred.done:
            self._deferred.materialize_all()

    def _making(self) -> Callable[[list[nn.Parameter]], list[torch.Tensor]] | None:
        """A model built on the meta device: what gives Parameters (and their init groups) values."""
        return self._deferred.materialize if self._deferred is not None and not self._deferred.done else None

    def _guard_released_module(self, released: list[nn.Parameter], where: str, also: str,
                               partial: Callable[[torch.Tensor], bool] | None = None) -> None:
        """The user's module holds 0-size Parameters where this rank does not keep the weight
        (or, under tensor parallelism, this rank's slice: `partial` tells a Parameter that is not
        whole); calling it would fail deep inside an op ("'weight' must be 2-D") or, with a slice,
        compute the wrong thing silently. Say why, and what works."""
        if not released or self._release_hook is not None:
            return
        partial = partial or (lambda t: t.numel() == 0)
        name = type(self.model).__name__
        # Looked up at call time: while the engine traces, stand-ins of full shape replace it.
        owner, leaf = next((m, n) for m in self.model.modules() for n, p in m._parameters.items() if p is released[0])

        def refuse(what: str, instead: str) -> None:
            # not inside engine.gathered(), not while tracing: then stand-ins of full shape are in
            # place, or the name is gone (a train capture hides a tied alias the forward does not
            # read, T5's `shared.weight`)
            current = owner._parameters.get(leaf)
            if current is not None and partial(current):
                raise FxspeedError(
                    f"{name}{what}, but fxspeed's engine holds its parameters {where}: this rank's "
                    f"module does not hold them whole. {instead}")

        full = ("get the full weights with engine.state_dict() (collective: call it on every rank) and load them "
                "into a copy of the model")
        # A plain state_dict() would hand back the 0-size tensors: torch.save of it writes an empty
        # checkpoint with no error. The engine's own reads pass keep_vars=True.
        self._release_hook = [
            self.model.register_forward_pre_hook(
                lambda m, args: refuse(" was called directly", f"Use engine.train_step / engine.eval_step, or {full}{also}")),
            self.model.register_state_dict_pre_hook(
                lambda m, prefix, keep_vars: keep_vars or refuse(
                    ".state_dict() was called", "Use engine.state_dict() (collective: call it on every rank; save on "
                    "rank 0) or engine.save(path)")),
            self.model.register_load_state_dict_pre_hook(
                lambda m, *args: refuse(
                    ".load_state_dict() was called", "Use engine.load_state_dict(state) (collective: call it on every "
                    "rank, with the same full state) or engine.load(path)")),
        ]
        self._module_state.ignore(self._release_hook[0])  # the engine's own hook: no new trace for it

    @contextlib.contextmanager
    def gathered(self) -> Iterator[None]:
        """Context manager: inside it, the user's module holds the full fp32 weights (ZeRO-3 and
        master weights gather them over dp, tensor parallelism over tp; collective, call it on
        every rank). Where every rank already holds them it does nothing.

        Writes to the weights inside are kept: at a normal exit each rank takes its shard / slice
        of what the module holds into the engine's state (the fp32 masters and working copies
        under master weights), as `load_state_dict` does, so edit them the same way on every
        rank. An exception inside leaves the engine's weights as they were. The write-back runs
        at every exit (a write through `.data` would escape a version check): a copy of this
        rank's shard, and with the masters in the offload file one write of them."""
        self.synchronize()
        if self._tp or (self._flat is not None and self._flat.released):
            # Its all-gathers entered on one rank only (`if rank == 0: with engine.gathered():
            # print(model.generate(...))`) hung every rank until dist_timeout_s, then a raw gloo
            # timeout: said at once instead.
            self._begin_step("engine.gathered()")
            self._expect_all_ranks("engine.gathered()", fix=(
                "Enter `with engine.gathered():` on every rank (it all-gathers the weights); to use the model on "
                "one rank only, enter it on every rank and guard what you do inside it with `if rank == 0:`"))
        self._check_tp_slices_untouched()
        with self._gathered():
            with self._tp.gathered(write_back=True) if self._tp is not None else contextlib.nullcontext():
                yield
            if self._flat is not None:  # still gathered over dp; the tp slices were written back above
                self._flat.capture_from_parameters()

    def _python_state(self, train: bool) -> tuple:
        """What a trace baked in besides the batch (runtime/python_state.py): each module's
        train/eval mode (train steps), its settings, its classes' and its forward's globals, its
        plain tensor attributes' identities, and the numbers and strings loss_fn reads. A change
        retraces, as torch.compile's guards would; the fast check costs ~0.2 ms for GPT-2."""
        return self._module_state.key(train), function_scalars(self.loss_fn)

    def _check_parameters_not_replaced(self) -> None:
        """The model's Parameters are the objects the engine bound at compile: a Parameter object
        put in place of one (module.weight = nn.Parameter(...), load_state_dict(assign=True))
        would be ignored by the programs, which read the old one. So would a buffer (`m.buf = t`,
        `bn.running_mean = torch.zeros(...)`), while engine.state_dict() showed the new one."""
        # (a meta Parameter is one deferred init has not given its values yet: where it will be)
        kinds = [(n, p.dtype, self._device if p.is_meta else p.device) for n, p in self._params.items()]
        if self._kinds is None:
            self._kinds = kinds
        elif kinds != self._kinds:
            n, was_dtype, was_device = next(k for k, now in zip(self._kinds, kinds) if k != now)
            p = self._params[n]
            raise FxspeedError(f"{type(self.model).__name__}'s parameter {n} is {p.dtype} on {p.device} now but was "
                               f"{was_dtype} on {was_device} at compile (model.double(), .half() or .to() after "
                               "fxspeed.compile); the engine's programs and optimizer were built for the old ones. "
                               "Convert the model before compiling (for mixed precision use Config.precision), or "
                               "compile a new engine")
        self._check_flat_layout_untouched()
        self._check_tp_slices_untouched()
        for what, bound, current, how, fix in (
                ("Parameter(s)", self._params, self.model.named_parameters(remove_duplicate=False),
                 "module.weight = nn.Parameter(...), load_state_dict(assign=True)",
                 "Change values in place (with torch.no_grad(): p.copy_(...)), use engine.load_state_dict(state) or "
                 "load_state_dict without assign=True"),
                ("buffer(s)", self._buffers, self.model.named_buffers(remove_duplicate=False),
                 "module.buf = tensor, register_buffer again, load_state_dict(assign=True)",
                 "Write into the buffer in place (with torch.no_grad(): buf.copy_(...)), use "
                 "engine.load_state_dict(state)")):
            current = list(current)
            replaced = [n for n, t in current if bound.get(n) is not t]
            if replaced or len(current) != len(bound):
                raise FxspeedError(f"{type(self.model).__name__}'s {what} {replaced[:5] or '(set changed)'} were "
                                   f"replaced or added after compile ({how}); the engine's programs read the ones it "
                                   f"compiled, so the new ones would be ignored. {fix}, or compile a new engine")

    def _check_flat_layout_untouched(self) -> None:
        """Writes to the module's Parameters that the flat layout (ZeRO, master weights) would not
        see: a `p.data = t` into a ZeRO-1/2 bucket view is taken into the bucket (as an in-place
        write would be); a write to a released (0-size) Parameter changed nothing, and is said
        (it was silently lost: training went on from the old weights)."""
        if self._flat is None:
            return
        self._refuse_raced_writes()
        lost, repointed = self._flat.edited_outside()
        if repointed:
            self._flat.adopt(repointed)
        if lost:
            self._flat.forget_edits()  # said once: the next step goes on from the engine's weights
            raise FxspeedError(
                f"{type(self.model).__name__}'s parameter(s) {lost[:5]} were written after compile, outside "
                "`engine.gathered()` (in place, nn.init, or through .data); between steps this rank's module "
                f"holds 0-size placeholders for them (the engine keeps them {self._flat_where()}), so the write "
                "changed nothing and the engine's weights are as they were. Write inside `with "
                "engine.gathered():` (on every rank; the writes are taken into the engine at its exit), or use "
                "engine.load_state_dict(state)")

    def _check_tp_slices_untouched(self) -> None:
        """Under tensor parallelism (without ZeRO's flat layout, which checks its own) the module
        holds this rank's slice of each sliced weight. A whole weight assigned by hand (`p.data =
        t`) is cut to this rank's slice; any other shape is refused, naming the parameter."""
        if not self._tp or self._flat is not None:
            return
        other = self._tp.adopt_reassigned()
        if other:
            names = {id(p): n for n, p in self._params.items()}
            p = other[0]
            raise FxspeedError(
                f"{type(self.model).__name__}'s parameter(s) {[names.get(id(q), '?') for q in other[:5]]} hold tensors "
                f"of another shape than at compile ({names.get(id(p), '?')}: {tuple(p.shape)}); under tensor "
                f"parallelism this rank's module holds its slice {self._tp.slice_shape(p)} of the whole "
                f"{self._tp.full_shape(p)} weight. Write whole weights inside `with engine.gathered():` (on every "
                "rank), assign the whole tensor (`p.data = t`, cut to this rank's slice at the next step), or use "
                "engine.load_state_dict(state)")

    def _flat_where(self) -> str:
        """Where the flat layout keeps the weights a released module does not hold."""
        flat = self._flat
        if not flat.master:
            return "sharded across the data-parallel ranks (ZeRO-3)"
        ranks = "across the data-parallel ranks" if self.dp_size > 1 else "on this rank"
        offloaded = "; the masters in the optimizer's offload file" if flat.masters_elsewhere else ""
        return (f"as {str(flat.work_dtype).removeprefix('torch.')} working copies and fp32 master shards {ranks}, "
                f"ZeRO-{self.config.zero} under {self.config.precision}{offloaded}")

    def _check_parameters_unchanged(self) -> None:
        """requires_grad and Parameter hooks as at compile: the optimizer and gradient buffers are
        built once, and the captured graph runs no Python hooks on Parameters."""
        self._check_parameters_not_replaced()
        now = [(n, p.requires_grad) for n, p in self._params.items()]
        if self._requires_grad is None:
            self._requires_grad = now
        elif now != self._requires_grad:
            changed = [f"{n} ({was} -> {is_})" for (n, was), (_, is_) in zip(self._requires_grad, now) if was != is_]
            raise FxspeedError(f"requires_grad changed after compile for {', '.join(changed[:5])}"
                               + (f" and {len(changed) - 5} more" if len(changed) > 5 else "")
                               + "; the optimizer and gradient buffers were built for the parameters trainable at "
                               "compile. Freeze or unfreeze before fxspeed.compile (or compile a new engine)")
        hooked = [n for n, p in self._params.items()
                  if p._backward_hooks or getattr(p, "_post_accumulate_grad_hooks", None)]
        if hooked:
            raise FxspeedError(f"Parameter {hooked[0]!r} of {type(self.model).__name__} has a gradient hook "
                               "(Tensor.register_hook or register_post_accumulate_grad_hook); the compiled step does "
                               "not run Python hooks on Parameters, so it would be ignored. Remove it; for clipping "
                               "use Config.grad_clip, for scaling change the loss (or use loss_fn)")

    def _build_optimizer(self, tensors: list[torch.Tensor]) -> None:
        spec = dataclasses.replace(_optimizer_spec(self.config), **self._offload_spec(tensors))
        decay = self._weight_decay(tensors)
        link = self._host_link() if self.config.offloads_optimizer else None
        if link is not None:
            # The tensors live on a device: the offloaded optimizer steps them through its host
            # tier, states in pinned host memory (swap_root None) or in files (nvme).
            self.optimizer = OffloadedAdam(tensors, lr=spec.lr, betas=spec.betas, eps=spec.eps,
                                           weight_decay=0.0 if decay else spec.weight_decay,
                                           decoupled=spec.name == "adamw", swap_root=spec.swap_root,
                                           name=spec.swap_name, chunk_bytes=spec.chunk_bytes,
                                           offload_bytes=spec.offload_bytes, masters=spec.masters,
                                           chunk_starts=spec.chunk_starts, link=link, decay=decay)
            self.lr_scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lr_lambda(spec))
        else:
            self.optimizer, self.lr_scheduler = build_optimizer(tensors, spec, decay)
        self._lr_set = [g["lr"] for g in self.optimizer.param_groups]
        store = self.compiler.options.optimizer_store
        if store:  # the training programs step this optimizer inside backward (passes/memory/step_in_backward,
            # by parameter; step_buckets_in_backward, by reduced bucket of the flat layout)
            self._in_backward = InBackwardSteps(self.optimizer, self._params, flat=self._flat)
            register_steps(store, self._in_backward)

    def _weight_decay(self, tensors: list[torch.Tensor]) -> WeightDecay | None:
        """Config.no_weight_decay: which elements of the optimizer's tensors decay. A tensor is a
        Parameter (or its tp slice), decayed whole or not at all, or a flat ZeRO shard, whose runs
        are the decayed Parameters' elements inside it."""
        if self._undecayed is None:
            return None
        shards = {id(t): k for k, t in enumerate(self._flat.shards)} if self._flat is not None else {}
        runs: dict[int, tuple[tuple[int, int], ...]] = {}
        for t in tensors:
            if id(t) in shards:
                b = self._flat.buckets[shards[id(t)]]
                lo, hi = self._flat._range(b)
                mine: list[tuple[int, int]] = []
                for name, shape, off in zip(b.names, b.shapes, b.offsets):
                    a, e = max(off, lo), min(off + _numel(shape), hi)
                    if a >= e or id(self._params[name]) in self._undecayed:
                        continue
                    if mine and mine[-1][1] == a - lo:  # neighbours: one run
                        mine[-1] = (mine[-1][0], e - lo)
                    else:
                        mine.append((a - lo, e - lo))
                runs[id(t)] = tuple(mine)
            elif id(t) not in self._undecayed:
                runs[id(t)] = ((0, t.numel()),)
        return WeightDecay(self.config.weight_decay, self.config.optimizer == "adamw", runs)

    def _activation_store(self) -> ActivationOffload:
        """Where this engine's programs put the activations they offload (made on first use):
        pinned host memory on a CUDA device, a swap file under Config.nvme_path on a CPU one."""
        if self._activations is None:
            c = self.config
            if self._device.type == "cuda":
                if c.offload_device == "nvme":
                    raise ConfigError("Config.offload_device='nvme' for activations on a CUDA device is not built in "
                                      "this version; use offload_device='cpu' (pinned host memory) or 'auto'")
                root = None
            else:
                root = self._offload_root("activations")
            self._activations = ActivationOffload(self._device, root, name=f"rank{self.rank}")
            register_activations(self.compiler.options.activation_store, self._activations)
        return self._activations

    def _host_link(self) -> DeviceLink | None:
        """Optimizer and parameter offload from a device apart from the host (CUDA): the link its
        states cross (made once); None on a CPU device, whose tensors are host memory already.
        FXSPEED_HOST_TIER_ON_CPU=1 (tests only) runs a CPU device as such a device: copies
        between CPU tensors, the tier's logic without a GPU (runtime/host_tier.py)."""
        if self._device.type == "cpu" and not host_tier_on_cpu():
            return None
        if self._device.type not in ("cpu", "cuda"):
            raise ConfigError(f"Config.offload={self.config.offload!r} on a {self._device.type} device is not built in "
                              "this version (CUDA and CPU devices are); use offload='none'")
        if self._link is None:
            self._link = DeviceLink(self._device)
        return self._link

    def _offload_root(self, what: str) -> str | None:
        """The directory the offloaded `what` ("optimizer" states, "parameters") go to on this
        rank's device (Config.nvme_path), None for pinned host memory (offload_device "cpu" or
        "auto" on a CUDA device), or a ConfigError saying what to set."""
        c = self.config
        held = {"optimizer": "Adam's moments", "parameters": "the working parameter shards",
                "activations": "the saved activations"}[what]
        if what != "activations" and self._host_link() is not None:
            if c.offload_device in ("cpu", "auto"):
                return None  # the host tier: pinned host memory
            if c.nvme_path is None:
                raise ConfigError(f"Config.offload_device='nvme' keeps {held} in files: set Config.nvme_path to a "
                                  "directory on a local disk (a swap directory is created and removed there), or use "
                                  "offload_device='cpu' to keep them in pinned host memory")
            return os.path.abspath(c.nvme_path)
        if c.offload_device == "cpu":
            raise ConfigError("Config.offload_device='cpu' on a CPU device moves nothing: the states are in host "
                              "memory already. Use offload_device='nvme' with nvme_path=<a directory on a local disk> "
                              f"to keep {held} in files, or offload='none'")
        if c.nvme_path is None:
            raise ConfigError(f"Config.offload={c.offload!r} on a CPU device keeps {held} in files: set "
                              "Config.nvme_path to a directory on a local disk (a swap directory is created and "
                              "removed there)")
        # Resolved now: a relative path read after the user's os.chdir named another directory
        # (the swap directory was then never removed, and an activation file made later went there)
        return os.path.abspath(c.nvme_path)

    def _offload_spec(self, tensors: list[torch.Tensor]) -> dict[str, Any]:
        """Config.offload="optimizer"/"all": where the Adam moments of `tensors` go on this rank's
        device, and in chunks of what size (the planner's rule, over these tensors' states)."""
        c = self.config
        if not c.offloads_optimizer:
            return {}
        root = self._offload_root("optimizer")
        # With a memory budget the plan says how much must go (it was made before the state is built).
        moved = None
        if self.plan is not None and c.memory_budget_gb is not None:
            ranks = self.plan.pipeline.get("ranks") if self.pipelined else None
            # under a pipeline each position's states (and budget decision) are its own
            moved = ranks[self.position]["offloaded"] if ranks else self.plan.offloaded_optimizer
        starts: list[int] = []
        if self.compiler.options.optimizer_store and self._flat is not None:
            # the program steps each gradient bucket on its own: no chunk of the file spans two
            at = 0
            for k in range(len(self._flat.buckets)):
                starts.append(at)
                at += len(self._flat.bucket_tensors(k))
        masters = self._flat is not None and self._flat.masters_elsewhere
        states = 4 * (3 if masters else 2) * sum(t.numel() for t in tensors)
        return {"swap_root": root, "swap_name": f"rank{self.rank}",
                "chunk_bytes": offload_chunk_bytes(c, states=states), "offload_bytes": moved, "masters": masters,
                "chunk_starts": tuple(starts)}

    # --- compile: pipeline ---------------------------------------------------------------------
    def _compile_pipeline(self, args: tuple, kwargs: dict) -> None:
        key = input_key(args, kwargs)
        if self._key is not None:
            if key != self._key:
                raise ConfigError("the pipeline engine was compiled for another batch signature (shapes, dtypes, or "
                                  "the values of non-tensor arguments such as a Python float): "
                                  f"{key_change(self._key, args, kwargs)}. Pass batches of the "
                                  "shapes given as example_inputs (a new shape would re-split the model across ranks; "
                                  "a DataLoader's smaller last batch: drop_last=True)")
            if self._python_state(True) != self._traced_state:
                raise ConfigError(f"a module's train/eval mode or a Python attribute of {type(self.model).__name__} "
                                  "(or a number loss_fn reads) changed after the pipeline was compiled; its stages "
                                  "cannot be traced again. Set modes and attributes before fxspeed.compile")
            return
        self._check_parameters_unchanged()
        check_agreement(self.dist, "the batch signature (shapes, dtypes, structure)", fingerprint(key),
                        "every rank must pass a batch of the same shapes (each pipeline: the same batch)")
        margs, mkw = split_batch(args, kwargs, self.M)[0]
        micro_cfg = dataclasses.replace(self.config, pipeline=1, microbatches=1, schedule="1f1b", zero=0,
                                        split_points=(), pipeline_chunks=1)  # (kept, they warned "no effect")
        # Every position's stages get the same rewrites, so every rank's plan is the same plan.
        cp = self.compiler.program(self.model, margs, mkw, train=True, positions=range(self.config.pipeline),
                                   split_points=list(self.config.split_points) or None,
                                   analyze=costs_reader(micro_cfg, self.devices[:1]))
        self.programs, self.schedule, self._grad_divisor = cp.stages, cp.schedule, cp.grad_divisor
        self._traced_state = self._python_state(True)
        # A model built on meta: this rank makes only the weights its stages read (and what shares
        # an init group with them); the other stages' stay on meta until freed, never made.
        self._holders = self._pipeline_holders()
        held = self._held_here()
        if self._tp is not None:  # this rank's stages' weights only: the others are freed (shapes stay full)
            self._tp.apply(self._params, {n: v for n, v in cp.captured.signature.tp_layout.items()
                                          if id(self._params[n]) in held}, make=self._making())
            if not cp.captured.signature.tp_layout:  # (a pipeline said nothing: 8 ranks of a small model ran tp=2 whole)
                self._say_unsharded()
        if self._deferred is not None:
            self._deferred.materialize([p for p in self._unique if id(p) in held])
        mine = {s: self.programs[s] for s in self.stages}
        self._pipeline_draws_random = graphs_draw_random(*[g for p in mine.values() for g in (
            p.forward, p.backward, p.backward_input, p.backward_weight)])
        # Any stage's: every rank of the pipeline then takes its own stream and moves the user's
        # generators by one draw (one stage without dropout kept its generator apart from the others')
        self._pipeline_any_draws = graphs_draw_random(*[g for p in self.programs for g in (
            p.forward, p.backward, p.backward_input, p.backward_weight)])
        # found once (see _executor): a generator put in another's place after this compile is
        # refused at the next step (the pipeline's Python-state check), never silently missed
        self._pipeline_held = module_generators(self.model) if self._pipeline_any_draws else []
        moves = self.config.offloads_activations and any(p.offload_saved for p in mine.values())
        self._runtime = PipelineRuntime(mine, self.M, self._bind, group=self.mesh.group("pp"), peers=self.pipe_ranks,
                                        device=self._device, activations=self._activation_store() if moves else None)
        if moves:
            self._activations.reserve(self._runtime.activation_sizes())
        self._key = key
        self._count_compile()
        # the plan before the state, as without a pipeline: the optimizer follows each position's
        # offload choice under Config.memory_budget_gb (built after it, it offloaded every state)
        self.plan = finish_plan(cp.costs, model_name=type(self.model).__name__, config=micro_cfg,
                                devices=self.devices[:1], passes=[r.to_dict() for r in cp.records],
                                tp=self.config.tensor)
        from fxspeed.planner.pipeline import apply_pipeline, pipeline_report

        apply_pipeline(self.plan, pipeline_report(self.programs, self.schedule, self.config, self.dp_size,
                                                  staged_here=staging_on_device(self.devices[0])),
                       self.world_size, self.config.pipeline)
        self._note_mesh()
        warn_over_budget(self.plan)
        self._setup_pipeline_state()
        if self._tp is not None:
            from fxspeed.planner.placement import describe_placements

            # this rank's stages' collectives per step (the joint graph's are every stage's, once)
            self.plan.tp_placements = describe_placements(cp.captured.gm, cp.captured.signature)[0]
            self.plan.tp_communication = dict(self.plan.pipeline["ranks"][self.position]["tp_communication"])
            self.plan.notes.append(TP_PLAN_NOTE)
        log.info("fxspeed: pipeline %d stages x %d micro-batches (%s) x %d replicas; rank %d runs stages %s",
                 len(self.programs), self.M, self.schedule.name, self.dp_size, self.rank, self.stages)

    def _setup_pipeline_state(self) -> None:
        """Which weights this rank keeps, the groups of weights shared across positions, the
        per-stage gradient buckets over the replicas, and the optimizer."""
        position = self.position
        by_id: dict[int, nn.Parameter] = {id(p): p for p in self._params.values()}
        holders = self._holders
        mine = self._held_here()
        unused = {pid for pid in by_id if pid not in holders}
        self._owned = [p for pid, p in by_id.items() if pid in mine and pid not in unused and p.requires_grad]
        # A weight read by several positions (tied): a group per replica over the positions
        # holding it, created on every rank in the same order.
        self._tied = []
        for pid in by_id:
            rs = sorted(holders.get(pid, ()))
            if len(rs) < 2 or not by_id[pid].requires_grad:  # a frozen tied weight has no gradient to sum
                continue
            for d in range(self.dp_size):
                for t in range(self.mesh.tp):  # under tp each rank sums its slices with its tp index's
                    ranks = [self.mesh.rank_at(dp=d, pp=r, tp=t) for r in rs]
                    group = self.mesh.new_group(ranks)
                    if self.rank in ranks:
                        self._tied.append((group, by_id[pid]))
        tied = {id(p) for _, p in self._tied}
        # The global norm counts each weight once: at the lowest position holding it.
        self._counted = [p for p in self._owned if min(holders[id(p)]) == position]
        with torch.no_grad():
            for pid, p in by_id.items():
                if pid not in mine:
                    # the full shape (a tp-sliced weight of another stage leaves the tp layout: this
                    # rank never gathers or loads it)
                    self._freed_shapes[pid] = (self._tp.forget(p) if self._tp is not None else None) or tuple(p.shape)
            if self._deferred is not None:  # never made here: 0-size on the device, as the freed ones below
                self._deferred.release([by_id[pid] for pid in self._freed_shapes])
            for pid in self._freed_shapes:
                p = by_id[pid]
                p.data = torch.empty(0, dtype=p.dtype, device=p.device)
        if self._freed_shapes:
            self._guard_released_module([by_id[pid] for pid in self._freed_shapes], "on other pipeline stages' ranks", "")
        tensors: list[torch.Tensor] = list(self._owned)
        if self.dp_size > 1:
            buckets = self._pipeline_buckets(tied)
            self._flat = FlatParameters({self._canonical[id(p)]: p for p in self._owned}, buckets,
                                        rank=self.dp_rank, world=self.dp_size, zero=self.config.zero,
                                        group=self.mesh.group("dp"))
            tensors = self._flat.optimizer_tensors()
        self._build_optimizer(tensors)

    def _pipeline_holders(self) -> dict[int, set[int]]:
        """id(Parameter) -> the pipeline positions whose stages read it."""
        holders: dict[int, set[int]] = {}
        for prog in self.programs:
            r = self.schedule.placement[prog.stage]
            for name in prog.names():
                if name in self._params:
                    holders.setdefault(id(self._params[name]), set()).add(r)
        return holders

    def _held_here(self) -> set[int]:
        """The ids of the Parameters this rank keeps: those its stages read. A weight no stage
        reads (forward never uses it) has no gradient and no stage: the first position keeps it,
        untrained as in eager, so state_dict and checkpoints still hold it (every rank freed it,
        and state_dict returned it 0-size)."""
        mine = {pid for pid, rs in self._holders.items() if self.position in rs}
        if self.position == 0:
            mine |= {id(p) for p in self._unique if id(p) not in self._holders}
        return mine

    def _pipeline_buckets(self, tied: set[int]) -> list[Bucket]:
        """One bucket per stage of this rank (its weights no other position holds), reduced at the
        stage's REDUCE while the rank's remaining backward runs; then the weights shared with other
        positions (summed over them first, after the schedule), counted and not counted apart."""
        counted = {id(p) for p in self._counted}
        reduce_order = [a.stage for a in self.schedule.actions[self.position] if a.kind == "REDUCE"]
        assigned: set[int] = set()
        per_stage: dict[int, list[nn.Parameter]] = {}
        owned = {id(p) for p in self._owned}
        # Latest REDUCE first: a weight two of this rank's stages read is complete only after both.
        for s in reversed(reduce_order):
            names = sorted(self.programs[s].names() & set(self._params))
            ps = []
            for n in names:
                p = self._params[n]
                if id(p) in owned and id(p) not in tied and id(p) not in assigned:
                    assigned.add(id(p))
                    ps.append(p)
            per_stage[s] = sorted(ps, key=lambda p: self._canonical[id(p)])
        groups: list[tuple[str, int | None, list[nn.Parameter]]] = []
        for s in reduce_order:
            if per_stage.get(s):
                groups.append(("stage", s, per_stage[s]))
        late = [p for p in self._owned if id(p) in tied or id(p) not in assigned]
        groups.append(("late", None, [p for p in late if id(p) in counted]))
        groups.append(("late", None, [p for p in late if id(p) not in counted]))
        buckets: list[Bucket] = []
        self._stage_buckets, self._late_buckets, self._counted_buckets = {}, [], []
        for kind, s, ps in groups:
            if not ps:
                continue
            k = len(buckets)
            buckets.append(_bucket(k, [(self._canonical[id(p)], p) for p in ps], self.dp_size))
            if kind == "stage":
                self._stage_buckets.setdefault(s, []).append(k)
            else:
                self._late_buckets.append(k)
            if id(ps[0]) in counted:
                self._counted_buckets.append(k)
        return buckets

    def _say_unsharded(self) -> None:
        """Warn once that tensor=T slices nothing: the tp ranks would compute the same thing."""
        if self._tp_unsharded_said:
            return
        self._tp_unsharded_said = True
        log.warning("fxspeed: tensor=%d: the planner sharded none of %s's parameters (at these sizes keeping "
                    "every weight whole on each tp rank was cheaper than the collectives sharding needs), so "
                    "the %d tp ranks compute the same thing. Use them for data parallelism (tensor=1) with "
                    "this model, or a wider one for tensor parallelism (to test the sharded layout on a small "
                    "model, pass devices= a DeviceSpec with low flops and mem_bandwidth: the planner "
                    "then finds sharding cheaper)", self.mesh.tp,
                    type(self.model).__name__, self.mesh.tp)

    def _apply_tp_layout(self, sig: StepSignature) -> None:
        """The first program's tp layout slices the Parameters; every later program must read each
        sliced Parameter as that same slice (never as a full "param" input), the first one included
        (a tied weight fed under two names, one sliced and one whole, would be bound wrongly)."""
        if not self._tp:
            self._tp.apply(self._params, sig.tp_layout, make=self._making())
            if self._tp:
                p, _, _, full = next(iter(self._tp.layout.values()))
                self._guard_released_module([p], f"as slices over the {self.mesh.tp} tensor-parallel ranks",
                                            " or wrap the call in `with engine.gathered():` (on every rank)",
                                            partial=lambda t: tuple(t.shape) != full)
            if not sig.tp_layout:
                self._say_unsharded()
        have = {id(p): (d, b) for p, d, b, _ in self._tp.layout.values()}
        for spec in sig.inputs:
            if spec.kind not in ("param", "param_tp"):
                continue
            p = self._params[spec.target]
            want = have.get(id(p))
            got = tuple(sig.tp_layout[spec.target]) if spec.kind == "param_tp" else None
            if (want is None) != (got is None) or (want is not None and tuple(want) != got):
                raise FxspeedError(f"a new program of this engine reads {spec.target} as {got or 'a full tensor'} "
                                   f"but its Parameter holds the tensor-parallel slice {want or 'whole'}; please "
                                   "report this with the model and shapes")

    def _bind(self, spec: IOSpec, working: bool = False) -> Any:
        """The tensor behind a program input. `working`: the program reads low-precision working
        copies of the trainable weights (master weights), not the Parameters."""
        if spec.kind in ("param", "param_tp"):
            p = self._params[spec.target]
            if working and self._flat is not None:
                w = self._flat.working(self._canonical[id(p)])
                if w is not None:
                    return w
            return p
        if spec.kind == "buffer":
            return self._buffers[spec.target]
        if spec.kind == "param_shard" and self._flat is not None:
            return self._flat.work_shards[int(spec.target)]
        if spec.kind == "grad_buffer" and self._flat is not None:
            return self._flat.grad_buffer(int(spec.target))
        if spec.kind == "grad_accum":  # a new tensor every step: read at each run
            return _EachRun(functools.partial(self._accumulated.__getitem__, int(spec.target)))
        if spec.kind == "loss_scale":
            return self._scale
        raise FxspeedError(f"the program has an input {spec} the engine cannot bind")

    def _count_compile(self) -> None:
        self.stats["compiles"] += 1
        if self.stats["compiles"] == RETRACE_WARN_AFTER:
            log.warning("fxspeed: %d batch signatures compiled so far; pad batches to a few fixed shapes "
                        "to avoid recompiling", RETRACE_WARN_AFTER)

    def _note_mesh(self) -> None:
        if self.plan is not None:
            self.plan.mesh = self.mesh.describe()

    def compile(self, args: tuple, kwargs: dict) -> None:
        """Compile the training program for this batch signature (fxspeed.compile calls it with
        example_inputs, so the plan exists before the first step)."""
        if self.pipelined:
            self._compile_pipeline(args, kwargs)
        else:
            self._executor(args, kwargs, train=True)

    def graph(self) -> "torch.fx.GraphModule":
        """The annotated training GraphModule of the first compiled batch signature (each node
        carries its NodeInfo under node.meta["fxspeed"]); under a pipeline, the forward program
        of this rank's first stage. For inspection; do not mutate."""
        if self.pipelined and self.programs:
            return self.programs[self.stages[0]].forward
        for (train, *_), ex in self._executors.items():
            if train:
                return ex.program.gm
        raise ValueError("no training step compiled yet; call fxspeed.compile(..., example_inputs=...) or "
                         "engine.train_step(batch) first")

    # --- inference (fxspeed.serve) -------------------------------------------------------------
    def setup_serving(self, **options: Any) -> None:
        """Compile for inference: the serving loop over the compiler's inference programs and a
        paged KV cache (runtime/serving.py; options: token_budget, max_batch, block_size,
        cache_tokens, cuda_graphs, pack_linear, prefix_caching), and the inference plan as `self.plan`."""
        from fxspeed.runtime.serving import model_limits

        vocab, context, limit = model_limits(self.model)
        # Served in eval mode (every program is traced so: capture_step(train=False)), and so is the
        # check's eager reference below; the user's modes are restored after, as HF's generate
        # leaves them: serve used to leave the model in eval mode, so a loop that trains and
        # generates with one model trained on without dropout
        modes = [(m, m.training) for m in self.model.modules()]
        self.model.eval()
        try:
            self._setup_serving(vocab, context, limit, options)
        finally:
            for m, mode in modes:
                m.training = mode

    def _setup_serving(self, vocab: int, context: int, limit: str, options: dict[str, Any]) -> None:
        from fxspeed.planner.inference import plan_inference
        from fxspeed.runtime.serving import ServingLoop

        tp = self._tp
        self._serving = ServingLoop(self._inference_program, self._bind, vocab_size=vocab, max_context=context,
                                    context_limit=limit,
                                    device=self._device, agree=self._agree_tokens if tp is not None else None,
                                    agree_min=self._agree_min if tp is not None else None,
                                    **options)
        low = self.config.precision != "fp32" or any(p.dtype in (torch.bfloat16, torch.float16) for p in self._unique)
        self._serving.check_against(self.model, low_precision=low,
                                    full_weights=tp.gathered if tp is not None else None)
        first = next(iter(self._serving.programs.values())).program
        self.plan = plan_inference(self.model, first, self._serving, self.devices[0], self.config,  # type: ignore[assignment]
                                   tensor=self.mesh.tp)

    def _inference_program(self, tokens: int, copies: str = "packed", ways: int = 1) -> Any:
        """The compiler's serving program for a bucket of `tokens`. Under tensor parallelism the
        first program's layout cuts the Parameters to this rank's slices; later buckets are traced
        with full-shaped meta stand-ins for them (the trace reads shapes only; gathering the
        weights would put a whole model copy in memory at every new bucket). `copies`, `ways`: the
        weight copies its linears read (Compiler.inference)."""
        shapes = {pid: full for pid, (_p, _d, _b, full) in self._tp.layout.items()} if self._tp else {}
        with _meta_stand_ins(self.model, shapes):
            program = self.compiler.inference(self.model, tokens, copies=copies, ways=ways)
        if self._tp is not None:
            self._apply_tp_layout(program.signature)
        return program

    def _agree_tokens(self, tokens: torch.Tensor) -> torch.Tensor:
        """Tensor-parallel serving: every rank continues with tp rank 0's sampled tokens. The
        logits are equal on every rank (all-reduced or all-gathered), so greedy choices agree
        anyway; a sampled token (each rank's own generator, perhaps seeded differently) might not,
        and one different token would make the ranks' schedules, and collectives, diverge."""
        dev = comm_device(self._tp.group)
        t = tokens.to(dev)
        dist.broadcast(t, group=self._tp.group, group_src=0)
        return t.to(tokens.device)

    def _agree_min(self, value: int) -> int:
        """Tensor-parallel serving: the smallest `value` over the tp ranks."""
        t = torch.tensor([value], dtype=torch.int64, device=comm_device(self._tp.group))
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self._tp.group)
        return int(t.item())

    def _serving_loop(self) -> Any:
        if self._serving is None:
            raise ConfigError("generate/stream need an engine compiled for inference: engine = fxspeed.serve(model, ...)")
        self._check_parameters_not_replaced()
        return self._serving

    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int | Sequence[int] = 16,
                 **kwargs: Any) -> list[Any]:
        """Token ids generated for each prompt (a list of token-id lists, any lengths), by continuous
        batching over the compiled programs. kwargs: temperature (0: greedy), top_k, top_p, seed,
        eos_token_id (all requests) or eos_token_ids (one per prompt), on_error ("raise": a
        GenerationError after the other requests finished, with .results; "return": the
        RequestError in place of that request's tokens). See runtime/serving.py."""
        from fxspeed.runtime.serving import check_generate_options

        check_generate_options("generate", kwargs)
        refuse_autocast("engine.generate")
        loop = self._serving_loop()
        self._begin_step("generate")
        loop.close_open_streams()  # tp: a stream left unfinished tells the other ranks it stopped
        self._same_requests_on_every_rank("generate", prompts, max_new_tokens, kwargs)
        with self._failure_said("generate", self._tp is not None):
            return loop.generate(prompts, max_new_tokens, **kwargs)

    def stream(self, prompts: Sequence[Sequence[int]], max_new_tokens: int | Sequence[int] = 16,
               **kwargs: Any) -> Any:
        """Yield (req_id, token) as tokens are produced, (req_id, RequestError) for a refused request."""
        from fxspeed.runtime.serving import check_generate_options

        check_generate_options("stream", kwargs)
        refuse_autocast("engine.stream")
        loop = self._serving_loop()
        self._begin_step("stream")
        loop.close_open_streams()
        self._same_requests_on_every_rank("stream", prompts, max_new_tokens, kwargs)
        return self._stream_steps(loop.stream(prompts, max_new_tokens, **kwargs))

    def _stream_steps(self, tokens: Iterator[Any]) -> Iterator[Any]:
        """A stream's tokens, a failure on this tensor-parallel rank said as generate's is."""
        with self._failure_said("stream", self._tp is not None):
            yield from tokens

    def _same_requests_on_every_rank(self, name: str, prompts: Any, max_new_tokens: Any, kwargs: dict) -> None:
        """Tensor-parallel serving: every rank must call generate/stream, with the same requests.
        On one rank only it hung until dist_timeout_s; with other prompts of the same lengths the
        ranks all-reduced activations of different tokens and returned rank 0's choices from that
        mix, with no error. `seed` may differ (every rank continues with rank 0's sampled tokens);
        `on_error` is each rank's own."""
        if self._tp is None or not self.dist.active:
            return
        self._expect_all_ranks(f"engine.{name}()", fix=f"Call engine.{name}(...) on every tensor-parallel rank, "
                                                         "with the same prompts")

        def canon(x: Any) -> Any:
            if isinstance(x, (list, tuple)):
                return [canon(v) for v in x]
            return x.tolist() if hasattr(x, "tolist") else x

        shared = {k: canon(v) for k, v in sorted(kwargs.items()) if k not in ("seed", "on_error")}
        check_same_everywhere(self.dist, f"the requests of engine.{name}()",
                              fingerprint(canon(prompts), canon(max_new_tokens), shared),
                              f"every tensor-parallel rank must call engine.{name}() with the same prompts, "
                              "max_new_tokens and sampling options")

    # --- steps -------------------------------------------------------------------------------
    @_normal_tensors
    def train_step(self, *args: Any, **kwargs: Any) -> float:
        """Forward, backward and optimizer step on one batch; returns the loss of the global batch
        (the mean over ranks) as a float, on every rank.

        Data parallel: each rank passes its own local batch (as with DDP). Pipeline: every rank of
        one pipeline passes its replica's batch, split into Config.microbatches. With
        Config.grad_accum=k the batch is split into k equal slices and their gradients averaged.

        That equals one step on the whole batch when the loss is a mean over equally weighted rows.
        A loss averaged over a varying number of items per slice or rank (tokens with padding or
        -100 labels) gives the mean of per-slice means, as DDP and DeepSpeed do; for the exact
        global mean, return local sum x replicas x k / (the global batch's item count, a tensor in
        the batch) from loss_fn (or the model), k being grad_accum or a pipeline's microbatches:
        see README.md.
        """
        if self._serving is not None:
            raise ConfigError("train_step: this engine was compiled for inference by fxspeed.serve (no optimizer); "
                              "use fxspeed.compile(model, ...) to train")
        self._begin_step("train_step")  # first: out of step, only restarting every rank mends it
        refuse_autocast("engine.train_step")
        if self._half_stepped:
            raise FxspeedError(self._half_stepped + "; load a checkpoint with engine.load (weights and optimizer states) "
                               "to train on")
        # Inside _failure_said: under tp or pp the replica check is a step's first collective, where a
        # rank whose peer left (its script ended a step early) got gloo's bare error and no out-of-step note.
        with self._failure_said("train_step", self.dist.active):
            self._check_replica_batch("train_step", args, kwargs)
        if self.scaler is not None:
            self._scale.copy_(self.scaler.scale)
        if isinstance(self.optimizer, OffloadedAdam):
            self.optimizer.prefetch()  # the first chunks' moments come off the disk during forward
        self._prefetch_parameters()
        if self._requires_grad is not None:
            self._check_parameters_unchanged()
        with self._failure_said("train_step", self.dist.active):
            if self.pipelined:
                loss = self._pipeline_step(args, kwargs)
            else:
                loss = self._joint_step(args, kwargs)
        self.stats["steps"] += 1
        return loss

    def _check_step_everywhere(self, key: Any) -> None:
        """Every rank runs the same step: the same method and batch signature. (A step called on
        one rank only pairs with the others' next one; that is found only when a collective
        times out, and said by _failed_mid_step.)"""
        check_same_everywhere(self.dist, "the step (train_step or eval_step), its batch signature (shapes, "
                              "dtypes, structure) or the model's Python settings", fingerprint(key),
                              "every rank must call the same step, in the same order, with local batches of the "
                              "same shapes, on a model with the same Python attributes; split the global batch "
                              "evenly with fxspeed.data.local_batch", parts=lambda: self._key_parts(key))

    def _key_parts(self, key: tuple) -> dict[str, str]:
        """A step key's pieces by what a user would call them, for the error naming which differ:
        (train, batch key, (module states, loss_fn scalars), role), or a pipeline's
        ("pipeline", train, batch key)."""
        if key[0] == "pipeline":
            return {"the step": "train_step" if key[1] else "eval_step", **describe_input_key(key[2])}
        train, batch, (modules, fn_scalars), role = key
        out = {"the step": "train_step" if train else "eval_step", **describe_input_key(batch),
               "loss_fn's numbers and strings": short_repr(fn_scalars), "the grad_accum slice": short_repr(role)}
        root = type(self.model).__name__
        for (name, _), (mode, attrs) in zip(self.model.named_modules(), modules):
            where = f"{root}.{name}" if name else root
            out[f"{where}.training"] = str(mode)
            for attr, value in attrs:
                out[f"{where}.{attr}"] = short_repr(value)
        return out

    def _refuse_half_stepped(self, name: str) -> None:
        """A checkpoint of a partly stepped model (a step interrupted after some buckets moved:
        an exception, Ctrl-C) mixes two steps' weights and would load and train on silently."""
        if self._half_stepped:
            raise FxspeedError(f"{name}: {self._half_stepped}; a checkpoint of it would mix two steps' weights. "
                               "Load the last checkpoint (engine.load) and go on from there")

    def _begin_step(self, name: str) -> None:
        if self._out_of_step:
            raise FxspeedError(f"{name}: {self._out_of_step}. {_restart(name)}")

    @contextlib.contextmanager
    def _failure_said(self, name: str, among_ranks: bool) -> Iterator[None]:
        """Around a step (`name`) that runs collectives with other ranks (`among_ranks`): an
        exception escaping it on this rank only is said as `_failed_mid_step` says it. fxspeed's
        own errors pass as they are: raised on every rank alike (the agreement checks) or already
        said."""
        try:
            yield
        except FxspeedError:
            raise
        except Exception as e:
            if not among_ranks:
                raise
            raise self._failed_mid_step(name, e) from e

    def _failed_mid_step(self, name: str, e: Exception) -> FxspeedError:
        """A step that raised on this rank while others were (or will be) in its collectives: the
        ranks are out of step for good. Said once here, with what failed, instead of a bare
        gloo/NCCL error on the peers and mismatched collectives at this rank's next step."""
        first = str(e).strip().splitlines()[0][:300] if str(e).strip() else ""
        collective = isinstance(e, dist.DistError) or any(k in str(e) for k in (
            "gloo", "NCCL", "Connection closed by peer", "Connection reset by peer", "Timed out waiting"))
        failed, exited = peers_gone() if collective else ([], [])
        uneven = ("the ranks ran different numbers of steps (a data loader with more batches on some ranks? give "
                  "every rank as many: fxspeed.data.shard_loader, or drop_last=True)")
        # (the step's number where it counts steps: a generate or stream call has none)
        nth = f"{name} {self.stats['steps'] + 1}" if name in ("train_step", "eval_step") else name
        here = f"while this rank ran {nth}"
        # A rank that failed on its own (it raised, or called a collective alone) or ended is the
        # cause; one whose collective failed because of it only failed in turn, and naming it first
        # sent the user to a rank with nothing to fix (8 ranks, one calling state_dict() alone:
        # most said "because rank 0 failed: Connection closed by peer").
        causes = [(r, what) for r, what, in_turn in failed if not in_turn]
        in_turn = [r for r, _, later in failed if later]
        also = f" (rank(s) {in_turn} failed in turn)" if in_turn and (causes or exited) else ""
        if causes or (failed and not exited):
            named = causes or [(r, what) for r, what, _ in failed]
            self._out_of_step = (f"a collective of {name} failed on rank {self.rank} because "
                                 + "; ".join(f"rank {r} failed: {what}" for r, what in named) + also)
        elif exited:
            self._out_of_step = (f"a collective of {name} failed on rank {self.rank}: rank(s) {exited} had ended their "
                                 f"script without an error (finished, or sys.exit(0)) {here}{also}: {uneven}")
        elif "closed by peer" in str(e) or "reset by peer" in str(e):
            self._out_of_step = (f"a collective of {name} failed on rank {self.rank}: another rank's process left "
                                 f"without a failure said (its script ended or called destroy_process_group, or it was "
                                 f"killed) {here}; if its script ended, {uneven}")
        elif collective:
            self._out_of_step = (f"a collective of {name} failed on rank {self.rank} ({type(e).__name__}: {first}): "
                                 "another rank left the step (it raised, see its error; exited; called another step "
                                 "or method; or did not call this one: a step called on some ranks only pairs with "
                                 "the others' next one), so the ranks' collectives are out of step")
        else:
            self._out_of_step = (f"{name} failed on rank {self.rank} ({type(e).__name__}: {first}) while the other "
                                 "ranks ran, or will run, the step's collectives, so the ranks are out of step")
        # in turn: a peer had failed or left first (a timeout alone may be this rank's own doing)
        note_failure_for_peers(f"{nth} raised {type(e).__name__}: {first}", in_turn=bool(
            failed or exited or "closed by peer" in str(e) or "reset by peer" in str(e)))
        return FxspeedError(f"{self._out_of_step}. {_restart(name)}")

    def _check_replica_batch(self, name: str, args: tuple, kwargs: dict) -> None:
        """Every tensor-parallel rank and pipeline position of a replica must pass the same batch.
        `local_batch(batch)` without the replica's coordinates splits it over all ranks: tp ranks
        then all-reduced partial results of different rows, and a pipeline's last stage took
        another batch's labels, with no error. A content digest per rank, compared within each
        replica every step (one small all-reduce)."""
        if self.mesh.active and (self.mesh.tp > 1 or self.mesh.pp > 1):
            check_same_in_replica(self.mesh, f"the batch of {name}", fingerprint(batch_digest(args, kwargs)),
                                  "every tensor-parallel rank and pipeline position of a data-parallel replica must "
                                  "pass the same batch: split a global batch with local_batch(batch, engine.dp_rank, "
                                  "engine.dp_size), not by the global rank")

    def _prefetch_parameters(self) -> None:
        """Parameter offload: start reading the shard the program fetches first."""
        if self._flat is not None and self._flat.files is not None:
            self._flat.files.prefetch(self._first_fetch)

    def _joint_step(self, args: tuple, kwargs: dict) -> float:
        k = self.config.grad_accum
        total: torch.Tensor | None = None
        grads: dict[str, torch.Tensor] = {}
        buckets: dict[int, torch.Tensor] = {}
        defer = False
        if self._in_backward is not None:
            # The program may step parameters while it runs: the lr rule is checked first.
            self._check_lr_untouched()
            self._in_backward.begin()
        once = self._accumulates_locally()
        self._accumulated.clear()  # (the programs' grad_accum inputs read this dict at each run)
        # Random ops draw from this replica's own stream (fxspeed.mesh.own_stream), every slice
        with contextlib.ExitStack() as streams:
            for i, (a, kw) in enumerate(split_batch(args, kwargs, k, key="grad_accum")):
                role = "whole" if not once else "last" if i == k - 1 else "local"
                ex = self._executor(a, kw, train=True, role=role)
                if i == 0 and ex.draws_random:
                    share_generators(self.mesh, self._device, ex.held_generators)
                    streams.enter_context(own_stream(self.mesh, self._device, ex.held_generators))
                defer = ex.program.signature.waits_for_parameters
                if not defer:
                    self.synchronize()
                out = self._run_stepping(ex, tensor_leaves(a, kw))
                total = out.loss if total is None else total + out.loss
                _accumulate(grads, out.grads)
                if role == "local":  # unreduced flat buckets (maybe in workspaces the next slice reuses)
                    _accumulate(self._accumulated, {n: t.clone() if n not in self._accumulated else t
                                                    for n, t in out.grad_buckets.items()})
                elif role == "last":  # every slice's buckets, reduced once
                    buckets = out.grad_buckets
                else:
                    # Reduced buckets may be persistent buffers the next slice overwrites: copy them.
                    _accumulate(buckets, out.grad_buckets if k == 1 else
                                {n: t.clone() for n, t in out.grad_buckets.items()})
                # The accumulated dicts now hold the only references this step needs. Dropped before
                # the next slice runs: `out` kept this slice's own buckets (already cloned above) alive
                # through it, a second copy of the accumulated gradients beside them (GPT 19M, fp32
                # ZeRO-1, grad_accum=2 on 2 ranks: 78 MB over the plan at the step's peak).
                del out
        self._accumulated.clear()
        self._broadcast_buffers(ex.updated_buffers)
        self.synchronize()  # a no-op when the program waited; the optimizer must not race a gather
        if k > 1:
            total = total / k
            grads = {n: t / k for n, t in grads.items()}
            buckets = {n: t / k for n, t in buckets.items()}
        for name, g in grads.items():
            # A tied weight the graph still feeds under several names gets one gradient per name.
            p = self._params[name]
            if self._in_backward is not None and id(p) in self._in_backward.stepped:
                raise FxspeedError(f"parameter {name!r} was stepped inside backward and is returned a gradient too (is "
                                   "it tied to another name?); compile with Config(disable_passes="
                                   "('step_in_backward',))")
            p.grad = in_layout_of(p, g if p.grad is None else p.grad + g)
        if self._flat is not None:
            self._flat.set_grads(buckets)
        del grads, buckets  # free before the optimizer allocates its temporaries
        self._optimizer_step(defer=defer, loss=total)
        if self.dist.active:
            total = total.detach().clone()
            dist.all_reduce(total, group=self.dist.group)
            total /= self.dist.world
        return float(total)

    def _accumulates_locally(self) -> bool:
        """Config.grad_accum under ZeRO-0/1 over several replicas: the step's slices sum their
        gradients locally and only the last slice's program reduces (the sum), as DDP's no_sync
        does: one slice's bytes per step instead of grad_accum times them. ZeRO-2/3 reduce every
        slice (they hold only their shard of each gradient between slices, as in DeepSpeed).
        why: docs/decisions/reduce-once-per-accumulated-step.md"""
        return (self.config.grad_accum > 1 and self.dist.active and self.dp_size > 1 and self.config.zero <= 1
                and self._in_backward is None)

    def _broadcast_buffers(self, buffers: list[torch.Tensor]) -> None:
        """Buffers the step wrote (BatchNorm's running statistics) take the values of the first rank
        of each data-parallel group, as DDP's broadcast_buffers (its default) makes them. Each
        replica updates them from its own rows; kept apart they drifted, engine.save wrote rank 0's,
        so a resumed run's ranks differed from an uninterrupted one's, and eval_step averaged
        losses computed with different statistics. One broadcast per dtype, after the step."""
        if not buffers or not self.mesh.active or self.mesh.dp == 1:
            return
        src = self.mesh.ranks("dp")[0]
        broadcast_into(buffers, src=src, group=self.mesh.group("dp"), receive=self.rank != src)

    def _run_stepping(self, ex: StepExecutor, batch: list[torch.Tensor]) -> Any:
        """Run a training program. One that steps parameters inside backward and fails after
        some of them moved leaves a half-stepped model: never trained on silently (the engine
        refuses further steps until a checkpoint is loaded)."""
        try:
            return ex.run(batch)
        except BaseException as e:
            moved = len(self._in_backward.stepped) if self._in_backward is not None else 0
            if not moved:
                raise
            # the other ranks are in (or will run) this step's collectives
            self._raise_half_stepped(e, f"train_step {self.stats['steps']} failed ({type(e).__name__}: {e}) after the "
                                        f"program had handed {moved} of {self._in_backward_units()} to the optimizer "
                                        "inside backward (the last of them where it failed, perhaps partly), so the "
                                        "model is partly stepped", " while the other ranks ran the step's collectives")

    def _raise_half_stepped(self, e: BaseException, why: str, elsewhere: str) -> None:
        """Mark the model partly stepped (`why`; refused for training and checkpoints until a
        load) and, under a process group, out of step (`why` + `elsewhere`: what the other ranks
        do), told to the peers; then raise: a KeyboardInterrupt or SystemExit as itself (the
        user's `except KeyboardInterrupt: ...` must see its own), anything else as FxspeedError."""
        self._half_stepped = why
        if self.dist.active:
            self._out_of_step = why + elsewhere
            note_failure_for_peers(self._out_of_step)
        if not isinstance(e, Exception):
            raise e
        raise FxspeedError(why + "; load a checkpoint (engine.load) before training on") from e

    def _in_backward_units(self) -> str:
        """What the program steps inside backward: parameters, or the flat layout's buckets."""
        return f"{len(self._flat.buckets)} gradient buckets" if self._flat is not None else f"{len(self._owned)} parameters"

    def _pipeline_step(self, args: tuple, kwargs: dict) -> float:
        if self.dist.active:
            self._check_step_everywhere(("pipeline", True, input_key(args, kwargs)))
        self._compile_pipeline(args, kwargs)
        held = self._pipeline_held
        if self._pipeline_draws_random:
            share_generators(self.mesh, self._device, held)
        micro = [tensor_leaves(a, kw) for a, kw in split_batch(args, kwargs, self.M)]
        actions = self.schedule.actions[self.position]
        t0 = time.perf_counter()
        # ZeRO-3: the schedule's GATHER/RELEASE actions make each stage's weights whole only while
        # it computes (passes/program/gather_stage_weights.py); without them, for the whole schedule.
        per_stage = any(a.kind == GATHER for a in actions)
        # Each position's random ops on its own stream (seeded alike, a stage drew the previous one's masks)
        stream = own_stream(self.mesh, self._device, held) if self._pipeline_any_draws else contextlib.nullcontext()
        with stream, self._gathered() if not per_stage else self._stage_weights_released():
            loss, grads = self._runtime.run(actions, micro, on_reduce=self._reduce_stage if self._flat else None,
                                            on_weights=self._stage_weights if per_stage else None)
        self._broadcast_buffers(self._runtime.updated_buffers())  # (over this stage's replicas)
        self._record_timing(time.perf_counter() - t0)
        with torch.no_grad():
            self._finish_pipeline_grads(grads)  # reads no weights: runs with every stage's released
        del grads
        self._optimizer_step(loss=loss)
        return self._global_mean(loss)

    def _stage_weights(self, kind: str, stage: int) -> None:
        """GATHER(stage): every bucket holding a weight the stage reads is made whole (once);
        RELEASE(stage): each such bucket no stage still to run on this rank reads is dropped."""
        flat = self._flat
        if self._weight_users is None:  # bucket -> this rank's stages reading it
            where = {n: b.index for b in flat.buckets for n in b.names}
            self._weight_users = {}
            for s in self.stages:
                for n in self.programs[s].names() & set(self._params):
                    k = where.get(self._canonical[id(self._params[n])])
                    if k is not None:
                        self._weight_users.setdefault(k, set()).add(s)
        users = self._weight_users
        if kind == GATHER:
            for k in sorted(users):
                if stage in users[k] and k not in self._whole:
                    flat.gather_bucket(k)
                    self._whole[k] = set(users[k])
            return
        for k in [k for k, left in self._whole.items() if stage in left]:
            self._whole[k].discard(stage)
            if not self._whole[k]:
                flat.release_bucket(k)
                del self._whole[k]

    @contextlib.contextmanager
    def _stage_weights_released(self) -> Iterator[None]:
        """Every bucket a schedule left whole (one that failed midway) is released again."""
        try:
            yield
        finally:
            for k in list(self._whole):
                self._flat.release_bucket(k)
            self._whole.clear()

    def _reduce_stage(self, stage: int, grads: dict[str, torch.Tensor]) -> None:
        """At REDUCE(stage): start reducing the stage's buckets over the replicas (async); they
        complete while this rank runs the rest of its schedule."""
        for k in self._stage_buckets.get(stage, []):
            self._start_reduce(k, grads)

    def _start_reduce(self, k: int, grads: dict[str, torch.Tensor]) -> None:
        flat = self._flat
        b = flat.buckets[k]
        buf = flat.grad_buffer(k)  # persistent, zero padding
        with torch.no_grad():
            for name, shape, off in zip(b.names, b.shapes, b.offsets):
                # A weight's gradient summed over every name it has in `grads` (tied aliases).
                parts = [grads[n] for n in self._names_of[id(self._params[name])] if n in grads]
                seg = buf[off:off + _numel(shape)].view(shape)
                if not parts:
                    seg.zero_()
                    continue
                seg.copy_(parts[0])
                for g in parts[1:]:
                    seg.add_(g)
        self._pending.append((k, _reduce_bucket(flat, k, buf, scatter=self.config.zero >= 2)))

    def _finish_pipeline_grads(self, grads: dict[str, torch.Tensor]) -> None:
        """Per-micro-batch sums -> the gradient of the global-batch mean on every tensor the
        optimizer steps: weights shared across positions summed over them, then everything not
        yet reduced over the replicas reduced, and the reduced buckets attached."""
        for p in self._owned:
            p.grad = None
        # By Parameter, not in .grad: under ZeRO-3 the Parameters hold nothing here (their stages'
        # RELEASE ran), and the flat layout takes the gradients by name anyway.
        total: dict[int, torch.Tensor] = {}
        for name, g in grads.items():
            p = self._params[name]
            if self._grad_divisor != 1.0:
                g = g / self._grad_divisor
            total[id(p)] = g if id(p) not in total else total[id(p)] + g
        shapes = {n: s for b in self._flat.buckets for n, s in zip(b.names, b.shapes)} if self._flat else {}
        for p in self._owned:
            if id(p) not in total:
                shape = shapes.get(self._canonical[id(p)], tuple(p.shape))
                total[id(p)] = torch.zeros(shape, dtype=p.dtype, device=p.device)
        for _, p in self._tied:  # summed over the positions holding it: the same memory order on each
            total[id(p)] = total[id(p)].contiguous()
        works = [dist.all_reduce(total[id(p)], group=group, async_op=True) for group, p in self._tied]
        for w in works:
            w.wait()
        if self._flat is None:
            for p in self._owned:
                p.grad = in_layout_of(p, total[id(p)])
            return
        named = {self._canonical[id(p)]: total[id(p)] for p in self._owned}
        del total
        for k in self._late_buckets:
            self._start_reduce(k, named)
        reduced = {}
        for k, finish in self._pending:
            buf = finish()  # the whole reduced bucket, or (ZeRO-2/3) this rank's reduced shard of it
            if self._grad_divisor != 1.0 and k not in self._late_buckets:
                buf /= self._grad_divisor
            reduced[k] = buf
        self._pending = []
        for p in self._owned:
            p.grad = None
        self._flat.set_grads(reduced)  # full buckets: ZeRO-1/2/3 keep this rank's shard of each
        if self.config.zero >= 2:
            # ZeRO-2/3 keep only the gradient shard between steps: the flat reduction buffers and the
            # runner's accumulation buffers are allocated again next step.
            self._flat.grad_buffers.clear()
            self._runtime.release_gradient_buffers()

    def _optimizer_step(self, defer: bool = False, loss: torch.Tensor | None = None) -> None:
        """Unscale and check (fp16), check for non-finite values (Config.nan_check), clip by the
        global norm, step the optimizer and the lr schedule, gather updated ZeRO shards;
        gradients are freed either way. `loss`: this rank's loss, if it has one."""
        stepped = [t for g in self.optimizer.param_groups for t in g["params"] if t.grad is not None]
        self._check_lr_untouched()
        # Everything stepped inside backward: no second pass over the optimizer (an offloaded one
        # would read and write its files for nothing); the schedule and the gathers still run.
        done = not stepped and self._in_backward is not None and bool(self._in_backward.stepped)
        # Masters in the offload file: the gradients are working-precision shards; unscaling and
        # clipping them in place would round (fp16 would underflow), so the factors go to the
        # optimizer, which applies them to its fp32 upcast chunk by chunk.
        factors: list | None = [] if isinstance(self.optimizer, OffloadedAdam) and self.optimizer.masters else None
        try:
            self._step_or_skip(stepped, factors, done, defer, loss)
        finally:
            for g in self.optimizer.param_groups:
                for t in g["params"]:
                    # free gradients now rather than holding them through the next forward (and
                    # after a failed step: the next one must not add to them)
                    t.grad = None

    def _step_or_skip(self, stepped: list[torch.Tensor], factors: list | None, done: bool, defer: bool,
                      loss: torch.Tensor | None) -> None:
        if not unscale_or_skip(self.scaler, stepped, self.stats, factors, say=self.rank == 0) and not self._nonfinite_skip(stepped, loss):
            if self.config.grad_clip is not None:
                self._clip(stepped, factors)
            if not done:
                try:
                    self.optimizer.step(**({"grad_factors": factors} if factors else {}))
                except BaseException as e:
                    # An optimizer that steps chunk by chunk (the offloaded one: a disk read that
                    # fails) leaves the chunks before it stepped: never trained on silently
                    # the other ranks stepped (or will) and go on to the next step
                    self._raise_half_stepped(e, f"train_step {self.stats['steps']} failed in the optimizer step "
                                                f"({type(e).__name__}: {e}), which may have updated some parameters, "
                                                "so the model may be partly stepped", " on this rank only")
            if self.config.lr_schedule != "manual":
                self.lr_scheduler.step()
                self._lr_set = [g["lr"] for g in self.optimizer.param_groups]
            if self._flat is not None:
                # Deferred: the gathers overlap the next forward, which waits for each bucket
                # just before its first use (passes/wait_parameter_gathers).
                self._flat.after_step(defer=defer)
        elif self.config.grad_clip is not None:
            # skipped (an fp16 overflow, nan_check="skip"): its gradient had no finite norm (h43:
            # the last clipped step's norm was kept and read as this step's)
            self._grad_norm = torch.tensor(float("nan"))

    def _check_lr_untouched(self) -> None:
        """The lr rule: Config's schedule owns the learning rate unless Config.lr_schedule is
        "manual". A param group's lr changed behind the schedule's back would be overwritten at
        this step without a word, so it is an error that names the way to own the lr."""
        if self.config.lr_schedule == "manual":
            return
        for i, (g, lr) in enumerate(zip(self.optimizer.param_groups, self._lr_set)):
            if g["lr"] != lr:
                raise FxspeedError(
                    f"engine.optimizer.param_groups[{i}]['lr'] was changed outside the engine ({lr:g} -> {g['lr']:g}); "
                    f"Config.lr_schedule={self.config.lr_schedule!r} sets it at every step and would undo that. To set "
                    "the lr yourself (by hand or with a torch.optim.lr_scheduler built on engine.optimizer), use "
                    "Config(lr_schedule='manual'); to change the schedule, change Config.lr / lr_schedule / "
                    "warmup_steps / total_steps")

    def _nonfinite_skip(self, stepped: list[torch.Tensor], loss: torch.Tensor | None) -> bool:
        """Config.nan_check: one agreed answer on every rank to "is the loss or any gradient
        NaN/inf at this step?" ("skip": the step is skipped, as an fp16 overflow is; "raise":
        an error naming the step). Off (the default) costs nothing."""
        mode = self.config.nan_check
        if mode == "off":
            return False
        grads = [t.grad for t in stepped]
        bad = torch.zeros((), dtype=torch.float32, device=self._device)
        if grads:
            # The largest magnitude, not the 2-norm: fp16 gradients still scaled by the loss scale
            # (offloaded optimizer: unscaled inside its step) square to inf in fp16 though every
            # one is finite, which skipped every step. NaN and inf survive max and * 0.
            biggest = torch._foreach_norm(grads, float("inf"))
            bad += torch.stack([b.float().to(bad.device) for b in biggest]).sum() * 0
        if loss is not None:
            bad += loss.detach().float().to(bad.device) * 0
        bad = (~torch.isfinite(bad)).float()
        if self.dist.active:
            dist.all_reduce(bad, op=dist.ReduceOp.MAX, group=self.dist.group)
        if not bad.item():
            return False
        step = self.stats["steps"]
        where = "the loss or a gradient"
        if loss is not None and not torch.isfinite(loss.detach()).all():
            where = f"rank {self.rank}'s loss ({float(loss.detach().float().sum()):g})"
        if mode == "raise":
            raise FxspeedError(f"train_step {step}: {where} is NaN or inf (Config.nan_check='raise'); the weights and "
                               "optimizer states are unchanged (this step was not applied). Check this batch, or use "
                               "nan_check='skip' to skip such steps")
        self.stats["skipped_steps"] += 1
        if self.rank == 0 or where.startswith("rank"):  # agreed: one line, plus any rank whose own loss it was
            log.warning("fxspeed: step %d: %s is NaN or inf; skipped (Config.nan_check='skip'; %d skipped so far)",
                        step, where, self.stats["skipped_steps"])
        return True

    def _clip(self, stepped: list[torch.Tensor], factors: list | None = None) -> None:
        """Clip `stepped` by the norm of the whole model's gradient: each weight counted once,
        wherever it lives (shards over replicas, stages over positions, slices over tp ranks).
        `factors` (masters in the offload file): the gradients are still to be multiplied by these;
        the norm counts them, and the clip coefficient is appended instead of applied."""
        if self._tp is not None:
            if self._flat is not None and self.config.zero >= 1:
                sq = self._tp_shard_squares(factors or ())
                dist.all_reduce(sq, group=self.dist.group)  # every element counted once over dp x tp
            elif self.pipelined:
                # Each weight at the lowest position holding it, a tp slice on every tp rank, a weight
                # replicated over tp on tp rank 0; replicas hold the same gradients (divided out).
                tp = self._tp
                sq = torch.zeros((), dtype=torch.float64, device=self._device)
                for p in self._counted:
                    if p.grad is not None and (tp.counted(p) or (id(p) not in tp.layout and tp.rank == 0)):
                        sq += p.grad.double().pow(2).sum()
                dist.all_reduce(sq, group=self.dist.group)
                sq /= self.dp_size
            else:
                sq = self._tp.squared_norm([(t, t.grad) for t in stepped])
            norm = self._grad_norm = sq.sqrt().to(torch.float32)
            if factors is not None:  # masters in the offload file: the optimizer applies it in fp32
                factors.append(torch.clamp(self.config.grad_clip / (norm + 1e-6), max=1.0))
            elif stepped:
                torch.nn.utils.clip_grads_with_norm_(stepped, self.config.grad_clip, norm, foreach=True)
            return
        if self._flat is not None and self.config.zero >= 1:
            # Disjoint shards over replicas (and positions): everyone's counted squares.
            counted = [self._flat.shards[k].grad for k in self._counted_buckets]
            group = self.dist.group
        elif self.pipelined:
            # Replicas hold identical full gradients: sum over this pipeline's positions only.
            counted = [p.grad for p in self._counted]
            group = self.mesh.group("pp")
        else:
            counted, group = [t.grad for t in stepped], None
        counted = [g for g in counted if g is not None]
        device = stepped[0].device if stepped else torch.device("cpu")
        sq = torch.zeros((), dtype=torch.float64, device=device)
        if counted:
            sq = (_total_norm(counted) if factors is None else _norm_after(counted, factors)).double() ** 2
        if group is not None:
            dist.all_reduce(sq, group=group)
        norm = self._grad_norm = sq.sqrt().to(torch.float32)
        if factors is not None:
            # torch.nn.utils.clip_grads_with_norm_'s coefficient, for the optimizer to apply
            factors.append(torch.clamp(self.config.grad_clip / (norm + 1e-6), max=1.0))
        elif stepped:
            torch.nn.utils.clip_grads_with_norm_(stepped, self.config.grad_clip, norm, foreach=True)

    def grad_norm(self) -> float | None:
        """The global gradient norm of the last step, before clipping: what
        torch.nn.utils.clip_grad_norm_ returns, each weight counted once whatever the layout
        (shards, stages, slices), the same on every rank. NaN where that step was skipped (an
        fp16 overflow, or Config.nan_check="skip" on a NaN/inf). None without Config.grad_clip,
        which is when the norm is computed (a step's gradients live in the engine's buffers, not
        in p.grad)."""
        return None if self._grad_norm is None else float(self._grad_norm)

    def _tp_shard_squares(self, factors: Sequence[Any] = ()) -> torch.Tensor:
        """Tensor x ZeRO-1/2/3: this rank's share of the squared gradient norm. A flat shard mixes
        tp slices (every tp rank holds its own: all count; one a group of ranks shares: its first
        rank) and weights replicated over tp (tp rank 0 counts them), so summing over the world
        counts each element once. `factors`: what the gradients are still to be multiplied by
        (masters in the offload file), applied to an fp32 copy as the in-memory path's gradients are."""
        flat, tp = self._flat, self._tp
        sq = torch.zeros((), dtype=torch.float64, device=self._device)
        for k in self._counted_buckets:
            g = flat.shards[k].grad
            if g is None:
                continue
            b = flat.buckets[k]
            lo, hi = flat._range(b)
            for name, shape, off in zip(b.names, b.shapes, b.offsets):
                a, z = max(off, lo), min(off + _numel(shape), hi)
                p = self._params[name]  # a slice shared by a group of tp ranks counts on the group's first
                if a < z and (tp.counted(p) or (id(p) not in tp.layout and tp.rank == 0)):
                    piece = g[a - lo:z - lo]
                    if factors:
                        piece = piece.float()  # a copy: the gradients stay as they are for the optimizer
                        for f in factors:
                            piece = piece * f
                    sq += piece.double().pow(2).sum()
        return sq

    def synchronize(self) -> None:
        """Finish the parameter all-gathers a ZeRO-1/2 step left in flight; afterwards the model's
        Parameters hold the updated weights (under master weights they hold nothing: use
        gathered()). state_dict(), save(), load() and eval_step() call it; call it yourself before
        reading the model's Parameters directly between steps."""
        if self._flat is not None:
            self._refuse_raced_writes()
            self._flat.wait_gathers()

    def _finish_gathers(self) -> None:
        """synchronize() for what overwrites every weight (load, load_state_dict): a write that raced
        the gathers is not refused, since it is about to be replaced (a checkpoint is the way back)."""
        if self._flat is not None:
            self._flat.wait_gathers()

    def _refuse_raced_writes(self) -> None:
        """ZeRO-1/2: train_step returns while the updated weights are still being gathered into
        the buckets the module's Parameters view. A write in place before they finish races with
        them (the other ranks' slices land over it, or not): the ranks then step from different
        weights, silently. Said once, after the gathers finish."""
        raced = self._flat.raced_writes()
        if not raced:
            return
        self._flat.wait_gathers()
        named = f"{raced[:5]}" + (f" and {len(raced) - 5} more" if len(raced) > 5 else "")
        raise FxspeedError(
            f"{type(self.model).__name__}'s parameter(s) {named} were written in place after train_step returned, "
            f"while Config.zero={self.config.zero}'s all-gathers of the updated weights were still in flight "
            "(train_step returns before they finish): the other ranks' slices may have landed over the write, so "
            "it is lost in part on some ranks, which may now hold different weights: restart from a checkpoint "
            "(engine.load / engine.load_state_dict on every rank). Call engine.synchronize() after train_step and "
            "before writing the model's Parameters (or write inside `with engine.gathered():`)")

    @contextlib.contextmanager
    def _full_weights(self) -> Iterator[None]:
        """The module holds the full weights: ZeRO shards gathered over dp, then tp slices
        gathered over tp (collective)."""
        with self._gathered(), (self._tp.gathered() if self._tp is not None else contextlib.nullcontext()):
            yield

    def _gathered(self) -> Any:
        return self._flat.gathered() if self._flat is not None else contextlib.nullcontext()

    @_normal_tensors
    @torch.no_grad()
    def eval_step(self, *args: Any, **kwargs: Any) -> Any:
        """Forward only, model in eval mode, no gradients. Returns the loss of the global batch as
        a float when the output has one (or loss_fn is set), else the model's outputs (one stage
        only). As for train_step, that is the mean of the ranks' (and under a pipeline, of the
        micro-batches') losses: the global batch's loss for a mean over equally weighted rows, not
        for a loss over the batch as a whole (CLIP's contrastive loss, as under DDP). A collective under ZeRO-3, master weights (ZeRO-1/2 under bf16/fp16: the fp32 masters
        are gathered) and pipelines: call it on every rank."""
        self._begin_step("eval_step")
        refuse_autocast("engine.eval_step")
        self._check_parameters_not_replaced()
        with self._failure_said("eval_step", self.dist.active):
            self._check_replica_batch("eval_step", args, kwargs)
            return self._eval_step(args, kwargs)

    def _eval_step(self, args: tuple, kwargs: dict) -> Any:
        if self.pipelined:
            return self._pipeline_eval(args, kwargs)
        ex = self._executor(args, kwargs, train=False)
        held = ex.held_generators
        if ex.draws_random:
            share_generators(self.mesh, self._device, held)
        self.synchronize()
        with own_stream(self.mesh, self._device, held) if ex.draws_random else contextlib.nullcontext(), self._gathered():
            out = ex.run(tensor_leaves(args, kwargs))
        if out.loss is not None:
            loss = out.loss.detach().float().clone()
            if self.dist.active:
                dist.all_reduce(loss, group=self.dist.group)
                loss /= self.dist.world
            return float(loss)
        spec, cls = ex.program.out_spec, ex.program.out_type
        if spec is None:
            return out.outputs
        result = pytree.tree_unflatten(out.outputs, spec)
        return cls(**result) if cls is not None and isinstance(result, dict) else result

    def _pipeline_eval(self, args: tuple, kwargs: dict) -> float:
        if self.dist.active:
            self._check_step_everywhere(("pipeline", False, input_key(args, kwargs)))
        self._compile_pipeline(args, kwargs)
        if self._eval_runtime is None:
            self._eval_runtime = self._compile_pipeline_eval(args, kwargs)
        micro = [tensor_leaves(a, kw) for a, kw in split_batch(args, kwargs, self.M)]
        actions = [a for a in self.schedule.actions[self.position] if a.kind in (F, SEND_F, RECV_F)]
        # Random ops as in the train step (an eval trace turns dropout modules off, but F.dropout's
        # training=True default, torch.rand and held generators still draw): the tp ranks share
        # the generators, and every position takes its own stream when any stage draws, so the
        # stages neither repeat each other's numbers nor leave the ranks' generators apart
        held, here, anywhere = self._eval_draws
        if here:
            share_generators(self.mesh, self._device, held)
        stream = own_stream(self.mesh, self._device, held) if anywhere else contextlib.nullcontext()
        with stream, self._gathered():
            loss, _ = self._eval_runtime.run(actions + [Action(STEP)], micro, forward_only=True)
        return self._global_mean(loss)

    def _compile_pipeline_eval(self, args: tuple, kwargs: dict) -> PipelineRuntime:
        """The eval program, split at the training split's module boundaries so every rank runs
        the same stages with the weights it holds. Other stages' weights were freed; tracing needs
        only their shapes: meta stand-ins (one per Parameter, so tied weights stay tied)."""
        margs, mkw = split_batch(args, kwargs, self.M)[0]
        # an eval trace puts the modules in eval mode, and restores each one's
        with _meta_stand_ins(self.model, self._freed_shapes), self._full_weights():
            cp = self.compiler.program(self.model, margs, mkw, train=False,
                                       split_points=[p.starts_at for p in self.programs[1:]])
        if not any(s.kind == "loss" for s in cp.captured.signature.outputs):
            raise ConfigError(f"eval_step under pipeline parallelism needs a loss: {type(self.model).__name__} "
                              "returns no loss for this batch; pass targets or compile with loss_fn=")
        mine = {s: cp.stages[s] for s in self.stages}
        anywhere = graphs_draw_random(*[p.forward for p in cp.stages])
        self._eval_draws = (module_generators(self.model) if anywhere else [],
                            graphs_draw_random(*[p.forward for p in mine.values()]), anywhere)
        return PipelineRuntime(mine, self.M, self._bind, group=self.mesh.group("pp"), peers=self.pipe_ranks,
                               device=self._device)

    def _global_mean(self, loss: torch.Tensor | None) -> float:
        """Mean micro-batch loss from the last stage, on every rank, averaged over replicas."""
        last = self.pipe_ranks[self.schedule.placement[-1]]
        if loss is not None:
            out = (loss / self.M).detach().float().clone()
        else:
            out = torch.zeros((), dtype=torch.float32, device=self._device)
        dist.broadcast(out, src=last, group=self.mesh.group("pp"))
        if self.dp_size > 1:
            dist.all_reduce(out, group=self.mesh.group("dp"))
            out /= self.dp_size
        return float(out)

    # --- pipeline measurements -----------------------------------------------------------------
    def _record_timing(self, step_s: float) -> None:
        """This rank's last step: compute (F/B/I/W), blocked (in receives, and at STEP waiting
        for its sends to be taken) and overhead (the rest: posting sends, Python between actions).
        The idle fraction is the blocked share: the bubble as this rank lives it."""
        tl = self._runtime.timeline
        compute = sum(e - b for k, _, _, b, e in tl if k in (F, B, I, W))
        blocked = sum(e - b for k, _, _, b, e in tl if k in (RECV_F, RECV_B, STEP))
        self.stats["step_s"] = step_s
        self.stats["compute_s"] = compute
        self.stats["blocked_s"] = blocked
        self.stats["idle_fraction"] = blocked / step_s if step_s > 0 else 0.0
        self.stats["overhead_fraction"] = max(0.0, 1.0 - (compute + blocked) / step_s) if step_s > 0 else 0.0

    def stage_times(self) -> dict[int, dict[str, float]]:
        """Measured seconds per micro-batch of each of this rank's stages in the last step, by
        action kind (F, B, I, W)."""
        acc: dict[int, dict[str, list[float]]] = {}
        for kind, s, _, start, end in self._runtime.timeline if self._runtime else []:
            if kind in (F, B, I, W):
                acc.setdefault(s, {}).setdefault(kind, []).append(end - start)
        return {s: {k: sum(v) / len(v) for k, v in d.items()} for s, d in acc.items()}

    def pipeline_report(self, costs: Any = None) -> dict[str, Any]:
        """Per stage: modules, parameters, predicted time and memory; the schedule's simulated
        bubble and step time. `costs` (a simulator.Costs) overrides the planner's stage times."""
        from fxspeed.planner.pipeline import pipeline_report

        return pipeline_report(self.programs, self.schedule, self.config, self.dp_size, costs,
                               staged_here=staging_on_device(self.devices[0]))

    def measure_p2p_latency(self, repeats: int = 20) -> float:
        """One-way seconds for a stage-boundary message (the largest activation sent), measured
        by ping-pong between pipeline positions 0 and 1 and shared over the pipeline. The
        simulator charges it to every message. Collective over the pipeline."""
        shape = max((m.shape for p in self.programs for m in p.send_f),
                    key=lambda sh: torch.Size(sh).numel(), default=(1,))
        t = torch.zeros(shape, device=self._device)
        out = torch.zeros((), device=self._device)
        a, b = self.pipe_ranks[0], self.pipe_ranks[1]
        group = self.mesh.group("pp")
        if self.position in (0, 1):
            times = []
            for _ in range(repeats + 2):
                t0 = time.perf_counter()
                if self.position == 0:
                    dist.send(t, b, group=group)
                    dist.recv(t, b, group=group)
                else:
                    dist.recv(t, a, group=group)
                    dist.send(t, a, group=group)
                times.append(time.perf_counter() - t0)
            out = torch.tensor(sorted(times[2:])[len(times[2:]) // 2] / 2, device=self._device)
        dist.broadcast(out, src=a, group=group)
        self._p2p_latency = float(out)
        return self._p2p_latency

    def measured_costs(self) -> Any:
        """simulator.Costs from the last step's measured per-micro-batch stage times (all ranks;
        collective over the pipeline)."""
        from fxspeed.planner.simulator import Costs, StageCosts

        mine = self.stage_times()
        # The rank's overhead (posting sends, glue between actions) is work the simulator has no
        # action for: spread it over the rank's compute, so the simulated rank is as busy.
        compute = self.stats.get("compute_s", 0.0)
        grow = 1.0 + (self.stats.get("overhead_fraction", 0.0) * self.stats.get("step_s", 0.0) / compute
                      if compute > 0 else 0.0)
        rows = []
        for s in range(len(self.programs)):
            d = mine.get(s, {})
            f, i, w = d.get("F", 0.0), d.get("I", d.get("B", 0.0)), d.get("W", 0.0)
            rows.append([f * grow, i * grow, w * grow])
        t = torch.tensor(rows, dtype=torch.float64, device=self._device)
        dist.all_reduce(t, group=self.mesh.group("pp"))  # each stage's times come from the one rank running it
        return Costs([StageCosts(*map(float, r)) for r in t], p2p_latency=self._p2p_latency)

    def describe(self) -> dict[str, Any]:
        """The mesh shape, the schedule's text form and each stage program's description."""
        return {"mesh": self.mesh.shape, "schedule": self.schedule.format() if self.schedule else None,
                "stages": [p.describe() for p in self.programs]}

    # --- state -------------------------------------------------------------------------------
    def _local_state(self) -> dict[str, torch.Tensor]:
        """The parameters this rank holds (full tensors, canonical names; gathered under ZeRO-3)
        and the buffers."""
        self.synchronize()
        self._check_tp_slices_untouched()  # (a whole weight assigned by hand: this rank's slice of it)
        held = self._owned if self.pipelined else self._unique
        out: dict[str, torch.Tensor] = {}
        if self._flat is not None and self._flat.released:
            full = self._flat.full_state()  # this tp rank's slices, gathered over dp
            for p in held:
                name = self._canonical[id(p)]
                t = full[name] if name in full else p.detach()
                out[name] = self._tp.gather_like(p, t) if self._tp else t
        elif self._tp:
            out = {self._canonical[id(p)]: self._tp.full(p) for p in held}  # all-gather over tp
        else:
            out = {self._canonical[id(p)]: p.detach() for p in held}
        if self.pipelined:
            # Frozen and unused weights are not in _owned; keep the ones this rank did not free.
            for p in self._unique:
                if id(p) not in self._freed_shapes:
                    out.setdefault(self._canonical[id(p)], p.detach())
        # A pipeline: a buffer a stage writes (BatchNorm's statistics) only from the ranks holding
        # that stage; the other ranks' copies never moved and would win the merge in state_dict.
        written_elsewhere = {n for s, p in enumerate(self.programs) if s not in self.stages
                             for n in p.buffer_updates} if self.pipelined else set()
        for n, b in self.model.named_buffers():
            if n not in written_elsewhere:
                out[n] = b.detach()
        return out

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The model's full state in its original names and shapes (tied weights under every
        name), loadable into the plain model with `load_state_dict(strict=True)`, on every rank.
        A collective under ZeRO-3, tensor parallelism, master weights (ZeRO-1/2/3 under bf16/fp16)
        and pipelines (call it on every rank), and then a snapshot: no tensor aliases the live
        weights or buffers. Without them, as with nn.Module.state_dict(), the tensors alias the
        live weights: clone them to keep a snapshot."""
        gathered = (self.pipelined or self.config.zero >= 3 or bool(self._tp)
                    or (self._flat is not None and self._flat.released))
        if gathered:
            self._begin_step("engine.state_dict()")  # its collectives would pair with a failed step's
            self._expect_all_ranks("engine.state_dict()")
        local = self._local_state()
        if self.pipelined and self.dist.active:
            parts: list[Any] = [None] * len(self.pipe_ranks)
            dist.all_gather_object(parts, {n: t.cpu() for n, t in local.items()}, group=self.mesh.group("pp"))
            device = next((t.device for t in local.values()), torch.device("cpu"))
            local = {n: t.to(device) for part in parts for n, t in part.items()}
        # The module's own state_dict over the full weights: its hooks (renamed, added or
        # transformed keys, values derived from a weight) and extra state come out as eager's.
        with pointing_at(self._full_targets(local)):
            out = self.model.state_dict()
        released = (self._flat is not None and self._flat.released) or bool(self._freed_shapes)
        empty = [n for n in self._params if released and n in out and out[n].numel() == 0]
        if empty:  # never hand back (or save, or export) a weight as a 0-size placeholder
            raise FxspeedError(f"engine.state_dict(): {empty[:5]} of {type(self.model).__name__} came back 0-size: "
                               "the engine lost track of where this rank keeps them (a bug in fxspeed; please report "
                               "it with the model). Train with zero<=2 to save this model meanwhile")
        if gathered:
            # The gathered weights are copies, but the replicated ones (a tp-sliced model's norms,
            # a GQA key/value weight kept whole) and buffers were the live tensors: a snapshot kept
            # for later held the sliced weights of this step and the others of the last step.
            live = {t.untyped_storage().data_ptr() for t in (*self._unique, *self.model.buffers()) if t.numel()}
            copies: dict[int, torch.Tensor] = {}  # tied names keep sharing one tensor, as in eager
            for k, v in out.items():
                if torch.is_tensor(v) and v.numel() and v.untyped_storage().data_ptr() in live:
                    if id(v) not in copies:
                        copies[id(v)] = v.clone()
                    out[k] = copies[id(v)]
        return out

    def _full_targets(self, full: dict[str, torch.Tensor]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(Parameter or buffer, its full tensor in `full`, by canonical or buffer name), each once."""
        out = [(p, full[self._canonical[id(p)]]) for p in self._unique if self._canonical[id(p)] in full]
        return out + [(b, full[n]) for n, b in self.model.named_buffers() if n in full]

    def _own_hooks(self) -> set[int]:
        return {h.id for h in self._release_hook or ()}

    def _expect_all_ranks(self, name: str, fix: str | None = None, patient: bool = False) -> None:
        """Fail fast when a collective method is called on some ranks only (`if rank == 0:
        engine.state_dict()`), instead of hanging until dist_timeout_s. `patient`: wait up to half
        of dist_timeout_s, not 30 s (ranks may arrive far apart: each reading a large file first)."""
        if self.dist.active:
            # Half the collective timeout: the clear error must come before the raw one would.
            half = self.config.dist_timeout_s / 2
            expect_all_ranks(name, timeout_s=half if patient else min(30.0, half), group=self.dist.group, fix=fix)

    def _full_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every parameter's and buffer's full shape by canonical name, whatever this rank holds."""
        full = {n: tuple(s) for b in (self._flat.buckets if self._flat is not None else ()) for n, s in zip(b.names, b.shapes)}
        # a tp slice's full shape first: the buckets (and the slice itself) hold the slice's
        out = {self._canonical[id(p)]: (self._tp.full_shape(p) if self._tp is not None else None)
               or full.get(self._canonical[id(p)], self._freed_shapes.get(id(p), tuple(p.shape))) for p in self._unique}
        out.update({n: tuple(b.shape) for n, b in self.model.named_buffers()})
        return out

    def optimizer_state_dict(self) -> dict[str, Any]:
        """This rank's optimizer and lr schedule states, as torch's `state_dict()`s of
        `engine.optimizer` and `engine.lr_scheduler`: under ZeRO, tensor parallelism, master
        weights or offload they are laid out as this rank holds them (flat bucket shards, tp
        slices), not per original parameter, so they load only into the same layout. For a
        checkpoint that loads into any layout (or one process) use `engine.save` / `engine.load`."""
        return {"optimizer": self.optimizer.state_dict(), "lr_scheduler": self.lr_scheduler.state_dict()}

    def load_state_dict(self, state: dict[str, Any], strict: bool = True) -> Any:
        """Load a full model state (original names); each rank keeps what it holds. Over several
        ranks it is collective: every rank loads (the same state), or the replicas would silently
        train on different weights. `strict` as in nn.Module.load_state_dict: a parameter or
        persistent buffer the state lacks, or a key the model does not have, is an error (nothing
        is loaded); with strict=False those keep their values and extra keys are ignored. Returns
        nn.Module.load_state_dict's (missing_keys, unexpected_keys).

        A model with load hooks, extra state (`set_extra_state`) or a module class with its own
        `_load_from_state_dict` (BatchNorm's old checkpoints) loads through its own
        load_state_dict, run over full-size copies of the weights (memory: one more copy of the
        model while it runs), so those run as in eager."""
        # Checked on every distributed run, not only where a collective follows (ZeRO-3, offload):
        # under ZeRO-0 a load on one rank left the replicas apart with no error at all.
        self._expect_all_ranks("engine.load_state_dict()", fix="Call engine.load_state_dict(state) on every rank, "
                               "with the same full state", patient=True)
        if self.dist.active:  # the same state: each rank keeps its part of it (the digest reads it once)
            keys = sorted(state)
            check_same_everywhere(self.dist, "the state given to engine.load_state_dict()",
                                  fingerprint(keys, batch_digest(tuple(state[k] for k in keys), {})),
                                  "every rank must load the same full state (each keeps its part of it); load it from "
                                  "the same file on every rank, or use engine.save / engine.load",
                                  parts=lambda: {k: fingerprint(batch_digest((state[k],), {})) for k in keys})
        self._finish_gathers()  # an in-flight gather would overwrite what is loaded
        if loads_through_module(self.model, self._own_hooks()):
            return self._load_through_module(state, strict)
        return self._load_model_state(state, strict)

    def _load_through_module(self, state: dict[str, Any], strict: bool) -> Any:
        """The model's own load_state_dict into full-size copies of its weights and buffers
        (this rank's values, so strict=False keeps the rest); then those copies are loaded as a
        plain state. Nothing is written to the engine's state if it fails."""
        local = self._local_state()
        shapes = self._full_shapes()
        copies = {c: t.clone() for c, t in local.items()}
        for p in self._unique:  # (a pipeline's other stages: their values are not loaded here)
            c = self._canonical[id(p)]
            copies.setdefault(c, torch.empty(shapes[c], dtype=p.dtype, device=p.device))
        buffers = dict(self.model.named_buffers())
        for name, b in buffers.items():  # (a pipeline: those other stages write are not in local)
            copies.setdefault(name, b.detach().clone())
        try:
            with pointing_at(self._full_targets(copies)), torch.no_grad():
                try:
                    result = self.model.load_state_dict(state, strict=strict)
                except RuntimeError as e:
                    said = str(e).strip().rstrip(".")
                    raise ConfigError(f"load_state_dict: the state does not fit {type(self.model).__name__} (nothing "
                                      f"was loaded into the engine): {said}. Pass the full state of the same model"
                                      + ("" if not strict else " (or strict=False to load only the keys both have)")
                                      ) from e
                finally:  # a load post-hook that rebinds a buffer (`self.buf = ...`): its value, the engine's object
                    for name, b in self.model.named_buffers():
                        if name in buffers and b is not buffers[name]:
                            copies[name] = b.detach().to(buffers[name].dtype)
                            owner, _, leaf = name.rpartition(".")
                            self.model.get_submodule(owner)._buffers[leaf] = buffers[name]
        finally:  # the load wrote the copies through the Parameters: not the user's writes to released ones
            if self._flat is not None:
                self._flat.remember_versions()
        keep = persistent_buffers(self.model)
        self._load_model_state({n: t for n, t in copies.items() if n not in buffers or n in keep})
        with torch.no_grad():  # buffers a state_dict does not hold, as a load post-hook left them
            for name, b in buffers.items():
                if name not in keep:
                    b.copy_(copies[name])
        return result

    def _load_model_state(self, state: dict[str, Any], strict: bool = True, every_buffer: bool = False) -> Any:
        """`every_buffer`: buffers a state_dict leaves out (persistent=False) load too, as from
        engine.save's checkpoints, which hold them (eager's strict load refuses them)."""
        shapes = self._full_shapes()
        # Everything is checked before anything is written: a half-loaded model is a silent mix.
        # Keys are the model's own names (no state_dict hook's): what engine.save writes.
        pairs, problems = [], []
        persistent = persistent_buffers(self.model)  # (one name per module: missing when none of its names is there)
        known = (set(self._params) | persistent_buffers(self.model, every_name=True)
                 | ({n for n, _ in self.model.named_buffers(remove_duplicate=False)} if every_buffer else set()))
        missing = [n for n, p in self._params.items() if n not in state and self._canonical[id(p)] not in state]
        missing += sorted(persistent - set(state))
        unexpected = sorted(set(state) - known)
        if strict:
            problems += [f"buffer {n} is missing" for n in missing if n not in self._params]
            problems += [f"{n} is not in the model" for n in unexpected]
        for name, p in self._params.items():
            if id(p) in self._freed_shapes:
                continue
            src = state.get(name, state.get(self._canonical[id(p)]))
            want = shapes.get(self._canonical[id(p)], tuple(p.shape))
            why = is_loadable(src) if src is not None else None
            if src is None:
                if strict:
                    problems.append(f"{name} is missing")
            elif why:
                problems.append(f"{name} {why}")
            elif tuple(src.shape) != want:
                problems.append(f"{name} has shape {tuple(src.shape)} in the state but {want} in the model")
            else:
                pairs.append((name, src))
        for name, b in self.model.named_buffers():
            why = is_loadable(state[name]) if name in state else None
            if why:
                problems.append(f"buffer {name} {why}")
            elif name in state and tuple(state[name].shape) != tuple(b.shape):
                problems.append(f"buffer {name} has shape {tuple(state[name].shape)} in the state but {tuple(b.shape)}")
        if problems:
            raise ConfigError(f"load_state_dict: the state does not fit {type(self.model).__name__} ({len(problems)} "
                              f"problem(s); nothing was loaded): {'; '.join(problems[:5])}"
                              + (" ..." if len(problems) > 5 else "") + ". Pass the full state of the same model "
                              "(or strict=False to load only the keys both have)")
        # Under tp each rank copies its slice of the full value into its sliced Parameter.
        with torch.no_grad(), self._gathered():
            for name, src in pairs:
                p = self._params[name]
                p.copy_(self._tp.local(p, src) if self._tp else src)
            for name, b in self.model.named_buffers():
                if name in state and name in known:
                    b.copy_(state[name])
            if self._flat is not None:
                self._flat.capture_from_parameters()
        return nn.modules.module._IncompatibleKeys(missing, unexpected)

    def save(self, directory: str | os.PathLike) -> None:
        """Write a checkpoint any mesh can load (torch.distributed.checkpoint, full tensors under
        the model's names): parameters, buffers, optimizer states, lr schedule, loss scale, step
        counters and RNG state. Collective: call it on every rank."""
        from fxspeed.runtime.checkpoint import CanonicalState, save_checkpoint

        if self.optimizer is None:
            raise FxspeedError("engine.save: nothing to save before the engine is compiled; pass example_inputs to "
                               "fxspeed.compile or run a train_step first")
        self._begin_step("engine.save()")
        self._refuse_half_stepped("engine.save()")
        self._expect_all_ranks("engine.save()", fix="Call engine.save(path) on every rank (each rank writes or reads its "
                               "part; do not guard it with `if rank == 0`)")
        self._check_same_directory("engine.save()", directory)
        # Dropout on a CUDA device draws from that device's generator: kept beside the CPU one's
        mine = (torch.get_rng_state(), torch.cuda.get_rng_state(self._device) if self._device.type == "cuda" else None)
        states: list[Any] = [mine]
        if self.dist.active:  # the checkpoint keeps rank 0's `extra`: carry every rank's RNG in it
            states = [None] * self.world_size
            dist.all_gather_object(states, mine, group=self.dist.group)
        rng, cuda_rng = [s[0] for s in states], [s[1] for s in states]
        state = CanonicalState(model=self._local_state(), optimizer=self._canonical_optimizer_state(),
                               extra={"lr_scheduler": {**self.lr_scheduler.state_dict(),
                                                       "param_groups": _group_settings(self.optimizer)},
                                      "loss_scaler": self.scaler.state_dict() if self.scaler is not None else None,
                                      "stats": dict(self.stats), "rng": rng, "cuda_rng": cuda_rng,
                                      "mesh": self.mesh.shape, "zero": self.config.zero,
                                      "module_extra_state": extra_states(self.model)})
        save_checkpoint(directory, state, group=self.dist.group if self.dist.active else None, rank=self.rank)

    def load(self, directory: str | os.PathLike) -> None:
        """Restore what save() wrote, under this engine's mesh and ZeRO stage (which may differ
        from the saving run's: a checkpoint holds full tensors by name). Collective."""
        from fxspeed.runtime.checkpoint import load_checkpoint

        if self.optimizer is None:
            raise FxspeedError("engine.load: compile the engine first (fxspeed.compile(..., example_inputs=...)) so "
                               "the parameter layout and optimizer exist")
        self._expect_all_ranks("engine.load()", fix="Call engine.load(path) on every rank (each rank writes or reads its "
                               "part; do not guard it with `if rank == 0`)")
        self._check_same_directory("engine.load()", directory)
        self._finish_gathers()
        held = [p for p in self._unique if id(p) not in self._freed_shapes]
        names = sorted({self._canonical[id(p)] for p in held} | {n for n, _ in self.model.named_buffers()})
        ck = load_checkpoint(directory, names=names, group=self.dist.group if self.dist.active else None,
                             rank=self.rank, expect=self._full_shapes())
        missing = [k for k in ("lr_scheduler", "stats", "rng") if k not in ck.extra]
        if missing:
            raise FxspeedError(f"engine.load({str(directory)!r}): the checkpoint has no {', '.join(missing)}; it was not "
                               "written by engine.save (nothing was loaded)")
        self._check_optimizer_states(ck.optimizer, ck.extra["stats"].get("steps", 0), directory)
        self._load_model_state(ck.model, every_buffer=True)
        set_extra_states(self.model, ck.extra.get("module_extra_state", {}))
        if any(k not in self._own_hooks() for m in self.model.modules() for k in m._load_state_dict_post_hooks):
            # (a hook deriving a buffer from the loaded weights: over the full weights, as eager's load)
            with pointing_at(self._full_targets(self._local_state())), torch.no_grad():
                run_load_post_hooks(self.model, self._own_hooks())
        self._load_canonical_optimizer_state(ck.optimizer)
        self._load_lr_schedule(ck.extra["lr_scheduler"])
        self._half_stepped = ""  # weights and optimizer states are one consistent step again
        if self.scaler is not None and ck.extra.get("loss_scaler") is not None:
            self.scaler.load_state_dict(ck.extra["loss_scaler"])
            self._scale.copy_(self.scaler.scale)
        # The run's progress only: the counters this engine kept itself (its compiles, the step
        # timings it measured, a pipeline's idle fraction) are not the saving engine's.
        saved = ck.extra["stats"]
        self.stats.update({k: saved[k] for k in ("steps", "skipped_steps") if k in saved})
        if self.scaler is not None:
            self.stats["loss_scale"] = float(self.scaler.scale)
        # The same rank's stream when the world size matches (an exact resume); else rank 0's.
        rng, cuda_rng = ck.extra["rng"], ck.extra.get("cuda_rng")
        i = self.rank if len(rng) == self.world_size else 0
        torch.set_rng_state(rng[i])
        if self._device.type == "cuda" and cuda_rng is not None and cuda_rng[i] is not None:
            torch.cuda.set_rng_state(cuda_rng[i], self._device)

    def _check_same_directory(self, name: str, directory: str | os.PathLike) -> None:
        """One checkpoint is written (read) by all ranks together: ranks given different
        directories each completed a part of one (a save that reported success, a load that mixed
        two checkpoints' shards or left the replicas apart). A per-rank name, such as a timestamp
        taken on each rank, is the usual cause."""
        where = os.path.abspath(os.fspath(directory))
        check_same_everywhere(self.dist, f"the directory of {name}", fingerprint(where),
                              f"every rank must pass the same directory to {name} (one checkpoint is written and read "
                              "by all ranks together); a name made on each rank (a timestamp) differs: make it from "
                              "the step count, or on rank 0 and broadcast it", parts=lambda: {"the directory": where})

    def _load_lr_schedule(self, saved: dict[str, Any]) -> None:
        """The schedule resumes at the saved step, but Config wins over the checkpoint: the lr is
        Config.lr under Config's schedule (a run resumed with a new lr uses it). Under
        lr_schedule="manual" the user owns the lr, and the saved one is restored."""
        self.lr_scheduler.load_state_dict(saved)
        groups = self.optimizer.param_groups
        if self.config.lr_schedule == "manual":
            # The user's scheduler wrote the groups; the engine's schedule never stepped, so its
            # `_last_lr` is still Config.lr (a resumed ExponentialLR went on from 8x its lr).
            # As torch's optimizer.load_state_dict does: every saved setting of each group.
            settings = saved.get("param_groups") or [{"lr": lr} for lr in saved.get("_last_lr", [])]
            for g, kept in zip(groups, settings):
                g.update({k: v for k, v in kept.items() if k not in _IMPLEMENTATION_FLAGS | _CONFIG_OWNED})
        else:
            was = saved.get("base_lrs", [])
            if any(lr != self.config.lr for lr in was):
                log.warning("fxspeed: the checkpoint was trained with lr=%s; continuing with Config.lr=%g (Config "
                            "wins; use Config(lr_schedule='manual') to keep the checkpoint's lr)",
                            ", ".join(f"{lr:g}" for lr in sorted(set(was))), self.config.lr)
            self.lr_scheduler.base_lrs = [self.config.lr] * len(groups)
            factor = self.lr_scheduler.lr_lambdas[0](self.lr_scheduler.last_epoch)
            for g in groups:
                g["lr"] = self.config.lr * factor
        self.lr_scheduler._last_lr = [g["lr"] for g in groups]
        self._lr_set = [g["lr"] for g in groups]

    def export(self, path: str | os.PathLike) -> None:
        """One consolidated safetensors file of the model's full state (what the model's own
        `load_state_dict` accepts); for a Hugging Face model, `path` is a directory that
        `from_pretrained` loads. Collective; rank 0 writes."""
        from fxspeed.runtime.checkpoint import export_hf, export_safetensors

        self._refuse_half_stepped("engine.export()")
        self._expect_all_ranks("engine.export()", fix="Call engine.export(path) on every rank (each rank writes or reads its "
                               "part; do not guard it with `if rank == 0`)")
        hf = hasattr(self.model, "config") and hasattr(self.model.config, "save_pretrained")
        if not hf and (os.path.isdir(path) or os.fspath(path).endswith(("/", os.sep))):
            # (checked on every rank, before the collective state_dict: rank 0 alone raising would hang the others)
            raise ConfigError(f"engine.export({os.fspath(path)!r}): {type(self.model).__name__} is exported as one "
                              "safetensors file and the path is a directory; give a file path, e.g. "
                              f"{os.path.join(os.fspath(path), 'model.safetensors')!r}")
        state = self.state_dict()
        objects = [k for k, v in state.items() if not isinstance(v, torch.Tensor)]
        if objects:  # (get_extra_state's Python objects: safetensors holds tensors only)
            if self.rank == 0:
                log.warning("fxspeed: engine.export(%r) leaves out %s (extra state that is not a tensor: safetensors "
                            "holds tensors only); engine.save keeps it", os.fspath(path), objects[:5])
            state = {k: v for k, v in state.items() if k not in objects}
        if hf:
            export_hf(path, self.model, state)
        else:
            export_safetensors(path, state, rank=self.rank)
        if self.dist.active:
            dist.barrier(group=self.dist.group)

    def _canonical_optimizer_state(self) -> dict[str, dict[str, torch.Tensor]]:
        """Optimizer states per parameter (canonical name), full tensors: shards of flat buckets
        are gathered over the replicas (collective)."""
        out: dict[str, dict[str, torch.Tensor]] = {}
        opt_state = _states_of(self.optimizer)
        if self._flat is not None and self.config.zero >= 1:
            flat = self._flat
            for k, b in enumerate(flat.buckets):
                st = opt_state.get(flat.shards[k], {})
                for key, v in st.items():
                    if v is None:
                        continue
                    if not torch.is_tensor(v) or v.dim() == 0:
                        for name in b.names:
                            out.setdefault(name, {})[key] = v.clone() if torch.is_tensor(v) else torch.tensor(v)
                        continue
                    # Gathered on the device the collective runs on; the host tier's states
                    # (host tensors) come back to the host, one bucket on the device at a time.
                    full = torch.empty(b.padded, dtype=v.dtype, device=flat.shards[k].device)
                    gather_into(full, v.to(full.device).contiguous(), flat.group, flat.world)
                    for name, shape, off in zip(b.names, b.shapes, b.offsets):
                        t = full[off:off + _numel(shape)].view(shape).to(v.device, copy=True)
                        # a tp slice's state -> the full tensor (collective over tp)
                        out.setdefault(name, {})[key] = self._tp.gather_like(self._params[name], t) if self._tp else t
            return out
        for g in self.optimizer.param_groups:
            for p in g["params"]:
                st = opt_state.get(p, {})
                name = self._canonical[id(p)]
                out[name] = {key: (v.clone() if torch.is_tensor(v) else torch.tensor(v)) for key, v in st.items()
                             if v is not None}
                if self._tp:  # slices of tp-sharded states -> full tensors (collective over tp)
                    out[name] = {key: self._tp.gather_like(p, v) for key, v in out[name].items()}
        return out

    def _check_optimizer_states(self, saved: dict[str, dict[str, torch.Tensor]], steps: int,
                                directory: str | os.PathLike) -> None:
        """The checkpoint's optimizer states must be this optimizer's: SGD's momentum_buffer under
        AdamW loaded without a word and failed inside the next step (KeyError: 'exp_avg'), and
        Adam's moments under SGD were dropped silently."""
        c = self.config
        own = {"step", "exp_avg", "exp_avg_sq"} if c.optimizer in ("adam", "adamw") else \
            {"momentum_buffer"} if c.momentum else set()
        keys = {k for st in saved.values() for k in st}
        if keys - own:
            kind = "Adam/AdamW's" if "exp_avg" in keys else "SGD with momentum's" if "momentum_buffer" in keys else "other"
            raise ConfigError(f"engine.load({str(directory)!r}): the checkpoint holds {kind} optimizer states "
                              f"({', '.join(sorted(keys))}) and this engine's Config.optimizer={c.optimizer!r}"
                              + (f" (momentum={c.momentum:g})" if c.optimizer == "sgd" else "") + " keeps "
                              + (", ".join(sorted(own)) or "none") + "; nothing was loaded. Compile with the "
                              "checkpoint's optimizer settings, or load the weights alone: "
                              "engine.load_state_dict(state) of an engine.state_dict() or exported model")
        if own and not keys and steps:
            log.warning("fxspeed: engine.load(%r): the checkpoint was trained %d steps but holds no optimizer states "
                        "(its optimizer kept none, e.g. SGD without momentum); Config.optimizer=%r starts from fresh "
                        "states", str(directory), steps, c.optimizer)

    def _load_canonical_optimizer_state(self, saved: dict[str, dict[str, torch.Tensor]]) -> None:
        if isinstance(self.optimizer, OffloadedAdam):
            staged: dict = {}
            self._fill_optimizer_state(saved, staged)
            self.optimizer.load_full_state(staged)
            return
        self._fill_optimizer_state(saved, self.optimizer.state)

    def _fill_optimizer_state(self, saved: dict[str, dict[str, torch.Tensor]], opt_state: Any) -> None:
        if self._flat is not None and self.config.zero >= 1:
            flat = self._flat
            for k, b in enumerate(flat.buckets):
                shard = flat.shards[k]
                keys = sorted({key for name in b.names for key in saved.get(name, {})})
                st: dict[str, Any] = {}
                for key in keys:
                    first = saved[b.names[0]][key]
                    if first.dim() == 0:
                        st[key] = first.clone().to(shard.device)
                        continue
                    full = torch.zeros(b.padded, dtype=first.dtype, device=shard.device)
                    for name, off in zip(b.names, b.offsets):
                        t = saved[name][key]
                        if self._tp:  # this tp rank's slice of a full saved state
                            t = self._tp.local(self._params[name], t)
                        full[off:off + t.numel()].copy_(t.reshape(-1))
                    lo, hi = flat._range(b)
                    st[key] = full[lo:hi].clone()
                if st:
                    opt_state[shard] = st
                else:  # saved before its first step: fresh, not what this engine had stepped since
                    opt_state.pop(shard, None)
            return
        for g in self.optimizer.param_groups:
            for p in g["params"]:
                name = self._canonical[id(p)]
                if name in saved and saved[name]:
                    opt_state[p] = {key: (self._tp.local(p, v) if self._tp else v).clone().to(p.device)
                                    for key, v in saved[name].items()}
                else:  # saved before its first step: fresh, not what this engine had stepped since
                    opt_state.pop(p, None)


def unscale_or_skip(scaler: DynamicLossScaler | None, stepped: list[torch.Tensor], stats: dict,
                    factors: list | None = None, say: bool = True) -> bool:
    """fp16: unscale the gradients of `stepped` in place (or, given `factors`, append 1/scale to
    it and leave them as they are) and agree on overflow with every rank; True means skip this
    step (parameters, optimizer states and the lr schedule stay as they were). Counts skipped
    steps and the scale in `stats`, and says so in the log when `say` (one rank: the answer is
    agreed, so every rank saying it would print the same line world-size times)."""
    if scaler is None:
        return False
    if factors is not None:
        factors.append(1.0 / scaler.scale)
    overflow = scaler.unscale_and_check([t.grad for t in stepped if t.grad is not None], unscale=factors is None)
    scaler.update(overflow)
    stats["loss_scale"] = float(scaler.scale)
    if overflow:
        stats["skipped_steps"] += 1
        if say:
            log.warning("fxspeed: step %d overflowed in fp16; skipped (loss scale now %g, %d skipped so far)",
                        stats["steps"], float(scaler.scale), stats["skipped_steps"])
    return overflow


def _norm_after(grads: list[torch.Tensor], factors: list) -> torch.Tensor:
    """The norm of `grads` upcast to fp32 and multiplied by `factors` (fp16's 1/scale), one tensor
    at a time: what the in-memory path takes of its unscaled fp32 gradients, bit for bit (the norm
    of the scaled ones times 1/scale differs in the last bits unless the scale is a power of 2)."""
    norms = []
    for g in grads:
        t = g.float()  # a copy for low-precision gradients: they stay scaled for the optimizer
        if t is g:
            t = g.clone()
        for f in factors:
            t.mul_(f)
        norms.append(torch._foreach_norm([t], 2.0)[0])
    return torch.linalg.vector_norm(torch.stack(norms), 2.0)


# param_group keys that choose torch's implementation, not a training setting: never restored
_IMPLEMENTATION_FLAGS = frozenset({"params", "fused", "foreach", "capturable", "differentiable"})


# ... and the ones Config owns (weight decay: the engine may apply it itself, under no_weight_decay)
# (and Config.optimizer's update rule: torch's `decoupled_weight_decay` is AdamW's vs Adam's, and
# the engine never sets amsgrad/maximize; restored from a checkpoint under lr_schedule="manual",
# an optimizer="adam" engine resuming an AdamW run decayed as AdamW)
_CONFIG_OWNED = frozenset({"weight_decay", "eps", "decoupled_weight_decay", "amsgrad", "maximize"})


def _group_settings(optimizer: torch.optim.Optimizer) -> list[dict[str, Any]]:
    """Each param_group's settings (lr, betas, momentum, a scheduler's initial_lr ...) for a
    checkpoint: what a user's scheduler under lr_schedule="manual" changes. As plain numbers: a
    numpy float (np.cos in a hand-written schedule) is refused by the checkpoint's safe load."""
    def plain(v: Any) -> Any:
        if isinstance(v, (tuple, list)):
            return type(v)(plain(x) for x in v)
        if isinstance(v, numbers.Real) and not isinstance(v, (bool, int, torch.Tensor)):
            return float(v)
        if isinstance(v, numbers.Integral) and not isinstance(v, (bool, torch.Tensor)):
            return int(v)
        return v
    keep = (bool, int, float, str, type(None), tuple, list, torch.Tensor)
    return [{k: plain(v) for k, v in g.items()
             if k not in _IMPLEMENTATION_FLAGS and k not in _CONFIG_OWNED and isinstance(plain(v), keep)}
            for g in optimizer.param_groups]


def _total_norm(grads: list[torch.Tensor]) -> torch.Tensor:
    """torch.nn.utils.get_total_norm, with low-precision gradients' norms taken in fp32 (a bf16
    norm keeps 3 digits: the clip coefficient would be off by ~0.4%)."""
    if all(g.dtype in (torch.float32, torch.float64) for g in grads):
        return torch.nn.utils.get_total_norm(grads, foreach=True)
    norms = torch._foreach_norm(grads, 2.0, dtype=torch.float32)
    return torch.linalg.vector_norm(torch.stack(norms), 2.0)


def _reduce_bucket(flat: FlatParameters, k: int, buf: torch.Tensor, *, scatter: bool) -> Callable[[], torch.Tensor]:
    """Start summing bucket k's flat gradient `buf` over the replicas (asynchronous); the returned
    finish() waits and gives the reduced bucket, or with `scatter` (ZeRO-2/3, which keep only
    their shard) this rank's reduced shard: a reduce-scatter, half an all-reduce's bytes
    (point-to-point exchanges on gloo, as the one-stage programs'; why:
    docs/decisions/zero-scatter-via-all-reduce-on-gloo.md)."""
    if not scatter:
        work = dist.all_reduce(buf, group=flat.group, async_op=True)
        return lambda: (work.wait(), buf)[1]
    world, rank = flat.world, flat.rank
    s = flat.buckets[k].shard_size(world)
    mine = buf[rank * s:(rank + 1) * s]
    if flat.exchange:
        received = exchange_scatter(buf, world, flat.group.group_name)

        def finish() -> torch.Tensor:
            _c10d.wait_tensor(received)
            if world == 2:  # one add: a + b == b + a, the collective's sum bit for bit
                return received.add_(mine)
            return mine + received.view(world - 1, s).sum(0)
        return finish
    shard = torch.empty(s, dtype=buf.dtype, device=buf.device)
    work = dist.reduce_scatter_tensor(shard, buf, group=flat.group, async_op=True)
    return lambda: (work.wait(), shard)[1]


@contextlib.contextmanager
def _meta_stand_ins(model: nn.Module, shapes: dict[int, tuple[int, ...]]) -> Iterator[None]:
    """Inside: every Parameter whose id is in `shapes` is replaced in its module by a meta
    Parameter of that shape (one per Parameter, so tied weights stay tied): for tracing a model
    whose Parameters hold only part of their values (pipeline stages freed, tp slices); the
    capture fakes them on the model's device. Restored on exit."""
    stand_in: dict[int, nn.Parameter] = {}
    swapped: list[tuple[dict, str, nn.Parameter]] = []
    try:
        for mod in model.modules():
            for name, t in list(mod._parameters.items()):
                if t is not None and id(t) in shapes:
                    if id(t) not in stand_in:
                        stand_in[id(t)] = nn.Parameter(torch.empty(shapes[id(t)], dtype=t.dtype, device="meta"),
                                                       requires_grad=t.requires_grad)
                    swapped.append((mod._parameters, name, t))
                    mod._parameters[name] = stand_in[id(t)]
        yield
    finally:
        for store, name, t in swapped:
            store[name] = t


def _canonical_names(model: nn.Module) -> dict[int, str]:
    out: dict[int, str] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        out.setdefault(id(p), name)
    return out


@dataclasses.dataclass(frozen=True)
class _EachRun:
    """A program input whose tensor changes between runs: StepExecutor calls `current()` at each."""
    current: Callable[[], torch.Tensor]


def _accumulate(into: dict, new: dict) -> None:
    for k, t in new.items():
        into[k] = t if k not in into else into[k] + t


def _layout(buckets: list[Bucket]) -> list[tuple]:
    return [(b.names, [tuple(s) for s in b.shapes], b.padded) for b in buckets]


def _bucket(index: int, named: list[tuple[str, nn.Parameter]], world: int) -> Bucket:
    offsets, off = [], 0
    for _, p in named:
        offsets.append(off)
        off += p.numel()
    padded = -(-off // world) * world
    return Bucket(index, [n for n, _ in named], [tuple(p.shape) for _, p in named], offsets, off, padded,
                  str(named[0][1].dtype).replace("torch.", ""))


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _states_of(optimizer: torch.optim.Optimizer) -> Any:
    """Per-tensor optimizer states, read back from the swap file when they are offloaded."""
    return optimizer.full_state() if isinstance(optimizer, OffloadedAdam) else optimizer.state


def _optimizer_spec(c: Config) -> OptimizerSpec:
    return OptimizerSpec(name=c.optimizer, lr=c.lr, betas=tuple(c.betas), eps=c.eps, weight_decay=c.weight_decay,
                         momentum=c.momentum, lr_schedule=c.lr_schedule, warmup_steps=c.warmup_steps,
                         total_steps=c.total_steps)

