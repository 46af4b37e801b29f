"""fuse_activations: an MLP's activation and its backward run as Triton kernels
(runtime/kernels/activations.py; the matcher and its exact forms: passes/graph/activation_pattern.py).

    before:  s = silu(g); y = mul(s, u)       ... nine backward ops (sigmoid, 1 - sigmoid, ...)
    after:   y = fxspeed.swiglu_fwd(g, u)     ... b = fxspeed.swiglu_bwd(dy, g, u)

and GELU (aten.gelu, or GPT-2's tanh form written out; a bias add of its own folded in) ->
fxspeed.gelu_fwd / gelu_bwd. The fused ops compute in fp32 and round once (in bf16 programs the
unfused ops round after each op: close, not identical). Runs after fuse_kernels, before
recompute_pointwise, which recomputes the fused forward in backward from g and u (kept anyway)
instead of keeping its output. compile_step and compile_inference add it where fuse_kernels runs,
and compile_inference alone on CPU programs (the serving runtime calls the fused forward ops' torch
bodies there: one aten.gelu for GPT-2's eight-op tanh GELU);
under tensor parallelism on each rank's program, after shard_tensors (on this rank's MLP
columns: docs/decisions/fuse-after-sharding.md). Disabled by name ("fuse_activations").
Options read: none.
"""

from __future__ import annotations

import torch.fx as fx

from fxspeed.compiler.pass_manager import PassContext, PassResult, graph_pass

from .activation_pattern import fuse_activations as rewrite_activations


@graph_pass("fuse_activations", invalidates=("annotate",))
def fuse_activations(gm: fx.GraphModule, ctx: PassContext) -> PassResult:
    return PassResult(gm, modified=rewrite_activations(gm.graph, ctx.module_of) > 0)
