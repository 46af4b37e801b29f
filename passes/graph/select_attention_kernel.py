"""select_attention_kernel: on CUDA, low-precision attention runs FlashAttention, not the
memory-efficient kernel that capture recorded.

Capture traces the step in fp32, where SDPA's dispatcher on CUDA cannot pick FlashAttention (it
takes bf16/fp16 only) and records `_scaled_dot_product_efficient_attention`; insert_casts then
feeds that op bf16 tensors. Eager autocast casts before SDPA dispatches, so it runs flash. This
pass makes the choice autocast's dispatcher would usually make (on some GPUs and cuDNN versions
it prefers cuDNN attention), for the pairs it can prove equivalent:

    before:  a = aten._scaled_dot_product_efficient_attention(q, k, v, None, True, p, causal, scale=s)
             out = a[0]; lse = a[1]; seed = a[2]; offset = a[3]
             b = aten._scaled_dot_product_efficient_attention_backward(g, q, k, v, None, out, lse,
                                                                       seed, offset, p, [T, T, T, F], causal, scale=s)
    after:   a = aten._scaled_dot_product_flash_attention(q, k, v, p, causal, False, scale=s)
             out = a[0]; lse = a[1]; seed = a[6]; offset = a[7]
             b = aten._scaled_dot_product_flash_attention_backward(g, q, k, v, out, lse, None, None,
                                                                   Lq, Lk, p, causal, seed, offset, scale=s)

Only where flash applies and computes the same thing: no attention bias (a mask makes flash
unusable), q/k/v bf16 or fp16 on CUDA with one head dimension, a multiple of 8 and at most 256
(192 off sm80/sm90), as many key/value heads as query heads, the last dimension contiguous, a
square causal mask (flash aligns a non-square one bottom-right, efficient top-left), more than
one query; an Ampere or newer GPU in this process (not ROCm), flash not disabled by
`torch.backends.cuda.enable_flash_sdp(False)`; flash's outputs (and its backward's gradients)
in the strides the graph was traced with (flash lays them out like q/k/v, efficient transposed);
and a backward, if any, asking for the input gradients only. The logsumexp and the random-number state flow only between the pair, so their different
layouts (flash's logsumexp is not padded; its philox state is uint64) stay inside it.
compile_step runs it on bf16/fp16 programs on CUDA (`on_cuda`), after insert_casts; disabled by
name ("select_attention_kernel").
"""

from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx as fx

from fxspeed.compiler.pass_manager import PassContext, PassResult, graph_pass
from fxspeed.compiler.rewrite import call, fake_value
from fxspeed.passes.graph.fuse_kernels import _arguments

aten = torch.ops.aten
EFFICIENT = aten._scaled_dot_product_efficient_attention.default
EFFICIENT_BWD = aten._scaled_dot_product_efficient_attention_backward.default
FLASH = aten._scaled_dot_product_flash_attention.default
FLASH_BWD = aten._scaled_dot_product_flash_attention_backward.default
# efficient forward's outputs (out, logsumexp, philox_seed, philox_offset) in flash's tuple
_FORWARD_OUTPUTS = {0: 0, 1: 1, 2: 6, 3: 7}
MAX_HEAD_DIM = 256


def on_cuda(gm: fx.GraphModule) -> bool:
    """Whether the program's inputs are CUDA tensors (fake at capture): where the pass can apply."""
    return any(isinstance(v := n.meta.get("val"), torch.Tensor) and v.device.type == "cuda"
               for n in gm.graph.nodes if n.op == "placeholder")


def wanted(gm: fx.GraphModule) -> bool:
    """Whether the program has a memory-efficient attention flash could run."""
    return any(n.op == "call_function" and n.target is EFFICIENT and _flash_applies(_arguments(n))
               for n in gm.graph.nodes)


@graph_pass("select_attention_kernel", invalidates=("annotate",))
def select_attention_kernel(gm: fx.GraphModule, ctx: PassContext) -> PassResult:
    g = gm.graph
    changed = False
    for n in list(g.nodes):
        if n.op != "call_function" or n.target is not EFFICIENT:
            continue
        a = _arguments(n)
        if not _flash_applies(a):
            continue
        outs = {u.args[1]: u for u in n.users if u.target is operator.getitem}
        if len(outs) != len(n.users):
            continue
        lse = outs.get(1)
        backward = list(lse.users) if lse is not None else []
        # logsumexp and the random state change layout: only a backward of this pair may read them
        private = [outs[i] for i in (1, 2, 3) if i in outs]
        if not all(b.target is EFFICIENT_BWD and _backward_applies(b, outs) for b in backward) or \
                any(u not in backward for o in private for u in o.users):
            continue
        args = (a["query"], a["key"], a["value"], a["dropout_p"], a["is_causal"], False)
        # The rest of the graph was traced on efficient's output layout (and its backward's):
        # flash lays its outputs out like q/k/v, so where that differs the pair stays.
        if not _same_layout(FLASH, args, {"scale": a["scale"]}, outs, (0,)) or \
                not all(_same_layout(FLASH_BWD, _backward_args(b), {"scale": _arguments(b)["scale"]},
                                     {u.args[1]: u for u in b.users}, (0, 1, 2)) for b in backward):
            continue
        with g.inserting_before(n):
            flash = call(g, FLASH, args, {"scale": a["scale"]})
        _keep_meta(n, flash, ctx)
        for i, u in outs.items():
            u.args = (flash, _FORWARD_OUTPUTS[i])
            u.meta["val"] = flash.meta["val"][_FORWARD_OUTPUTS[i]]
        g.erase_node(n)
        for b in backward:
            _replace_backward(g, b, ctx)
        changed = True
    return PassResult(gm, modified=changed)


