"""The kv_cache pass (passes/inference/kv_cache.py) and the paged attention it puts in graphs:
before/after on small models, refusals, and the property that prefill + k decode steps give the
logits of one full forward over the prefix."""

from __future__ import annotations

import types

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import fxspeed
from fxspeed.compiler.capture_inference import compile_inference
from fxspeed.config import Config
from fxspeed.errors import PassError
from fxspeed.models.gpt import GPT, GPTConfig
from fxspeed.runtime.kernels.packed_linear import PACKED_KINDS

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()

aten = torch.ops.aten
SDPA = {aten._scaled_dot_product_flash_attention_for_cpu.default, aten._scaled_dot_product_flash_attention.default,
        aten._scaled_dot_product_efficient_attention.default, aten.scaled_dot_product_attention.default}


def tiny_gpt() -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=64, block_size=48, n_layer=2, n_head=4, n_embd=32)).eval()


def targets(gm: torch.fx.GraphModule) -> list:
    return [n.target for n in gm.graph.nodes if n.op == "call_function"]


def test_the_pass_replaces_every_attention_by_paged_attention_and_adds_the_cache_inputs():
    prog = compile_inference(tiny_gpt(), 8, config=Config())
    ts = targets(prog.gm)
    assert not SDPA & set(ts)
    assert ts.count(torch.ops.fxspeed.paged_attention.default) == 2
    kinds = [s.kind for s in prog.signature.inputs if s.kind not in ("param", "buffer", *PACKED_KINDS)]
    assert sorted(kinds) == sorted(["tokens", "positions", "slot_mapping", "block_table", "query_index", "query_pos",
                                    *["kv_cache"] * 4, "logits_index"])
    # fxspeed's GPT makes its positions with arange(T): replaced by the positions input
    assert aten.arange.start not in ts and aten.arange.default not in ts
    assert prog.kv_layout == [(4, 8, torch.float32)] * 2
    assert prog.kv_bytes_per_token() == 2 * 2 * 4 * 8 * 4
    assert [r.name for r in prog.records if r.name != "annotate"][-6:] == [
        "kv_cache", "select_logits", "fuse_activations", "drop_clones", "eliminate_dead_code", "pack_linear_weights"]


def test_grouped_query_attention_caches_the_kv_heads_not_the_repeated_ones():
    torch.manual_seed(0)
    m = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        num_hidden_layers=1, hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=64, max_position_embeddings=64, attn_implementation="sdpa")).eval()
    before = fxspeed.compiler.capture.capture_step(
        m, (), {"input_ids": torch.zeros(1, 4, dtype=torch.long), "position_ids": torch.arange(4)[None],
                "use_cache": False}, train=False)
    assert any(t in SDPA for t in targets(before.gm))
    assert aten.expand.default in targets(before.gm)  # repeat_kv before the attention
    prog = compile_inference(m, 4, config=Config())
    assert prog.kv_layout == [(2, 8, torch.float32)]
    assert aten.expand.default not in targets(prog.gm)  # the repeat is dead: the kernel reads Hkv heads


class _SlicedGroupedHeads(nn.Module):
    """Grouped-query attention over heads [lo, hi) of 4 query heads, with keys/values cut from
    the 2 key/value heads repeated whole: what a tensor-parallel rank runs where the solver left
    the keys replicated and sliced its query heads' share (shard_tensors' clone(slice(...)))."""

    def __init__(self, lo: int, hi: int) -> None:
        super().__init__()
        self.lo, self.hi = lo, hi
        self.config = types.SimpleNamespace(vocab_size=64, max_position_embeddings=64)  # what serve reads
        self.emb, self.q, self.kv = nn.Embedding(64, 32), nn.Linear(32, 32), nn.Linear(32, 32)
        self.head = nn.Linear(8 * (hi - lo), 64)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.emb(input_ids)
        B, T, _ = x.shape
        q = self.q(x).view(B, T, 4, 8).transpose(1, 2)[:, self.lo:self.hi]
        k, v = self.kv(x).view(B, T, 2, 2, 8).permute(2, 0, 3, 1, 4)
        rep = lambda t: t[:, :, None].expand(B, 2, 2, T, 8).reshape(B, 4, T, 8)[:, self.lo:self.hi].contiguous()
        y = F.scaled_dot_product_attention(q, rep(k), rep(v), is_causal=True)
        return self.head(y.transpose(1, 2).reshape(B, T, -1))


