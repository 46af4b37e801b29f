"""select_attention_kernel (passes/graph/select_attention_kernel.py): low-precision attention on
CUDA runs FlashAttention instead of the memory-efficient kernel fp32 capture recorded. Checked
here on graphs of fake CUDA tensors (the rewrite and its shapes); numbers on a GPU in the cuda
tier (tests/test_cuda.py)."""

from __future__ import annotations

import operator

import pytest
import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx
from torch.fx.passes.fake_tensor_prop import FakeTensorProp

from fxspeed.compiler.options import PassOptions
from fxspeed.compiler.pass_manager import PassContext
from fxspeed.ir import StepSignature
from fxspeed.passes.graph.select_attention_kernel import (EFFICIENT, EFFICIENT_BWD, FLASH, FLASH_BWD,
                                                          select_attention_kernel, wanted)

aten = torch.ops.aten


def attention_graph(dtype: torch.dtype = torch.bfloat16, d: int = 64, kv_heads: int = 4, bias: bool = False,
                    device: str = "cuda", backward: bool = True) -> tuple[fx.GraphModule, list[torch.Tensor], FakeTensorMode]:
    """Forward and backward of memory-efficient attention as capture records them (dropout on)."""
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    with mode:
        q = torch.empty(2, 4, 128, d, dtype=dtype, device=device)
        k = torch.empty(2, kv_heads, 128, d, dtype=dtype, device=device)
        v = torch.empty(2, kv_heads, 128, d, dtype=dtype, device=device)
        g = torch.empty_like(q)
        b = torch.empty(2, 4, 128, 128, dtype=dtype, device=device) if bias else None

    def step(q, k, v, g):  # noqa: ANN001, ANN202
        out, lse, seed, off = aten._scaled_dot_product_efficient_attention(q, k, v, b, True, 0.1, True, scale=0.125)
        if not backward:
            return (out,)
        gq, gk, gv, _ = aten._scaled_dot_product_efficient_attention_backward(
            g, q, k, v, b, out, lse, seed, off, 0.1, [True, True, True, False], True, scale=0.125)
        return out, gq, gk, gv

    with mode:
        gm = make_fx(step)(q, k, v, g)
    return gm, [q, k, v, g], mode


def run_pass(gm: fx.GraphModule) -> bool:
    ctx = PassContext(signature=StepSignature(), options=PassOptions())
    return select_attention_kernel.fn(gm, ctx).modified


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("backward", [True, False])
def test_low_precision_cuda_attention_becomes_flash_forward_and_backward_with_the_same_shapes(
        dtype: torch.dtype, backward: bool) -> None:
    gm, inputs, mode = attention_graph(dtype, backward=backward)
    before = [tuple(n.meta["val"].shape) for n in gm.graph.nodes if n.op == "output" for n in n.args[0]]
    assert wanted(gm) and run_pass(gm)
    gm.graph.lint()
    gm.recompile()
    targets = {n.target for n in gm.graph.nodes}
    assert FLASH in targets and EFFICIENT not in targets and EFFICIENT_BWD not in targets
    assert (FLASH_BWD in targets) == backward
    # the random state reaches the backward from flash's tuple (positions 6 and 7)
    if backward:
        bwd = next(n for n in gm.graph.nodes if n.target is FLASH_BWD)
        assert [a.args[1] for a in bwd.args[4:6]] == [0, 1] and [a.args[1] for a in bwd.args[12:14]] == [6, 7]
        assert bwd.args[8:10] == (128, 128) and bwd.kwargs["scale"] == 0.125
    with mode:
        FakeTensorProp(gm, mode).propagate(*inputs)  # the rewritten program type-checks
    after = [tuple(n.meta["val"].shape) for n in gm.graph.nodes if n.op == "output" for n in n.args[0]]
    assert after == before


@pytest.mark.parametrize("case", [dict(dtype=torch.float32), dict(d=72 + 1), dict(d=512), dict(kv_heads=2),
                                  dict(bias=True), dict(device="cpu")])
def test_attention_flash_cannot_run_keeps_the_memory_efficient_kernel(case: dict) -> None:
    """fp32, a head dimension flash does not take, grouped key/value heads, a bias (mask), a CPU graph."""
    gm, _, _ = attention_graph(**case)
    assert not wanted(gm) and not run_pass(gm)
    assert any(n.target is EFFICIENT for n in gm.graph.nodes)


def test_a_logsumexp_read_by_something_else_keeps_the_pair() -> None:
    """The pair is rewritten together or not at all: flash's logsumexp has another layout."""
    gm, _, _ = attention_graph()
    lse = next(n for n in gm.graph.nodes if n.target is operator.getitem and n.args[0].target is EFFICIENT
               and n.args[1] == 1)
    out = next(n for n in gm.graph.nodes if n.op == "output")
    out.args = ((*out.args[0], lse),)
    assert not run_pass(gm)
