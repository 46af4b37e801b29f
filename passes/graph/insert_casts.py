"""insert_casts: mixed precision as a rewrite of the training-step graph, per op.

Matmuls, convolutions and attention (forward and backward) run in the low precision
(bf16/fp16); everything else — reductions, norms, softmax, losses, the optimizer's fp32
master weights and their gradients — stays fp32. Nodes owned by a module named in
`fp32_modules` are left alone.

    before:  t = t(w);  y = addmm(b, x, t);  z = gelu(y) ...  g_w = mm(g^T, x)
    after:   w16 = to(w, bf16); b16 = to(b, bf16); x16 = to(x, bf16)     # one cast per value
             y16 = addmm(b16, x16, t(w16)); y = to(y16, fp32); z = gelu(y) ...
             g_w = to(mm(to(g^T, bf16), x16), fp32)                      # x16 reused: the
                                                                        # bf16 copy is what
                                                                        # backward keeps
A cast is placed at the root of a view chain (the parameter, not its transpose), and each
value is cast once however many low-precision ops read it, so each parameter is cast once
per step; backward reads the same low-precision copies forward made. A low op fed by
another low op's output takes it directly (no fp32 round trip). A floating attention mask
(the bias of `_scaled_dot_product_efficient_attention`, `attn_mask` of the CPU flash kernel:
Hugging Face models build one in fp32 at capture) is cast to the query's dtype, as autocast
does; a bool mask stays bool.

Options read from ctx.options: precision ("bf16" | "fp16"; "fp32" does nothing),
fp32_modules (module path prefixes kept in fp32).
"""

from __future__ import annotations

import operator
from typing import Callable

import torch
import torch.fx as fx

from fxspeed.ir import META_KEY
from fxspeed.compiler.pass_manager import PassContext, PassResult, graph_pass
from fxspeed.compiler.rewrite import call

aten = torch.ops.aten
LOW_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}

# op -> positions of the tensor arguments that run in low precision
LOW_OPS: dict[torch._ops.OpOverload, tuple[int, ...]] = {
    aten.mm.default: (0, 1),
    aten.addmm.default: (0, 1, 2),
    aten.bmm.default: (0, 1),
    aten.baddbmm.default: (0, 1, 2),
    aten.convolution.default: (0, 1, 2),
    aten.convolution_backward.default: (0, 1, 2),
}
# Attention ops: (positions run in low precision, position of the query, the mask argument as
# (position or None, keyword name) or None). The positions follow each op's schema: the
# logsumexp stays as produced, and a floating mask/bias is cast to the query's dtype (the CUDA
# kernels refuse an fp32 bias next to a bf16 query; eager autocast casts it too); a bool
# mask is left alone. Ops a torch build lacks are skipped.
_ATTENTION: dict[str, tuple[tuple[int, ...], int, tuple[int | None, str] | None]] = {
    # (query, key, value, dropout_p, is_causal, *, attn_mask, scale)
    "_scaled_dot_product_flash_attention_for_cpu": ((0, 1, 2), 0, (None, "attn_mask")),
    # (grad_out, query, key, value, out, logsumexp, dropout_p, is_causal, *, attn_mask, scale)
    "_scaled_dot_product_flash_attention_for_cpu_backward": ((0, 1, 2, 3, 4), 1, (None, "attn_mask")),
    # (query, key, value, dropout_p, is_causal, return_debug_mask, *, scale): no mask
    "_scaled_dot_product_flash_attention": ((0, 1, 2), 0, None),
    # (grad_out, query, key, value, out, logsumexp, cum_seq_q, ...)
    "_scaled_dot_product_flash_attention_backward": ((0, 1, 2, 3, 4), 1, None),
    # (query, key, value, attn_bias, compute_log_sumexp, dropout_p, is_causal, *, scale)
    "_scaled_dot_product_efficient_attention": ((0, 1, 2), 0, (3, "attn_bias")),
    # (grad_out, query, key, value, attn_bias, out, logsumexp, philox_seed, philox_offset, ...)
    "_scaled_dot_product_efficient_attention_backward": ((0, 1, 2, 3, 5), 1, (4, "attn_bias")),
    # (query, key, value, attn_bias, compute_log_sumexp, dropout_p, is_causal, return_debug_mask, *, scale)
    "_scaled_dot_product_cudnn_attention": ((0, 1, 2), 0, (3, "attn_bias")),
    # (grad_out, query, key, value, out, logsumexp, philox_seed, philox_offset, attn_bias, ...)
    "_scaled_dot_product_cudnn_attention_backward": ((0, 1, 2, 3, 4), 1, (8, "attn_bias")),
    # (query, key, value, attn_bias, dropout_p, is_causal, return_debug_mask, *, scale)
    "_scaled_dot_product_fused_attention_overrideable": ((0, 1, 2), 0, (3, "attn_bias")),
    # (grad_out, query, key, value, attn_bias, grad_input_mask, out, logsumexp, ...)
    "_scaled_dot_product_fused_attention_overrideable_backward": ((0, 1, 2, 3, 6), 1, (4, "attn_bias")),
    # the composite op (decomposed by capture; here for graphs built by hand)
    "scaled_dot_product_attention": ((0, 1, 2), 0, (3, "attn_mask")),
}
# op -> (position of the query, (position or None, keyword) of its mask)
MASK_ARGS: dict[torch._ops.OpOverload, tuple[int, tuple[int | None, str]]] = {}
for _name, (_pos, _query, _mask) in _ATTENTION.items():
    _op = getattr(aten, _name, None)
    if _op is None:
        continue
    LOW_OPS[_op.default] = _pos
    if _mask is not None:
        MASK_ARGS[_op.default] = (_query, _mask)


