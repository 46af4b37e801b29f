"""fuse_kernels: norms and their backward run as fxspeed's Triton kernels (runtime/kernels/norms.py).

The first slice of the fusion pass: ATen's norm ops are replaced one for one by custom ops with
the same arguments and outputs; everything else is left alone.

    before:  ln = aten.native_layer_norm(x, [C], w, b, 1e-5)
             y = getitem(ln, 0); mean = getitem(ln, 1); rstd = getitem(ln, 2)
             ...
             lnb = aten.native_layer_norm_backward(g, x, [C], mean, rstd, w, b, [True, True, True])
             gx = getitem(lnb, 0); gw = getitem(lnb, 1); gb = getitem(lnb, 2)
    after:   ln = fxspeed.layer_norm_fwd(x, [C], w, b, 1e-5)            # same getitems
             lnb = fxspeed.layer_norm_bwd(g, x, [C], mean, rstd, w, b)

and aten._fused_rms_norm / aten._fused_rms_norm_backward (what F.rms_norm and nn.RMSNorm
dispatch to for CUDA tensors) -> fxspeed.rms_norm_fwd / fxspeed.rms_norm_bwd. A backward whose
output_mask asks for something other than (input gradient, weight gradient if there is a weight,
bias gradient if there is a bias) is left to ATen.

RMSNorm written out in ATen ops (Hugging Face's LlamaRMSNorm / MistralRMSNorm / Qwen2RMSNorm,
and nn.RMSNorm / F.rms_norm on CPU, which decompose the same way) is matched as a region,
forward and backward, by passes/graph/rms_norm_pattern.py:

    before:  r = rsqrt(add(mean(pow(x, 2), [-1], True), eps)); h = mul(x, r); y = mul(w, h)
             ... a dozen backward ops reading x, r and h ...
    after:   f = fxspeed.rms_norm_fwd(x, [N], w, eps); y = getitem(f, 0); rstd = getitem(f, 1)
             b = fxspeed.rms_norm_bwd(dy, x, [N], rstd, w)   # input gradient, weight gradient

so backward keeps x and rstd only. Exact forms only; anything else is left as it is.

Costs: the annotate analysis (rerun after this pass) reads the custom op's inputs and outputs
like any node's, so each fused node reads x (+ weight, bias) and writes out, mean, rstd, as
ATen's op does; FLOPs are 0 for both (torch's formula registry has none for norms).

Options read from ctx.options: fuse_kernels ("cuda": fuse when the program's tensors are on
CUDA, the default; "always": any program, FXSPEED_FUSE_ON_CPU=1 in compiler/options.py; "off").
compile_step runs the pass only where `wanted` says so, so CPU programs list no record of it.
Disabled by name like any pass ("fuse_kernels").
"""

from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx as fx

from fxspeed.compiler.pass_manager import PassContext, PassResult, graph_pass
from fxspeed.compiler.rewrite import call, wanted_on

from .rms_norm_pattern import fuse_rms_norms

aten = torch.ops.aten


def _arguments(n: fx.Node) -> dict[str, Any]:
    """The node's arguments by schema name (positional or keyword), defaults filled in."""
    schema = n.target._schema
    out: dict[str, Any] = {}
    for i, a in enumerate(schema.arguments):
        if i < len(n.args):
            out[a.name] = n.args[i]
        elif a.name in n.kwargs:
            out[a.name] = n.kwargs[a.name]
        elif a.has_default_value():
            out[a.name] = a.default_value
        else:
            out[a.name] = None
    return out


def _layer_norm_fwd(a: dict[str, Any]) -> tuple[Any, tuple] | None:
    return torch.ops.fxspeed.layer_norm_fwd.default, (a["input"], list(a["normalized_shape"]), a["weight"],
                                                      a["bias"], float(a["eps"]))


def _layer_norm_bwd(a: dict[str, Any]) -> tuple[Any, tuple] | None:
    if list(a["output_mask"]) != [True, a["weight"] is not None, a["bias"] is not None]:
        return None
    return torch.ops.fxspeed.layer_norm_bwd.default, (a["grad_out"], a["input"], list(a["normalized_shape"]),
                                                      a["mean"], a["rstd"], a["weight"], a["bias"])


def _rms_norm_fwd(a: dict[str, Any]) -> tuple[Any, tuple] | None:
    return torch.ops.fxspeed.rms_norm_fwd.default, (a["input"], list(a["normalized_shape"]), a["weight"], a["eps"])


def _rms_norm_bwd(a: dict[str, Any]) -> tuple[Any, tuple] | None:
    if list(a["output_mask"]) != [True, a["weight"] is not None]:
        return None
    return torch.ops.fxspeed.rms_norm_bwd.default, (a["grad_out"], a["input"], list(a["normalized_shape"]),
                                                    a["rstd"], a["weight"])


def _replacements() -> dict[Any, Any]:
    table = {aten.native_layer_norm.default: _layer_norm_fwd,
             aten.native_layer_norm_backward.default: _layer_norm_bwd}
    if hasattr(aten, "_fused_rms_norm"):  # every torch >= 2.11 has it; kept optional for older builds
        table[aten._fused_rms_norm.default] = _rms_norm_fwd
        table[aten._fused_rms_norm_backward.default] = _rms_norm_bwd
    return table


def wanted(gm: fx.GraphModule, options: Any) -> bool:
    """Whether `options` (PassOptions) fuse this program: always, or when it runs on CUDA (the
    device of its inputs' values, fake at capture)."""
    return wanted_on(gm, options.fuse_kernels)


@graph_pass("fuse_kernels", invalidates=("annotate",))
def fuse_kernels(gm: fx.GraphModule, ctx: PassContext) -> PassResult:
    if not wanted(gm, ctx.options):
        return PassResult(gm, modified=False)
    import fxspeed.runtime.kernels.norms  # noqa: F401  registers the fxspeed:: ops (triton is not imported)

    table = _replacements()
    g = gm.graph
    changed = False
    for n in list(g.nodes):
        make = table.get(n.target) if n.op == "call_function" else None
        if make is None:
            continue
        rewritten = make(_arguments(n))
        if rewritten is None:
            continue
        target, args = rewritten
        with g.inserting_before(n):
            new = call(g, target, args)
        for k, v in n.meta.items():  # stack trace, module, checkpoint tags: as on the node it replaces
            new.meta.setdefault(k, v)
        if n.name in ctx.module_of:  # annotate finds forward nodes' modules by name
            ctx.module_of[new.name] = ctx.module_of[n.name]
        n.replace_all_uses_with(new)
        for u in new.users:  # the outputs ATen left None (absent weight/bias) are now empty tensors
            if u.target is operator.getitem:
                u.meta["val"] = new.meta["val"][u.args[1]]
        g.erase_node(n)
        changed = True
    # after the one-for-one swaps: the written-out norms have no ATen norm op for them to touch
    if fuse_rms_norms(g, ctx.module_of):
        changed = True
    return PassResult(gm, modified=changed)