@pytest.mark.parametrize("lo,hi,heads", [(2, 4, 1), (0, 4, 2), (0, 1, 1), (1, 3, 2)])
def test_keys_cut_from_repeated_heads_are_cached_as_their_key_value_heads(lo: int, hi: int, heads: int):
    # (1, 3) spans half of each group: no kv-head form, the cache holds the 2 repeated heads
    torch.manual_seed(0)
    model = _SlicedGroupedHeads(lo, hi).eval()
    assert compile_inference(model, 4, config=Config()).kv_layout == [(heads, 8, torch.float32)]
    eng = fxspeed.serve(model, token_budget=4, max_batch=2, block_size=4, cache_tokens=64)
    eng._serving.record_logits = {}
    prompts = [[3, 9, 27, 17, 51, 1], [8]]
    outs = eng.generate(prompts, max_new_tokens=5)
    with torch.no_grad():
        for i, (p, o) in enumerate(zip(prompts, outs)):
            want = model(torch.tensor([p + o]))[0, len(p) - 1:len(p) + 4]
            torch.testing.assert_close(torch.stack(eng._serving.record_logits[i]), want, rtol=0, atol=1e-4)


class _Bidirectional(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(16, 8)
        self.qkv = nn.Linear(8, 24)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(self.emb(input_ids)).unflatten(-1, (3, 2, 4)).permute(2, 0, 3, 1, 4)
        return F.scaled_dot_product_attention(q, k, v).transpose(1, 2).flatten(2)


class _Handwritten(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(16, 8)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.emb(input_ids)
        return torch.softmax(x @ x.transpose(1, 2), -1) @ x


_FAST = fxspeed.DeviceSpec("fast-compute-slow-links", 1e10, {"fp32": 1e12}, 1e12, 1e6, "cpu")


@pytest.mark.parametrize("device", ["cpu", "H100-80GB", "fast-compute-slow-links"])
@pytest.mark.parametrize("family, width, heads, kv", [("llama", 512, 8, 2), ("gpt2", 64, 4, 4)])
def test_a_tensor_parallel_serving_program_caches_only_its_rank_s_heads_on_any_device(device, family, width, heads,
                                                                                        kv):
    """The first serving program's layout splits attention by heads where they divide, so each of
    T=2 ranks caches kv / 2 key/value heads a layer. Left to the cost model of one step, a Llama
    512 wide on the H100 preset (and GPT-2 64 wide where links are slow next to compute) ran
    attention whole on every rank, an all-reduce a layer fewer, and cached every head on each:
    half the requests fit."""
    import transformers

    from fxspeed.compiler.options import PassOptions
    from fxspeed.devices import PRESETS
    from fxspeed.planner.placement import PlacementAnalysis

    torch.manual_seed(0)
    if family == "llama":
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
            vocab_size=128, hidden_size=width, intermediate_size=2 * width, num_hidden_layers=2,
            num_attention_heads=heads, num_key_value_heads=kv, max_position_embeddings=64)).eval()
    else:
        model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
            vocab_size=128, n_embd=width, n_layer=2, n_head=heads, n_positions=64)).eval()
    analysis = PlacementAnalysis([PRESETS.get(device, _FAST)])
    options = PassOptions.single_device(Config(), tp_size=2, tp_rank=0, tp_group_name="tp")
    program = compile_inference(model, 8, config=Config(), options=options, analyses=[analysis.graph_pass])
    assert [h for h, _, _ in program.kv_layout] == [kv // 2] * 2


def test_a_bidirectional_attention_is_refused_not_served_wrongly():
    with pytest.raises(PassError, match="not causal"):
        compile_inference(_Bidirectional().eval(), 4, config=Config())


def test_a_model_without_scaled_dot_product_attention_is_refused_with_the_fix():
    with pytest.raises(PassError, match="attn_implementation='sdpa'"):
        compile_inference(_Handwritten().eval(), 4, config=Config())


class _MaskedCausalLM(nn.Module):
    """Attention through SDPA's math form with its own causal mask (how HF Falcon traced before
    transformers 5.2x)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb, self.qkv, self.head = nn.Embedding(64, 32), nn.Linear(32, 96), nn.Linear(32, 64)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.emb(input_ids)
        B, T, _ = x.shape
        q, k, v = self.qkv(x).view(B, T, 3, 4, 8).permute(2, 0, 3, 1, 4)
        mask = torch.ones(T, T, dtype=torch.bool, device=x.device).tril()
        with torch.nn.attention.sdpa_kernel([torch.nn.attention.SDPBackend.MATH]):  # the math form, as traced
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.head(y.transpose(1, 2).reshape(B, T, 32))


def test_attention_traced_to_its_masked_math_form_is_refused_naming_the_mask():
    # matmul + softmax: no attention op to thread the cache through
    torch.manual_seed(0)
    with pytest.raises(PassError, match="explicit attn_mask.*is_causal=True"):
        compile_inference(_MaskedCausalLM().eval(), 4, config=Config())


def test_attention_on_heads_permuted_out_of_the_last_dim_is_refused_naming_contiguous(monkeypatch):
    """SDPA on a query/key/value whose last dim is not contiguous (a permute that moves the head
    dim) traces on the CPU to its math form, as a masked SDPA does; the error blamed a mask the
    model never passed."""
    import fxspeed.models.gpt as gpt

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = (t.view(B, T, C // self.n_head, self.n_head).permute(0, 3, 1, 2)
                   for t in self.qkv(x).split(C, dim=2))
        return self.proj(F.scaled_dot_product_attention(q, k, v, is_causal=True).permute(0, 2, 3, 1).reshape(B, T, C))

    monkeypatch.setattr(gpt.CausalSelfAttention, "forward", forward)
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=64, block_size=32, n_layer=1, n_head=2, n_embd=32)).eval()
    with pytest.raises(PassError, match=r"last dim is not contiguous.*add \.contiguous\(\)"):
        compile_inference(model, 4, config=Config())


class _MaskedSDPA(nn.Module):
    """Attention through SDPA with an explicit mask of one kind (its fused CPU kernel, which the
    kv_cache pass rewrites, takes the mask as it is)."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.emb, self.qkv, self.head = nn.Embedding(64, 32), nn.Linear(32, 96), nn.Linear(32, 64)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.emb(input_ids)
        B, T, _ = x.shape
        q, k, v = self.qkv(x).view(B, T, 3, 4, 8).permute(2, 0, 3, 1, 4)
        i = torch.arange(T, device=x.device)
        back = i[:, None] - i[None, :]
        visible = back >= 0
        if self.kind == "window3":
            visible = visible & (back < 3)
        elif self.kind == "future":
            visible = back >= -1
        mask = torch.zeros(T, T).masked_fill(~visible, float("-inf"))
        if self.kind == "bool":
            mask = visible
        elif self.kind == "alibi":  # Falcon / BLOOM: a per-head linear bias on the visible positions
            slopes = torch.tensor([0.5, 0.25, 0.125, 0.0625]).view(4, 1, 1)
            mask = mask - slopes * back.clamp(min=0)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask.expand(B, 4, T, T))
        return self.head(y.transpose(1, 2).reshape(B, T, 32))


