"""pack_linear_weights: in a CPU serving program of a few tokens, every fp32 linear layer reads its
weight pre-packed for oneDNN instead of multiplying through MKL's GEMM, which is slow at a few
rows (runtime/kernels/packed_linear.py has the measurements).

    before:  w: param [out, in];  y = addmm(b, x, t(w))        # nn.Linear
             c: param [in, out];  z = addmm(b2, x2, c)          # GPT-2's Conv1D
             (lm head)            l = mm(r, t(E))               # E also read by the embedding
    after:   wp: packed_weight(w);   y = mkldnn._linear_pointwise(x, wp, b)
             cp: packed_weight_t(c); z = mkldnn._linear_pointwise(x2, cp, b2)
             Ep: packed_weight(E);   l = mkldnn._linear_pointwise(r, Ep, None)

The new inputs (IOSpec kinds "packed_weight", "packed_weight_t", target: the parameter's name)
are the parameter as [out, in], packed by the serving loop once for every bucket
(runtime/kernels/packed_linear.PackedWeights); a parameter no other node reads leaves the
program's inputs. Only 2-D fp32 products whose weight is a parameter (directly or through one
transpose) and whose bias, if any, is a 1-D vector of the output size are rewritten.

Runs in programs on the CPU of at most `pack_linear_tokens` tokens (the decode buckets; at a
full prefill bucket MKL is as fast, so those keep reading the parameters). In a larger CPU
program it still records the bytes it would pack (`gm.meta["packed_weight_bytes"]`, and
`["transposed_copy_bytes"]` for the GEMM's copies), so the inference plan, made from the first
(largest) bucket, counts the copies the decode buckets hold,
and the weights with their limit (`gm.meta["packable_weights"]`, `["pack_linear_tokens"]`), which
the serving loop times both ways before it compiles a small bucket with packing or without
(`pack_linear_tokens` 0 for that bucket): which is faster depends on the machine.
With `linear_copies="split"` (the serving loop's probe measured it fastest, CPU threads > 1) the
products read copies split over the threads instead:

    after:   cs: split_weight_t(c) [k, in, ceil(out/k)];  z = split_linear(x2, cs, b2, out)

(runtime/kernels/packed_linear.split_linear: a batched GEMM of one slice per thread; k is
`linear_split_ways`, the slices of the serving loop's copies, PackedWeights.ways).
Options read: pack_linear_tokens (0: never), linear_copies, linear_split_ways.
why: docs/decisions/pack-linear-weights-on-cpu.md
"""

from __future__ import annotations

import torch
import torch.fx as fx

from fxspeed.compiler.pass_manager import PassContext, PassResult, graph_pass
from fxspeed.compiler.rewrite import call
from fxspeed.ir import IOSpec, StepSignature
from fxspeed.runtime.kernels.packed_linear import LINEAR, TRANSPOSED_KIND, available, split_linear

aten = torch.ops.aten
WEIGHT_KINDS = ("param", "param_tp")


@graph_pass("pack_linear_weights", invalidates=("annotate",))
def pack_linear_weights(gm: fx.GraphModule, ctx: PassContext) -> PassResult:
    g = gm.graph
    sig = ctx.signature
    placeholders = [n for n in g.nodes if n.op == "placeholder"]
    spec_of = dict(zip(placeholders, sig.inputs))
    tokens = next((n.meta["val"].shape[-1] for n, s in spec_of.items() if s.kind == "tokens"), None)
    found = [(n, *m) for n in g.nodes if (m := _match(n, spec_of)) is not None]
    on_cpu = all(v.device.type == "cpu" for n in placeholders if isinstance(v := n.meta.get("val"), torch.Tensor))
    limit = ctx.options.pack_linear_tokens
    if not found or not on_cpu or not available() or limit <= 0 or tokens is None:
        return PassResult(gm, modified=False)
    # one packed copy per (parameter, orientation), however many products read it
    unique = {(m[1], m[2]): m[1] for m in found}
    gm.meta["packed_weight_bytes"] = sum(p.meta["val"].numel() * 4 for p in unique.values())
    # and the [in, out] copies of the [out, in] ones, held where the probe picks ATen's GEMM
    gm.meta["transposed_copy_bytes"] = sum(p.meta["val"].numel() * 4 for (p, t) in unique if not t)
    # and the split copies of every weight, held where the probe splits the products over the threads
    # (only with more than one: one thread runs a batch of products one after the other), in as many
    # slices as the serving loop's copies hold (PassOptions.linear_split_ways)
    ways = ctx.options.linear_split_ways
    gm.meta["split_copy_bytes"] = sum(_split_shape(p.meta["val"], t, ways).numel() * 4 for (p, t) in unique) \
        if ways > 1 else 0
    # what the serving loop times before it compiles a bucket with or without packing
    gm.meta["packable_weights"] = [IOSpec("packed_weight_t" if t else "packed_weight", spec_of[p].target)
                                   for p, t in unique]
    gm.meta["pack_linear_tokens"] = limit
    if tokens > limit:
        return PassResult(gm, modified=False)
    if ctx.options.linear_copies == "transposed":
        return _read_transposed_copies(gm, sig, spec_of, found)
    splits = ctx.options.linear_copies == "split"
    kind = "split_weight" if splits else "packed_weight"
    packed: dict[tuple[fx.Node, bool], fx.Node] = {}
    new_specs: list[IOSpec] = []
    last = placeholders[-1]
    for node, param, transposed, x, bias in found:
        key = (param, transposed)
        if key not in packed:
            with g.inserting_after(last):
                ph = g.placeholder(f"{param.name}_{'split' if splits else 'packed'}{'_t' if transposed else ''}")
            val = param.meta["val"]
            # packed: [out, in], the runtime's is oneDNN's opaque layout; split: [k, in, ceil(out / k)]
            ph.meta["val"] = _split_shape(val, transposed, ways) if splits else val.t() if transposed else val
            packed[key] = last = ph
            new_specs.append(IOSpec(f"{kind}_t" if transposed else kind, spec_of[param].target))
        with g.inserting_before(node):
            if splits:
                out = param.meta["val"].shape[1 if transposed else 0]
                new = call(g, split_linear, (x, packed[key], bias, out))
            else:
                new = call(g, LINEAR, (x, packed[key], bias, "none", [], ""))
        node.replace_all_uses_with(new)
        weight = node.args[-1]
        g.erase_node(node)
        if weight is not param and not weight.users:
            g.erase_node(weight)
    _drop_unread_parameters(g, sig, spec_of, new_specs)
    return PassResult(gm, modified=True)


