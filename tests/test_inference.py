"""fxspeed.serve: greedy tokens identical to Hugging Face `generate` over mixed-length batches
(prompts split into chunks and mixed with decode tokens under a small token budget), logits
within 1e-4 of a full forward, bad requests failing alone, streaming, sampling, the plan."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import fxspeed
from fxspeed.errors import ConfigError
from fxspeed.models.gpt import GPT, GPTConfig

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()

V = 96
# Lengths straddle the token budget (8) and the block size (4): chunked prefills, decode tokens of
# other requests in the same steps, requests joining when max_batch (3) frees a slot.
PROMPTS = [[5, 17, 3], list(range(10, 30)), [7], [40, 41, 42, 43, 44, 45, 46, 47, 48], list(range(60, 72))]
NEW = [6, 5, 7, 4, 6]


def _hf(name: str) -> torch.nn.Module:
    torch.manual_seed(0)
    common = dict(vocab_size=V, max_position_embeddings=64, attn_implementation="sdpa")
    if name == "gpt2":
        cfg = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=4, n_positions=64, vocab_size=V,
                                      attn_implementation="sdpa", initializer_range=0.2)
        return transformers.GPT2LMHeadModel(cfg).eval()
    if name == "llama":
        cfg = transformers.LlamaConfig(num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=4,
                                       num_key_value_heads=2, initializer_range=0.2, **common)
        return transformers.LlamaForCausalLM(cfg).eval()
    if name == "mistral":
        cfg = transformers.MistralConfig(num_hidden_layers=2, hidden_size=32, intermediate_size=64,
                                         num_attention_heads=4, num_key_value_heads=1, sliding_window=48,
                                         initializer_range=0.2, **common)
        return transformers.MistralForCausalLM(cfg).eval()
    if name == "neox":
        cfg = transformers.GPTNeoXConfig(num_hidden_layers=2, hidden_size=32, intermediate_size=64,
                                         num_attention_heads=4, rotary_pct=0.5, initializer_range=0.2, **common)
        return transformers.GPTNeoXForCausalLM(cfg).eval()
    if name == "qwen2":  # GQA with biased q/k/v projections
        cfg = transformers.Qwen2Config(num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=4,
                                       num_key_value_heads=2, initializer_range=0.2, **common)
        return transformers.Qwen2ForCausalLM(cfg).eval()
    if name == "phi":  # partial rotary, attention and MLP in parallel from one norm
        cfg = transformers.PhiConfig(num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=4,
                                     partial_rotary_factor=0.5, initializer_range=0.2, **common)
        return transformers.PhiForCausalLM(cfg).eval()
    if name == "opt":
        cfg = transformers.OPTConfig(num_hidden_layers=2, hidden_size=32, ffn_dim=64, num_attention_heads=4,
                                     word_embed_proj_dim=32, init_std=0.2, **common)
        return transformers.OPTForCausalLM(cfg).eval()
    if name.startswith("qwen3_moe"):  # Hugging Face's grouped_mm experts: 8 of them top-2, or 4 top-1
        experts, top = (4, 1) if name.endswith("top1") else (8, 2)
        cfg = transformers.Qwen3MoeConfig(num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=4,
                                          num_key_value_heads=2, head_dim=8, num_experts=experts, num_experts_per_tok=top,
                                          moe_intermediate_size=16, initializer_range=0.2, **common)
        return transformers.Qwen3MoeForCausalLM(cfg).eval()
    raise ValueError(name)


def _gpt() -> GPT:
    torch.manual_seed(0)
    m = GPT(GPTConfig(vocab_size=V, block_size=64, n_layer=2, n_head=4, n_embd=32)).eval()
    with torch.no_grad():
        for p in m.parameters():
            p.mul_(8.0)  # away from near-uniform logits, so greedy choices are not ties
    return m


def _logits(model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    out = model(torch.tensor([ids]))
    return (out if isinstance(out, torch.Tensor) else out.logits)[0]


def _greedy_by_hand(model: torch.nn.Module, prompt: list[int], n: int) -> list[int]:
    """The n greedy tokens after `prompt`, one full eager forward per token (for models without
    HF's generate)."""
    seq = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            seq.append(int(_logits(model, seq)[-1].argmax()))
    return seq[len(prompt):]


def _generates_hugging_faces_tokens(model: torch.nn.Module, engine: fxspeed.Engine, prompts: list[list[int]],
                                    new: list[int]) -> None:
    """engine.generate gives HF generate's greedy tokens per prompt, and the logits of each sampled
    token within 1e-4 of the model's full forward."""
    engine._serving.record_logits = {}
    outs = engine.generate(prompts, max_new_tokens=new)
    with torch.no_grad():
        for i, (p, n, o) in enumerate(zip(prompts, new, outs)):
            ref = model.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                                 max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0)
            assert o == ref[0, len(p):].tolist(), f"request {i}"
            want = _logits(model, p + o)[len(p) - 1:len(p) + n - 1]
            torch.testing.assert_close(torch.stack(engine._serving.record_logits[i]), want, rtol=0, atol=1e-4)


@pytest.mark.parametrize("name", ["gpt2", "llama", "fxspeed_gpt", "mistral", "neox", "opt", "qwen2", "phi", "qwen3_moe",
                                  "qwen3_moe_top1"])
def test_greedy_tokens_equal_hugging_face_generate_over_a_mixed_length_batch(name):
    """qwen3_moe: the experts' group offsets (a cumsum over 8 experts) were refused as a scan over
    the 8 tokens of a bucket; qwen3_moe_top1: the inverse of the sort by expert (an arange as long
    as the row) was taken for the positions."""
    model = _gpt() if name == "fxspeed_gpt" else _hf(name)
    engine = fxspeed.serve(model, token_budget=8, max_batch=3, block_size=4, cache_tokens=96)
    engine._serving.record_logits = {}
    outs = engine.generate(PROMPTS, max_new_tokens=NEW)
    with torch.no_grad():
        for i, (p, n, o) in enumerate(zip(PROMPTS, NEW, outs)):
            if name == "fxspeed_gpt":  # no generate()
                ref = _greedy_by_hand(model, p, n)
            else:
                ref = model.generate(torch.tensor([p]), max_new_tokens=n, do_sample=False, eos_token_id=None,
                                     pad_token_id=0)[0, len(p):].tolist()
            assert o == ref, f"request {i}"
            want = _logits(model, p + o)[len(p) - 1:len(p) + n - 1]
            torch.testing.assert_close(torch.stack(engine._serving.record_logits[i]), want, rtol=0, atol=1e-4)
    st = engine._serving.stats
    assert st["steps"] < sum(NEW) + sum(len(p) for p in PROMPTS)  # requests shared steps
    assert set(engine._serving.programs) <= set(engine._serving.buckets)  # one program per bucket, reused


def test_an_moe_asked_for_its_router_logits_is_refused_naming_the_setting_and_serves_without_them():
    """Hugging Face collects router logits through hooks that returned more outputs from each of
    the trace's two calls: the error was "spec mismatch: existing=TreeSpec(tuple, ..." and the
    generic "rewrite that line"."""
    model = _hf("qwen3_moe")
    model.config.output_router_logits = True
    with pytest.raises(fxspeed.CaptureError, match=r"model.config.output_router_logits = False"):
        fxspeed.serve(model, token_budget=4, max_batch=2, block_size=4, cache_tokens=32)
    model = _hf("qwen3_moe")
    model.config.output_router_logits = False
    engine = fxspeed.serve(model, token_budget=4, max_batch=2, block_size=4, cache_tokens=32)
    p = PROMPTS[0]
    ref = model.generate(torch.tensor([p]), max_new_tokens=3, do_sample=False, eos_token_id=None, pad_token_id=0)
    assert engine.generate([p], max_new_tokens=3) == [ref[0, len(p):].tolist()]


@pytest.fixture(scope="module")
def gpt2_engine():
    model = _hf("gpt2")
    return model, fxspeed.serve(model, token_budget=8, max_batch=4, block_size=4, cache_tokens=40)


def test_bad_requests_fail_alone_and_the_others_match_their_greedy_tokens(gpt2_engine):
    model, engine = gpt2_engine
    good = [[1, 2, 3], [9, 8]]
    bad = {1: [], 2: [5, V + 3], 3: list(range(62)), 5: list(range(38))}  # empty, OOV, > context, > whole cache
    prompts = [good[0], bad[1], bad[2], bad[3], good[1], bad[5]]
    with pytest.raises(fxspeed.GenerationError) as e:
        engine.generate(prompts, max_new_tokens=5)
    res = e.value.results
    assert [r.req_id for r in e.value.errors] == [1, 2, 3, 5]
    assert "empty" in str(res[1]) and "outside the vocabulary" in str(res[2])
    assert "exceeds the model's context of 64" in str(res[3]) and "cache_tokens" in str(res[5])
    alone = engine.generate(good, max_new_tokens=5)
    assert [res[0], res[4]] == alone
    returned = engine.generate(prompts, max_new_tokens=5, on_error="return")
    assert [returned[0], returned[4]] == alone and isinstance(returned[1], fxspeed.RequestError)


