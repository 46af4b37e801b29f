"""The vocabulary projection and its cross-entropy in chunks of rows (passes/memory/
chunk_cross_entropy.py, runtime/kernels/cross_entropy.py): the op against torch's formula, the
rewrite's shape, and training parity with eager PyTorch where the planner's rule chunks."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from hypothesis import given, settings, strategies as st

import fxspeed
from fxspeed.compiler.pipelines import compile_step
from fxspeed.config import Config
from fxspeed.models import GPT, GPTConfig
from fxspeed.runtime.kernels.cross_entropy import linear_cross_entropy

OP = torch.ops.fxspeed.linear_cross_entropy.default


@settings(max_examples=25, deadline=None)
@given(n=st.integers(1, 40), c=st.integers(1, 24), v=st.integers(2, 70), rows=st.integers(1, 50),
       reduction=st.sampled_from([1, 2]), ignored=st.floats(0, 1), dtype=st.sampled_from([torch.float32, torch.bfloat16]),
       seed=st.integers(0, 2**16))
def test_the_chunked_op_gives_torchs_loss_and_gradients(n: int, c: int, v: int, rows: int, reduction: int,
                                                       ignored: float, dtype: torch.dtype, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(n, c, generator=g).to(dtype).requires_grad_()
    wt = torch.randn(c, v, generator=g).to(dtype).requires_grad_()
    target = torch.randint(0, v, (n,), generator=g)
    target[torch.rand(n, generator=g) < ignored] = -100
    ref = F.cross_entropy((h @ wt).float(), target, ignore_index=-100, reduction="mean" if reduction == 1 else "sum")
    ref.backward()
    loss, gh, gwt_t = linear_cross_entropy(h.detach(), wt.detach(), target, -100, reduction, rows)
    assert gh.dtype == gwt_t.dtype == dtype and gwt_t.shape == (v, c)
    if torch.isnan(ref):  # every target ignored under "mean": NaN loss, zero gradients, as torch
        assert torch.isnan(loss) and not gh.any() and not gwt_t.any()
        return
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(loss, ref.detach(), **tol)
    torch.testing.assert_close(gh.float(), h.grad.float(), **tol)
    torch.testing.assert_close(gwt_t.t().float(), wt.grad.float(), **tol)


def _gpt(vocab: int = 64) -> tuple[nn.Module, tuple[torch.Tensor, torch.Tensor]]:
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=vocab, block_size=16, n_layer=1, n_head=2, n_embd=32))
    x = torch.randint(0, vocab, (2, 16))
    return model, (x, torch.roll(x, 1, 1))


def _ops(gm: torch.fx.GraphModule) -> list:
    return [n.target for n in gm.graph.nodes if n.op == "call_function"]


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_the_rewrite_replaces_log_softmax_nll_and_both_backward_matmuls_by_one_op(precision: str) -> None:
    model, batch = _gpt()
    plain = compile_step(model, batch, {}, config=Config(precision=precision), loss_fn=None,
                         options=dict(chunk_cross_entropy="off")).captured.gm
    gm = compile_step(model, batch, {}, config=Config(precision=precision), loss_fn=None,
                      options=dict(chunk_cross_entropy="always")).captured.gm
    ops = _ops(gm)
    assert ops.count(OP) == 1
    aten = torch.ops.aten
    for gone in (aten._log_softmax.default, aten.nll_loss_forward.default, aten.nll_loss_backward.default,
                 aten._log_softmax_backward_data.default):
        assert gone in _ops(plain) and gone not in ops
    assert _ops(plain).count(aten.mm.default) - ops.count(aten.mm.default) == 3  # the head's forward and two backward


def test_logits_read_by_anything_else_leave_the_graph_unchanged() -> None:
    class ZLoss(nn.Module):  # cross-entropy plus a penalty on the logits (PaLM's z-loss)
        def __init__(self) -> None:
            super().__init__()
            self.emb, self.head = nn.Embedding(64, 16), nn.Linear(16, 64, bias=False)

        def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            logits = self.head(self.emb(x)).view(-1, 64)
            return F.cross_entropy(logits, y.view(-1)) + 1e-4 * logits.logsumexp(-1).pow(2).mean()

    x = torch.randint(0, 64, (2, 8))
    gm = compile_step(ZLoss(), (x, x), {}, config=Config(), loss_fn=None,
                      options=dict(chunk_cross_entropy="always")).captured.gm
    assert OP not in _ops(gm) and torch.ops.aten._log_softmax.default in _ops(gm)


def _hf(kind: str, vocab: int) -> tuple[nn.Module, dict]:
    import transformers

    torch.manual_seed(0)
    if kind == "gpt2":
        model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
            n_layer=1, n_embd=16, n_head=2, vocab_size=vocab, n_positions=256, resid_pdrop=0.0, embd_pdrop=0.0,
            attn_pdrop=0.0, bos_token_id=0, eos_token_id=0))
    else:
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
            num_hidden_layers=1, hidden_size=16, intermediate_size=32, num_attention_heads=2, num_key_value_heads=1,
            vocab_size=vocab, max_position_embeddings=256, bos_token_id=0, eos_token_id=0, pad_token_id=0))
    ids = torch.randint(0, vocab, (2, 256))
    return model, {"input_ids": ids, "labels": ids}


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_a_large_vocabulary_is_chunked_by_default_and_trains_as_eager_does(kind: str) -> None:
    """2 x 256 tokens x 32768 vocabulary: 64 MiB of fp32 logits, the "auto" rule's threshold. SGD,
    so parameters differ from eager's exactly as much as gradients do (Adam turns rounding noise in
    near-zero gradients into +-lr steps, with or without this pass)."""
    model, batch = _hf(kind, 32768)
    eager = copy.deepcopy(model)
    engine = fxspeed.compile(model, 1, fxspeed.Config(optimizer="sgd", lr=0.5), example_inputs=batch)
    assert any(p["name"] == "chunk_cross_entropy" and p["modified"] for p in engine.plan.passes)
    opt = torch.optim.SGD(eager.parameters(), lr=0.5, fused=True)
    for step in range(3):
        loss = engine.train_step(**batch)
        ref = eager(**batch).loss
        ref.backward()
        opt.step()
        opt.zero_grad()
        assert abs(loss - ref.item()) <= 1e-5 * abs(ref.item()), step
    for (name, p), q in zip(model.named_parameters(), eager.parameters()):
        assert (p - q).norm() <= 1e-5 * q.norm(), name
