"""The compile pipelines: the one place that decides pass order.

One-stage program (compile_step):

    capture      model + batch          -> GraphModule + StepSignature
    passes       normalize, DCE, ...    -> rewritten GraphModule (verified after each)
    annotate     analysis               -> NodeInfo on every node
    program      GraphModule + signature, handed to the runtime

Pipeline program (compile_program): compile_step on one micro-batch without data parallelism,
then the program passes (passes.PROGRAM_PASSES: lower_schedule, gather_stage_weights,
split_stages, split_backward, accumulate_gradients, offload_stage_activations) under the same
pass manager -> stage programs + schedule.

Pass options are a PassOptions (fxspeed.compiler.options), derived once per rank from the
Config and the mesh by `derive_options`; the Compiler object holds them for the engine.
"""

from __future__ import annotations

import copy as copy_module
import dataclasses
import logging
import time
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import torch.fx as fx
import torch.nn as nn

from fxspeed.compiler.annotate import make_annotate_pass
from fxspeed.compiler.capture import (CapturedStep, LossFn, capture_step, forget_stale_graph_sources,
                                     graph_source_keys)
from fxspeed.compiler.options import PassOptions, derive_options, frees_gradients_in_backward
from fxspeed.compiler.pass_manager import DistributedProgram, PassContext, PassManager, PassRecord
from fxspeed.compiler.rewrite import scale_backward_seed
from fxspeed.config import Config
from fxspeed.errors import ConfigError, PassError
from fxspeed.ir import StageProgram, StepSignature
from fxspeed.ir.schedule import Schedule

log = logging.getLogger("fxspeed")

__all__ = ["CompiledProgram", "CompiledStep", "Compiler", "OPTIONAL_PASS_NAMES", "PassOptions", "compile_program", "compile_step",
           "derive_options", "micro_config"]

# The fusion passes (passes/graph/fuse_*.py): compile_step and compile_inference add them where
# fusion is wanted (PassOptions.fuse_kernels), so every pipeline must know their names to
# accept them in Config.disable_passes.
FUSION_PASS_NAMES = ("fuse_kernels", "fuse_rotary", "fuse_activations", "fuse_residual_norms", "fold_norm_casts")
# The other graph passes that join a pipeline only where they have work (or only for training):
# every pipeline accepts their names in Config.disable_passes too.
OPTIONAL_PASS_NAMES = ("recompute_checkpointed", "chunk_cross_entropy", "step_in_backward", "offload_activations",
                       "select_attention_kernel", "recompute_pointwise", "upcast_cpu_compute")


@dataclass
class CompiledStep:
    captured: CapturedStep
    records: list[PassRecord]
    capture_seconds: float
    pass_seconds: float
    costs: Any = None  # what `analyze` returned for the single-device program (the planner's GraphCosts)