def test_a_prompt_of_integer_ids_in_any_container_is_served_and_one_of_floats_bools_or_strings_is_refused(gpt2_engine):
    """Token ids come as a list, a 1-D integer tensor (any integer dtype, non-contiguous) or a numpy
    array; a float id (2.5, and 2.0 from a float tensor), a bool or a string would have been
    rounded or coerced into some other token: that request is refused, the others are served."""
    import numpy as np

    _, engine = gpt2_engine
    want = engine.generate([[1, 2, 3, 4]], max_new_tokens=4)[0]
    strided = torch.tensor([1, 0, 2, 0, 3, 0, 4, 0])[::2]
    ok = [torch.tensor([1, 2, 3, 4], dtype=torch.int32), strided, np.array([1, 2, 3, 4]), (1, 2, 3, 4)]
    bad = [[1, 2.5, 3, 4], torch.tensor([1.0, 2.0, 3.0, 4.0]), [True, 2, 3, 4], ["1", "2", "3", "4"], [[1, 2], [3, 4]]]
    res = engine.generate([*ok, *bad], max_new_tokens=4, on_error="return")
    assert res[:len(ok)] == [want] * len(ok)
    assert all(isinstance(r, fxspeed.RequestError) and "integer token ids" in str(r) for r in res[len(ok):])
    assert "position 1 holds 2.5 (float)" in str(res[len(ok)])
    # max_new_tokens: any integer type (numpy's from a length computation), not a bool
    assert engine.generate([[1, 2, 3, 4]] * 2, max_new_tokens=np.int64(4)) == [want] * 2
    assert engine.generate([[1, 2, 3, 4]] * 2, max_new_tokens=[np.int32(4), 2]) == [want, want[:2]]
    assert "max_new_tokens must be an int" in str(engine.generate([[1, 2]], max_new_tokens=True, on_error="return")[0])


def test_serving_programs_leave_only_their_own_generated_source_in_torch_fx_s_cache():
    """Every bucket's program is compiled through passes that each regenerate its code, and
    torch.fx keeps every generated source: only the sources of the programs the engine holds stay."""
    from torch.fx import graph_module

    model = _gpt()
    before = set(graph_module._loader.eval_cache)
    engine = fxspeed.serve(model, token_budget=8, max_batch=2, block_size=4, cache_tokens=32)
    engine.generate([[1, 2, 3, 4, 5]], max_new_tokens=2)  # a prefill and a decode bucket
    added = set(graph_module._loader.eval_cache) - before
    bound = [getattr(b, "bound", b) for b in engine._serving.programs.values()]
    kept = {type(gm).forward.__code__.co_filename for b in bound for gm in (b.program.gm, b.run)}  # (run: the
    assert len(bound) >= 2 and added <= kept, (len(added), len(kept))  # direct calls' copy of the program)


def test_a_torch_compiled_model_is_served_as_its_original_module_with_its_tokens():
    """serve read the token arguments from OptimizedModule.forward's (*args, **kwargs) and refused
    the model as taking no token ids (h54); fxspeed.compile already traced `_orig_mod`."""
    model = _hf("llama")
    ref = model.generate(torch.tensor([PROMPTS[0]]), max_new_tokens=4, do_sample=False, eos_token_id=None,
                         pad_token_id=0)[0, len(PROMPTS[0]):].tolist()
    engine = fxspeed.serve(torch.compile(model), token_budget=4, max_batch=2, block_size=4, cache_tokens=32)
    assert engine.generate([PROMPTS[0]], max_new_tokens=4) == [ref]


class _LogitsAndLoss(torch.nn.Module):
    """nanoGPT's forward: (logits, loss), the loss None without targets."""

    def __init__(self, gpt: GPT) -> None:
        super().__init__()
        self.gpt, self.config = gpt, gpt.config

    def forward(self, idx: torch.Tensor) -> tuple[torch.Tensor, None]:
        return self.gpt(idx), None


def test_a_model_returning_logits_and_a_loss_is_served_with_its_greedy_tokens():
    """serve's check against the eager forward read out["logits"] of any output that was not a
    tensor: a nanoGPT-style (logits, None) tuple failed serve with `TypeError: tuple indices must
    be integers or slices, not str`, though its program (the first output) was right (h61)."""
    model = _LogitsAndLoss(_gpt())
    engine = fxspeed.serve(model, token_budget=4, max_batch=2, block_size=4, cache_tokens=32)
    ref = list(PROMPTS[0])
    with torch.no_grad():
        for _ in range(4):
            ref.append(int(model(torch.tensor([ref]))[0][0, -1].argmax()))
    assert engine.generate([PROMPTS[0]], max_new_tokens=4) == [ref[len(PROMPTS[0]):]]


class _TablesByPosition(torch.nn.Module):
    """Positions read by slicing tables to the sequence length, as hand-written models do: minGPT's
    learned `pos_emb[:, :t]` and Meta's Llama rotary `freqs_cis[:seqlen]` (complex, twice the
    context long)."""

    def __init__(self) -> None:
        super().__init__()
        self.config = GPTConfig(vocab_size=V, block_size=32)
        self.emb, self.qkv, self.head = torch.nn.Embedding(V, 32), torch.nn.Linear(32, 96), torch.nn.Linear(32, V)
        self.pos_emb = torch.nn.Parameter(torch.randn(1, 32, 32))
        angles = torch.outer(torch.arange(64.0), 1.0 / 10000 ** (torch.arange(0, 8, 2) / 8))
        self.register_buffer("freqs_cis", torch.polar(torch.ones_like(angles), angles), persistent=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        B, t = idx.shape
        x = self.emb(idx) + self.pos_emb[:, :t, :]
        q, k, v = self.qkv(x).view(B, t, 3, 4, 8).unbind(2)  # [B, t, heads, head_dim] each
        rot = self.freqs_cis[:t].view(1, t, 1, 4)
        q, k = (torch.view_as_real(torch.view_as_complex(y.reshape(B, t, 4, 4, 2)) * rot).flatten(3) for y in (q, k))
        y = torch.nn.functional.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                             is_causal=True)
        return self.head(x + y.transpose(1, 2).reshape(B, t, 32))


def test_tables_sliced_to_the_sequence_length_are_read_at_each_tokens_position():
    """`table[:t]` read the rows of positions 0 .. t-1 for every request packed in a step: serve
    refused such a model ("compiled serving program disagrees with its eager forward", max logit
    error 0.177 for a Meta-style Llama); kv_cache now reads the rows of the tokens' positions (h61)."""
    torch.manual_seed(0)
    model = _TablesByPosition().eval()
    engine = fxspeed.serve(model, token_budget=8, max_batch=3, block_size=4, cache_tokens=96)
    prompts, new = PROMPTS[:4], [4, 3, 5, 2]
    for p, n, out in zip(prompts, new, engine.generate(prompts, max_new_tokens=new)):
        assert out == _greedy_by_hand(model, p, n)


