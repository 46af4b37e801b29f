"""fuse_residual_norms: a residual add and the norm that reads it run as one Triton kernel, and
the add that accumulates the residual stream's gradient runs inside the norm's backward
(runtime/kernels/residual_norms.py; the matcher: passes/graph/residual_norm_pattern.py).

    before:  h = add(x, r); n = fxspeed.layer_norm_fwd(h, [C], w, b, eps)
             ...
             nb = fxspeed.layer_norm_bwd(dy, h, [C], mean, rstd, w, b); gh = add(g, nb[0])
    after:   f = fxspeed.add_layer_norm_fwd(x, r, [C], w, b, eps)        # h = f[0]
             ...
             bb = fxspeed.layer_norm_bwd_add(dy, h, [C], mean, rstd, w, b, g)   # gh = bb[0]

(and the same for RMSNorm). It reads fuse_kernels' output: the norms are already fxspeed ops.

A pass of its own, run after recompute_pointwise where that runs: a fused add + norm reads x and
r, and r (the sublayer's output) is not kept for backward, so recompute_pointwise could not
recompute the norm's output from what backward keeps; fused first, every norm's output would be
kept until backward (planned activations +18% on a 4-layer GPT, measured). Run after it, the
recomputed norm copies in backward read h, and the forward norm is fused with its add.

compile_step and compile_inference add it where fuse_kernels runs; under tensor parallelism on
each rank's program, after shard_tensors (the residual stream whole, or this rank's tokens under
sequence parallelism: docs/decisions/fuse-after-sharding.md). Disabled by name
("fuse_residual_norms"). Options read: none.
"""

from __future__ import annotations

import torch.fx as fx

from fxspeed.compiler.pass_manager import PassContext, PassResult, graph_pass

from .residual_norm_pattern import fuse_residual_norms as rewrite_residual_norms


@graph_pass("fuse_residual_norms", invalidates=("annotate",))
def fuse_residual_norms(gm: fx.GraphModule, ctx: PassContext) -> PassResult:
    return PassResult(gm, modified=rewrite_residual_norms(gm.graph, ctx.module_of) > 0)