def compile_step(model: nn.Module, args: tuple, kwargs: dict, *, config: Config, loss_fn: LossFn | None,
                 train: bool = True, extra_passes: Sequence[Any] = (),
                 options: PassOptions | Mapping[str, Any] | None = None,
                 analyze: Callable[[fx.GraphModule, StepSignature], Any] | None = None,
                 analyses: Sequence[Any] = ()) -> CompiledStep:
    """Capture one step and run the graph passes over it.

    `analyses`: extra analyses the distributed passes may require, made by the planner and
    handed in by the engine (e.g. "tp_placements", which shard_tensors requires when tp_size > 1).

    `options` reach passes as ctx.options: this rank's PassOptions (`derive_options(config,
    mesh)`); None means `PassOptions.single_device(config)`, and a mapping of field names is
    read as changes to that. The single-device passes run first; `analyze(gm, signature)` (the
    planner's cost reader, passed in so the compiler never imports the planner) sees that
    program before the distributed passes rewrite it for this rank.
    """
    from fxspeed.passes import ALL_PASSES, DISTRIBUTED_PASSES, SINGLE_DEVICE_PASSES, STAGE_PASS_NAMES
    from fxspeed.passes.memory.recompute_checkpointed import has_checkpointed_regions, recompute_checkpointed
    from fxspeed.passes.graph.fuse_kernels import fuse_kernels, wanted as fusion_wanted
    from fxspeed.passes.graph.fuse_activations import fuse_activations
    from fxspeed.passes.graph.fuse_residual_norms import fuse_residual_norms
    from fxspeed.passes.graph.fold_norm_casts import fold_norm_casts
    from fxspeed.passes.graph.fuse_rotary import fuse_rotary
    from fxspeed.passes.memory.chunk_cross_entropy import chunk_cross_entropy, wanted as chunking_wanted
    from fxspeed.passes.graph.select_attention_kernel import on_cuda, select_attention_kernel
    from fxspeed.passes.memory.recompute_pointwise import recompute_pointwise
    from fxspeed.passes.graph.upcast_cpu_compute import upcast_cpu_compute, wanted as upcast_wanted

    opts = PassOptions.coerce(options, config)
    _check_derived(opts, config, ("precision", "fp32_modules", "reduce_dtype"))
    sources = graph_source_keys()
    t0 = time.perf_counter()
    cap = capture_step(model, args, kwargs, loss_fn=loss_fn, train=train)
    t1 = time.perf_counter()
    annotate = make_annotate_pass()
    known = [*ALL_PASSES, *OPTIONAL_PASS_NAMES, *FUSION_PASS_NAMES, *STAGE_PASS_NAMES, *(p.name for p in extra_passes)]
    ctx = PassContext(signature=cap.signature, module_of=cap.module_of, options=opts,
                      model_name=type(model).__name__)
    # torch.utils.checkpoint regions (tagged at capture) are recomputed in backward: after the
    # casts and DCE (a cast of a region's value is recomputed with it), before the planner reads
    # the program and the distributed passes rewrite it. Only graphs with such regions run it.
    # Low-precision attention on CUDA runs FlashAttention, as autocast's dispatch would choose.
    # The fusion passes (on CUDA programs, options.fuse_kernels) run last: norms -> Triton
    # kernels see every norm, recomputed ones included, and the planner reads the fused program;
    # then rotary embeddings and MLP activations. Elementwise values backward reads are
    # recomputed there from what it keeps anyway (recompute_pointwise); then a residual add and
    # the norm reading it become one kernel (after recompute_pointwise, which recomputes a norm
    # from its input h, not from the add's operands), and a norm whose output is only cast down
    # writes it in the low dtype itself (fold_norm_casts). A large vocabulary's projection +
    # cross-entropy is chunked after the casts (it matches through them).
    # Under tensor parallelism all of these run on this rank's program, after shard_tensors:
    # each matched region is then local by construction (its values are this rank's shards, or
    # whole where the layout gathered them), so the placement solver needs no rule for the
    # fused ops, and it never sees a recompute clone that would make it gather a
    # sequence-sharded value a second time (docs/decisions/fuse-after-sharding.md).
    fuse = fusion_wanted(cap.gm, opts)
    local = [*([fuse_kernels, fuse_rotary, fuse_activations] if fuse else []),
             *([recompute_pointwise] if train else []),
             *([fuse_residual_norms, fold_norm_casts] if fuse else []),
             *([upcast_cpu_compute] if upcast_wanted(cap.gm, opts) else [])]
    sharded = opts.tp_size > 1
    single = [*SINGLE_DEVICE_PASSES, *([recompute_checkpointed] if has_checkpointed_regions(cap.gm) else []),
              *([chunk_cross_entropy] if chunking_wanted(cap.gm, opts) else []),
              *([select_attention_kernel] if opts.precision != "fp32" and on_cuda(cap.gm) else []),
              *([] if sharded else local)]
    records: list[PassRecord] = []

    def run(gm: fx.GraphModule, passes: Sequence[Any], more: Sequence[Any] = ()) -> fx.GraphModule:
        """`passes` under one pass manager, annotated after, their records kept in order."""
        pm = PassManager(passes, analyses=[annotate, *more], disabled=config.disable_passes, known=known)
        gm = pm.ensure("annotate", pm.run(gm, ctx), ctx)
        records.extend(pm.records)
        return gm

    gm = run(cap.gm, single)
    if not any(a.name == "tp_placements" for a in analyses):
        analyses = [*analyses, _no_placements()]
    distributed = [*DISTRIBUTED_PASSES, *extra_passes]
    if sharded:
        # Tensor parallelism: the planner reads this tp rank's program (its slices of the weights,
        # its share of the activations), before data parallelism rewrites it; and step_in_backward
        # must see the tp collectives that finish each gradient (a later program, compiled
        # without a plan, too). The fusion passes follow, on this rank's program.
        from fxspeed.passes import shard_tensors

        gm = run(gm, [shard_tensors], analyses)
        if local:
            gm = run(gm, local)
        distributed = [p for p in distributed if p is not shard_tensors]
    if train and opts.optimizer_store:
        # The optimizer steps inside backward (one replica only, so after tp's collectives and
        # before the planner reads the program: gradients then die where they are stepped).
        from fxspeed.passes import step_in_backward

        gm = run(gm, [step_in_backward])
    if train and opts.activation_store:
        # Saved activations leave the device until backward (after tp: their shapes are this
        # rank's; before the planner reads the program, which then counts them gone).
        from fxspeed.passes import offload_activations

        gm = run(gm, [offload_activations])
    costs = None
    if train and analyze is not None:
        planned, planned_sig = gm, cap.signature
        if _plans_bucket_steps(opts, config):
            planned, planned_sig = _stepped_by_parameter(gm, ctx, known, config)
        costs = analyze(planned, planned_sig)
    gm = run(gm, distributed, analyses)
    cap.gm = gm
    t2 = time.perf_counter()
    log.info("fxspeed: captured %s %s step: %d nodes in %.2fs, passes %.2fs", type(model).__name__,
             "training" if train else "eval", len(gm.graph.nodes), t1 - t0, t2 - t1)
    forget_stale_graph_sources(sources, gm)  # the passes' intermediate programs' (and the planner's copy's)
    return CompiledStep(cap, records, t1 - t0, t2 - t1, costs)