def test_a_weight_sliced_to_the_length_of_one_bucket_is_refused_not_read_by_position():
    """`w[:8]` of a weight is `table[:T]` in the 8-token bucket only: read at the positions there,
    it would give that bucket wrong tokens, and serve's check runs the largest bucket only."""

    class Cut(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.config = GPTConfig(vocab_size=V, block_size=32)
            self.emb, self.w, self.head = torch.nn.Embedding(V, 16), torch.nn.Parameter(torch.randn(16, 16)), \
                torch.nn.Linear(8, V)

        def forward(self, idx: torch.Tensor) -> torch.Tensor:
            h = (self.emb(idx) @ self.w[:8].T)[:, None]  # [B, 1 head, t, 8]
            return self.head(torch.nn.functional.scaled_dot_product_attention(h, h, h, is_causal=True)[:, 0])

    engine = fxspeed.serve(Cut().eval(), token_budget=16, max_batch=2, block_size=4, cache_tokens=64)
    with pytest.raises(ConfigError, match="in 8-token steps w is sliced to the step's length"):
        engine.generate([list(range(8))], max_new_tokens=1)


def test_a_base_model_without_its_language_model_head_is_refused_naming_the_causal_lm_class():
    """A LlamaModel (hidden states, no LM head) was served with the argmax over its hidden units as
    the next tokens, without an error (before that, serve failed with KeyError: 'logits'); a
    forward whose first output is as wide as the hidden size, not the vocabulary, likewise (h61)."""
    from fxspeed.compiler.capture_inference import compile_inference
    from fxspeed.errors import CaptureError

    torch.manual_seed(0)
    base = transformers.LlamaModel(transformers.LlamaConfig(
        num_hidden_layers=1, hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=V, max_position_embeddings=64, attn_implementation="sdpa")).eval()
    with pytest.raises(CaptureError, match="LlamaModel returns no logits .*last_hidden_state.*ForCausalLM"):
        compile_inference(base, 8, config=fxspeed.Config())

    class HiddenFirst(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb, self.head = torch.nn.Embedding(V, 16), torch.nn.Linear(16, V)
            self.config = GPTConfig(vocab_size=V)

        def forward(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            h = self.emb(ids)[:, None]  # [B, 1 head, T, 16]
            h = torch.nn.functional.scaled_dot_product_attention(h, h, h, is_causal=True)[:, 0]
            return h, self.head(h)

    with pytest.raises(CaptureError, match="output '0' has 16 entries per token but its vocabulary has 96"):
        compile_inference(HiddenFirst(), 8, config=fxspeed.Config())


def test_one_unwrapped_prompt_or_a_batch_tensor_of_prompts_is_refused_saying_how_to_give_them(gpt2_engine):
    """A new user's two likely mistakes (h54): one prompt not wrapped in a list failed as one bad
    request per id ("int 80"), and Hugging Face's 2-D input_ids only as "must be a list"."""
    import numpy as np

    _, engine = gpt2_engine
    with pytest.raises(ConfigError, match=r"one prompt's token ids.*\[\[5, 6, 7\]\]"):
        engine.generate([5, 6, 7], max_new_tokens=2)
    for batch in (torch.tensor([[5, 6, 7]]), np.array([[5, 6, 7]])):
        with pytest.raises(ConfigError, match=r"of shape \(1, 3\).*tolist\(\).*padding"):
            engine.generate(batch, max_new_tokens=2)
    for one in (torch.tensor([5, 6, 7]), np.array([5, 6, 7])):  # one prompt as a tensor: wrap it
        with pytest.raises(ConfigError, match=r"of shape \(3,\).*in a list of their own: \[ids\]"):
            engine.generate(one, max_new_tokens=2)


@pytest.mark.parametrize("options,key", [
    (dict(temperature=float("nan")), "temperature"), (dict(temperature=float("inf")), "temperature"),
    (dict(temperature=-1.0), "temperature"), (dict(temperature=1.0, top_k=-3), "top_k"),
    (dict(temperature=1.0, top_k=2.5), "top_k"), (dict(temperature=1.0, top_p=0.0), "top_p"),
    (dict(temperature=1.0, top_p=1.5), "top_p"), (dict(temperature=1.0, top_p=float("nan")), "top_p"),
    (dict(temperature=1.0, seed=1.5), "seed"), (dict(eos_token_id=2.5), "eos_token_id"),
    (dict(eos_token_id=[1, "x"]), "eos_token_id"), (dict(eos_token_ids=[[1], 2.0]), "eos_token_ids")])
def test_a_sampling_option_out_of_its_range_is_refused_before_any_token_is_made(gpt2_engine, options, key):
    """A NaN temperature used to fail inside the first sampled step, a top_p of 1.5 or a negative
    top_k to be ignored, a float stop id to be matched against nothing."""
    _, engine = gpt2_engine
    with pytest.raises(fxspeed.ConfigError, match=f"generate: {key} must be"):
        engine.generate([[1, 2, 3], [4, 5]], max_new_tokens=3, **options)
    assert engine._serving.cache.free_blocks() == engine._serving.cache.usable_blocks  # nothing held


@pytest.mark.parametrize("max_new", [2.0, torch.tensor(2.0), "2", pytest.param("np0d", id="numpy-0d")])
def test_max_new_tokens_that_is_neither_an_int_nor_one_per_prompt_is_refused_naming_it(gpt2_engine, max_new):
    """A float or a 0-d float tensor failed with Python's "'float' object is not iterable"."""
    import numpy as np

    _, engine = gpt2_engine
    max_new = np.array(2.0) if max_new == "np0d" else max_new
    with pytest.raises(fxspeed.ConfigError, match="generate: max_new_tokens must be an int or one int per prompt"):
        engine.generate([[1, 2, 3]], max_new_tokens=max_new)


def test_a_request_that_cannot_get_blocks_while_a_paused_stream_holds_them_is_refused_not_left_waiting(gpt2_engine):
    """A generate() called while the caller holds another stream() of the engine half-way: no
    request of this loop will ever give blocks back, so waiting would never end (it raised
    "max() arg is an empty sequence"). The request fails alone; the stream goes on. So does one
    admitted beside the paused stream that then needs a block none of its own loop can free."""
    _, engine = gpt2_engine  # 40 tokens of cache: the stream's 39-token prompt takes all 10 blocks
    want = engine.generate([[3, 4, 5]], max_new_tokens=12)[0]
    it = engine.stream([[1] * 39], max_new_tokens=2)
    first = next(it)
    out = engine.generate([[3, 4, 5]], max_new_tokens=4, on_error="return")
    assert isinstance(out[0], fxspeed.RequestError) and "another unfinished stream()" in str(out[0])
    rest = [first, *it]
    assert len(rest) == 2 and engine._serving.cache.free_blocks() == engine._serving.cache.usable_blocks
    it = engine.stream([[1] * 30], max_new_tokens=3)  # 8 blocks held; 2 left, where 14 positions need 4
    first = next(it)
    out = engine.generate([[3, 4, 5]], max_new_tokens=12, on_error="return")
    assert isinstance(out[0], fxspeed.RequestError) and "another unfinished stream()" in str(out[0])
    assert len([first, *it]) == 3 and engine._serving.cache.free_blocks() == engine._serving.cache.usable_blocks
    assert engine.generate([[3, 4, 5]], max_new_tokens=12)[0] == want


def test_stream_yields_the_tokens_of_generate_and_eos_stops_a_request(gpt2_engine):
    _, engine = gpt2_engine
    prompts = [[1, 2, 3], [9, 8], [4, 4, 4, 4, 4, 4, 4, 4, 4, 4]]
    full = engine.generate(prompts, max_new_tokens=[6, 3, 5])
    seen: dict[int, list[int]] = {0: [], 1: [], 2: []}
    for rid, tok in engine.stream(prompts, max_new_tokens=[6, 3, 5]):
        seen[rid].append(tok)
    assert [seen[i] for i in range(3)] == full
    stop = full[0][2]
    cut = engine.generate(prompts, max_new_tokens=[6, 3, 5], eos_token_ids=[stop, None, None])
    assert cut[0] == full[0][:full[0].index(stop) + 1] and cut[1:] == full[1:]


def test_a_stream_left_early_gives_its_cache_blocks_back(gpt2_engine):
    _, engine = gpt2_engine
    free = engine._serving.cache.free_blocks()
    it = engine.stream([[1, 2, 3], [9, 8]], max_new_tokens=10)
    next(it)
    assert engine._serving.cache.free_blocks() < free
    it.close()
    assert engine._serving.cache.free_blocks() == free


def test_requests_wait_for_cache_blocks_and_still_finish(gpt2_engine):
    _, engine = gpt2_engine  # 40 tokens of cache: two 20-token requests at a time
    prompts = [[i + 1] * 14 for i in range(4)]
    outs = engine.generate(prompts, max_new_tokens=6)
    assert outs == [engine.generate([p], max_new_tokens=6)[0] for p in prompts]


def test_sampling_is_reproducible_with_a_seed_and_top_k_1_is_greedy(gpt2_engine):
    _, engine = gpt2_engine
    prompts = [[1, 2, 3], [9, 8]]
    a = engine.generate(prompts, max_new_tokens=8, temperature=1.5, top_p=0.9, seed=3)
    b = engine.generate(prompts, max_new_tokens=8, temperature=1.5, top_p=0.9, seed=3)
    assert a == b
    assert engine.generate(prompts, max_new_tokens=8, temperature=0.7, top_k=1, seed=5) == \
        engine.generate(prompts, max_new_tokens=8)
    with pytest.raises(ConfigError, match="temperature"):
        engine.generate(prompts, temperature=-1.0)


def test_top_p_keeps_the_smallest_set_of_tokens_whose_probability_reaches_it():
    """Two tokens of probability 0.5 under top_p=0.5: the first reaches it, so one is kept (as
    Hugging Face's TopPLogitsWarper does); both were sampled (h61)."""
    from fxspeed.runtime.serving import _Request, _sample

    logits = torch.tensor([0.0, 0.0, -30.0, -30.0])
    drawn = {_sample(logits, _Request(0, [1], 1, frozenset(), 1.0, None, 0.5, torch.Generator().manual_seed(s)))
             for s in range(64)}
    assert len(drawn) == 1 and drawn <= {0, 1}, drawn


class _BansTokens(torch.nn.Module):
    """fxspeed's GPT whose forward masks every third token id with -inf (a model that bans tokens)."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = _gpt()
        self.config = self.inner.config
        self.register_buffer("banned", torch.arange(V) % 3 == 0)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.inner(idx).masked_fill(self.banned, float("-inf"))


def test_a_model_whose_logits_hold_minus_infinity_is_served_and_never_yields_a_masked_token():
    """serve's packed check compared -inf with -inf: NaN, so the model was refused as 'disagrees
    with its eager forward'; and its tolerance grew with the largest |logit|, inf, so any error
    would have passed it (h82)."""
    model = _BansTokens().eval()
    engine = fxspeed.serve(model, token_budget=8, max_batch=3, block_size=4, cache_tokens=96)
    prompts = [[5, 17, 3], list(range(10, 30)), [7]]
    greedy = engine.generate(prompts, max_new_tokens=5)
    for p, o in zip(prompts, greedy):
        assert o == _greedy_by_hand(model, p, 5)
    sampled = engine.generate(prompts, max_new_tokens=5, temperature=1.5, top_k=50, top_p=0.9, seed=1)
    assert all(t % 3 for o in greedy + sampled for t in o)


def test_a_tiny_temperature_decodes_greedily_and_any_int_seed_samples(gpt2_engine):
    """temperature=1e-40 divided the logits to inf (softmax: NaN, the whole call failed midway); a
    seed from time.time_ns() overflowed the generator's 64 bits."""
    _, engine = gpt2_engine
    prompts = [[1, 2, 3], [9, 8]]
    assert engine.generate(prompts, max_new_tokens=6, temperature=1e-40, seed=0) == \
        engine.generate(prompts, max_new_tokens=6)
    for seed in (2 * 10**13, 1796505002289279384, -7, 2**80):
        a = engine.generate(prompts, max_new_tokens=4, temperature=1.0, seed=seed)
        assert a == engine.generate(prompts, max_new_tokens=4, temperature=1.0, seed=seed)
    np = pytest.importorskip("numpy")
    # a numpy int seed (a value read from an array) samples as the same Python int: it failed in
    # the seed arithmetic with an OverflowError (h54), and an int32 one would wrap before the modulo
    for seed in (np.int64(5), np.int32(123457), np.uint64(5)):
        assert engine.generate(prompts, max_new_tokens=4, temperature=1.0, seed=seed) == \
            engine.generate(prompts, max_new_tokens=4, temperature=1.0, seed=int(seed))
    stop = engine.generate(prompts[:1], max_new_tokens=6)[0][1]
    assert engine.generate(prompts[:1], max_new_tokens=6, eos_token_id=np.array([stop]))[0][-1] == stop


def test_the_inference_plan_counts_cache_bytes_per_token_and_a_serving_engine_refuses_training(gpt2_engine):
    model, engine = gpt2_engine
    plan = engine.plan
    assert plan.kv_bytes_per_token == 2 * 2 * 32 * 4  # layers x (k, v) x n_embd x fp32
    assert plan.cache_tokens == 40 and plan.cache_bytes == 2 * 2 * (10 + 1) * 4 * 32 * 4
    assert plan.max_batch_at_context == plan.max_cache_tokens // 64 > 0
    assert all(v > 0 for v in plan.predicted_tokens_per_s.values())
    text = plan.summary()
    assert "bytes/token" in text and "tokens/s" in text
    with pytest.raises(ConfigError, match="inference"):
        engine.train_step(torch.zeros(1, 4, dtype=torch.long))


def test_a_measured_cpu_gives_the_inference_plan_this_machines_rates():
    from fxspeed.planner.inference import decode_tokens_per_s

    spec = fxspeed.measured_cpu()
    assert spec.kind == "cpu" and "measured" in spec.name
    assert 1e8 < spec.mem_bandwidth < 1e13 and all(1e8 < f < 1e14 for f in spec.flops.values())
    assert fxspeed.measured_cpu() is spec  # once per process
    model = _hf("gpt2")
    plan = fxspeed.serve(model, devices=spec, token_budget=8, max_batch=4, block_size=4, cache_tokens=40).plan
    assert plan.device == spec.name and spec.name in plan.summary()
    want = decode_tokens_per_s(plan.parameters, plan.weight_bytes, 64 * plan.kv_bytes_per_token, 1, spec)
    assert plan.predicted_tokens_per_s["batch=1,context=64"] == pytest.approx(want)


@pytest.mark.slow
def test_two_tensor_parallel_ranks_serve_the_tokens_and_logits_of_one_device(tmp_path):
    """tests/workers/serving_worker.py, one launch of 2 ranks: GPT-2, Llama (GQA), fxspeed's GPT and
    OPT cut by heads (the cache holds kv_heads / 2 per rank) give HF's greedy tokens and logits
    within 1e-4 of a full forward, Llama also with the fusion passes on (each rank fuses its own
    heads); sampling without a seed agrees over the ranks; bad requests fail alone; a stream stopped
    at different tokens on the ranks is an error on the rank that goes on, not a hang; a Llama whose
    6 query / 3 key/value heads do not split over 2 ranks is served, with one device's tokens; so is
    a Phi3 (fused qkv, grouped keys) whose largest bucket all-gathers its repeated keys' tokens; a
    Gemma3 with local and global layers keeps its local layers' blocks in a smaller pool; a narrow
    Llama on a slow device caches the same heads in every bucket; a small Llama under the H100
    preset's costs is split by heads (it ran whole on every rank, no tp collective)."""
    from tests.multiprocess import launch_worker

    cases = ("gpt2", "llama", "gpt", "opt", "gemma3", "llama_fused", "sampling", "bad_request", "stream_stops", "uneven_heads",
             "fused_qkv_gqa", "bucket_layouts", "gpu_preset")
    launch_worker("tests.workers.serving_worker", 2, tmp_path, "--case", ",".join(cases), timeout=600)
    for case in cases:
        for rank in range(2):
            assert (tmp_path / f"{case}_rank{rank}.txt").read_text() == "ok", (case, rank)


def test_serving_refuses_devices_that_are_not_one_or_the_tensor_size():
    with pytest.raises(ConfigError, match="tensor-parallel over all of them"):
        fxspeed.serve(_gpt(), devices=2)
    with pytest.raises(ConfigError, match="tensor-parallel over all of them"):
        fxspeed.serve(_gpt(), devices=4, config=fxspeed.Config(tensor=2))


def test_a_bf16_gqa_model_caches_its_key_value_heads_in_bf16_and_stays_near_the_fp32_logits():
    """Under bf16 the repeated keys are cast for the attention; the cache must still hold the 2
    key/value heads (not the 4 repeated ones), in bf16: a quarter of the fp32 repeated bytes."""
    model = _hf("llama")
    engine = fxspeed.serve(model, config=fxspeed.Config(precision="bf16"), token_budget=8, max_batch=3, block_size=4,
                           cache_tokens=96)
    k = engine._serving.cache.tensors["0.k"]
    assert k.dtype == torch.bfloat16 and k.shape[2] == 2
    assert engine.plan.kv_bytes_per_token == 2 * 2 * 2 * (32 // 4) * 2  # layers x (k, v) x kv heads x head_dim x bf16
    engine._serving.record_logits = {}
    outs = engine.generate(PROMPTS[:3], max_new_tokens=4)
    with torch.no_grad():
        for i, (p, o) in enumerate(zip(PROMPTS[:3], outs)):
            want = _logits(model, p + o)[len(p) - 1:len(p) + 3]
            got = torch.stack(engine._serving.record_logits[i])
            assert (got - want).abs().max() <= 5e-2 * (1 + want.abs().max()), i


def test_a_bf16_serving_program_runs_silu_and_the_gate_product_in_bf16_unless_low_activations_is_off():
    """keep_activations_low runs in the serving passes too (autocast's dataflow between the
    matmuls); serve's own packed check against the eager model passes either way. Seen on the
    unfused ops (fuse_activations computes the product in fp32 and rounds once either way)."""
    dtypes = {}
    for low in (True, False):
        config = fxspeed.Config(precision="bf16", low_activations=low, disable_passes=("fuse_activations",))
        engine = fxspeed.serve(_hf("llama"), config=config, token_budget=8, max_batch=3, block_size=4, cache_tokens=96)
        gm = next(iter(engine._serving.programs.values())).program.gm
        silu = [n for n in gm.graph.nodes if n.target is torch.ops.aten.silu.default]
        assert silu
        dtypes[low] = {n.meta["val"].dtype for n in silu} | {u.meta["val"].dtype for n in silu for u in n.users
                                                            if u.target is torch.ops.aten.mul.Tensor}
    assert dtypes == {True: {torch.bfloat16}, False: {torch.float32}}


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_a_model_converted_to_bf16_serves_in_bf16_near_its_own_eager_logits(precision):
    """bf16 logits of packed serving steps and of one full forward round differently (ties in
    bf16 are common, so greedy tokens may part after a few steps): compared at bf16 tolerance.
    With Config(precision="bf16") as well (the issue's API): its matmuls gave bf16 already and
    must not be cast back to fp32 (that fed the next matmul an fp32 operand: a crash at serve)."""
    model = _hf("llama").to(torch.bfloat16)
    engine = fxspeed.serve(model, config=fxspeed.Config(precision=precision), token_budget=8, max_batch=3,
                           block_size=4, cache_tokens=96)
    assert engine._serving.cache.tensors["0.k"].dtype == torch.bfloat16
    assert engine.plan.weight_bytes == 2 * sum(p.numel() for p in model.parameters())
    engine._serving.record_logits = {}
    outs = engine.generate(PROMPTS[:3], max_new_tokens=4)
    with torch.no_grad():
        for i, (p, o) in enumerate(zip(PROMPTS[:3], outs)):
            want = _logits(model, p + o)[len(p) - 1:len(p) + 3].float()
            got = torch.stack(engine._serving.record_logits[i])
            assert (got - want).abs().max() <= 3e-2 * (1 + want.abs().max()), i


@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_serving_programs_run_the_fused_kernels_where_fusion_is_on_and_give_the_same_tokens(name, monkeypatch):
    """fuse_kernels and fuse_residual_norms run on serving programs of a CUDA device (here forced
    on the CPU, where the fused ops run their torch fallback), forward only: every norm, written
    out (Llama) or ATen's (GPT-2), is one kernel, fused with the residual add it reads where it
    reads one (all but the first layer's first norm); Llama's rotaries (q and k) and SwiGLU, GPT-2's
    written-out GELU, one kernel each; tokens and logits are those of the unfused engine."""
    model = _hf(name)
    plain = fxspeed.serve(model, token_budget=8, max_batch=3, block_size=4, cache_tokens=96)
    monkeypatch.setenv("FXSPEED_FUSE_ON_CPU", "1")
    fused = fxspeed.serve(model, token_budget=8, max_batch=3, block_size=4, cache_tokens=96)
    ops = torch.ops.fxspeed
    norm, add_norm = {"llama": (ops.rms_norm_fwd.default, ops.add_rms_norm_fwd.default),
                      "gpt2": (ops.layer_norm_fwd.default, ops.add_layer_norm_fwd.default)}[name]
    activation = {"llama": ops.swiglu_fwd.default, "gpt2": ops.gelu_fwd.default}[name]
    for program in fused._serving.programs.values():
        targets = [n.target for n in program.program.gm.graph.nodes if n.op == "call_function"]
        assert (targets.count(norm), targets.count(add_norm)) == (1, 2 * 2)  # two per layer and the final one
        assert targets.count(activation) == 2
        assert targets.count(ops.rotary_fwd.default) == (2 * 2 if name == "llama" else 0)
        assert torch.ops.aten.rsqrt.default not in targets and torch.ops.aten.native_layer_norm.default not in targets
        assert torch.ops.aten.tanh.default not in targets and torch.ops.aten.silu.default not in targets
        records = [r.name for r in program.program.records]
        assert "fuse_kernels" in records and "fuse_residual_norms" in records
    for e in (plain, fused):
        e._serving.record_logits = {}
    assert fused.generate(PROMPTS, max_new_tokens=NEW) == plain.generate(PROMPTS, max_new_tokens=NEW)
    for i in range(len(PROMPTS)):
        torch.testing.assert_close(torch.stack(fused._serving.record_logits[i]),
                                   torch.stack(plain._serving.record_logits[i]), rtol=0, atol=1e-5)


@pytest.mark.parametrize("name", ["llama", "gpt2", "mistral", "gemma3"])
def test_decode_buckets_at_the_fixed_shapes_of_a_cuda_graph_give_the_tokens_and_logits_of_per_step_shapes(name):
    """cuda_graphs: the buckets up to the decode bucket run at fixed shapes (every step's metadata
    padded to min(T, max_batch) sequences, T query slots, a whole context of blocks; the logits
    rows to the sequences), which is what a CUDA graph replays. Here on the CPU the padded steps
    run without the capture: with prompts split in chunks beside decode tokens, the tokens are
    those of per-step shapes and the logits agree within float rounding. Mistral (a sliding window)
    with a padded sequence beside decode tokens crashed the CPU torch path's grouping (h41)."""
    from fxspeed.runtime.serving import _Static

    model = _gemma3_hybrid() if name == "gemma3" else _hf(name)  # gemma3: two block tables, two pools
    options = dict(token_budget=8, max_batch=4, block_size=4, cache_tokens=96)
    plain = fxspeed.serve(model, **options)
    fixed = fxspeed.serve(model, **options)
    fixed.setup_serving(**options, cuda_graphs=True)  # the CPU dry run (serve refuses it without CUDA)
    assert plain._serving.static_buckets == set() and fixed._serving.static_buckets == {1, 2, 4}
    for e in (plain, fixed):
        e._serving.record_logits = {}
    # three requests decoding together: bucket 4 runs them beside a padded sequence
    prompts, new = [[5, 17, 3, 9, 11], list(range(1, 10)), [7, 8, 9]], [6] * 3
    assert fixed.generate(prompts, max_new_tokens=new) == plain.generate(prompts, max_new_tokens=new)
    ran = {T: type(b) for T, b in fixed._serving.programs.items()}
    assert ran.get(4) is _Static and ran.get(8) is not _Static, ran
    assert fixed._serving.programs[4].graph is None  # no capture off CUDA
    for i in range(len(prompts)):
        torch.testing.assert_close(torch.stack(fixed._serving.record_logits[i]),
                                   torch.stack(plain._serving.record_logits[i]), rtol=0, atol=1e-4)


def test_cuda_graphs_without_a_cuda_device_or_under_tensor_parallelism_are_refused_with_the_way_out():
    with pytest.raises(ConfigError, match="cuda_graphs=True needs one CUDA device"):
        fxspeed.serve(_gpt(), cuda_graphs=True)


def test_a_full_context_prompt_gets_its_one_new_token_and_a_custom_window_is_served_up_to_it():
    """The last new token is never fed, so a request needs prompt + max_new_tokens - 1 positions
    (a full-context prompt with one new token was refused). A window the config does not name
    per layer (set on the module, not the config) is served as causal attention up to it."""
    model = _hf("llama")  # context 64
    engine = fxspeed.serve(model, token_budget=16, max_batch=2, block_size=8)
    prompt = [(7 * i) % V for i in range(64)]
    want = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, 64, dtype=torch.long), max_new_tokens=1,
                          do_sample=False, pad_token_id=0)[0, 64:].tolist()
    out = engine.generate([prompt, prompt], max_new_tokens=[1, 2], on_error="return")
    assert out[0] == want
    assert isinstance(out[1], fxspeed.RequestError) and "context of 64 tokens" in str(out[1])


@pytest.mark.parametrize("family", ["mistral", "gemma3", "qwen2"])
def test_sliding_window_models_are_served_past_their_window_with_hugging_faces_tokens(family):
    """Each layer's window from the config (Mistral: every layer; Gemma3: local layers between
    global ones; Qwen2: the layers past max_window_layers) goes to the paged attention, which hides
    keys that many positions back: requests run past the window (they were capped at it) and give
    HF generate's greedy tokens and logits, over a mixed-length batch."""
    torch.manual_seed(0)
    small = dict(vocab_size=V, max_position_embeddings=64, attn_implementation="sdpa", num_hidden_layers=2,
                 hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
                 initializer_range=0.2)
    if family == "mistral":
        model = transformers.MistralForCausalLM(transformers.MistralConfig(**small, sliding_window=6))
    elif family == "gemma3":
        model = transformers.Gemma3ForCausalLM(transformers.Gemma3TextConfig(
            **small, head_dim=8, sliding_window=5, layer_types=["sliding_attention", "full_attention"]))
    else:
        model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**small, sliding_window=6, use_sliding_window=True,
                                                                       max_window_layers=1))
    model.eval()
    engine = fxspeed.serve(model, token_budget=8, max_batch=3, block_size=4, cache_tokens=128)
    _generates_hugging_faces_tokens(model, engine, [list(range(3, 23)), [5, 17, 3], list(range(30, 39))], [6, 12, 5])


