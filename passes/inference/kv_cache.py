"""kv_cache: thread a paged KV cache through the attention ops of a captured forward.

The forward was captured on one packed row of T tokens (`capture_inference`): the tokens of a
serving step, from several requests, side by side. Each attention is replaced by
`fxspeed::paged_attention`, which writes the step's keys and values into persistent cache
buffers (in place: no per-step allocation, no Hugging Face cache object) and attends, per
request, over everything that request cached so far:

    before:  q, k, v = ...                                  # [1, H, T, D], k/v maybe repeat_kv'd
             a = _scaled_dot_product_flash_attention_for_cpu(q, k, v, attn_mask=causal, scale=s)
             o = getitem(a, 0)
    after:   o = paged_attention(q, k0, v0, k_cache.i, v_cache.i, slot_mapping, block_table,
                                 query_index, query_pos, s)     # k0/v0: [1, Hkv, T, D]

New graph inputs (IOSpec kinds): `kv_cache` (target "<layer>.k" / "<layer>.v"; bound to the
runtime's cache tensors [num_blocks, block_size, Hkv, D]), and one each of `slot_mapping`,
`block_table`, `query_index`, `query_pos` (see runtime/kernels/paged_attention.py). Grouped-query
attention: a `repeat_kv` in front of the attention (unsqueeze -> expand -> clone -> view) is
looked through, so the cache holds Hkv heads, not H.

Positions: a model whose forward takes `position_ids` gets them as the `positions` input
(capture labels it). A model that makes its own positions with `arange(T)` (fxspeed's GPT) has
that arange replaced by the `positions` input, which this pass adds; with packed requests
`arange(T)` would be wrong for every request but the first. So is a parameter or buffer sliced to
the row's length, `table[:T]` (minGPT's `pos_emb[:, :t]`, Meta's Llama `freqs_cis[:seqlen]`):
read at the positions instead (`index_select`; not under tensor parallelism, whose weight cuts
are slices of that form). Anything else the pass cannot prove
right is refused: an attention that is not causal, an attention op it does not know, an
`arange(T)` still read after the rewrite next to a `positions` input.

Sliding windows (PassOptions.kv_windows, per layer from the model's config) go to each layer's
paged attention. Where only some layers slide (Gemma3's local layers between global ones), those
read their own `slot_mapping` and `block_table` inputs (IOSpec target "window"): a second block
table, over a second pool of blocks that the runtime keeps as a ring per request.

`gm.meta["kv_cache_position_tables"]`: the parameters/buffers read at the positions that way.
`gm.meta["kv_cache_layout"]`: per layer (Hkv, D, dtype) — what the runtime allocates and what the
planner counts as cache bytes per token; `kv_cache_windows` and `kv_cache_groups` (the block
table each layer reads: "" or "window"), per layer. Reads no options but kv_windows.
"""

from __future__ import annotations

import math
import operator

import torch
import torch.fx as fx

from fxspeed.compiler.pass_manager import PassContext, PassResult, graph_pass
from fxspeed.compiler.rewrite import call
from fxspeed.errors import PassError
from fxspeed.ir import IOSpec
from fxspeed.ir.program import WINDOW_GROUP
from fxspeed.ir.attention import SDPA_FORWARD, sdpa_arg, sdpa_mask
from fxspeed.runtime.kernels import paged_attention as _registers_the_op  # noqa: F401 - torch.ops.fxspeed.paged_attention

aten = torch.ops.aten
c10d = torch.ops._c10d_functional

METADATA = ("slot_mapping", "block_table", "query_index", "query_pos")
# where a model has layers with and without a sliding window, the sliding ones read these under
# the IOSpec target WINDOW_GROUP (the others, and every layer of any other model, under "")
GROUP_METADATA = ("slot_mapping", "block_table")
NOMINAL_BLOCKS, NOMINAL_BLOCK_SIZE = 1, 16  # the cache placeholders' traced shape; the runtime binds any


