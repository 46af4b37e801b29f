"""recompute_pointwise: a cheap elementwise value that backward reads is recomputed there from
inputs backward keeps anyway, instead of being kept from forward to backward.

Autograd saves what each backward formula reads. Around an activation that is often a value
*and* the inputs it was computed from: GELU's output (for the next matmul's weight gradient)
beside its input (for gelu_backward); SwiGLU's silu(g) and silu(g) * u beside g and u. The
output costs one more tensor of the MLP's widest shape per layer, from forward until backward,
and recomputing it costs one elementwise pass. torch.compile's partitioner makes the same trade
(min-cut); here the rule is local and exact:

    before:  h = mm(x, w1); a = gelu(h); y = mm(a, w2)            # h and a saved
             ...
             g_w2 = mm(t(g_y), a); g_a = mm(g_y, t(w2)); g_h = gelu_backward(g_a, h)
    after:   h = mm(x, w1); a = gelu(h); y = mm(a, w2)            # a dies here; h saved
             ...
             a_r = gelu(h)                                        # just before its first reader
             g_w2 = mm(t(g_y), a_r); g_a = mm(g_y, t(w2)); g_h = gelu_backward(g_a, h)

A forward node is recomputed when
  - it is a pure, deterministic ATen op tagged pointwise, a cast (insert_casts' bf16 copy of a
    saved fp32 value), or one of fuse_kernels' norms, so recomputing gives the same bits;
  - backward reads it, directly or through forward views of it (which are recomputed with it),
    and neither it nor such a view is a graph output;
  - every tensor it reads is a value backward reads anyway (saved, or a placeholder backward
    reads), or another value recomputed by this rule (chains: silu(g), then silu(g) * u); a cast
    may also read a weight under a pipeline (a stage holds its weights throughout), so a bf16 twin
    of an fp32 weight is cast again in backward rather than kept per micro-batch in flight.
Clones go before the first backward reader or the first clone reading them, so each lives only
as long as backward needs it. Random ops (dropout) never qualify: their mask is kept.

compile_step runs it on training programs; under tensor parallelism on each rank's program,
after shard_tensors. Run before the placement solver, a clone reading a token-sharded value made
the solver all-gather it again in backward (10 backward all-gathers instead of 5 on a 2-layer
Llama); on the rank's program every input is local, so no collective is added
(docs/decisions/fuse-after-sharding.md). Options read: none. Disabled by name ("recompute_pointwise").
why: docs/decisions/recompute-pointwise.md
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from fxspeed.compiler.pass_manager import PassContext, PassResult, graph_pass
from fxspeed.ir import META_KEY
from fxspeed.passes.memory.recompute_checkpointed import CASTS, _is_forward, clone_into_backward, is_recomputable_op

prims = torch.ops.prims


def _is_view(n: fx.Node) -> bool:
    inf = n.meta.get(META_KEY)
    return n.target is operator.getitem or (inf is not None and inf.is_view)


# fuse_kernels' forward ops (each one pass over its inputs, as cheap as the elementwise ops it
# replaces): without them here the fused program would keep each norm's, rotary's or activation's
# output, which the unfused program's recomputed elementwise ops do not.
_FUSED_NORMS = ("fxspeed::rms_norm_fwd", "fxspeed::layer_norm_fwd", "fxspeed::rotary_fwd", "fxspeed::swiglu_fwd",
                "fxspeed::gelu_fwd")


def _cheap(n: fx.Node) -> bool:
    """Elementwise and deterministic: recomputing it reads its inputs once and writes one value."""
    if not is_recomputable_op(n) or n.target is operator.getitem:
        return False
    if n.target._schema.name in _FUSED_NORMS:
        return True
    if n.target in CASTS:
        # a dtype cast only (no device or layout change)
        return n.target is prims.convert_element_type.default or set(n.kwargs) <= {"dtype"}
    return torch.Tag.pointwise in n.target.tags and isinstance(n.meta.get("val"), torch.Tensor)


@graph_pass("recompute_pointwise", requires=("annotate",), invalidates=("annotate",))
def recompute_pointwise(gm: fx.GraphModule, ctx: PassContext) -> PassResult:
    graph = gm.graph
    nodes = list(graph.nodes)
    index = {n: i for i, n in enumerate(nodes)}
    forward = {n for n in nodes if _is_forward(n)}

    def backward_users(n: fx.Node) -> list[fx.Node]:
        return [u for u in n.users if u not in forward and u.op != "output"]

    def forward_views(n: fx.Node) -> list[fx.Node]:
        return [u for u in n.users if u in forward and _is_view(u)]

    def read_in_backward(n: fx.Node) -> bool:
        """Backward reads n's storage: n itself, or a forward view of it (autograd often saves
        the view a matmul reads, e.g. the [B*T, C] view of an activation)."""
        return bool(backward_users(n)) or any(read_in_backward(u) for u in forward_views(n))

    def returned(n: fx.Node) -> bool:
        return any(u.op == "output" for u in n.users) or any(returned(u) for u in forward_views(n))

    # Under a pipeline, a weight's low-precision twin (insert_casts' `to(w, bf16)`: pipelines keep
    # fp32 weights) is cast again in backward: the stage holds the weight throughout, and kept, the
    # twin lived from a micro-batch's forward to its backward, one copy of the stage's weights per
    # micro-batch in flight (a 4-layer GPT's first stage, bf16 on 2 H100s: 221 -> 208 MB planned).
    # A joint program keeps one twin either way (its peak did not move), so it casts once.
    resident: set[fx.Node] = set()
    if ctx.options.pipeline > 1:
        placeholders = [n for n in nodes if n.op == "placeholder"]
        resident = {ph for spec, ph in zip(ctx.signature.inputs, placeholders) if spec.kind in ("param", "param_tp")}

    def kept(a: fx.Node, n: fx.Node) -> bool:
        return a in chosen or bool(backward_users(a)) or (a in resident and n.target in CASTS)

    chosen: set[fx.Node] = set()
    for n in nodes:  # in graph order: a chain's inputs are decided before it
        if n not in forward or not read_in_backward(n) or returned(n):
            continue
        if _is_view(n) and is_recomputable_op(n):
            # a view of a recomputed value is recomputed with it (it shares its storage)
            if n.all_input_nodes and n.all_input_nodes[0] in chosen:
                chosen.add(n)
            continue
        # each input recomputed too, or read by backward anyway (saved; a candidate not chosen
        # stays saved), so the clone extends no other value's life
        if _cheap(n) and all(kept(a, n) for a in n.all_input_nodes):
            chosen.add(n)
    # Defensive: a chosen value no backward node and no chosen value reads would have no place
    # to go (views are chosen with their base, so this does not happen for the ops seen so far).
    idle = [n for n in chosen if not backward_users(n) and not any(u in chosen for u in n.users)]
    while idle:
        chosen.difference_update(idle)
        idle = [n for n in chosen if not backward_users(n) and not any(u in chosen for u in n.users)]
    if not chosen:
        return PassResult(gm, modified=False)
    order = sorted(chosen, key=index.__getitem__)
    clone_into_backward(graph, order, backward_users, "recomputed_pointwise")
    for n in reversed(order):  # a value forward no longer reads at all (read by backward only)
        if not n.users:
            graph.erase_node(n)
    return PassResult(gm, modified=True)