def test_requests_hold_the_blocks_they_have_fed_and_the_youngest_gives_them_back_when_the_cache_runs_out():
    """A cache of 16 blocks of 4 and three requests of 4 + 39 positions (11 blocks each: one at a
    time when a request reserved its whole length). They start together, grow a block at a time,
    and the youngest is preempted when none is free, then fed again (prompt and tokens so far):
    HF's greedy tokens and logits, and a seeded sampling run draws what a roomy cache draws."""
    model = _hf("llama")
    prompts, new = [[5, 17, 3, 9], [40, 41, 42, 43], [7, 8, 9, 10]], [40] * 3
    tight = fxspeed.serve(model, token_budget=8, max_batch=3, block_size=4, cache_tokens=64)
    assert tight._serving.cache.usable_blocks == 16
    _generates_hugging_faces_tokens(model, tight, prompts, new)
    assert tight._serving.stats["preempted"] > 0 and tight._serving.cache.free_blocks() == 16
    roomy = fxspeed.serve(model, token_budget=8, max_batch=3, block_size=4, cache_tokens=256)
    sampled = dict(temperature=1.0, top_k=20, seed=3)
    assert tight.generate(prompts, max_new_tokens=new, **sampled) == roomy.generate(prompts, max_new_tokens=new,
                                                                                    **sampled)
    assert roomy._serving.stats["preempted"] == 0


