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
import fxspeed.passes.graph.select_attention_kernel as sak
from fxspeed.passes.graph.select_attention_kernel import (EFFICIENT, EFFICIENT_BWD, FLASH, FLASH_BWD,
                                                          select_attention_kernel, wanted)

aten = torch.ops.aten


@pytest.fixture(autouse=True)
def _an_h100(monkeypatch: pytest.MonkeyPatch) -> None:
    """The pass asks this process's GPU what flash supports; these tests stand in an sm90 one."""
    monkeypatch.setattr(sak, "_capability", lambda: (9, 0))


def attention_graph(dtype: torch.dtype = torch.bfloat16, d: int = 64, kv_heads: int = 4, bias: bool = False,
                    device: str = "cuda", backward: bool = True, layout: str = "heads_transposed",
                    lk: int = 128, causal: bool = True) -> tuple[fx.GraphModule, list[torch.Tensor], FakeTensorMode]:
    """Forward and backward of memory-efficient attention as capture records them (dropout on).
    "heads_transposed": q/k/v are (B, L, H, D) tensors transposed to (B, H, L, D), as attention
    modules make them; "contiguous": (B, H, L, D) tensors (after a qk-norm, say)."""
    mode = FakeTensorMode(allow_non_fake_inputs=True)

    def make(h: int, length: int) -> torch.Tensor:
        if layout == "contiguous":
            return torch.empty(2, h, length, d, dtype=dtype, device=device)
        return torch.empty(2, length, h, d, dtype=dtype, device=device).transpose(1, 2)

    with mode:
        q, k, v = make(4, 128), make(kv_heads, lk), make(kv_heads, lk)
        g = make(4, 128)
        b = torch.empty(2, 4, 128, lk, dtype=dtype, device=device) if bias else None

    def step(q, k, v, g):  # noqa: ANN001, ANN202
        out, lse, seed, off = aten._scaled_dot_product_efficient_attention(q, k, v, b, True, 0.1, causal, scale=0.125)
        if not backward:
            return (out,)
        gq, gk, gv, _ = aten._scaled_dot_product_efficient_attention_backward(
            g, q, k, v, b, out, lse, seed, off, 0.1, [True, True, True, False], causal, scale=0.125)
        return out, gq, gk, gv

    with mode:
        gm = make_fx(step)(q, k, v, g)
    return gm, [q, k, v, g], mode


def run_pass(gm: fx.GraphModule) -> bool:
    ctx = PassContext(signature=StepSignature(), options=PassOptions())
    return select_attention_kernel.fn(gm, ctx).modified


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("backward", [True, False])
def test_low_precision_cuda_attention_becomes_flash_forward_and_backward_with_the_same_layouts(
        dtype: torch.dtype, backward: bool) -> None:
    gm, inputs, mode = attention_graph(dtype, backward=backward)
    before = [(n.meta["val"].shape, n.meta["val"].stride()) for n in gm.graph.nodes if n.op == "output"
              for n in n.args[0]]
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
    after = [(n.meta["val"].shape, n.meta["val"].stride()) for n in gm.graph.nodes if n.op == "output"
             for n in n.args[0]]
    assert after == before  # the same shapes and strides the rest of the graph was traced with


@pytest.mark.parametrize("case", [dict(dtype=torch.float32), dict(d=72 + 1), dict(d=512), dict(kv_heads=2),
                                  dict(bias=True), dict(device="cpu"), dict(lk=96)])
def test_attention_flash_cannot_run_or_masks_differently_keeps_the_memory_efficient_kernel(case: dict) -> None:
    """fp32, a head dimension flash does not take, grouped key/value heads, a bias (mask), a CPU
    graph, a non-square causal mask (flash aligns it bottom-right, efficient top-left)."""
    gm, _, _ = attention_graph(**case)
    assert not wanted(gm) and not run_pass(gm)
    assert any(n.target is EFFICIENT for n in gm.graph.nodes)


def test_a_non_square_attention_without_a_causal_mask_becomes_flash() -> None:
    gm, _, _ = attention_graph(lk=96, causal=False)
    assert run_pass(gm)


def test_contiguous_heads_keep_the_memory_efficient_kernel_whose_output_layout_the_graph_was_traced_on() -> None:
    """Flash lays its output out like q (here contiguous (B, H, L, D)), efficient transposed:
    the views traced after it would not fit."""
    gm, _, _ = attention_graph(layout="contiguous")
    assert not run_pass(gm)


@pytest.mark.parametrize("capability, d, moved", [((7, 5), 64, False), ((8, 6), 128, True), ((8, 6), 256, False),
                                                  ((8, 0), 256, True), (None, 64, False)])
def test_the_gpu_decides_as_sdpas_dispatcher_does(monkeypatch: pytest.MonkeyPatch, capability, d: int,
                                                  moved: bool) -> None:
    """Pre-Ampere: no flash; sm86-class: no head dim above 192 (its backward); no CUDA: nothing."""
    monkeypatch.setattr(sak, "_capability", lambda: capability)
    gm, _, _ = attention_graph(d=d)
    assert run_pass(gm) == moved


def test_a_logsumexp_read_by_something_else_keeps_the_pair() -> None:
    """The pair is rewritten together or not at all: flash's logsumexp has another layout."""
    gm, _, _ = attention_graph()
    lse = next(n for n in gm.graph.nodes if n.target is operator.getitem and n.args[0].target is EFFICIENT
               and n.args[1] == 1)
    out = next(n for n in gm.graph.nodes if n.op == "output")
    out.args = ((*out.args[0], lse),)
    assert not run_pass(gm)
