"""The compile pipeline for one batch signature: capture -> passes -> annotate -> program.

    capture      model + batch          -> GraphModule + StepSignature
    passes       normalize, DCE, ...    -> rewritten GraphModule (verified after each)
    annotate     analysis               -> NodeInfo on every node
    program      GraphModule + signature, handed to the runtime
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch.fx as fx
import torch.nn as nn

from fxspeed.compiler.annotate import make_annotate_pass
from fxspeed.compiler.capture import CapturedStep, LossFn, capture_step
from fxspeed.config import Config
from fxspeed.compiler.pass_manager import PassContext, PassManager, PassRecord
from fxspeed.compiler.rewrite import scale_backward_seed
from fxspeed.ir import StageProgram, StepSignature
from fxspeed.ir.schedule import Schedule

log = logging.getLogger("fxspeed")


@dataclass
class CompiledStep:
    captured: CapturedStep
    records: list[PassRecord]
    capture_seconds: float
    pass_seconds: float
    costs: Any = None  # what `analyze` returned for the single-device program (the planner's GraphCosts)


def compile_step(model: nn.Module, args: tuple, kwargs: dict, *, config: Config, loss_fn: LossFn | None,
                 train: bool = True, extra_passes: Sequence[Any] = (),
                 options: dict[str, Any] | None = None,
                 analyze: Callable[[fx.GraphModule, StepSignature], Any] | None = None) -> CompiledStep:
    """`options` reach passes as ctx.options (world_size, zero, group_name, bucket_bytes).

    The single-device passes run first; `analyze(gm, signature)` (the planner's cost reader,
    passed in so the compiler never imports the planner) sees that program before the
    distributed passes rewrite it for this rank.
    """
    from fxspeed.passes import ALL_PASSES, DISTRIBUTED_PASSES, SINGLE_DEVICE_PASSES, STAGE_PASS_NAMES

    t0 = time.perf_counter()
    cap = capture_step(model, args, kwargs, loss_fn=loss_fn, train=train)
    t1 = time.perf_counter()
    annotate = make_annotate_pass()
    known = [*ALL_PASSES, *STAGE_PASS_NAMES, *(p.name for p in extra_passes)]
    opts = {"precision": config.precision, "fp32_modules": tuple(config.fp32_modules),
            "reduce_dtype": config.reduce_dtype, **(options or {})}
    ctx = PassContext(signature=cap.signature, module_of=cap.module_of, options=opts)
    local = PassManager(SINGLE_DEVICE_PASSES, analyses=[annotate], disabled=config.disable_passes, known=known)
    gm = local.ensure("annotate", local.run(cap.gm, ctx), ctx)
    costs = None
    if train and analyze is not None:
        costs = analyze(gm, cap.signature)
    dist = PassManager([*DISTRIBUTED_PASSES, *extra_passes], analyses=[annotate], disabled=config.disable_passes,
                       known=known)
    gm = dist.ensure("annotate", dist.run(gm, ctx), ctx)
    cap.gm = gm
    t2 = time.perf_counter()
    log.info("fxspeed: captured %s %s step: %d nodes in %.2fs, passes %.2fs", type(model).__name__,
             "training" if train else "eval", len(gm.graph.nodes), t1 - t0, t2 - t1)
    return CompiledStep(cap, local.records + dist.records, t1 - t0, t2 - t1, costs)


# --- multi-program (pipeline) compilation ------------------------------------------------------

SCHEDULE_NAMES = {"gpipe": "gpipe", "1f1b": "1f1b", "interleaved": "interleaved-1f1b", "zb": "zb-h1"}


@dataclass
class CompiledProgram:
    """A distributed program for one batch signature: per stage, named graph programs
    (StageProgram: forward, backward or backward_input + backward_weight), and the schedule
    of actions every pipeline position runs. `captured` is the joint micro-batch graph the
    stages were cut from (after the single-device passes)."""

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
                               pipeline=1, microbatches=1, schedule="1f1b", zero=0)


def compile_program(model: nn.Module, micro_args: tuple, micro_kwargs: dict, *, config: Config, replicas: int,
                    positions: Sequence[int] = (), loss_fn: LossFn | None = None, train: bool = True,
                    split_points: Sequence[str] | None = None,
                    analyze: Callable[[fx.GraphModule, StepSignature], Any] | None = None) -> CompiledProgram:
    """Capture one micro-batch, cut it into Config.pipeline x chunks stages and schedule them.

        joint(*state, *batch) -> (loss, *grads)
          -> split_stages   -> stage s: F_s, B_s (zb: I_s, W_s)
          -> lower_schedule -> actions per pipeline position (F/B/I/W, SEND/RECV, REDUCE, STEP)
          -> accumulate_gradients on the stages of `positions` (the ones this rank runs)

    `replicas` is the data-parallel degree: the backward seed carries 1/(M x replicas), so the
    summed gradients are those of the global-batch mean. `split_points` (module names) fixes the
    cuts, e.g. to reproduce the training split for the eval program.
    """
    from fxspeed.ir.schedule import validate
    from fxspeed.passes.program.accumulate_gradients import accumulate_stage_gradients
    from fxspeed.passes.program.lower_schedule import make
    from fxspeed.passes.program.split_stages import split_stages

    P, M = config.pipeline, config.microbatches
    chunks = int(config.extra.get("pipeline_chunks", 2)) if config.schedule == "interleaved" else 1
    schedule = make(SCHEDULE_NAMES[config.schedule], P, M, chunks)
    validate(schedule)
    compiled = compile_step(model, micro_args, micro_kwargs, config=micro_config(config), loss_fn=loss_fn,
                            train=train, options={"world_size": 1, "zero": 0, "group_name": "",
                                                  "bucket_bytes": 1 << 30}, analyze=analyze)
    cap = compiled.captured
    divisor = 1.0
    if train:
        # Gradients of the global-batch mean come straight out of backward: the seed carries
        # 1/(M x replicas) (exact for powers of two), so no pass over the gradients divides them.
        divisor = 1.0 if scale_backward_seed(cap.gm, cap.signature, 1.0 / (M * replicas)) else float(M * replicas)
        cap.gm.recompile()
    stages = split_stages(cap.gm, cap.signature, P * chunks, split_points=split_points,
                          model_name=type(model).__name__)
    if train and "accumulate_gradients" not in config.disable_passes:
        for s, pos in enumerate(schedule.placement):
            if pos in positions:
                stages[s] = accumulate_stage_gradients(stages[s])
    return CompiledProgram(cap, stages, schedule, compiled.records, compiled.costs, divisor)


class Compiler:
    """The compiler as the engine sees it: bound once to a Config, the mesh and the loss, it
    turns a model and a batch into programs. The runtime calls it (api.compile hands it to the
    Engine) and so never imports the compiler or the passes itself.

    Pass options are derived here, once, from the Config and the mesh.
    """

    def __init__(self, config: Config, mesh: Any, loss_fn: LossFn | None = None):
        self.config = config
        self.mesh = mesh
        self.loss_fn = loss_fn
        self.options = derive_options(config, mesh)

    def step(self, model: nn.Module, args: tuple, kwargs: dict, *, train: bool,
             analyze: Callable[[fx.GraphModule, StepSignature], Any] | None = None) -> CompiledStep:
        """One-stage program: the joint step graph rewritten for this rank (data parallel, ZeRO)."""
        return compile_step(model, args, kwargs, config=self.config, loss_fn=self.loss_fn, train=train,
                            options=self.options if train else {}, analyze=analyze)

    def program(self, model: nn.Module, micro_args: tuple, micro_kwargs: dict, *, train: bool,
                positions: Sequence[int] = (), split_points: Sequence[str] | None = None,
                analyze: Callable[[fx.GraphModule, StepSignature], Any] | None = None) -> CompiledProgram:
        """Pipeline program: stage programs and the schedule (see compile_program)."""
        return compile_program(model, micro_args, micro_kwargs, config=self.config, replicas=self.mesh.dp,
                               positions=positions, loss_fn=self.loss_fn, train=train, split_points=split_points,
                               analyze=analyze)


def derive_options(config: Config, mesh: Any) -> dict[str, Any]:
    """Pass options for this rank from the Config and the mesh (the passes never read Config)."""
    import torch.distributed as dist

    gloo = mesh.active and dist.get_backend(mesh.group("world")) == "gloo"
    return {"precision": config.precision, "fp32_modules": tuple(config.fp32_modules),
            "reduce_dtype": config.reduce_dtype,
            "world_size": mesh.dp, "rank": mesh.coords()["dp"], "zero": config.zero,
            "group_name": mesh.group_name("dp"), "bucket_bytes": int(config.bucket_mb * 2**20),
            # gloo's reduce-scatter of a 25 MB bucket took 1.5x as long as all-reduce plus the
            # slice copy (2 CPU ranks), so ZeRO-2/3 all-reduce and keep their slice there.
            "scatter_via_all_reduce": gloo,
            # gloo's all-gather allocates a full-size temporary per call and took 1.6x an
            # all-reduce of the zero-padded shard, so ZeRO-3 gathers that way there.
            "gather_via_all_reduce": gloo,
            "reuse_grad_buckets": True}