def _is_view(n: fx.Node) -> bool:
    """A view of its first input in that input's dtype: what a cast can be moved in front of. A
    view that reinterprets the dtype (`view_as_real`, `view_as_complex`, `view.dtype`: a complex
    rotary's) is not one: cast in front of it, the complex value would be cast to bf16."""
    if n.op != "call_function":
        return False
    if n.target is operator.getitem:  # an element of split/unbind (a view), not of a multi-output op
        return isinstance(n.args[0], fx.Node) and _is_view(n.args[0])
    if not getattr(n.target, "is_view", False):
        return False
    src = n.args[0].meta.get("val") if n.args and isinstance(n.args[0], fx.Node) else None
    out = n.meta.get("val")
    return not (isinstance(src, torch.Tensor) and isinstance(out, torch.Tensor) and src.dtype != out.dtype)


@graph_pass("insert_casts", requires=("annotate",), invalidates=("annotate",))
def insert_casts(gm: fx.GraphModule, ctx: PassContext) -> PassResult:
    precision = ctx.options.precision
    if precision == "fp32":
        return PassResult(gm, modified=False)
    low = LOW_DTYPES[precision]
    keep = ctx.options.fp32_modules
    g = gm.graph
    low_of: dict[fx.Node, fx.Node] = {}  # fp32 value -> its low-precision twin
    raw_of: dict[fx.Node, fx.Node] = {}  # fp32 cast-back -> the low value it came from
    cast_of: dict[tuple[fx.Node, torch.dtype], fx.Node] = {}  # (mask, dtype) -> its cast, not to `low`
    changed = False

    def lowered(v: fx.Node) -> fx.Node:
        """The low-precision twin of `v`, cast at the root of its view chain, made once."""
        if v in raw_of:
            return raw_of[v]
        if v in low_of:
            return low_of[v]
        if _is_view(v) and isinstance(v.args[0], fx.Node):
            base = lowered(v.args[0])
            with g.inserting_after(base if base.op != "placeholder" else _after_placeholders(g)):
                twin = call(g, v.target, (base, *v.args[1:]), dict(v.kwargs))
        else:
            anchor = v if v.op != "placeholder" else _after_placeholders(g)
            with g.inserting_after(anchor):
                twin = call(g, aten._to_copy.default, (v,), {"dtype": low})
        low_of[v] = twin
        return twin

    for n in list(g.nodes):
        positions = LOW_OPS.get(n.target) if n.op == "call_function" else None
        if positions is None:
            continue
        inf = n.meta.get(META_KEY)
        if keep and inf is not None and any(inf.module == m or inf.module.startswith(m + ".") for m in keep):
            continue
        args = list(n.args)
        for i in positions:
            a = args[i] if i < len(args) else None
            if isinstance(a, fx.Node) and isinstance(a.meta.get("val"), torch.Tensor) and a.meta["val"].dtype == torch.float32:
                args[i] = lowered(a)
        n.args = tuple(args)
        if n.target in MASK_ARGS:
            _cast_mask(g, n, *MASK_ARGS[n.target], low, lowered, cast_of)
        before = n.meta.get("val")
        n.meta["val"] = _fake(n)
        _cast_back(g, n, raw_of, before)
        changed = True
    return PassResult(gm, modified=changed)