def _plans_bucket_steps(opts: PassOptions, config: Config) -> bool:
    """The program will step its reduced buckets inside backward (step_buckets_in_backward: data
    parallelism or master weights) in a layout whose gradients then die there."""
    return (bool(opts.optimizer_store) and (opts.world_size > 1 or opts.master_weights)
            and frees_gradients_in_backward(config, opts.world_size)
            and "step_buckets_in_backward" not in config.disable_passes)


def _stepped_by_parameter(gm: fx.GraphModule, ctx: PassContext, known: Sequence[str],
                          config: Config) -> tuple[fx.GraphModule, StepSignature]:
    """What the planner reads for a program that will step its reduced buckets inside backward: a
    copy of the one-replica program with step_in_backward's calls (each gradient dies at its
    parameter's step, as each bucket's does at its call). The program itself is not changed."""
    from fxspeed.passes import step_in_backward

    graph = fx.Graph()
    graph.output(graph.graph_copy(gm.graph, {}))  # nodes' meta shallow-copied: annotations stay apart
    copy = fx.GraphModule(gm, graph)
    sig = copy_module.deepcopy(ctx.signature)
    local = dataclasses.replace(ctx.options.local(), optimizer_store=ctx.options.optimizer_store)
    pctx = PassContext(signature=sig, options=local, module_of=ctx.module_of, model_name=ctx.model_name)
    pm = PassManager([step_in_backward], analyses=[make_annotate_pass()], disabled=config.disable_passes,
                     known=known)
    return pm.ensure("annotate", pm.run(copy, pctx), pctx), sig


def _no_placements() -> Any:
    """Stands in for the planner's "tp_placements" analysis when none was handed in: nothing to
    place on one tp rank; with tp_size > 1 a clear error instead of a guess."""
    from fxspeed.compiler.pass_manager import PassResult, graph_pass

    def run(gm: fx.GraphModule, ctx: PassContext) -> PassResult:
        if ctx.options.tp_size > 1:
            raise ConfigError(f"tensor parallelism (tp_size={ctx.options.tp_size}) needs the planner's placements: "
                              "compile through fxspeed.compile, or pass analyses=[fxspeed.planner.placement."
                              "make_placement_analysis(devices)] to compile_step")
        return PassResult(gm, modified=False)

    return graph_pass("tp_placements", is_analysis=True)(run)


def _check_derived(opts: PassOptions, config: Config, names: Sequence[str]) -> None:
    """Options must describe the Config they are compiled with (they are derived from it)."""
    cfg = PassOptions.single_device(config)
    differ = [n for n in names if getattr(opts, n) != getattr(cfg, n)]
    if differ:
        raise ConfigError("pass options disagree with the Config on "
                          + ", ".join(f"{n} ({getattr(opts, n)!r} vs Config's {getattr(cfg, n)!r})" for n in differ)
                          + "; derive them from this Config (derive_options or PassOptions.single_device)")


# --- multi-program (pipeline) compilation ------------------------------------------------------

@dataclass
class CompiledProgram:
    """A distributed program for one batch signature: per stage, named graph programs
    (StageProgram: forward, backward or backward_input + backward_weight), and the schedule
    of actions every pipeline position runs. `captured` is the joint micro-batch graph the
    stages were cut from (after the single-device passes). `records`: the graph passes' records,
    then the program passes'."""

    captured: CapturedStep
    stages: list[StageProgram]
    schedule: Schedule
    records: list[PassRecord]
    costs: Any = None
    grad_divisor: float = 1.0  # what the runtime still divides summed gradients by (1.0: the seed carries it)