def _split_shape(val: torch.Tensor, transposed: bool, ways: int) -> torch.Tensor:
    """An empty tensor shaped as the split copy (runtime/kernels/packed_linear.split) of parameter
    value `val`: [in, out] where `transposed` (a Conv1D's), else [out, in]."""
    inp, out = val.shape if transposed else val.shape[::-1]
    return val.new_empty((ways, inp, -(-out // ways)))


def _drop_unread_parameters(g: fx.Graph, sig: StepSignature, spec_of: dict[fx.Node, IOSpec],
                            new_specs: list[IOSpec]) -> None:
    """Parameters only the rewritten products read are inputs no longer; the copies' inputs
    (`new_specs`, placeholders added after the others) follow the rest."""
    placeholders = list(spec_of)
    unread = {ph for ph in placeholders if spec_of[ph].kind in WEIGHT_KINDS and not ph.users}
    for ph in unread:
        g.erase_node(ph)
    sig.inputs = [spec_of[n] for n in placeholders if n not in unread] + new_specs


def _read_transposed_copies(gm: fx.GraphModule, sig: StepSignature, spec_of: dict[fx.Node, IOSpec],
                            found: list[tuple[fx.Node, fx.Node, bool, fx.Node, fx.Node | None]]) -> PassResult:
    """linear_copies="transposed": every product over `t(P)` of an [out, in] parameter reads a
    contiguous [in, out] copy of it instead (a new input of kind "transposed_weight"), so ATen's
    GEMM streams rows of the weight, not dot products over them (1.6x faster at a row on the dev
    box: runtime/kernels/packed_linear.transposed). Products over an [in, out] parameter (Conv1D)
    already read that layout and stay."""
    g = gm.graph
    copies: dict[fx.Node, fx.Node] = {}
    new_specs: list[IOSpec] = []
    last = list(spec_of)[-1]
    for node, param, transposed, _x, _bias in found:
        if transposed:
            continue
        if param not in copies:
            with g.inserting_after(last):
                ph = g.placeholder(f"{param.name}_transposed")
            ph.meta["val"] = param.meta["val"].t()  # [in, out]; the runtime's copy is contiguous
            copies[param] = last = ph
            new_specs.append(IOSpec(TRANSPOSED_KIND, spec_of[param].target))
        weight = node.args[-1]
        node.args = (*node.args[:-1], copies[param])
        if not weight.users:
            g.erase_node(weight)
    if not copies:
        return PassResult(gm, modified=False)
    _drop_unread_parameters(g, sig, spec_of, new_specs)
    return PassResult(gm, modified=True)


def _match(node: fx.Node, spec_of: dict[fx.Node, IOSpec]) -> tuple[fx.Node, bool, fx.Node, fx.Node | None] | None:
    """(parameter, transposed, x, bias) of an fp32 `mm(x, W)` / `addmm(bias, x, W)` whose W is a
    parameter [in, out] (transposed: it is packed as W.t()) or `t(P)` of one [out, in]; else None."""
    if node.op != "call_function" or node.kwargs:
        return None
    if node.target == aten.mm.default:
        (x, w), bias = node.args, None
    elif node.target == aten.addmm.default and len(node.args) == 3:
        bias, x, w = node.args
    else:
        return None
    if not isinstance(w, fx.Node) or not isinstance(x, fx.Node):
        return None
    if w.op == "placeholder":
        param, transposed = w, True
    elif w.op == "call_function" and (w.target == aten.t.default or
                                      w.target == aten.permute.default and list(w.args[1]) == [1, 0]):
        param, transposed = w.args[0], False
    else:
        return None
    if not isinstance(param, fx.Node) or param.op != "placeholder" or spec_of[param].kind not in WEIGHT_KINDS:
        return None
    xv, pv = x.meta.get("val"), param.meta.get("val")
    if not isinstance(xv, torch.Tensor) or not isinstance(pv, torch.Tensor):
        return None
    if xv.dim() != 2 or pv.dim() != 2 or xv.dtype != torch.float32 or pv.dtype != torch.float32:
        return None
    out = pv.shape[1] if transposed else pv.shape[0]
    if bias is not None:
        bv = bias.meta.get("val") if isinstance(bias, fx.Node) else None
        if not isinstance(bv, torch.Tensor) or bv.dim() != 1 or bv.shape[0] != out or bv.dtype != torch.float32:
            return None
    return param, transposed, x, bias