def _cast_mask(g: fx.Graph, n: fx.Node, query: int, mask: tuple[int | None, str], low: torch.dtype,
               lowered: Callable[[fx.Node], fx.Node], cast_of: dict[tuple[fx.Node, torch.dtype], fx.Node]) -> None:
    """Give attention node `n` its floating mask in the query's dtype (a bool mask stays bool).

    An fp32 mask next to a low-precision query gets the same shared twin as any other value
    (cast at the root of its view chain: an expanded or padded-and-sliced bias keeps its
    layout, which the memory-efficient kernel's alignment checks read); any other mismatch
    gets one cast per (mask, dtype)."""
    pos, key = mask
    in_args = pos is not None and pos < len(n.args)
    m = n.args[pos] if in_args else n.kwargs.get(key)
    q = n.args[query] if query < len(n.args) else None
    if not isinstance(m, fx.Node) or not isinstance(q, fx.Node):
        return
    mv, qv = m.meta.get("val"), q.meta.get("val")
    if not isinstance(mv, torch.Tensor) or not isinstance(qv, torch.Tensor) or not mv.is_floating_point() \
            or mv.dtype == qv.dtype:
        return
    if mv.dtype == torch.float32 and qv.dtype == low:
        cast = lowered(m)
    else:
        cast = cast_of.get((m, qv.dtype))
        if cast is None:
            with g.inserting_after(m if m.op != "placeholder" else _after_placeholders(g)):
                cast = call(g, aten._to_copy.default, (m,), {"dtype": qv.dtype})
            cast_of[(m, qv.dtype)] = cast
    if in_args:
        n.args = (*n.args[:pos], cast, *n.args[pos + 1:])
    else:
        n.kwargs = {**n.kwargs, key: cast}


def _after_placeholders(g: fx.Graph) -> fx.Node:
    return [n for n in g.nodes if n.op == "placeholder"][-1]


def _fake(n: fx.Node) -> object:
    from fxspeed.compiler.rewrite import fake_value

    return fake_value(n.target, n.args, n.kwargs)


def _cast_back(g: fx.Graph, n: fx.Node, raw_of: dict[fx.Node, fx.Node], before: object) -> None:
    """Give the consumers of each output of `n` that was fp32 before the rewrite (`before`: its
    value then) and is low now an fp32 value (one cast each). An output that was low already (a
    model converted to bf16: its matmuls took bf16 and gave bf16) stays as its readers had it."""
    val = n.meta["val"]
    if isinstance(val, torch.Tensor):
        outs = [(n, before)]
    else:  # tuple outputs are read through getitem nodes
        outs = [(u, before[u.args[1]] if isinstance(before, (tuple, list)) else None)
                for u in n.users if u.target is operator.getitem]
        for u, _ in outs:
            u.meta["val"] = val[u.args[1]]
    for o, was in outs:
        v = o.meta["val"]
        if not isinstance(v, torch.Tensor) or v.dtype == torch.float32 or not v.is_floating_point():
            continue
        if not isinstance(was, torch.Tensor) or was.dtype != torch.float32:
            continue
        users = [u for u in o.users]
        with g.inserting_after(o):
            back = call(g, aten._to_copy.default, (o,), {"dtype": torch.float32})
        for u in users:
            u.replace_input_with(o, back)
        raw_of[back] = o
