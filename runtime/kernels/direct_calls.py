"""Serving programs call the bodies of fxspeed's custom ops directly, not through the dispatcher.

A custom op's dispatch (schema check, fake-tensor registration lookup, autograd and mutation
bookkeeping) costs 10-200 us a call on the CPU, where a decode step's ops themselves take a few
microseconds each: the paged attention's ~0.2 ms a call was ~5% of a GPT-2 decode step, the
fused GELU's ~14 us a third of the op. A serving program is forward-only and run under no_grad,
so none of that bookkeeping has work to do; its nodes can call the Python function each op
wraps (the same computation: the Triton kernel where that op would launch it, else its torch
implementation).

    before:  y = torch.ops.fxspeed.gelu_fwd.default(x, "tanh", None, None)
    after:   y = gelu_fwd_body(x, "tanh", None, None)

Training programs keep the ops: their backward needs the autograd registrations.
"""

from __future__ import annotations

import copy
from typing import Any, Callable

import torch

from .activations import gelu_fwd, swiglu_fwd
from .paged_attention import paged_attention_impl

# (importing the kernels' modules registers their ops.) A CustomOpDef keeps the function it was
# made from as `_init_fn`.
_BODIES: dict[Any, Callable[..., Any]] = {torch.ops.fxspeed.paged_attention.default: paged_attention_impl,
                                          torch.ops.fxspeed.gelu_fwd.default: gelu_fwd._init_fn,
                                          torch.ops.fxspeed.swiglu_fwd.default: swiglu_fwd._init_fn}


def direct_calls(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """A copy of serving program `gm` whose fxspeed op nodes (paged attention, the fused forward
    activations) call the ops' bodies instead of the ops; `gm` is left as it is."""
    graph = copy.deepcopy(gm.graph)
    for n in graph.nodes:
        if n.op == "call_function" and n.target in _BODIES:
            n.target = _BODIES[n.target]
    return torch.fx.GraphModule(gm, graph)