@pytest.mark.parametrize("kind, window", [("bool", None), ("additive", None), ("window3", 3)])
def test_an_explicit_causal_mask_is_checked_and_a_sliding_window_is_recorded(kind: str, window: int | None) -> None:
    program = compile_inference(_MaskedSDPA(kind).eval(), 8, config=Config())
    assert torch.ops.fxspeed.paged_attention.default in targets(program.gm)
    assert program.window == window


@pytest.mark.parametrize("kind, says", [("alibi", "adds a bias to the visible positions"), ("future", "is not causal")])
def test_a_mask_that_is_not_plain_causal_is_refused_not_dropped(kind: str, says: str) -> None:
    """Falcon with alibi=True was served with its ALiBi bias dropped (the paged attention is
    causal by construction and ignored the mask): logits off by 3e-3 at 40 tokens, other tokens."""
    with pytest.raises(PassError, match=says):
        compile_inference(_MaskedSDPA(kind).eval(), 8, config=Config())


def test_falcon_with_alibi_is_refused_by_serve() -> None:
    torch.manual_seed(0)
    cfg = transformers.FalconConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                                    alibi=True, max_position_embeddings=64)
    with pytest.raises(PassError, match="adds a bias to the visible positions"):
        fxspeed.serve(transformers.FalconForCausalLM(cfg), devices=1, token_budget=16)


