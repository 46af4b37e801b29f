"""The compile pipeline for one batch signature: capture -> passes -> annotate -> program.

    capture      model + batch          -> GraphModule + StepSignature
    passes       normalize, DCE, ...    -> rewritten GraphModule (verified after each)
    annotate     analysis               -> NodeInfo on every node
    program      GraphModule + signature, handed to the runtime
"""

from __future__ import annotations

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
from fxspeed.ir import StepSignature

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
