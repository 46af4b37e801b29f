"""The vocabulary projection and its cross-entropy in chunks of rows (passes/memory/
chunk_cross_entropy.py, runtime/kernels/cross_entropy.py): the op against torch's formula, the
rewrite's shape, and training parity with eager PyTorch where the planner's rule chunks."""

from __future__ import annotations

import copy
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from hypothesis import given, settings, strategies as st

import fxspeed
from fxspeed.compiler.pipelines import compile_step
from fxspeed.config import Config
from fxspeed.ir import META_KEY, op_workspace
from fxspeed.planner.memory import memory_timeline
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


@settings(max_examples=15, deadline=None)
@given(n=st.integers(1, 40), c=st.integers(1, 24), v=st.integers(2, 70), rows=st.integers(1, 50),
       seed=st.integers(0, 2**16))
def test_the_op_on_a_cpu_that_upcasts_bf16_matches_the_native_path_within_bf16_rounding(
        n: int, c: int, v: int, rows: int, seed: int) -> None:
    """The upcast path (weight in fp32 once, weight gradient summed in fp32) against the native one."""
    import fxspeed.runtime.kernels.cross_entropy as ce

    g = torch.Generator().manual_seed(seed)
    h, wt = torch.randn(n, c, generator=g).bfloat16(), torch.randn(c, v, generator=g).bfloat16()
    target = torch.randint(0, v, (n,), generator=g)
    native = linear_cross_entropy(h, wt, target, -100, 1, rows)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(ce, "cpu_computes_natively", lambda dtype: dtype == torch.float32)
        up = linear_cross_entropy(h, wt, target, -100, 1, rows)
    assert all(u.dtype == a.dtype for u, a in zip(up, native))
    for u, a in zip(up, native):
        torch.testing.assert_close(u.float(), a.float(), rtol=2e-2, atol=2e-2)


_PEAK_SCRIPT = """
import gc, sys, torch
import fxspeed.runtime.kernels.cross_entropy as ce
if sys.argv[2] == "upcast":
    ce.cpu_computes_natively = lambda d: d == torch.float32
dt = getattr(torch, sys.argv[1])
n, c, v = 384, 256, 24000
h = torch.randn(n, c).to(dt); wt = (torch.randn(c, v) * 0.02).to(dt); tgt = torch.randint(0, v, (n,))
rows = ce.rows_per_chunk(v)
def status(key):
    return next(int(l.split()[1]) << 10 for l in open("/proc/self/status") if l.startswith(key))
ce.linear_cross_entropy(h, wt, tgt, -100, 1, rows); gc.collect()
open("/proc/self/clear_refs", "w").write("5")
base = status("VmRSS")
out = ce.linear_cross_entropy(h, wt, tgt, -100, 1, rows)
inside = status("VmHWM") - base - sum(o.numel() * o.element_size() for o in out)
print(inside, ce.workspace_bytes(h, wt, tgt, -100, 1, rows))
"""


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux's peak-RSS reset")
@pytest.mark.parametrize("dtype,path", [("float32", "native"), ("bfloat16", "native"), ("bfloat16", "upcast")])
def test_the_workspace_the_op_declares_to_the_planner_covers_what_it_allocates_inside(dtype: str, path: str) -> None:
    """Measured from outside (peak RSS over the call, minus the outputs, glibc returning frees) in
    a fresh process: what the planner adds at the op's node must not fall short of it, nor be
    more than twice it. (The bf16 op held a [V, C] product beside its fp32 sum before: 212 MiB
    at 512 x 512 x 50257, now 160, 162 declared.)"""
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-c", _PEAK_SCRIPT, dtype, path], env=env, capture_output=True,
                         text=True, timeout=300, check=True).stdout.split()
    inside, declared = int(out[0]), int(out[1])
    slack = 4 * 2**20  # page-granular RSS, the interpreter's own allocations
    assert inside <= declared + slack, (inside, declared)
    assert declared <= 2 * inside + slack, (inside, declared)


def test_the_planner_counts_the_ops_workspace_while_it_runs() -> None:
    """The plan's timeline at the op's node holds the declared workspace beside the live values."""
    model, batch = _gpt(vocab=512)
    gm = compile_step(model, batch, {}, config=Config(precision="bf16"), loss_fn=None,
                      options=dict(chunk_cross_entropy="always")).captured.gm
    (node,) = [n for n in gm.graph.nodes if n.target is OP]
    assert node.meta[META_KEY].workspace == op_workspace(node) > 512 * 32 * 4  # the weight gradient's fp32 sum
    tl = memory_timeline(gm)
    i = tl.names.index(node.name)
    assert tl.totals[i] - tl.totals[i - 1] >= op_workspace(node)


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