def test_a_model_with_a_context_below_the_token_budget_is_refused_for_its_attention_not_its_buffers() -> None:
    """GPT-Neo's causal-mask buffer is context x context: a packed row of the default 256 tokens
    failed inside the capture with a broadcast error. Steps are capped at the context, so the
    user reads why it cannot be served (its attention has no SDPA form)."""
    torch.manual_seed(0)
    cfg = transformers.GPTNeoConfig(vocab_size=64, hidden_size=32, num_layers=2, num_heads=4, window_size=16,
                                    attention_types=[[["global", "local"], 1]], max_position_embeddings=64)
    with pytest.raises(PassError, match="cannot be served yet"):
        fxspeed.serve(transformers.GPTNeoForCausalLM(cfg).eval(), devices=1)


def test_serving_past_a_window_the_config_does_not_declare_is_refused() -> None:
    model = _MaskedSDPA("window3").eval()
    model.config = type("C", (), {"vocab_size": 64, "max_position_embeddings": 32})()
    with pytest.raises(fxspeed.ConfigError, match="hide keys 3 or more positions back .* sliding window"):
        fxspeed.serve(model, devices=1, token_budget=8, max_batch=4).generate([[1, 2, 3, 4, 5]], max_new_tokens=4)


_ENGINE: dict = {}


def _served() -> tuple[GPT, fxspeed.Engine]:
    if not _ENGINE:
        model = tiny_gpt()
        eng = fxspeed.serve(model, token_budget=8, max_batch=4, block_size=4, cache_tokens=160)
        eng._serving.record_logits = {}
        _ENGINE["v"] = (model, eng)
    return _ENGINE["v"]


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(lengths=st.lists(st.integers(1, 19), min_size=1, max_size=3), k=st.integers(1, 4),
       seed=st.integers(0, 2**16))
def test_prefill_and_k_decode_steps_give_the_logits_of_a_full_forward_over_the_prefix(lengths, k, seed):
    model, eng = _served()
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, 64, (n,), generator=g).tolist() for n in lengths]
    eng._serving.record_logits.clear()
    outs = eng.generate(prompts, max_new_tokens=k)
    with torch.no_grad():
        for i, (p, o) in enumerate(zip(prompts, outs)):
            assert len(o) == k
            full = model(torch.tensor([p + o]))[0]  # one forward over prompt + generated
            want = full[len(p) - 1:len(p) + k - 1]
            got = torch.stack(eng._serving.record_logits[i])
            torch.testing.assert_close(got, want, rtol=0, atol=1e-4)


class _SoftCapped(GPT):
    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        return 4.0 * torch.tanh(super().forward(idx) / 4.0)


def test_a_head_followed_by_other_ops_keeps_all_logits_and_still_samples_the_right_rows():
    torch.manual_seed(0)
    model = _SoftCapped(GPTConfig(vocab_size=64, block_size=48, n_layer=1, n_head=2, n_embd=16)).eval()
    prog = compile_inference(model, 8, config=Config())
    assert not prog.selects_logits and not any(s.kind == "logits_index" for s in prog.signature.inputs)
    eng = fxspeed.serve(model, token_budget=8, max_batch=2, block_size=4, cache_tokens=64)
    prompts = [[1, 2, 3, 4, 5], [9, 9]]
    outs = eng.generate(prompts, max_new_tokens=4)
    with torch.no_grad():
        for p, o in zip(prompts, outs):
            ref = list(p)
            for _ in range(4):
                ref.append(int(model(torch.tensor([ref]))[0, -1].argmax()))
            assert o == ref[len(p):]


class _CumsumPositions(GPT):
    """Positions from a cumsum over the row (as older OPT did from its attention mask): packed
    requests would get the wrong ones, and nothing in the graph says so."""

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        pos = torch.ones_like(idx).cumsum(-1) - 1
        x = self.wte(idx) + self.wpe(pos)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def _positions_matter(cls: type[_CumsumPositions]) -> _CumsumPositions:
    torch.manual_seed(0)
    model = cls(GPTConfig(vocab_size=64, block_size=48, n_layer=1, n_head=2, n_embd=16)).eval()
    with torch.no_grad():
        model.wpe.weight.mul_(50.0)  # make positions matter
    return model


def test_serve_refuses_a_model_whose_positions_the_passes_cannot_follow():
    model = _positions_matter(_CumsumPositions)
    with pytest.raises(fxspeed.ConfigError, match="disagrees with its eager forward"):
        fxspeed.serve(model, token_budget=8, max_batch=2, block_size=4, cache_tokens=64)


