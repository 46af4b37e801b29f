"""fuse_rotary: rotary position embeddings (q and k, forward and backward) run as Triton kernels
(runtime/kernels/rotary.py; the matcher and its exact forms: passes/graph/rotary_pattern.py).

    before:  a = mul(x, cos); r = cat([neg(slice(x, -1, h, D)), slice(x, -1, 0, h)], -1)
             out = add(a, mul(r, sin)); c = _to_copy(out, dtype=bf16)
    after:   c = fxspeed.rotary_fwd(x, cos, sin, bf16)
             (backward: eight ops -> fxspeed.rotary_bwd(g, cos, sin[, dtype]))

Bit-identical to the ops it replaces (fp32 and bf16; the cast after it folded in). Runs after
fuse_kernels, before recompute_pointwise (which recomputes the fused forward in backward like the
elementwise ops it replaces). compile_step and compile_inference add it where fuse_kernels runs;
under tensor parallelism on each rank's program, after shard_tensors (on this rank's heads:
docs/decisions/fuse-after-sharding.md). Disabled by name ("fuse_rotary"). Options read: none.
"""

from __future__ import annotations

import torch.fx as fx

from fxspeed.compiler.pass_manager import PassContext, PassResult, graph_pass

from .rotary_pattern import fuse_rotary as rewrite_rotaries


@graph_pass("fuse_rotary", invalidates=("annotate",))
def fuse_rotary(gm: fx.GraphModule, ctx: PassContext) -> PassResult:
    return PassResult(gm, modified=rewrite_rotaries(gm.graph, ctx.module_of) > 0)