def _unrepeat(k: fx.Node, g: fx.Graph, before: fx.Node) -> fx.Node:
    """`repeat_kv(x)` (unsqueeze(x, 2) -> expand -> [clone] -> view/_unsafe_view/reshape) -> x.
    Under bf16/fp16 the repeated keys are cast for the attention (`_to_copy(repeat_kv(x))`): that
    becomes a cast of x, put before the attention, so the cache holds the key/value heads in the
    low precision (half the bytes of the repeated fp32 heads it held otherwise, with GQA)."""
    if k.target == aten._to_copy.default and set(k.kwargs) <= {"dtype"} and len(k.args) == 1:
        inner = _unrepeat(k.args[0], g, before)
        if inner is k.args[0]:
            return k
        with g.inserting_before(before):
            return call(g, aten._to_copy.default, (inner,), dict(k.kwargs))
    cut = k.args[0] if k.target == aten.clone.default else k
    if isinstance(cut, fx.Node) and cut.target == aten.slice.Tensor:
        return _unrepeat_slice(k, cut, g, before)
    n = k
    if n.target not in (aten.view.default, aten._unsafe_view.default, aten.reshape.default):
        return k
    n = n.args[0]
    if n.target == aten.clone.default:
        n = n.args[0]
    ns, ks = tuple(n.meta["val"].shape), tuple(k.meta["val"].shape)
    # [B, kv, rep, S, hd], the repeat over dim 2, viewed as [B, kv*rep, S, hd]
    if not (len(ns) == 5 and len(ks) == 4 and ns[0] == ks[0] and ns[3:] == ks[2:] and ns[1] * ns[2] == ks[1]):
        return k
    if n.target == aten.expand.default and tuple(n.args[0].meta["val"].shape)[2:3] == (1,):
        e = n.args[0]
        if e.target == aten.unsqueeze.default and e.args[1] == 2:
            return e.args[0]
        # Whatever made the unrepeated 5-d value: under tensor parallelism an all-reduce of partial
        # sums (and the permute/clone/permute restoring its layout) can sit between the unsqueeze and
        # the expand; its dim 2 is dropped by a view instead, so the cache still holds kv heads, not
        # the repeated ones (h31: 2x the cache for the values of a Llama 6/3 layer at tensor=2).
        with g.inserting_before(before):
            return call(g, aten.squeeze.dim, (e, 2))
    if ns[2] > 1 and _repeated_along(n, 2):
        # The repeat made before an all-gather of the tokens (tensor parallelism's sequence split of
        # a fused qkv projection: Phi3 at tensor=2 cached [2, 4] heads in one bucket and [2, 2] in
        # another, and serve refused it): every entry along dim 2 is the same, take the first
        with g.inserting_before(before):
            return call(g, aten.select.int, (n, 2, 0))
    return k


