"""ATen's scaled-dot-product attention ops, as the planner and the passes read them.

A captured program holds whichever attention kernel the device's dispatcher chose: the CPU's
flash kernel, FlashAttention, memory-efficient attention or cuDNN's on CUDA (and the
composite op in programs captured before decomposition). Their arguments sit at different
positions (the CPU kernel takes `attn_mask` after `is_causal`; the memory-efficient one takes
`attn_bias` before `dropout_p`), so they are read here by their schema names, the same for
every kernel: a rule written against one of them (say the CPU's, the only one CI traces) then
holds for the kernels a GPU program has.
"""

from __future__ import annotations

import torch
import torch.fx as fx

aten = torch.ops.aten

SDPA_FORWARD = frozenset({
    aten.scaled_dot_product_attention.default,
    aten._scaled_dot_product_flash_attention_for_cpu.default,
    aten._scaled_dot_product_flash_attention.default,
    aten._scaled_dot_product_efficient_attention.default,
    aten._scaled_dot_product_cudnn_attention.default,
})
SDPA_BACKWARD = frozenset({
    aten._scaled_dot_product_flash_attention_for_cpu_backward.default,
    aten._scaled_dot_product_flash_attention_backward.default,
    aten._scaled_dot_product_efficient_attention_backward.default,
    aten._scaled_dot_product_cudnn_attention_backward.default,
})
# Tensors with one slice per head on dim 1 ([B, heads, L, ...]): the queries, keys and values,
# the output and its gradient, the log-sum-exp statistics
PER_HEAD = frozenset({"query", "key", "value", "out", "grad_out", "grad_out_", "logsumexp"})
MASKS = ("attn_mask", "attn_bias")


def sdpa_arg(n: fx.Node, name: str, default: object = None) -> object:
    """The argument `name` of the call `n` of an attention op, given positionally or by keyword
    (`default` where the op has no such argument or the call leaves it out)."""
    names = [a.name for a in n.target._schema.arguments]
    if name not in names:
        return default
    i = names.index(name)
    return n.args[i] if i < len(n.args) else n.kwargs.get(name, default)


def sdpa_mask(n: fx.Node) -> object:
    """The additive or boolean mask of the attention call `n` (`attn_mask` or `attn_bias`, by
    kernel), or None."""
    return next((m for m in (sdpa_arg(n, k) for k in MASKS) if m is not None), None)


def sdpa_input_names(n: fx.Node) -> list[str]:
    """The schema name of each tensor input of `n`, in the order `fx.node.map_arg` visits them
    (positional arguments, then keywords), so that it lines up with a list of its input nodes."""
    names = [a.name for a in n.target._schema.arguments]
    out: list[str] = []
    for i, a in enumerate(n.args):
        fx.node.map_arg(a, lambda x, i=i: out.append(names[i]) or x)
    for k, a in n.kwargs.items():
        fx.node.map_arg(a, lambda x, k=k: out.append(k) or x)
    return out