def micro_config(config: Config) -> Config:
    """The config one micro-batch's joint graph is captured with: single-device passes only, tied
    weights kept under each name (stages may hold either), no data-parallel rewrite inside it."""
    return dataclasses.replace(config, disable_passes=tuple({*config.disable_passes, "dedupe_tied_parameters"}),
                               pipeline=1, microbatches=1, schedule="1f1b", zero=0, split_points=())


def compile_program(model: nn.Module, micro_args: tuple, micro_kwargs: dict, *, config: Config, replicas: int,
                    positions: Sequence[int] | None = None, loss_fn: LossFn | None = None, train: bool = True,
                    split_points: Sequence[str] | None = None,
                    analyze: Callable[[fx.GraphModule, StepSignature], Any] | None = None,
                    options: PassOptions | None = None, analyses: Sequence[Any] = ()) -> CompiledProgram:
    """Capture one micro-batch, cut it into Config.pipeline (x pipeline_chunks) stages and schedule them.

        joint(*state, *batch) -> (loss, *grads)            compile_step, no data parallelism
          -> lower_schedule       actions per pipeline position (F/B/I/W, SEND/RECV, REDUCE, STEP)
          -> gather_stage_weights ZeRO-3 over replicas: GATHER(s) / RELEASE(s) around stage s's actions
          -> split_stages         stage s: F_s, B_s
          -> split_backward       zb: B_s -> I_s, W_s
          -> accumulate_gradients on the stages of `positions` (the ones this rank runs)
          -> offload_stage_activations  activation offload: OFFLOAD(s,m) / RELOAD(s,m) actions

    The program passes run under the pass manager: verified after each, recorded in
    `records` after the graph passes, disabled by name through Config.disable_passes.

    `options`: this rank's PassOptions (default `PassOptions.single_device(config)`, which runs
    every position). `positions` and `split_points`, when given, replace the options' (module
    names fixing the cuts, e.g. to reproduce the training split for the eval program).
    `replicas` is the data-parallel degree: the backward seed carries 1/(M x replicas), so the
    summed gradients are those of the global-batch mean.

    Tensor parallelism (options.tp_size > 1; `analyses` holds the planner's "tp_placements"):
    shard_tensors rewrites the joint graph for this tp rank before the cut, so each stage program
    takes its slices of the weights and runs its tp collectives itself; the messages between
    stages are this tp rank's share of each boundary value.
    """
    from fxspeed.passes import ALL_PASSES, PROGRAM_PASSES

    opts = PassOptions.coerce(options, config)
    _check_derived(opts, config, ("precision", "fp32_modules", "reduce_dtype", "pipeline", "microbatches",
                                  "schedule"))
    changes: dict[str, Any] = {}
    if positions is not None:
        changes["positions"] = tuple(positions)
    if split_points is not None:
        changes["split_points"] = tuple(split_points)
    opts = dataclasses.replace(opts, **changes)
    sources = graph_source_keys()
    compiled = compile_step(model, micro_args, micro_kwargs, config=micro_config(config), loss_fn=loss_fn,
                            train=train, options=opts.local(), analyze=analyze, analyses=analyses)
    cap = compiled.captured
    divisor = 1.0
    M = opts.microbatches
    if train:
        # Gradients of the global-batch mean come straight out of backward: the seed carries
        # 1/(M x replicas) (exact for powers of two), so no pass over the gradients divides them.
        divisor = 1.0 if scale_backward_seed(cap.gm, cap.signature, 1.0 / (M * replicas)) else float(M * replicas)
        cap.gm.recompile()
    ctx = PassContext(signature=cap.signature, options=opts, module_of=cap.module_of,
                      model_name=type(model).__name__)
    pm = PassManager(PROGRAM_PASSES, disabled=config.disable_passes,
                     known=[*ALL_PASSES, *OPTIONAL_PASS_NAMES, *FUSION_PASS_NAMES, *(p.name for p in PROGRAM_PASSES)])
    t0 = time.perf_counter()
    program = pm.run(DistributedProgram(cap.gm, cap.signature), ctx)
    if not program.stages or program.schedule is None:
        raise PassError(f"the program passes left {'no stages' if not program.stages else 'no schedule'}; "
                        f"split_stages and lower_schedule cannot be disabled (Config.disable_passes="
                        f"{list(config.disable_passes)})")
    log.info("fxspeed: %d stage programs, schedule %s: program passes %.2fs", len(program.stages),
             program.schedule.name, time.perf_counter() - t0)
    # the stage programs' sources stay; the joint graph's (cut into them) and the passes' go
    forget_stale_graph_sources(sources, *(g for p in program.stages for g in (p.forward, p.backward, p.backward_input,
                                                                              p.backward_weight)))
    return CompiledProgram(cap, program.stages, program.schedule, compiled.records + pm.records, compiled.costs,
                           divisor)