class _CumsumPositionsMasked(_CumsumPositions):
    """The same, banning every fourth id with finfo.min, as models mask tokens."""

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        logits = super().forward(idx)
        return logits.masked_fill(torch.arange(logits.shape[-1]) % 4 == 0, torch.finfo(logits.dtype).min)


def test_serve_refuses_such_a_model_when_it_masks_tokens_with_the_smallest_float():
    """The packed check's tolerance grew with the largest |logit|: 3.4e38 here, so the wrong
    positions passed it (h82)."""
    model = _positions_matter(_CumsumPositionsMasked)
    with pytest.raises(fxspeed.ConfigError, match="disagrees with its eager forward"):
        fxspeed.serve(model, token_budget=8, max_batch=2, block_size=4, cache_tokens=64)


def test_the_packed_check_still_runs_when_the_cache_holds_one_short_request_only():
    """It was skipped with a warning below two 8-token requests, serving this model wrongly."""
    model = _positions_matter(_CumsumPositions)
    with pytest.raises(fxspeed.ConfigError, match="disagrees with its eager forward"):
        fxspeed.serve(model, token_budget=8, max_batch=2, block_size=16, cache_tokens=16)


class _TokenMixing(GPT):
    """A layer with state from token to token outside attention: a causal depthwise conv1d over
    the sequence (Mamba's, LFM2's ShortConv) or a running sum over it (a scan)."""

    def __init__(self, config: GPTConfig, kind: str) -> None:
        super().__init__(config)
        self.kind = kind
        self.conv = nn.Conv1d(config.n_embd, config.n_embd, 4, groups=config.n_embd, padding=3)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        if self.kind == "conv":
            x = x + self.conv(x.transpose(1, 2))[..., :idx.shape[1]].transpose(1, 2)
        else:
            x = x + x.cumsum(1) / 10
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


@pytest.mark.parametrize("kind", ["conv", "scan"])
def test_a_model_that_mixes_tokens_outside_attention_is_refused_not_served_without_its_state(kind: str):
    """Served, the conv / scan saw only each step's own tokens, mixed across packed requests;
    FalconH1 at default init stayed under the packed check's tolerance and gave a wrong token."""
    torch.manual_seed(0)
    model = _TokenMixing(GPTConfig(vocab_size=64, block_size=48, n_layer=1, n_head=2, n_embd=16), kind).eval()
    with pytest.raises(PassError, match="mixes tokens outside its attention"):
        compile_inference(model, 8, config=Config())


def test_the_torch_path_makes_a_step_s_slots_and_mask_once_and_again_when_the_metadata_is_refilled_in_place():
    """Every layer of a step reads the same metadata tensors: the slots and mask are made once.
    A static bucket refills the same tensors for the next step: they must be made again."""
    from fxspeed.runtime.kernels.paged_attention import _step_index

    bt = torch.tensor([[1, 2], [3, 0]])
    qp = torch.tensor([[5], [2]])
    qi = torch.tensor([[0], [1]])
    first, decode = _step_index(bt, qp, qi, 4)
    assert _step_index(bt, qp, qi, 4)[0] is first  # the second layer: the same tensors
    (slots, mask, _), = first
    assert slots.tolist() == [4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3]
    assert (mask[:, 0, 0] == 0).tolist() == [[j <= 5 for j in range(8)], [j <= 2 for j in range(8)]]
    assert decode  # sequence s's one query is token s: a decode step
    bt[1, 0] = 2  # the next step, refilled in place
    qp.copy_(torch.tensor([[6], [3]]))
    qi.copy_(torch.tensor([[1], [0]]))
    (again, decode) = _step_index(bt, qp, qi, 4)
    (slots, mask, _), = again
    assert slots[8:12].tolist() == [8, 9, 10, 11]
    assert (mask[:, 0, 0] == 0).tolist() == [[j <= 6 for j in range(8)], [j <= 3 for j in range(8)]]
    assert mask[0, 0, 0, 7] == float("-inf") and not decode  # the queries swapped: not in token order
    assert _step_index(bt.clone(), qp, qi, 4)[0] is not again  # another tensor, however equal: made again
    qi.copy_(torch.tensor([[0], [1]]))  # only the query slots refilled: the decode test is made again
    assert _step_index(bt, qp, qi, 4)[1]
    assert _step_index(bt, qp, qi, 4, torch.bfloat16)[0][0][1].dtype == torch.bfloat16  # the queries' dtype
