"""Annotate: the analysis that gives every node a `NodeInfo` (see ir.py).

It only reads the graph and writes `node.meta["fxspeed"]`; it never rewrites.
FLOPs come from torch's own formula registry (torch.utils.flop_counter: matmul, conv,
attention forward and backward), so they agree with `FlopCounterMode`.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx
from torch.utils.flop_counter import flop_registry, sdpa_backward_flop_count, sdpa_flop_count

from fxspeed.ir import (ACTIVATIONS, BACKWARD, BUFFERS, FORWARD, GRADIENTS, INPUTS, IO, META_KEY, PARAMETERS, STEP,
                        TEMPORARIES, NodeInfo, StepSignature, dtype_name, op_workspace, step_calls, tensor_bytes)

_INPUT_CATEGORY = {"param": PARAMETERS, "param_shard": PARAMETERS, "param_tp": PARAMETERS, "buffer": BUFFERS,
                   "input": INPUTS,
                   "loss_scale": INPUTS, "grad_buffer": GRADIENTS, "grad_accum": GRADIENTS,
                   # inference programs (passes/inference/kv_cache.py): the cache is state, the rest per step
                   "kv_cache": BUFFERS, "tokens": INPUTS, "positions": INPUTS, "slot_mapping": INPUTS,
                   "block_table": INPUTS, "query_index": INPUTS, "query_pos": INPUTS, "logits_index": INPUTS,
                   # passes/inference/pack_linear_weights.py: a parameter in oneDNN's packed layout,
                   # an [out, in] one copied as [in, out], or one split over the CPU threads
                   "packed_weight": PARAMETERS, "packed_weight_t": PARAMETERS, "transposed_weight": PARAMETERS,
                   "split_weight": PARAMETERS, "split_weight_t": PARAMETERS}


def annotate(gm: fx.GraphModule, signature: StepSignature, module_of: dict[str, str] | None = None) -> None:
    """Write a NodeInfo on every node of `gm` (shape, dtype, bytes, FLOPs, module, role, category)."""
    module_of = module_of or {}
    nodes = list(gm.graph.nodes)
    placeholders = [n for n in nodes if n.op == "placeholder"]
    output = nodes[-1]
    outs = list(output.args[0])

    forward = _forward_nodes(outs, signature)
    grad_outputs = {o for o, s in zip(outs, signature.outputs) if s.kind in ("grad", "grad_bucket") and isinstance(o, fx.Node)}
    steps = step_calls(gm.graph)
    grad_outputs |= {g for n in steps for g in n.args[3]}  # gradients the program steps itself
    param_module = {ph: signature.inputs[i].target.rpartition(".")[0] for i, ph in enumerate(placeholders)
                    if signature.inputs[i].kind in ("param", "param_tp")}
    # a weight with one name (a tied one belongs to several modules: its reader is told by its other inputs)
    tied = {*signature.tied, *signature.tied.values()}
    untied = {ph for i, ph in enumerate(placeholders) if ph in param_module and signature.inputs[i].target not in tied}

    for i, ph in enumerate(placeholders):
        spec = signature.inputs[i]
        ph.meta[META_KEY] = _base_info(ph, role=IO, category=_INPUT_CATEGORY[spec.kind],
                                       module=param_module.get(ph, ""))
    tied_readers = _tied_readers(nodes, forward, {ph: signature.inputs[i].target for i, ph in enumerate(placeholders)
                                                  if ph in param_module}, signature)
    for n in nodes:
        if n.op != "call_function":
            continue
        # An element of a forward op's tuple that only backward reads (layer norm's mean/rstd,
        # attention's logsumexp) is still produced by forward.
        parent = n.args[0] if n.target is _getitem() and n.args and isinstance(n.args[0], fx.Node) else None
        role = FORWARD if n in forward or (parent is not None and parent in forward) else BACKWARD
        if n in steps:
            role = STEP
        module = module_of.get(n.name) if role == FORWARD else None
        if module is None:
            module = tied_readers.get(n) or _module_from_inputs(n, param_module, untied)
        inf = _base_info(n, role=role, category=TEMPORARIES, module=module)
        inf.is_view = _is_view(n)
        inf.bytes_read = sum(tensor_bytes(a.meta.get("val")) for a in n.all_input_nodes) if not inf.is_view else 0
        inf.bytes_written = 0 if inf.is_view else inf.output_bytes
        inf.flops = node_flops(n)
        inf.workspace = op_workspace(n)
        if n in grad_outputs:
            inf.category = GRADIENTS
        elif role == FORWARD and any(u not in forward and u.op != "output" for u in n.users):
            inf.category = ACTIVATIONS  # produced in forward, read by backward: saved for backward
        n.meta[META_KEY] = inf
    output.meta[META_KEY] = NodeInfo(role=IO, category=TEMPORARIES)


def _base_info(n: fx.Node, *, role: str, category: str, module: str) -> NodeInfo:
    val = n.meta.get("val")
    t = val if isinstance(val, torch.Tensor) else None
    return NodeInfo(shape=tuple(int(s) for s in t.shape) if t is not None else None,
                    dtype=dtype_name(t.dtype) if t is not None else None,
                    output_bytes=0 if n.target is _getitem() else tensor_bytes(val),
                    module=module, role=role, category=category)


def _getitem() -> Any:
    import operator

    return operator.getitem


def _forward_nodes(outs: list[Any], signature: StepSignature) -> set[fx.Node]:
    """Forward = everything the loss, buffer updates and user outputs depend on."""
    seeds = [o for o, s in zip(outs, signature.outputs)
             if s.kind in ("loss", "buffer_update", "output") and isinstance(o, fx.Node)]
    seen: set[fx.Node] = set()
    stack = list(seeds)
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        stack.extend(n.all_input_nodes)
    return seen


def _tied_readers(nodes: list[fx.Node], forward: set[fx.Node], weight_names: dict[fx.Node, str],
                  signature: StepSignature) -> dict[fx.Node, str]:
    """The module of each forward op reading a tied weight (directly or through views and casts).

    The graph names a tied weight once (or, as the pipeline captures it, reads it under one of
    its names), so its placeholder tells no reader apart: GPT's embedding lookup came out as
    `head`'s, and `split_points=["head"]` named the model's first op. The weight's names are
    taken in registration order and matched to its readers in graph order: the first reader
    gets the first name, the last the last, those between the names between (the embedding is
    registered and run before the head; ALBERT's one block, k times, gets its k slots)."""
    groups: dict[str, list[str]] = {}
    for alias, canonical in signature.tied.items():
        groups.setdefault(canonical, [canonical]).append(alias)
    group_of = {name: canonical for canonical, g in groups.items() for name in g}
    chains: dict[fx.Node, str] = {ph: group_of[name] for ph, name in weight_names.items() if name in group_of}
    readers: dict[str, list[fx.Node]] = {}
    for n in nodes:
        if n.op != "call_function" or n not in forward:
            continue
        via = next((chains[a] for a in n.all_input_nodes if a in chains), None)
        if via is None:
            continue
        if _is_view(n) or n.target in _CASTS:
            chains[n] = via  # (t(weight), its bf16 copy: the reader is the op that uses them)
        else:
            readers.setdefault(via, []).append(n)
    out: dict[fx.Node, str] = {}
    for canonical, ns in readers.items():
        names, k = groups[canonical], len(ns)
        for i, n in enumerate(ns):
            j = len(names) - 1 if i == k - 1 and k > 1 else min(i, len(names) - 1)
            out[n] = names[j].rpartition(".")[0]
    return out


def _module_from_inputs(n: fx.Node, param_module: dict[fx.Node, str], untied: set[fx.Node]) -> str:
    """Backward nodes inherit the module of the parameter or forward value they read: first of a
    parameter read directly or through views and casts (a bias-free Linear's mm reads t(weight): it is the
    Linear's, not the module of its activation input, which fp32_modules and split points missed)."""
    best = ""
    for a in n.all_input_nodes:
        if a in param_module:
            return param_module[a]
        base = a
        while base.op == "call_function" and (_is_view(base) or base.target in _CASTS) and base.all_input_nodes:
            base = base.all_input_nodes[0]
            if base in untied:
                return param_module[base]
    for a in n.all_input_nodes:
        inf = a.meta.get(META_KEY)
        if inf is not None and inf.module and len(inf.module) > len(best):
            best = inf.module
    return best


# a cast of a weight (bf16/fp16 working copy per step) reads as the weight
_CASTS = (torch.ops.aten._to_copy.default, torch.ops.prims.convert_element_type.default)


def _is_view(n: fx.Node) -> bool:
    t = n.target
    if t is _getitem():
        return True
    return bool(getattr(t, "is_view", False))


aten = torch.ops.aten


def _cpu_attention_flops(q: Any, k: Any, v: Any, *_: Any, **__: Any) -> int:
    return sdpa_flop_count(q.shape, k.shape, v.shape)


def _cpu_attention_backward_flops(g: Any, q: Any, k: Any, v: Any, *_: Any, **__: Any) -> int:
    return sdpa_backward_flop_count(g.shape, q.shape, k.shape, v.shape)


def _grouped_mm_flops(a: Any, b: Any, *_: Any, out_val: Any = None, **__: Any) -> int:
    """MoE experts (torch._grouped_mm): 2 x M x N x K over the groups. 2-D x 2-D groups split
    K (the weight gradient: out [G, M, N]); otherwise each output element sums a's last dim."""
    if a.dim() == 2 and b.dim() == 2:
        return 2 * out_val.numel() // out_val.shape[0] * a.shape[1]
    return 2 * out_val.numel() * a.shape[-1]


# Ops torch's flop registry has no formula for, which a CPU trace meets: without them a plan made
# off a GPU left out attention (5-15% of a transformer's FLOPs at 1-4k tokens) and MoE experts.
_FLOPS = {aten._scaled_dot_product_flash_attention_for_cpu.default: _cpu_attention_flops,
          aten._scaled_dot_product_flash_attention_for_cpu_backward.default: _cpu_attention_backward_flops}
if hasattr(aten, "_grouped_mm"):
    _FLOPS[aten._grouped_mm.default] = _grouped_mm_flops


def node_flops(n: fx.Node) -> int:
    """FLOPs of one ATen node from torch's formula registry (and _FLOPS); 0 for ops with none."""
    target = n.target
    packet = getattr(target, "overloadpacket", None)
    fn = _FLOPS.get(target) or (flop_registry.get(packet) if packet is not None else None)
    if fn is None:
        return 0
    args, kwargs = fx.node.map_arg((n.args, n.kwargs), lambda a: a.meta.get("val"))
    try:
        return int(fn(*args, **kwargs, out_val=n.meta.get("val")))
    except Exception:  # noqa: BLE001 - a formula that cannot handle these args costs 0, not a crash
        return 0


def _annotate_pass_fn(gm: fx.GraphModule, ctx: Any) -> Any:
    from fxspeed.compiler.pass_manager import PassResult

    annotate(gm, ctx.signature, ctx.module_of)
    return PassResult(gm, modified=False)


def make_annotate_pass() -> Any:
    from fxspeed.compiler.pass_manager import graph_pass

    return graph_pass("annotate", is_analysis=True)(_annotate_pass_fn)