def _unrepeat_slice(k: fx.Node, cut: fx.Node, g: fx.Graph, before: fx.Node) -> fx.Node:
    """`[clone](repeat_kv(x)[:, a:b])` (tensor parallelism: this rank's query heads' keys, cut from
    keys repeated whole on every rank) -> `x[:, a/rep:b/rep]`, where the cut holds whole groups
    of `rep` repeats (or lies in one group: its kv head). Else `k`: the cache then holds the
    repeated heads (more bytes, still exact)."""
    src, dim, a, b, step = (*cut.args, *(None,) * (5 - len(cut.args)))[:5]
    heads = tuple(src.meta["val"].shape)
    if dim not in (1, -3) or len(heads) != 4 or step not in (None, 1) or not isinstance(a, int) \
            or not isinstance(b, int) or a < 0 or b <= a:
        return k
    inner = _unrepeat(src, g, before)
    if inner is src:
        return k
    kv = inner.meta["val"].shape[1]
    rep = heads[1] // kv
    b = min(b, heads[1])
    if not (a % rep == 0 and b % rep == 0 or a // rep == (b - 1) // rep):
        return k
    with g.inserting_before(before):
        return call(g, aten.slice.Tensor, (inner, 1, a // rep, -(-b // rep)))


def _repeated_along(x: fx.Node, dim: int) -> bool:
    """Whether every entry of `x` along `dim` is the same value: an expand from size 1 there,
    reached through ops that move whole entries without mixing that dim (copies, permutes,
    waits, an all-gather along another dim)."""
    for _ in range(16):
        if not isinstance(x, fx.Node) or x.op != "call_function":
            return False
        t = x.target
        if t == aten.expand.default:
            src = x.args[0].meta["val"]
            d = dim - (x.meta["val"].dim() - src.dim())
            return d < 0 or src.shape[d] == 1  # (d < 0: a dim the expand added)
        if t == aten.permute.default:
            dim = list(x.args[1])[dim] % x.meta["val"].dim()
        elif t == c10d.all_gather_into_tensor.default:
            if dim == 0:
                return False
        elif t not in (aten.clone.default, aten._to_copy.default, aten.alias.default, c10d.wait_tensor.default):
            return False
        x = x.args[0]
    return False


def _placeholder(gm: fx.GraphModule, ctx: PassContext, spec: IOSpec, val: torch.Tensor) -> fx.Node:
    last = [n for n in gm.graph.nodes if n.op == "placeholder"][-1]
    with gm.graph.inserting_after(last):
        ph = gm.graph.placeholder(f"{spec.kind}_{spec.target}".replace(".", "_").rstrip("_"))
    ph.meta["val"] = val
    ctx.signature.inputs.append(spec)
    return ph


@graph_pass("kv_cache", requires=("annotate",), produces=("kv_cache",), invalidates=("annotate",))
def kv_cache(gm: fx.GraphModule, ctx: PassContext) -> PassResult:
    g = gm.graph
    attention = [n for n in g.nodes if n.op == "call_function" and n.target in SDPA_FORWARD]
    if not attention:
        others = sorted({str(n.target) for n in g.nodes if "attention" in str(n.target)})
        # F.scaled_dot_product_attention traces (on the CPU) to its math form, matmuls and a
        # softmax with no attention op left to thread the cache through, when given an explicit
        # attn_mask or inputs its fused kernels refuse (a last dim that is not contiguous: a
        # permute that moves the head dim, as torch's kernel choice checks its stride).
        math_form = any("_safe_softmax" in str(n.target) for n in g.nodes)
        raise PassError(f"kv_cache: no scaled_dot_product_attention in {ctx.model_name}'s forward"
                        + (f" (found {others})" if others else "")
                        + ("; its attention traced as matmul + softmax, which is what SDPA becomes with an "
                           "explicit attn_mask, or with a query/key/value whose last dim is not contiguous (a "
                           "permute before the call: add .contiguous()): serving needs SDPA called with "
                           "is_causal=True, no mask and contiguous heads (the Hugging Face 'sdpa' attention of "
                           "Llama, Mistral, Qwen2, GPT-2, OPT, GPT-NeoX, Phi)"
                           if math_form else
                           "; build the model with attn_implementation='sdpa' (Hugging Face) or call "
                           "F.scaled_dot_product_attention, so the cache can be threaded through it (a model "
                           "whose attention has no SDPA form, such as BLOOM's ALiBi or GPT-Neo's, cannot be "
                           "served yet)"))
    phs = [n for n in g.nodes if n.op == "placeholder"]
    tokens = next((ph for ph, s in zip(phs, ctx.signature.inputs) if s.kind == "tokens"), None)
    if tokens is None:
        raise PassError("kv_cache: the program has no `tokens` input; capture it with capture_inference")
    T = tokens.meta["val"].shape[-1]
    device = tokens.meta["val"].device
    windows = tuple(ctx.options.kv_windows)
    if windows and len(windows) != len(attention):
        raise PassError(f"kv_cache: {ctx.model_name}'s config names the sliding window of {len(windows)} layers "
                        f"(sliding_window and layer_types), but its forward has {len(attention)} attentions; which "
                        "window is whose is unknown, so this model cannot be served yet")
    i64 = dict(dtype=torch.int64, device=device)
    # Layers with and without a window in one model (Gemma3, Qwen2 past max_window_layers): the
    # sliding ones read a block table of their own (target "window"), so the runtime can keep a
    # ring of blocks for them while the global layers keep every block of the context.
    groups = [WINDOW_GROUP if w and not all(windows) else "" for w in windows] or [""] * len(attention)
    meta = {(k, grp): _placeholder(gm, ctx, IOSpec(k, grp), torch.empty((T,) if k == "slot_mapping" else (1, T), **i64))
            for grp in dict.fromkeys(groups) for k in METADATA if grp == "" or k in GROUP_METADATA}
    layout = []
    for layer, n in enumerate(attention):
        q, k, v = n.args[:3]
        if sdpa_arg(n, "dropout_p", 0.0) not in (0, 0.0):
            raise PassError(f"kv_cache: attention {n.name} of {ctx.model_name} has dropout; serve the model in eval "
                            "mode (fxspeed.serve does) or set its attention dropout to 0")
        causal = sdpa_arg(n, "is_causal", False)
        mask = sdpa_mask(n)
        masked = mask is not None
        # With one query (T == 1) models drop the causal mask (nothing to hide); serve compiles
        # its largest bucket first, where a bidirectional attention is caught.
        if not (causal or masked or T == 1):
            raise PassError(f"kv_cache: attention {n.name} of {ctx.model_name} is not causal (no mask, is_causal="
                            "False); a KV cache serves decoder (causal) attention only")
        # The paged attention is causal by construction and drops the mask: it must be the plain
        # causal mask, not one that also carries a bias (Falcon's ALiBi was served without it).
        problem, window = _not_causal(gm, ctx, mask, T) if masked and T > 1 else ("", None)
        if windows and T > 1 and (window or 0) != windows[layer] and (window is not None or T > windows[layer]):
            # A T-token row's mask shows a window below T (else none): one that disagrees with the
            # config's (a config window the model does not apply) would be applied wrongly in the
            # buckets too short to show it
            raise PassError(f"kv_cache: attention {n.name} of {ctx.model_name} (layer {layer}) masks keys "
                            + (f"{window} or more positions back" if window is not None else "by causality only")
                            + f", but the config's sliding window for that layer is {windows[layer] or 'none'} "
                            "(sliding_window, layer_types); this model cannot be served yet")
        if window is not None and not windows:
            # a window the config does not name: served as causal attention up to it (the
            # runtime's context limit), since the buckets too short to show it would not apply it
            gm.meta["kv_cache_window"] = min(window, gm.meta.get("kv_cache_window", window))
        if problem:
            raise PassError(f"kv_cache: attention {n.name} of {ctx.model_name} reads a mask {mask.name} that "
                            f"{problem}; the paged attention applies the causal mask only, so this model cannot "
                            "be served yet (a position bias such as ALiBi, or another mask, has no paged form here)")
        qv = q.meta["val"]
        if qv.shape[0] != 1 or qv.shape[2] != T:
            raise PassError(f"kv_cache: attention {n.name} has queries of shape {tuple(qv.shape)}, expected "
                            f"[1, heads, {T}, head_dim] for a packed row of {T} tokens")
        k0, v0 = _unrepeat(k, g, n), _unrepeat(v, g, n)
        if k0.meta["val"].shape != v0.meta["val"].shape:
            k0, v0 = k, v
        kv = k0.meta["val"]
        scale = n.kwargs.get("scale") or 1.0 / math.sqrt(qv.shape[-1])
        cache_val = torch.empty(NOMINAL_BLOCKS, NOMINAL_BLOCK_SIZE, kv.shape[1], kv.shape[3], dtype=kv.dtype,
                                device=device)
        kc = _placeholder(gm, ctx, IOSpec("kv_cache", f"{layer}.k"), cache_val)
        vc = _placeholder(gm, ctx, IOSpec("kv_cache", f"{layer}.v"), torch.empty_like(cache_val))
        layout.append((int(kv.shape[1]), int(kv.shape[3]), kv.dtype))
        with g.inserting_before(n):
            grp = groups[layer]
            out = call(g, torch.ops.fxspeed.paged_attention.default,
                       (q, k0, v0, kc, vc, meta["slot_mapping", grp], meta["block_table", grp],
                        meta["query_index", ""], meta["query_pos", ""], float(scale),
                        int(windows[layer]) if windows else 0))
        users = list(n.users)
        if isinstance(n.meta["val"], torch.Tensor):
            n.replace_all_uses_with(out)
        else:
            for u in users:
                if u.target != operator.getitem or u.args[1] != 0:
                    if u.users:
                        raise PassError(f"kv_cache: {u.name} reads output {u.args[1]} of attention {n.name} "
                                        "(its log-sum-exp), which a paged cache does not produce")
                    g.erase_node(u)
                    continue
                u.replace_all_uses_with(out)
                g.erase_node(u)
        g.erase_node(n)
    _dead_code(g)
    _refuse_token_mixing(g, ctx, T)
    _thread_positions(gm, ctx, T, device)
    gm.meta["kv_cache_layout"] = layout
    gm.meta["kv_cache_windows"] = tuple(int(w) for w in windows) if windows else (0,) * len(layout)
    gm.meta["kv_cache_groups"] = tuple(groups)
    gm.recompile()
    return PassResult(gm, modified=True)


def _not_causal(gm: fx.GraphModule, ctx: PassContext, mask: fx.Node, T: int) -> tuple[str, int | None]:
    """Why `mask` is not the plain causal mask of a row of T tokens at positions 0 .. T-1 ("" when
    it is), and the sliding window W it also applies, if any (positions W or more back hidden:
    plain causal attention for requests of at most W tokens). The nodes computing it are run on
    those tokens and positions. A boolean mask must be (banded) lower triangular; an additive one
    0 there and very negative elsewhere."""
    kinds = {ph: s.kind for ph, s in zip([n for n in gm.graph.nodes if n.op == "placeholder"], ctx.signature.inputs)}
    needed, stack = set(), [mask]
    while stack:
        x = stack.pop()
        if x not in needed:
            needed.add(x)
            stack.extend(x.all_input_nodes)
    env: dict[fx.Node, object] = {}
    for x in gm.graph.nodes:
        if x not in needed:
            continue
        if x.op == "placeholder":
            val = x.meta["val"]
            if kinds.get(x) == "tokens":
                env[x] = torch.zeros(val.shape, dtype=val.dtype, device=val.device)
            elif kinds.get(x) == "positions":
                env[x] = torch.arange(T, dtype=val.dtype, device=val.device).view(val.shape)
            else:
                return f"depends on the input {x.name} ({kinds.get(x)}), so it cannot be checked to be causal", None
        elif x.op == "get_attr":
            env[x] = getattr(gm, x.target)
        elif x.op == "call_function":
            env[x] = x.target(*fx.node.map_arg(x.args, env.__getitem__), **fx.node.map_arg(x.kwargs, env.__getitem__))
        else:
            return f"is computed by {x.op} {x.name}, which cannot be checked", None
    m = env[mask]
    if not isinstance(m, torch.Tensor) or m.dim() < 2 or tuple(m.shape[-2:]) != (T, T):
        return f"has shape {tuple(getattr(m, 'shape', ()))}, not [..., {T}, {T}]", None
    visible = m if m.dtype == torch.bool else m == 0
    if m.dtype != torch.bool and not bool(((m == 0) | (m <= -1e4)).all()):
        bias = m[(m != 0) & (m > -1e4)]
        return f"adds a bias to the visible positions (up to {float(bias.abs().max()):.3g})", None
    vis = visible.reshape(-1, T, T)
    if not bool((vis == vis[:1]).all()):
        return "differs between heads or rows", None
    i = torch.arange(T, device=m.device)
    back = i[:, None] - i[None, :]  # how far back each key is from its query
    hidden_back = back[(back >= 0) & ~vis[0]]
    window = int(hidden_back.min()) if hidden_back.numel() else None
    want = (back >= 0) & (back < (window if window is not None else T))
    if window == 0 or not bool((vis[0] == want).all()):
        return "is not causal (it shows later positions, or hides others than a sliding window does)", None
    return "", window


def _dead_code(g: fx.Graph) -> None:
    """The causal masks the attention read are dead now; drop them so `_thread_positions` sees
    only the aranges still read."""
    for n in reversed(list(g.nodes)):
        if n.op == "call_function" and not n.users and not (
                isinstance(n.target, torch._ops.OpOverload) and n.target._schema.is_mutable):
            g.erase_node(n)


# Ops that combine values along one of their dims: over the packed row's token dim they mix
# tokens of different requests and see none of a request's earlier tokens (no state is carried
# between steps). Convolutions: over every spatial dim; the others: over their `dim` argument(s).
_ALONG_DIM = {aten.cumsum.default: 1, aten.cumprod.default: 1, aten.logcumsumexp.default: 1, aten.cummax.default: 1,
              aten.cummin.default: 1, aten.flip.default: 1, aten.roll.default: 2}


def _token_mixing(n: fx.Node, T: int) -> bool:
    """Whether `n` combines floating values along a dim of size T (the packed row's tokens). Not
    a scan of a histogram (histc / bincount: one entry per bin, not per token): the offsets of a
    mixture of experts' token groups (Hugging Face's grouped_mm: cumsum(histc(expert ids)) over
    the experts) were refused as a scan over the tokens wherever the number of experts equalled
    a bucket's token count (8, 64, 128: every power of two)."""
    if n.op != "call_function" or not n.args or not isinstance(n.args[0], fx.Node):
        return False
    x = n.args[0].meta.get("val")
    if not isinstance(x, torch.Tensor) or not x.is_floating_point() or _of_a_histogram(n.args[0]):
        return False
    if n.target == aten.convolution.default:
        return T in x.shape[2:]
    at = _ALONG_DIM.get(n.target)
    if at is None:
        return False
    dims = n.args[at] if len(n.args) > at else n.kwargs.get("dims", n.kwargs.get("dim"))
    dims = [dims] if isinstance(dims, int) else list(dims or [])
    return any(x.shape[d] == T for d in dims if -x.dim() <= d < x.dim())


def _of_a_histogram(x: fx.Node) -> bool:
    """`x` is a histogram's counts, through casts and views."""
    for _ in range(8):
        if not isinstance(x, fx.Node) or x.op != "call_function":
            return False
        if x.target in (aten.histc.default, aten.bincount.default):
            return True
        if x.target not in (aten._to_copy.default, torch.ops.prims.convert_element_type.default, aten.view.default,
                            aten._unsafe_view.default, aten.reshape.default, aten.clone.default):
            return False
        x = x.args[0]
    return False


def _refuse_token_mixing(g: fx.Graph, ctx: PassContext, T: int) -> None:
    """A layer that mixes tokens outside attention (a causal conv1d: Mamba, LFM2's ShortConv,
    FalconH1; a scan over time) has state the paged cache does not carry; served, it computed
    each step from that step's tokens alone. A helper saw FalconH1's logits 3e-4..2e-3 off at
    default init (under the packed check's tolerance) and a wrong 15th token."""
    if T == 1:  # every dim of size 1 would match; serve's first (largest) bucket has T > 1
        return
    for n in g.nodes:
        if _token_mixing(n, T):
            raise PassError(f"kv_cache: {ctx.model_name}'s forward mixes tokens outside its attention ({n.name} = "
                            f"{n.target} along the {T} tokens of the packed row: a convolution or scan over the "
                            "sequence, as in Mamba / state-space or short-convolution layers); serving caches "
                            "attention keys and values only, so this model cannot be served yet")


def _aranges(g: fx.Graph, T: int) -> list[fx.Node]:
    """The aranges of length T that may be the tokens' positions. Not one that is only written
    into a permutation's inverse (`inv[perm] = arange(n)`, Hugging Face's grouped_mm undoing its
    sort of the tokens by expert: n = tokens x top-k, T under top-1 routing): replaced by the
    positions, it would have scrambled the experts' outputs of every request but the first."""
    out = []
    for n in g.nodes:
        if n.op == "call_function" and n.target in (aten.arange.default, aten.arange.start, aten.arange.start_step):
            v = n.meta.get("val")
            if isinstance(v, torch.Tensor) and v.dim() == 1 and v.shape[0] == T and not _inverts_a_permutation(n):
                out.append(n)
    return out


def _inverts_a_permutation(r: fx.Node) -> bool:
    """`r` is read only as the values of index_put / index_copy / scatter (`inv[perm] = r`),
    directly or through views (a 1-token row's arange(1) is viewed as a scalar first). A position
    written into a table this way (none of the families tried) would pass here; serve's packed
    check against the eager forward is what stands behind it."""
    writes = {aten.index_put.default: 2, aten.index_put_.default: 2, aten._index_put_impl_.default: 2,
              aten.index_copy.default: 3, aten.scatter.src: 3}
    views = (aten.view.default, aten._unsafe_view.default, aten.reshape.default)
    return bool(r.users) and all(
        _inverts_a_permutation(u) if u.target in views and u.args[0] is r
        else u.target in writes and len(u.args) > writes[u.target] and u.args[writes[u.target]] is r
        for u in r.users)


def _thread_positions(gm: fx.GraphModule, ctx: PassContext, T: int, device: torch.device) -> None:
    g = gm.graph
    has_positions = any(s.kind == "positions" for s in ctx.signature.inputs)
    ranges = _aranges(g, T)
    if has_positions:
        if ranges:
            raise PassError(f"kv_cache: {ctx.model_name}'s forward still reads arange({T}) ({ranges[0].name}) besides "
                            "its position_ids; with several requests packed in one row that would be wrong for all "
                            "but the first, so this model cannot be served yet")
        return
    pos = _placeholder(gm, ctx, IOSpec("positions", ""), torch.empty(1, T, dtype=torch.int64, device=device))
    for r in ranges:
        if r.target != aten.arange.default and (r.args[0] != 0 or (len(r.args) > 2 and r.args[2] != 1)):
            raise PassError(f"kv_cache: {ctx.model_name}'s forward reads {r.name} = arange{tuple(r.args)}, not "
                            f"arange({T}); it cannot be mapped to the tokens' positions, so this model cannot be "
                            "served yet")
        with g.inserting_after(pos):
            flat = call(g, aten.view.default, (pos, [T]))
        conv = flat
        if r.meta["val"].dtype != torch.int64:
            with g.inserting_after(flat):
                conv = call(g, aten._to_copy.default, (flat,), {"dtype": r.meta["val"].dtype})
        r.replace_all_uses_with(conv)
        g.erase_node(r)
    cuts = _position_table_cuts(gm, ctx, T)
    # which tables: a table read by position is cut in every bucket, so the runtime checks that each
    # bucket cut the first one's (a weight cut to a constant length equal to one bucket's T is not one)
    names = {ph: s.target for ph, s in zip([n for n in g.nodes if n.op == "placeholder"], ctx.signature.inputs)}
    gm.meta["kv_cache_position_tables"] = tuple(sorted({names.get(c.args[0], str(c.args[0].target)) for c in cuts}))
    for cut in cuts:
        # table[:T] (Meta's Llama `freqs_cis[:seqlen]`, minGPT's `pos_emb[:, :t]`) holds the rows of
        # positions 0 .. T-1: the rows of the tokens' positions instead, as for arange(T) above
        src, dim = cut.args[0], cut.args[1]
        with g.inserting_before(cut):
            flat = call(g, aten.view.default, (pos, [T]))
            rows = call(g, aten.index_select.default, (src, dim, flat))
        cut.replace_all_uses_with(rows)
        g.erase_node(cut)


def _position_table_cuts(gm: fx.GraphModule, ctx: PassContext, T: int) -> list[fx.Node]:
    """The slices `w[..., 0:T, ...]` of a parameter or buffer along one dim: a table read by
    position, in a model that makes its own positions (no position_ids). Under tensor parallelism
    none: shard_tensors cuts a weight into its ranks' pieces with slices of the same form (rank
    0's piece of a dim of 2T is `0:T`), and the program's collectives show that it ran."""
    g = gm.graph
    if any(n.op == "call_function" and getattr(n.target, "namespace", "") == "_c10d_functional" for n in g.nodes):
        return []
    phs = [n for n in g.nodes if n.op == "placeholder"]
    state = {ph for ph, s in zip(phs, ctx.signature.inputs) if s.kind in ("param", "buffer")}
    out = []
    for n in g.nodes:
        if n.op != "call_function" or n.target != aten.slice.Tensor:
            continue
        src, dim, start, end, step = (*n.args, *(None,) * (5 - len(n.args)))[:5]
        shape = getattr(getattr(src, "meta", {}).get("val"), "shape", ())
        if (src in state or getattr(src, "op", None) == "get_attr") and isinstance(dim, int) \
                and start in (0, None) and end == T and step in (1, None) and -len(shape) <= dim < len(shape) \
                and shape[dim] >= T:
            out.append(n)
    return out