def _capability() -> tuple[int, int] | None:
    """This process's CUDA device's compute capability, or None (no CUDA, or ROCm: its flash
    differs); the tests of this pass stand in for a GPU here."""
    if torch.version.hip or not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_capability()


def _arch_allows(head_dim: int) -> bool:
    """What SDPA's own dispatcher checks of the GPU (aten/src/ATen/native/transformers/cuda/
    sdp_utils.cpp): Ampere or newer, flash not disabled by the user, and a head dimension whose
    backward the architecture's kernels have (above 192 only sm80 and sm90)."""
    cap = _capability()
    if cap is None or cap < (8, 0) or not torch.backends.cuda.flash_sdp_enabled():
        return False
    return head_dim <= 192 or cap in ((8, 0), (9, 0))


def _same_layout(op: Any, args: tuple, kwargs: dict, outs: dict[int, fx.Node], which: tuple[int, ...]) -> bool:
    """`op`'s outputs `which` would have the strides the old op's getitems `outs` were traced with."""
    new = fake_value(op, args, kwargs)
    for i in which:
        old = outs.get(i)
        if old is not None and tuple(old.meta["val"].stride()) != tuple(new[i].stride()):
            return False
    return True


def _backward_args(n: fx.Node) -> tuple:
    b = _arguments(n)
    q, k = b["query"].meta["val"], b["key"].meta["val"]
    return (b["grad_out_"], b["query"], b["key"], b["value"], b["out"], b["logsumexp"], None, None,
            int(q.shape[-2]), int(k.shape[-2]), b["dropout_p"], b["is_causal"], b["philox_seed"], b["philox_offset"])


def _flash_applies(a: dict[str, Any]) -> bool:
    if a["attn_bias"] is not None:
        return False
    vals = [x.meta.get("val") if isinstance(x, fx.Node) else None for x in (a["query"], a["key"], a["value"])]
    if not all(isinstance(v, torch.Tensor) and v.dim() == 4 for v in vals):
        return False
    q, k, v = vals
    d = q.shape[-1]
    # flash's causal mask is aligned bottom-right, efficient's top-left: the same only when square
    square = not a["is_causal"] or q.shape[-2] == k.shape[-2]
    return (all(t.device.type == "cuda" and t.dtype == q.dtype and t.shape[-1] == d and t.stride(-1) == 1
                for t in vals)
            and q.dtype in (torch.bfloat16, torch.float16) and d % 8 == 0 and d <= MAX_HEAD_DIM
            and q.shape[1] == k.shape[1] == v.shape[1] and square and q.shape[-2] > 1 and _arch_allows(d))


def _backward_applies(n: fx.Node, outs: dict[int, fx.Node]) -> bool:
    """The backward reads this forward's out, logsumexp and random state, and wants the input
    gradients only (nothing reads a bias gradient)."""
    b = _arguments(n)
    return (b["attn_bias"] is None and list(b["grad_input_mask"])[:3] == [True, True, True]
            and b["out"] is outs.get(0) and b["logsumexp"] is outs.get(1)
            and b["philox_seed"] is outs.get(2) and b["philox_offset"] is outs.get(3)
            and all(u.target is operator.getitem and (u.args[1] < 3 or not u.users) for u in n.users))


def _replace_backward(g: fx.Graph, n: fx.Node, ctx: PassContext) -> None:
    with g.inserting_before(n):
        flash = call(g, FLASH_BWD, _backward_args(n), {"scale": _arguments(n)["scale"]})
    _keep_meta(n, flash, ctx)
    for u in list(n.users):
        if u.args[1] < 3:
            u.args = (flash, u.args[1])
            u.meta["val"] = flash.meta["val"][u.args[1]]
        else:
            g.erase_node(u)  # the bias gradient nothing reads (there is no bias)
    g.erase_node(n)


def _keep_meta(old: fx.Node, new: fx.Node, ctx: PassContext) -> None:
    for key, value in old.meta.items():  # stack trace, module, checkpoint tags
        new.meta.setdefault(key, value)
    if old.name in ctx.module_of:
        ctx.module_of[new.name] = ctx.module_of[old.name]