def test_requests_that_share_a_prompt_start_read_its_cached_blocks_instead_of_computing_them():
    """Prefix caching: three prompts share 17 tokens (4 full blocks of 4). The first call computes
    them (its requests start together); the next call's requests read those blocks and compute
    from position 16 on, with HF's tokens and logits, and so does a later prompt that extends an
    earlier request's prompt and output (a chat's next turn)."""
    model = _hf("llama")
    engine = fxspeed.serve(model, token_budget=8, max_batch=3, block_size=4, cache_tokens=96)
    serving = engine._serving
    assert serving.prefix_caching
    shared = list(range(10, 27))
    prompts = [shared + [1, 2], shared + [3], shared + [4, 5, 6, 7, 8]]
    _generates_hugging_faces_tokens(model, engine, prompts, [6] * 3)
    hits = serving.stats["prefix_hit_tokens"]
    _generates_hugging_faces_tokens(model, engine, prompts, [6] * 3)
    assert serving.stats["prefix_hit_tokens"] - hits >= 3 * 16
    turn = prompts[2] + engine.generate([prompts[2]], max_new_tokens=6)[0] + [9, 9]
    hits = serving.stats["prefix_hit_tokens"]
    _generates_hugging_faces_tokens(model, engine, [turn], [5])
    # the earlier request fed 22 + 5 tokens (its last new token is never fed): 6 full blocks
    assert serving.stats["prefix_hit_tokens"] - hits == 6 * 4
    assert serving.cache.free_blocks() == serving.cache.usable_blocks


@pytest.mark.parametrize("write", ["in_place", "data"])
def test_cached_prefixes_are_forgotten_when_the_weights_change_between_calls(write):
    """Blocks computed with the old weights would give the new model's requests the old keys and
    values: a write to the weights (in place under no_grad, or through .data) between calls drops
    the index, and the next call gives the new model's tokens and logits."""
    model = _hf("llama")
    engine = fxspeed.serve(model, token_budget=8, max_batch=3, block_size=4, cache_tokens=96)
    prompts = [list(range(10, 30)), list(range(10, 25))]
    engine.generate(prompts, max_new_tokens=4)
    with torch.no_grad():
        for p in model.parameters():
            (p if write == "in_place" else p.data).mul_(1.5)
    hits = engine._serving.stats["prefix_hit_tokens"]
    _generates_hugging_faces_tokens(model, engine, prompts, [4, 4])
    assert engine._serving.stats["prefix_hit_tokens"] == hits


def test_forgetting_prefixes_leaves_the_blocks_a_paused_stream_shares_with_it_until_released():
    """Two requests of a paused stream share prefix blocks; the weights change and another call
    drops the index. Those blocks stayed counted (h45: they went to the free list when the first of
    the two finished, were handed out while the other still read them, and came back twice): the
    stream ends with the new model's tokens and every block is free once."""
    model = _hf("llama")
    engine = fxspeed.serve(model, token_budget=8, max_batch=3, block_size=4, cache_tokens=96)
    shared = list(range(10, 27))
    engine.generate([shared], max_new_tokens=2)
    prompts = [shared + [1], shared + [2, 3, 4]]
    it = engine.stream(prompts, max_new_tokens=[3, 12])
    got: list[list[int]] = [[], []]
    rid, tok = next(it)
    got[rid].append(tok)
    with torch.no_grad():
        model.model.norm.weight.add_(0)  # a write: the index is dropped at the next call
    engine.generate([[5, 6, 7, 8, 9]], max_new_tokens=3)
    for rid, tok in it:
        got[rid].append(tok)
    with torch.no_grad():
        for p, n, o in zip(prompts, [3, 12], got):
            assert o == model.generate(torch.tensor([p]), max_new_tokens=n, do_sample=False, eos_token_id=None,
                                       pad_token_id=0)[0, len(p):].tolist()
    cache = engine._serving.cache
    assert cache.free_blocks() == cache.usable_blocks and len(set(cache._free[""])) == len(cache._free[""])


