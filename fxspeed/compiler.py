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
from typing import Any, Sequence

import torch.nn as nn

from .annotate import make_annotate_pass
from .capture import CapturedStep, LossFn, capture_step
from .config import Config
from .pass_manager import PassContext, PassManager, PassRecord

log = logging.getLogger("fxspeed")


@dataclass
class CompiledStep:
    captured: CapturedStep
    records: list[PassRecord]
    capture_seconds: float
    pass_seconds: float


def compile_step(model: nn.Module, args: tuple, kwargs: dict, *, config: Config, loss_fn: LossFn | None,
                 train: bool = True, extra_passes: Sequence[Any] = (),
                 options: dict[str, Any] | None = None) -> CompiledStep:
    """`options` reach passes as ctx.options (world_size, zero, group_name, bucket_bytes)."""
    from fxspeed.passes import default_pipeline

    t0 = time.perf_counter()
    cap = capture_step(model, args, kwargs, loss_fn=loss_fn, train=train)
    t1 = time.perf_counter()
    annotate = make_annotate_pass()
    pm = PassManager([*default_pipeline(), *extra_passes], analyses=[annotate], disabled=config.disable_passes)
    ctx = PassContext(signature=cap.signature, module_of=cap.module_of, options=dict(options or {}))
    gm = pm.run(cap.gm, ctx)
    gm = pm.ensure("annotate", gm, ctx)
    cap.gm = gm
    t2 = time.perf_counter()
    log.info("fxspeed: captured %s %s step: %d nodes in %.2fs, passes %.2fs", type(model).__name__,
             "training" if train else "eval", len(gm.graph.nodes), t1 - t0, t2 - t1)
    return CompiledStep(cap, pm.records, t1 - t0, t2 - t1)