class Compiler:
    """The compiler as the engine sees it: bound once to a Config, the mesh and the loss, it
    turns a model and a batch into programs. The runtime calls it (api.compile hands it to the
    Engine) and so never imports the compiler or the passes itself.

    Pass options are derived here, once, from the Config and the mesh (`self.options`).
    """

    def __init__(self, config: Config, mesh: Any, loss_fn: LossFn | None = None, analyses: Sequence[Any] = (),
                 device: Any = None):
        """`analyses`: planner-made analyses the distributed passes require (tp placements).
        `device`: this rank's DeviceSpec (the cost of moving activations off it)."""
        self.analyses = tuple(analyses)
        self.config = config
        self.mesh = mesh
        self.loss_fn = loss_fn
        self.options = derive_options(config, mesh, device)

    def step(self, model: nn.Module, args: tuple, kwargs: dict, *, train: bool,
             analyze: Callable[[fx.GraphModule, StepSignature], Any] | None = None,
             grad_accum_role: str = "whole", bucket_layout: Sequence[Sequence[str]] = ()) -> CompiledStep:
        """One-stage program: the joint step graph rewritten for this rank (data parallel, ZeRO).
        Eval programs are compiled without data parallelism. `grad_accum_role`: "local" / "last"
        for the slices of a step that reduces once (PassOptions.grad_accum_role).
        `bucket_layout`: the gradient buckets' parameter names the engine's flat buffers hold
        (PassOptions.bucket_layout); () for its first program."""
        options = self.options if train else self.options.local()
        if train and grad_accum_role != "whole":
            options = dataclasses.replace(options, grad_accum_role=grad_accum_role)
        if train and bucket_layout:
            options = dataclasses.replace(options, bucket_layout=bucket_layout)  # (PassOptions makes it tuples)
        return compile_step(model, args, kwargs, config=self.config, loss_fn=self.loss_fn, train=train,
                            options=options, analyze=analyze, analyses=self.analyses)

    def inference(self, model: nn.Module, tokens: int, copies: str = "packed", ways: int = 1) -> Any:
        """The serving program for one packed row of `tokens` tokens, with the paged KV cache
        (fxspeed/compiler/capture_inference.py). Where pack_linear_weights applies its linears read
        `copies` of the weights: "packed" (oneDNN's layout), "transposed" (ATen's GEMM over [in, out]
        copies of the [out, in] weights), "split" (copies split over the CPU threads, a batched
        GEMM) or "none" (the Parameters themselves: no memory beside the model's,
        serve(pack_linear="never")). `ways`: the slices of the split copies (the serving loop's
        PackedWeights.ways; PassOptions.linear_split_ways), in every bucket: the first sizes the
        split copies the plan counts."""
        from fxspeed.compiler.capture_inference import compile_inference

        options = dataclasses.replace(self.options.local(), linear_split_ways=ways)
        if copies == "none":
            options = dataclasses.replace(options, pack_linear_tokens=0)
        elif copies != "packed":
            options = dataclasses.replace(options, linear_copies=copies)
        return compile_inference(model, tokens, config=self.config, options=options, analyses=self.analyses)

    def program(self, model: nn.Module, micro_args: tuple, micro_kwargs: dict, *, train: bool,
                positions: Sequence[int] | None = None, split_points: Sequence[str] | None = None,
                analyze: Callable[[fx.GraphModule, StepSignature], Any] | None = None) -> CompiledProgram:
        """Pipeline program: stage programs and the schedule (see compile_program). `positions`
        defaults to this rank's pipeline position, `split_points` to Config.split_points."""
        return compile_program(model, micro_args, micro_kwargs, config=self.config, replicas=self.mesh.dp,
                               positions=positions, loss_fn=self.loss_fn, train=train, split_points=split_points,
                               analyze=analyze, options=self.options, analyses=self.analyses)