def test_a_request_running_across_a_weight_write_indexes_none_of_its_blocks():
    """A paused stream's request has computed 3 positions of its first block with the old weights
    when they change and another call drops the index; it fills the block with the new ones. The
    block mixes both, so it is not indexed: a later prompt starting with it computes it again (h46:
    it was read, logits 3.7 off)."""
    model = _hf("llama")
    engine = fxspeed.serve(model, token_budget=4, max_batch=2, block_size=4, cache_tokens=96)
    long = list(range(20, 30))
    it = engine.stream([[3], long], max_new_tokens=[6, 2])
    next(it)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(1.25)
    engine.generate([[40, 41]], max_new_tokens=2)  # drops the index
    for _ in it:
        pass
    hits = engine._serving.stats["prefix_hit_tokens"]
    _generates_hugging_faces_tokens(model, engine, [long + [7]], [5])
    assert engine._serving.stats["prefix_hit_tokens"] == hits


def test_a_step_that_raises_indexes_none_of_the_blocks_it_did_not_write():
    """The blocks a step fills are indexed after it ran: one that raised (an interrupt, an
    allocator failure) left them indexed, unwritten, and the next call read them (h45)."""
    model = _hf("llama")
    engine = fxspeed.serve(model, token_budget=8, max_batch=3, block_size=4, cache_tokens=96)
    prompt = list(range(30, 45))
    bound = engine._serving.program(8)

    def fail(step):  # noqa: ANN001, ANN202
        raise RuntimeError("interrupted")

    engine._serving.programs[8] = fail
    fail.static = False
    fail.program = bound.program
    fail.shape = bound.shape
    with pytest.raises(RuntimeError, match="interrupted"):
        engine.generate([prompt], max_new_tokens=3)
    engine._serving.programs[8] = bound
    hits = engine._serving.stats["prefix_hit_tokens"]
    _generates_hugging_faces_tokens(model, engine, [prompt], [3])
    assert engine._serving.stats["prefix_hit_tokens"] == hits


def test_a_released_prefix_is_evicted_from_its_last_block_so_its_first_blocks_stay_findable():
    from fxspeed.runtime.serving import KVCache

    cache = KVCache([(1, 1, torch.float32)], 6, 2, torch.device("cpu"))  # 5 usable blocks of 2
    seq = tuple(range(8))
    blocks, chain = cache.allocate({"": 4})[""], 0
    for k, b in enumerate(blocks):
        chain = cache.index(b, chain, seq[2 * k:2 * k + 2])
    cache.release({"": blocks})
    cache.allocate({"": 2})  # one never-used block, then one evicted: the prefix's last
    assert cache.match(seq, 4)[0] == blocks[:3]


def test_a_sliding_window_model_computes_every_prompt():
    """A window layer needs the keys before the first token it computes in its own pool (its ring
    holds no shared blocks), so prefix caching is off for models with a sliding window."""
    engine = fxspeed.serve(_hf("mistral"), token_budget=8, max_batch=2, block_size=4, cache_tokens=32)
    assert engine._serving.prefix_caching is False
    assert fxspeed.serve(_hf("llama"), token_budget=8, max_batch=2, block_size=4, cache_tokens=32,
                         prefix_caching=False)._serving.prefix_caching is False


@settings(max_examples=80, deadline=None)
@given(ops=st.lists(st.tuples(st.integers(0, 4), st.integers(1, 14)), min_size=1, max_size=40),
       block_size=st.sampled_from([1, 2, 3, 4]))
def test_the_prefix_index_finds_a_block_only_where_it_holds_those_tokens_after_that_prefix(ops, block_size):
    """KVCache's prefix index under admissions of sequences sharing starts, releases, evictions
    (LRU, when the free list runs out) and forgets: every block `match` returns was filled with
    exactly that prefix (the sequence up to its end), and free blocks + blocks held = usable."""
    from fxspeed.runtime.serving import KVCache

    cache = KVCache([(1, 1, torch.float32)], 9, block_size, torch.device("cpu"))
    filled: dict[int, tuple[int, ...]] = {}  # block -> the prefix its keys and values were computed from
    held: list[list[int]] = []
    for kind, n in ops:
        if kind == 4 and n == 1:
            cache.forget_prefixes()
            continue
        seq = tuple(([kind % 3] * 6 + list(range(n)))[:n])
        full = len(seq) // block_size
        hits, chain = cache.match(seq, full)
        for k, b in enumerate(hits):
            assert filled[b] == seq[:(k + 1) * block_size]
        need = full - len(hits)
        while held and need > cache.free_blocks() - cache.idle_among(hits):
            cache.release({"": held.pop(0)})
            hits, chain = cache.match(seq, full)  # a release may make room by eviction later, never drop a hit
            need = full - len(hits)
        if need > cache.free_blocks() - cache.idle_among(hits):
            continue  # longer than the whole cache
        cache.hold(hits)
        new = cache.allocate({"": need})[""]
        for k, b in enumerate(new, start=len(hits)):
            filled[b] = seq[:(k + 1) * block_size]
            chain = cache.index(b, chain, seq[k * block_size:(k + 1) * block_size])
        held.append(hits + new)
        if kind == 3:
            cache.release({"": held.pop(0)})
        assert cache.free_blocks() + len({b for h in held for b in h}) == cache.usable_blocks


def test_requests_that_stop_early_at_eos_run_side_by_side_in_a_cache_too_small_for_their_whole_lengths():
    """max_new_tokens 40 (11 blocks a request) on a cache of 16 blocks: each request stops at an
    eos it meets in its third token, so all three start in the first two steps (the first token of
    each), instead of one after the other."""
    model = _hf("llama")
    prompts = [[5, 17, 3, 9], [40, 41, 42, 43], [7, 8, 9, 10]]
    with torch.no_grad():
        refs = [model.generate(torch.tensor([p]), max_new_tokens=3, do_sample=False, eos_token_id=None,
                               pad_token_id=0)[0, len(p):].tolist() for p in prompts]
    eos = [[r[2]] for r in refs]
    want = [r[:r.index(e[0]) + 1] for r, e in zip(refs, eos)]
    engine = fxspeed.serve(model, token_budget=8, max_batch=3, block_size=4, cache_tokens=64)
    first_at: dict[int, int] = {}
    got: list[list[int]] = [[] for _ in prompts]
    for rid, tok in engine.stream(prompts, max_new_tokens=40, eos_token_ids=eos):
        first_at.setdefault(rid, engine._serving.stats["steps"])
        got[rid].append(tok)
    assert got == want and max(first_at.values()) <= 2, first_at


def test_a_mistral_request_longer_than_the_whole_cache_reuses_its_blocks_behind_the_window():
    """Every layer of a Mistral slides (window 6): a request keeps ring_blocks(6, budget 8, blocks
    of 4) = 4 blocks whatever its length, reused in turn. A cache of 5 blocks serves two requests of
    49 and 30 positions (13 and 8 blocks: refused before) one after the other, with HF's tokens and
    logits; the plan counts what a request of the whole context holds."""
    torch.manual_seed(0)
    model = transformers.MistralForCausalLM(transformers.MistralConfig(
        vocab_size=V, max_position_embeddings=64, attn_implementation="sdpa", num_hidden_layers=2, hidden_size=32,
        intermediate_size=64, num_attention_heads=4, num_key_value_heads=2, initializer_range=0.2,
        sliding_window=6)).eval()
    engine = fxspeed.serve(model, token_budget=8, max_batch=2, block_size=4, cache_tokens=20)
    assert engine._serving.ring == 4 and engine._serving.cache.usable_blocks == 5
    assert engine.plan.held_at_context == 16 and "each holds 16 tokens" in engine.plan.summary()
    _generates_hugging_faces_tokens(model, engine, [list(range(3, 33)), [(5 * i) % V for i in range(11)]], [20, 20])
    assert engine._serving.cache.free_blocks() == 5
    small = fxspeed.serve(model, token_budget=8, max_batch=2, block_size=4, cache_tokens=12)  # 3 blocks < the ring
    with pytest.raises(fxspeed.GenerationError, match=r"needs 16 tokens of KV cache \(a ring of 4 blocks of 4"):
        small.generate([[1, 2, 3]], max_new_tokens=20)


def _gemma3_hybrid() -> torch.nn.Module:
    """Gemma3 with three local layers (window 5) and one global layer, as its 5:1 pattern in small."""
    torch.manual_seed(0)
    return transformers.Gemma3ForCausalLM(transformers.Gemma3TextConfig(
        vocab_size=V, max_position_embeddings=64, attn_implementation="sdpa", num_hidden_layers=4, hidden_size=32,
        intermediate_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=8, initializer_range=0.2,
        sliding_window=5, layer_types=["sliding_attention"] * 3 + ["full_attention"])).eval()


