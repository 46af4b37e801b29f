"""scale_loss: fp16 dynamic loss scaling as a graph input that multiplies the backward seed.

    before:  seed = ones_like(loss);      ... grads
    after:   seed = ones_like(loss) * S;  ... grads * S        (S: new input "loss_scale")

The loss output is unchanged; every gradient comes out multiplied by S, so small fp16
gradients do not flush to zero. The runtime owns S: it unscales, checks for inf/NaN on all
ranks, skips an overflowing step and adjusts S.

Options read from ctx.options: precision (acts only for "fp16").
"""

from __future__ import annotations

import torch
import torch.fx as fx

from fxspeed.ir import IOSpec
from fxspeed.compiler.pass_manager import PassContext, PassResult, graph_pass
from fxspeed.compiler.rewrite import scale_backward_seed


@graph_pass("scale_loss", invalidates=("annotate",))
def scale_loss(gm: fx.GraphModule, ctx: PassContext) -> PassResult:
    sig = ctx.signature
    if ctx.options.precision != "fp16" or not any(s.kind == "loss" for s in sig.outputs) \
            or not any(s.kind == "grad" for s in sig.outputs):
        return PassResult(gm, modified=False)
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    with gm.graph.inserting_after(placeholders[-1]):
        scale = gm.graph.placeholder("loss_scale")
    scale.meta["val"] = _scalar_like(placeholders)
    if not scale_backward_seed(gm, sig, scale):
        gm.graph.erase_node(scale)
        raise ValueError("fp16 loss scaling needs the backward seed ones_like(loss), which this graph lacks; "
                         "use precision='bf16' (no loss scaling needed)")
    sig.inputs.append(IOSpec("loss_scale", "scale"))
    return PassResult(gm, modified=True)


def _scalar_like(placeholders: list[fx.Node]) -> torch.Tensor:
    ref = next(p.meta["val"] for p in placeholders if isinstance(p.meta.get("val"), torch.Tensor))
    return ref.new_empty((), dtype=torch.float32)