def test_a_model_with_global_and_sliding_layers_keeps_a_ring_in_its_sliding_layers_and_every_block_in_the_others():
    """Gemma3's local layers read a block table of their own over a pool of their own: a request
    keeps ring_blocks(5, budget 8, blocks of 4) = 3 blocks there, reused in turn, and every block of
    its context in the global layer. The local pool holds max_batch rings (9 blocks, not the 32 of
    the global one); requests of up to 31 positions wrap their rings several times and give HF's
    tokens and logits. The plan counts both: a request of the whole context (64) holds
    (64 + 3 x 12) / 4 = 25 tokens of every layer's cache."""
    from fxspeed.ir.program import WINDOW_GROUP

    model = _gemma3_hybrid()
    engine = fxspeed.serve(model, token_budget=8, max_batch=3, block_size=4, cache_tokens=128)
    serving = engine._serving
    assert serving.rings == {"": None, WINDOW_GROUP: 3}
    assert serving.cache.sizes == {"": 33, WINDOW_GROUP: 10}
    assert [tuple(serving.cache.tensors[f"{i}.k"].shape) for i in range(4)] == [(10, 4, 2, 8)] * 3 + [(33, 4, 2, 8)]
    program = serving.programs[8].program
    assert program.kv_groups == (WINDOW_GROUP,) * 3 + ("",)
    assert {(s.kind, s.target) for s in program.signature.inputs if s.target == WINDOW_GROUP} == {
        ("slot_mapping", WINDOW_GROUP), ("block_table", WINDOW_GROUP)}
    assert engine.plan.held_at_context == 25 and "each holds 25 tokens" in engine.plan.summary()
    assert engine.plan.window_pool_tokens == 36 and "the sliding layers' pool: 36 tokens" in engine.plan.summary()
    _generates_hugging_faces_tokens(model, engine, [list(range(3, 23)), [5, 17, 3], list(range(30, 39)), [9] * 14],
                                    [12, 20, 5, 18])
    assert serving.cache.free_blocks("") == 32 and serving.cache.free_blocks(WINDOW_GROUP) == 9


def test_max_batch_requests_of_a_model_with_sliding_layers_run_side_by_side():
    """The sliding layers' pool holds max_batch rings. Admission kept a block of room for every
    running request, also those whose ring was whole and never take another: the last of three
    long requests waited for the first to finish (h44: first token at step 23 of 42). Now the
    three start together, as on a model without windows."""
    model = _gemma3_hybrid()
    engine = fxspeed.serve(model, token_budget=8, max_batch=3, block_size=4, cache_tokens=256)
    first_at: dict[int, int] = {}
    prompts = [[(7 * i + j) % V for i in range(12)] for j in range(3)]
    for rid, _ in engine.stream(prompts, max_new_tokens=20):
        first_at.setdefault(rid, engine._serving.stats["steps"])
    assert max(first_at.values()) <= 6, first_at


def test_a_model_whose_layers_all_slide_or_none_do_reads_one_block_table():
    """The second table is only for models with both kinds of layer: Mistral (every layer slides)
    and Llama (none) read one slot mapping and one block table, as before."""
    for name in ("mistral", "llama"):
        engine = fxspeed.serve(_hf(name), token_budget=8, max_batch=2, block_size=4, cache_tokens=32)
        program = engine._serving.programs[8].program
        assert set(program.kv_groups) == {""} and set(engine._serving.cache.sizes) == {""}
        assert [s.kind for s in program.signature.inputs].count("block_table") == 1


@settings(max_examples=60, deadline=None)
@given(window=st.integers(1, 20), budget=st.integers(1, 12), block_size=st.sampled_from([1, 2, 3, 4, 8]),
       data=st.data())
def test_a_ring_of_blocks_keeps_every_key_a_window_reads_where_it_was_written(window, budget, block_size, data):
    """The serving loop's slot rule under a ring (logical block b in block b % ring) over any
    sequence of chunks of at most `budget` tokens: after a step's writes, every key within the
    window of each of its queries is still in its slot. One block fewer loses a key under full
    chunks: the ring is as small as it can be."""
    from fxspeed.runtime.serving import ring_blocks

    def keeps_every_key(ring: int, chunks: list[int]) -> bool:
        held: dict[int, int] = {}  # slot -> position written there
        at = 0
        for c in chunks:
            for p in range(at, at + c):
                held[((p // block_size) % ring) * block_size + p % block_size] = p
            if any(held[((p // block_size) % ring) * block_size + p % block_size] != p
                   for q in range(at, at + c) for p in range(max(0, q - window + 1), q + 1)):
                return False
            at += c
        return True

    ring = ring_blocks([window, window], budget, block_size)
    assert ring_blocks([window, 0], budget, block_size) is None  # a layer without a window keeps everything
    assert keeps_every_key(ring, data.draw(st.lists(st.integers(1, budget), min_size=1, max_size=12), label="chunks"))
    if ring > 1:
        assert not keeps_every_key(ring - 1, [budget] * ((ring + 1) * block_size // budget + 3))


@pytest.mark.parametrize("window", [6, 12])
def test_a_config_window_the_models_code_never_reads_is_not_applied_and_caps_the_context(window):
    """Llama ignores config.sliding_window (Hugging Face keeps any key of a config.json). Applied,
    a window past the longest bucket (12 > 8 tokens), which no bucket's masks can check, gave other
    tokens than HF's from position 13 (h37); it is served up to the window, as before."""
    model = _hf("llama")
    model.config.sliding_window = window
    engine = fxspeed.serve(model, token_budget=8, max_batch=2, block_size=4, cache_tokens=64)
    prompt = list(range(3, 3 + window - 2))
    want = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                          max_new_tokens=3, do_sample=False, eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
    out = engine.generate([prompt, prompt], max_new_tokens=[3, 4], on_error="return")
    assert out[0] == want
    assert isinstance(out[1], fxspeed.RequestError) and f"sliding window of {window} tokens" in str(out[1])


def test_a_config_window_the_masks_contradict_is_refused():
    """Mistral slides every layer; a config that says its first layer does not (layer_types) is
    contradicted by that layer's mask in a bucket longer than the window."""
    from fxspeed.errors import FxspeedError

    torch.manual_seed(0)
    model = transformers.MistralForCausalLM(transformers.MistralConfig(
        vocab_size=V, max_position_embeddings=64, attn_implementation="sdpa", num_hidden_layers=2, hidden_size=32,
        intermediate_size=64, num_attention_heads=4, num_key_value_heads=2, sliding_window=6)).eval()
    model.config.layer_types = ["full_attention", "sliding_attention"]
    with pytest.raises(FxspeedError, match=r"6 or more positions back, but the config's sliding window for that "
                                           r"layer is none"):
        fxspeed.serve(model, token_budget=8, max_batch=2, block_size=4, cache_tokens=64)


def test_the_default_cache_of_a_model_with_sliding_and_global_layers_fits_both_pools_in_half_the_free_memory(
        monkeypatch):
    """One global and one sliding layer of 128 bytes a token; the sliding pool holds 2 rings of 3
    blocks of 4 at most. Half the free memory is 12800 bytes: 76 tokens of the global layer (19
    blocks, 9728 bytes) and the 6 sliding blocks (3072 bytes), not the 50 tokens that counting
    every layer at every token would leave."""
    from fxspeed.runtime import serving

    class Program:
        kv_layout = [(2, 8, torch.float32)] * 2
        kv_groups = ("", "window")

        def kv_bytes_per_token(self, group: str | None = None) -> int:
            return 128 * (2 if group is None else 1)

    monkeypatch.setattr(serving, "free_memory", lambda device: 2 * 12800)
    cache = serving._allocate_cache(Program(), None, 64 * 16, 4, torch.device("cpu"), None,
                                    window_blocks=lambda usable: min(usable, 6))
    assert cache.sizes == {"": 20, "window": 7}
    assert tuple(cache.tensors["0.k"].shape) == (20, 4, 2, 8) and tuple(cache.tensors["1.k"].shape) == (7, 4, 2, 8)
    # a cache smaller than two rings: the sliding pool takes no more blocks than the global one
    assert serving._allocate_cache(Program(), 12, 64 * 16, 4, torch.device("cpu"), None,
                                   window_blocks=lambda usable: min(usable, 6)).sizes == {"": 4, "window": 4}


def test_the_default_cache_is_capped_at_half_the_free_memory_and_a_cache_that_cannot_be_allocated_names_cache_tokens(
        monkeypatch, caplog):
    from fxspeed.runtime import serving

    class Program:  # what _allocate_cache reads of an InferenceProgram: 2 layers of 2 heads x 8, fp32
        kv_layout = [(2, 8, torch.float32)] * 2

        def kv_bytes_per_token(self) -> int:
            return 2 * 2 * 2 * 8 * 4

    monkeypatch.setattr(serving, "free_memory", lambda device: 2 * 256 * 100)  # half of it: 100 tokens
    with caplog.at_level("WARNING", logger="fxspeed"):
        cache = serving._allocate_cache(Program(), None, 64 * 16, 4, torch.device("cpu"), None)
    assert cache.usable_blocks * 4 == 100 and "cache_tokens" in caplog.text
    assert serving._allocate_cache(Program(), 500, 64 * 16, 4, torch.device("cpu"), None).usable_blocks == 125

    def fail(*args, **kwargs):
        raise RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 2048002048 bytes")

    # tensor parallelism: the smallest rank's room (here another rank's 60 tokens) on every rank
    assert serving._allocate_cache(Program(), None, 64 * 16, 4, torch.device("cpu"), lambda v: min(v, 60)
                                   ).usable_blocks * 4 == 60
    # and when another rank's allocation failed (the minimum of the success flags is 0), this one raises too
    with pytest.raises(ConfigError, match="another tensor-parallel rank could not allocate"):
        serving._allocate_cache(Program(), 500, 64 * 16, 4, torch.device("cpu"), lambda v: 0)

    monkeypatch.setattr(serving.KVCache, "__init__", fail)
    with pytest.raises(ConfigError, match=r"could not be allocated .* lower serve\(\.\.\., cache_tokens=\)"):
        serving._allocate_cache(Program(), 10**7, 64 * 16, 4, torch.device("cpu"), None)


@pytest.mark.parametrize("cache_tokens", [0, 2.5, True])
def test_a_cache_size_that_is_not_a_positive_int_is_refused_before_compiling(cache_tokens):
    with pytest.raises(ConfigError, match="cache_tokens must be an int >= 1"):
        fxspeed.serve(_gpt(), cache_tokens=cache_tokens)


def test_models_the_serving_programs_cannot_follow_are_refused_with_what_is_wrong():
    """Rotary scaling that changes with the sequence length (longrope, dynamic), a model without
    SDPA attention in HF (Gemma2), a forward that writes its buffers (longrope: inv_freq), and one
    that keeps a tensor it made from the traced values (as longrope's long_inv_freq: the program
    computed on it as a tensor without data, failing with a fake-tensor error at the first step)."""
    from fxspeed.compiler.capture_inference import compile_inference
    from fxspeed.errors import CaptureError

    small = dict(vocab_size=V, max_position_embeddings=64, num_hidden_layers=1, hidden_size=32, intermediate_size=64,
                 num_attention_heads=4, num_key_value_heads=2)
    longrope = transformers.Phi3ForCausalLM(transformers.Phi3Config(
        **small, original_max_position_embeddings=16, pad_token_id=0,
        rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0] * 4,
                         "long_factor": [4.0] * 4, "original_max_position_embeddings": 16})).eval()
    with pytest.raises(ConfigError, match="'longrope' rotary scaling"):
        fxspeed.serve(longrope)
    longrope.set_attn_implementation("sdpa")
    # (torch 2.11 refuses it one step earlier, at longrope's `long_inv_freq.to(device)`)
    with pytest.raises(CaptureError, match=r"writes its buffer\(s\) model.rotary_emb.inv_freq"
                       + ("" if torch.__version__ >= "2.13" else "|kept on the module")):
        compile_inference(longrope, 8, config=fxspeed.Config())
    dynamic = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        **small, rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0})).eval()
    with pytest.raises(ConfigError, match="'dynamic' rotary scaling"):
        fxspeed.serve(dynamic)
    gemma2 = transformers.Gemma2ForCausalLM(transformers.Gemma2Config(**small, head_dim=8,
                                                                      attn_implementation="eager")).eval()
    with pytest.raises(ConfigError, match="cannot run with attn_implementation='sdpa'"):
        fxspeed.serve(gemma2)

    class Counting(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = torch.nn.Embedding(V, 16)
            self.head = torch.nn.Linear(16, V)
            self.register_buffer("calls", torch.zeros(()))

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            self.calls.add_(1)
            return self.head(self.emb(ids))

    with pytest.raises(CaptureError, match="writes its buffer"):
        compile_inference(Counting(), 8, config=fxspeed.Config())

    class Caching(Counting):  # makes a tensor on its first call and keeps it (as longrope's long_inv_freq)
        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            if not hasattr(self, "scale"):
                self.scale = torch.full((16,), 2.0)
            h = (self.emb(ids) * self.scale)[:, None]  # [B, 1 head, T, 16]
            return self.head(torch.nn.functional.scaled_dot_product_attention(h, h, h, is_causal=True)[:, 0])

    with pytest.raises(CaptureError, match="keeps it on the module|kept on the module"):  # 2.13 | 2.11
        compile_inference(Caching(), 8, config=fxspeed.Config())
    ids = torch.randint(0, V, (2, 8))
    with pytest.raises(CaptureError, match="fake buffer|keeps it on the module|kept on the module"):  # training: AOT export's own check
        fxspeed.compile(Caching(), 1, example_inputs=(ids,), loss_fn=lambda out, ids: out.float().mean())


def test_max_new_tokens_as_a_tensor_of_ints_is_one_per_prompt_and_top_p_without_temperature_is_warned(caplog) -> None:
    import logging

    model = fxspeed.models.GPT(fxspeed.models.GPTConfig(vocab_size=64, block_size=48, n_layer=1, n_head=2, n_embd=16)).eval()
    engine = fxspeed.serve(model, devices=1, token_budget=16, max_batch=4)
    outs = engine.generate([[1, 2], [3]], max_new_tokens=torch.tensor([3, 1]))
    assert [len(o) for o in outs] == [3, 1]
    with caplog.at_level(logging.WARNING, logger="fxspeed"):
        engine.generate([[1, 2]], max_new_tokens=2, top_p=0.5)
    assert "temperature=0 decodes greedily" in caplog.text


def test_eos_ids_outside_the_vocabulary_both_eos_options_and_hugging_face_only_options_are_refused(gpt2_engine):
    """Each was silent: an eos id the model can never sample ran the request to max_new_tokens,
    eos_token_ids silently replaced eos_token_id, and do_sample=/max_length= failed as a TypeError
    naming the internal ServingLoop.stream. Tensors are taken where ints are, as prompts are."""
    _, engine = gpt2_engine
    prompts = [[1, 2, 3], [9, 8]]
    full = engine.generate(prompts, max_new_tokens=4)
    for bad in (-1, V, [3, V + 7]):
        with pytest.raises(ConfigError, match="outside the vocabulary"):
            engine.generate(prompts, max_new_tokens=4, eos_token_id=bad)
    with pytest.raises(ConfigError, match="not both"):
        engine.generate(prompts, max_new_tokens=4, eos_token_id=full[0][1], eos_token_ids=[None, full[1][1]])
    with pytest.raises(ConfigError, match="do_sample: temperature > 0 samples"):
        engine.generate(prompts, max_new_tokens=4, do_sample=True)
    with pytest.raises(ConfigError, match="max_length: give max_new_tokens"):
        list(engine.stream(prompts, max_length=8))
    stop = full[0][1]
    cut = engine.generate(prompts, max_new_tokens=torch.tensor(4), eos_token_id=torch.tensor(stop))
    assert cut[0] == full[0][:full[0].index(stop) + 1]


def test_bloom_and_mpt_are_refused_for_their_alibi_and_a_qwen2_whose_layers_do_not_slide_serves_past_the_window():
    """BLOOM/MPT were told to add a context length (the blocker is ALiBi), RecurrentGemma to
    give one (the blocker is its recurrent state); Qwen2 with
    use_sliding_window but max_window_layers covering every layer (HF: all 'full_attention') was
    refused past a window no layer uses."""
    small = dict(vocab_size=V, num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=64)
    for model in (transformers.BloomForCausalLM(transformers.BloomConfig(vocab_size=V, hidden_size=32, n_layer=1,
                                                                          n_head=4)),
                  transformers.MptForCausalLM(transformers.MptConfig(vocab_size=V, d_model=32, n_layers=1, n_heads=4,
                                                                      max_seq_len=64))):
        with pytest.raises(ConfigError, match="ALiBi"):
            fxspeed.serve(model.eval())
    # RecurrentGemma was told it has no context length (the blocker is its recurrent state)
    recurrent = transformers.RecurrentGemmaForCausalLM(transformers.RecurrentGemmaConfig(
        vocab_size=V, hidden_size=16, lru_width=16, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, head_dim=8, block_types=["recurrent"]))
    with pytest.raises(ConfigError, match="carries a recurrent state"):
        fxspeed.serve(recurrent.eval())
    torch.manual_seed(0)
    qwen = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**small, sliding_window=8, use_sliding_window=True,
                                                                  max_window_layers=2)).eval()
    prompt = list(range(1, 21))
    ref = qwen.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, 20, dtype=torch.long), max_new_tokens=5,
                        do_sample=False, pad_token_id=None, eos_token_id=None)[0, 20:].tolist()
    engine = fxspeed.serve(qwen, token_budget=16, max_batch=2, block_size=4)
    assert engine.generate([prompt], max_new_tokens=5) == [ref]


def test_serve_generates_without_dropout_and_leaves_the_user_s_modules_in_their_modes():
    """serve called model.eval() and left it so: a loop that trains and generates with one model
    trained on without dropout (HF's generate leaves the modes alone). Now every program is traced
    in eval mode and the modes are restored: dropout stays off in generate, even in buckets first
    compiled after the model is back in training mode."""
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=4, n_positions=64, vocab_size=V, resid_pdrop=0.5,
                                  embd_pdrop=0.5, attn_pdrop=0.5, attn_implementation="sdpa", initializer_range=0.2)
    model = transformers.GPT2LMHeadModel(cfg).train()
    model.transformer.h[1].eval()  # a module the user keeps in eval mode stays so
    modes = {n: m.training for n, m in model.named_modules()}
    engine = fxspeed.serve(model, token_budget=8, max_batch=3, block_size=4, cache_tokens=96)
    assert {n: m.training for n, m in model.named_modules()} == modes
    outs = engine.generate(PROMPTS[:2], max_new_tokens=NEW[:2])  # a bucket past the first: compiled now
    model.eval()
    try:
        with torch.no_grad():
            for p, n, o in zip(PROMPTS[:2], NEW[:2], outs):
                ref = model.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                                     max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0)
                assert o == ref[0, len(p):].tolist()
    finally:
        model.train()
    assert engine.generate(PROMPTS[:2], max_new_tokens=NEW[:2]) == outs
