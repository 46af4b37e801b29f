"""pack_linear_weights: the CPU serving programs of small buckets read their fp32 linear weights
pre-packed for oneDNN; tokens and logits stay those of the unpacked programs, larger buckets keep
the parameters, the plan counts the packed copies, and a weight changed after serve is packed
again before the next generate."""

from __future__ import annotations

import types

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import fxspeed
from fxspeed.runtime.kernels.packed_linear import (COPY_KINDS, LINEAR, PACKED_KINDS, SPLIT_KINDS, TRANSPOSED_KIND,
                                                   available, split_linear)

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()
pytestmark = pytest.mark.skipif(not available(), reason="this torch build has no oneDNN")

aten = torch.ops.aten
V = 96
PROMPTS = [[5, 17, 3], list(range(10, 30)), [7], [40, 41, 42, 43, 44, 45, 46, 47, 48]]
NEW = [6, 5, 7, 4]
# every bucket packed (pack_linear="auto" would pack where a probe measures it faster)
SMALL = dict(token_budget=8, max_batch=3, block_size=4, cache_tokens=96, pack_linear="always")
UNPACKED = fxspeed.Config(disable_passes=("pack_linear_weights",))


def _hf(name: str, context: int = 64) -> nn.Module:
    torch.manual_seed(0)
    if name == "gpt2":  # Conv1D weights [in, out] through addmm; the head tied to the embedding
        cfg = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=4, n_positions=context, vocab_size=V,
                                      attn_implementation="sdpa", initializer_range=0.2)
        return transformers.GPT2LMHeadModel(cfg).eval()
    cfg = transformers.LlamaConfig(num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=4,
                                   num_key_value_heads=2, initializer_range=0.2, vocab_size=V,
                                   max_position_embeddings=64, attn_implementation="sdpa")
    return transformers.LlamaForCausalLM(cfg).eval()


def _params_read_by_products(gm: torch.fx.GraphModule, inputs: list) -> list[str]:
    """Parameters an mm/addmm still reads (directly or through one transpose)."""
    spec = dict(zip([n for n in gm.graph.nodes if n.op == "placeholder"], inputs))
    out = []
    for n in gm.graph.nodes:
        if n.op == "call_function" and n.target in (aten.mm.default, aten.addmm.default):
            w = n.args[-1]
            w = w.args[0] if w.op == "call_function" and w.target in (aten.t.default, aten.permute.default) else w
            if w.op == "placeholder" and spec[w].kind in ("param", "param_tp"):
                out.append(spec[w].target)
    return out


def _same_generation(packed: fxspeed.Engine, plain: fxspeed.Engine, prompts=PROMPTS, new=NEW) -> None:
    for e in (packed, plain):
        e._serving.record_logits = {}
    assert packed.generate(prompts, max_new_tokens=new) == plain.generate(prompts, max_new_tokens=new)
    for i in range(len(prompts)):
        # oneDNN sums in another order than MKL: float rounding, not a different computation. The
        # rounding grows with the logits' scale (tied heads over a scaled embedding reach ~1000, where
        # 2.8e-3 apart was seen, 3e-6 of the scale), so the bound is relative to each prompt's
        # largest logit; a wrong product is off by O(1) of it.
        got, want = torch.stack(packed._serving.record_logits[i]), torch.stack(plain._serving.record_logits[i])
        torch.testing.assert_close(got, want, rtol=0, atol=1e-4 * max(1.0, want.abs().max().item()))


@pytest.mark.parametrize("name,linears,transposed", [("gpt2", 2 * 4 + 1, 2 * 4), ("llama", 2 * 7 + 1, 0)])
def test_every_linear_of_a_small_bucket_reads_a_packed_weight_and_the_tokens_are_those_of_the_parameters(
        name, linears, transposed):
    """GPT-2's Conv1D weights ([in, out], read by addmm) are packed transposed, nn.Linear's as
    they are; GPT-2's head, tied to the embedding, is packed while the embedding keeps reading
    the parameter; no product reads a parameter any more."""
    model = _hf(name)
    packed, plain = fxspeed.serve(model, **SMALL), fxspeed.serve(model, config=UNPACKED, **SMALL)
    _same_generation(packed, plain)
    for T, bound in packed._serving.programs.items():
        prog = bound.program
        kinds = [s.kind for s in prog.signature.inputs]
        targets = [n.target for n in prog.gm.graph.nodes if n.op == "call_function"]
        assert targets.count(LINEAR) == linears, T
        assert (kinds.count("packed_weight_t"), kinds.count("packed_weight")) == (transposed, linears - transposed)
        assert _params_read_by_products(prog.gm, prog.signature.inputs) == []
        assert "pack_linear_weights" in [r.name for r in prog.records if r.modified]
    params = [s.target for s in bound.program.signature.inputs if s.kind == "param"]
    assert ("transformer.wte.weight" in params) == (name == "gpt2")  # the embedding still reads it
    for bound in plain._serving.programs.values():
        assert LINEAR not in [n.target for n in bound.program.gm.graph.nodes]
    assert packed._serving.packed.nbytes() == 4 * sum(  # one copy per weight, shared by the buckets
        p.numel() for n, p in model.named_parameters() if p.dim() == 2 and "wpe" not in n
        and (name == "gpt2" or "embed_tokens" not in n))


def test_a_bucket_above_pack_linear_tokens_reads_the_parameters_and_the_plan_counts_the_copies_to_come():
    model = _hf("gpt2", context=256)  # a step's token budget is at most the model's context
    engine = fxspeed.serve(model, token_budget=256, max_batch=2, block_size=16, cache_tokens=128,
                           pack_linear="always")
    big = engine._serving.programs[256].program
    assert LINEAR not in [n.target for n in big.gm.graph.nodes]
    assert not [s for s in big.signature.inputs if s.kind in PACKED_KINDS]
    expected = 4 * sum(p.numel() for n, p in model.named_parameters() if p.dim() == 2 and "wpe" not in n)
    assert engine.plan.packed_weight_bytes == expected
    assert "packed for the decode buckets" in engine.plan.summary()
    assert engine._serving.packed.nbytes() == 0  # made when a decode bucket first runs
    engine.generate([[1, 2, 3], [4, 5]], max_new_tokens=3)
    assert engine._serving.packed.nbytes() == expected
    plain = fxspeed.serve(model, config=UNPACKED, token_budget=256, max_batch=2, block_size=16, cache_tokens=128)
    assert plain.plan.packed_weight_bytes == 0
    # pack_linear="never": no copy beside the model's weights, not even the GEMM's [in, out] ones
    never = fxspeed.serve(model, token_budget=256, max_batch=2, block_size=16, cache_tokens=128, pack_linear="never")
    never.generate([[1, 2, 3], [4, 5]], max_new_tokens=3)
    assert never.plan.packed_weight_bytes == 0 and never._serving.packed.nbytes() == 0
    assert not [s for b in never._serving.programs.values() for s in b.program.signature.inputs if s.kind in COPY_KINDS]


def test_with_pack_linear_auto_each_small_bucket_packs_only_where_its_probe_measured_packing_faster(monkeypatch):
    """Which is faster, oneDNN over packed weights or ATen's GEMM, depends on the machine (one
    2-core box: packing 1.3x faster at one row, another 1.2x slower). Each small bucket is timed
    both ways before it compiles; here the probe says GEMM for the 1-token bucket only."""
    import fxspeed.runtime.serving as serving

    asked = []

    def probe(specs, rows, bind, layout_rows, ways):  # noqa: ANN001, ANN202
        asked.append((rows, len(specs)))
        return "transposed" if rows == 1 else "packed", {"packed": 1e-3, "transposed": 2e-3}

    monkeypatch.setattr(serving, "fastest_copies", probe)
    model = _hf("gpt2")
    auto = fxspeed.serve(model, token_budget=8, max_batch=3, block_size=4, cache_tokens=96)
    _same_generation(auto, fxspeed.serve(model, config=UNPACKED, **SMALL))
    auto.generate([[5, 6], [7, 8]], max_new_tokens=3)  # two decode tokens a step: bucket 2
    assert sorted(auto._serving.programs) == [1, 2, 4, 8] and sorted(r for r, _ in asked) == [1, 2, 4]
    assert all(n == 2 * 4 + 1 for _, n in asked)  # every linear weight the pass would pack, the head included
    for T, bound in auto._serving.programs.items():
        inputs = bound.program.signature.inputs
        packed_inputs = [s for s in inputs if s.kind in PACKED_KINDS]
        assert bool(packed_inputs) == (T != 1), T  # 8: the first program, packed without a probe
        # ATen's GEMM reads the tied head [out, in] through a contiguous [in, out] copy (a row times
        # it streams the weight; through t() it ran dot products at ~60% of the bandwidth), the
        # Conv1D weights ([in, out] already) as they are
        copies = [i for i, s in enumerate(inputs) if s.kind == TRANSPOSED_KIND]
        assert [inputs[i].target for i in copies] == (["transformer.wte.weight"] if T == 1 else []), T
        if T == 1:
            assert bound.args[copies[0]].shape == (32, V) and bound.args[copies[0]].is_contiguous()
            assert _params_read_by_products(bound.program.gm, inputs) == [f"transformer.h.{i}.{m}.weight"
                                                                          for i in range(2) for m in
                                                                          ("attn.c_attn", "attn.c_proj",
                                                                           "mlp.c_fc", "mlp.c_proj")]
    assert set(auto._serving.pack_probe) == {1, 2, 4}
    # the plan counts both kinds of copies "auto" may hold (the head's [in, out] one: 1882 MB peak
    # RSS on GPT-2 124M against a plan of the packed copies only)
    copies = sum(b.args[i].nbytes for b in auto._serving.programs.values()
                 for i, s in enumerate(b.program.signature.inputs) if s.kind == TRANSPOSED_KIND)
    assert auto.plan.gemm_copy_bytes == copies == 4 * V * 32 and "of [in, out] copies" in auto.plan.summary()


@pytest.mark.parametrize("ways", [1, 2])
def test_the_packing_probe_times_each_way_on_the_first_weights_up_to_its_byte_budget(ways):
    """Packed, [in, out] copies through the GEMM, and with more than one thread copies split over
    the threads (at one thread a split product is the GEMM's, one slice after the other)."""
    from fxspeed.ir import IOSpec
    from fxspeed.runtime.kernels.packed_linear import fastest_copies

    weights = {"a": torch.randn(64, 32), "b": torch.randn(32, 48), "c": torch.randn(16, 64)}
    specs = [IOSpec("packed_weight", "a"), IOSpec("packed_weight_t", "b"), IOSpec("packed_weight", "c")]
    read = []

    def bind(spec):  # noqa: ANN001, ANN202
        read.append(spec.target)
        return weights[spec.target]

    fastest_copies(specs, 4, bind, layout_rows=4, ways=ways, budget_bytes=64 * 32 * 4 + 1)
    torch.manual_seed(3)
    want = torch.rand(2)
    torch.manual_seed(3)
    copies, seconds = fastest_copies(specs, 4, bind, layout_rows=4, ways=ways, budget_bytes=64 * 32 * 4 + 1)
    assert torch.equal(torch.rand(2), want)  # the user's RNG is not advanced (unseeded sampling draws from it)
    assert read[-2:] == ["a", "b"] and all(t > 0 for t in seconds.values())
    assert set(seconds) == {"packed", "transposed", *(["split"] if ways > 1 else [])}
    assert copies == min(seconds, key=seconds.get)
    with pytest.raises(fxspeed.ConfigError, match="pack_linear"):
        fxspeed.serve(_hf("gpt2"), pack_linear="sometimes")


@pytest.mark.parametrize("pack_linear,probed", [("always", None), ("auto", "transposed"), ("auto", "split")])
def test_weights_changed_after_serve_are_packed_again_before_the_next_generate(caplog, monkeypatch, pack_linear,
                                                                                probed):
    """An optimizer step or load_state_dict writes the Parameters in place: the packed copies
    must follow (the programs of larger buckets read the Parameters themselves); so must the
    [in, out] copies ATen's GEMM reads where the probe chose it (every nn.Linear weight of a Llama)
    and the copies split over the threads where it chose those."""
    import fxspeed.runtime.serving as serving

    monkeypatch.setattr(serving, "fastest_copies", lambda specs, rows, bind, layout_rows, ways: (probed, {}))
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)  # the split copies in two slices (one thread runs them)
    model = _hf("llama")
    packed = fxspeed.serve(model, **{**SMALL, "pack_linear": pack_linear})
    before = packed.generate(PROMPTS, max_new_tokens=NEW)
    torch.manual_seed(1)
    other = _hf("llama")
    with torch.no_grad():
        for p in other.parameters():
            p.add_(0.3 * torch.randn_like(p))
    model.load_state_dict(other.state_dict())
    with caplog.at_level("INFO", logger="fxspeed"):
        _same_generation(packed, fxspeed.serve(model, config=UNPACKED, **SMALL))
    # auto: the first bucket (8 tokens, not probed) packed, the probed ones read [in, out] copies
    assert f"packed {15 if pack_linear == 'always' else 30} weights again" in caplog.text
    assert packed.generate(PROMPTS, max_new_tokens=NEW) != before  # the new weights, not the old copies
    kinds = {s.kind for b in packed._serving.programs.values() for s in b.program.signature.inputs}
    assert (kinds & set(SPLIT_KINDS) != set()) == (probed == "split")


def test_with_more_than_one_thread_a_bucket_the_probe_splits_reads_copies_split_over_the_threads(monkeypatch):
    """At one row ATen's GEMM runs on one thread and oneDNN's packed linear did not reach the
    2-thread read bandwidth either: a bucket the probe measures fastest split reads [k, in, out/k]
    copies of every linear weight (GPT-2's Conv1D ones and the tied head), each product a batched
    GEMM of a slice per thread; the tokens stay the unpacked program's and the plan counts the
    copies. k is the serving loop's threads at serve, in every bucket's program: one compiled
    after the process went down to one thread (torch.set_num_threads) has k=2 placeholders as
    the copies it reads (the pass read the thread count itself and gave this one k=1)."""
    import fxspeed.runtime.serving as serving

    monkeypatch.setattr(serving, "fastest_copies", lambda specs, rows, bind, layout_rows, ways:
                        ("split" if rows == 1 and ways == 2 else "packed", {}))
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)  # serve at two threads (this test's one runs both)
    model = _hf("gpt2")
    auto = fxspeed.serve(model, token_budget=8, max_batch=3, block_size=4, cache_tokens=96)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)  # the 1-token bucket is compiled at generate
    _same_generation(auto, fxspeed.serve(model, config=UNPACKED, **SMALL))
    bound = auto._serving.programs[1]
    inputs = bound.program.signature.inputs
    split = {s.target: bound.args[i] for i, s in enumerate(inputs) if s.kind in SPLIT_KINDS}
    assert len(split) == 2 * 4 + 1 and not [s for s in inputs if s.kind in PACKED_KINDS]
    assert split["transformer.wte.weight"].shape == (2, 32, V // 2)  # the head: [out, in] -> 2 x [in, out / 2]
    assert split["transformer.h.0.mlp.c_fc.weight"].shape == (2, 32, 64)  # a Conv1D's [in, out] -> 2 x [in, out / 2]
    placeholders = [n for n in bound.program.gm.graph.nodes if n.op == "placeholder"]
    assert {s.target: tuple(n.meta["val"].shape) for n, s in zip(placeholders, inputs) if s.kind in SPLIT_KINDS} == \
        {t: tuple(c.shape) for t, c in split.items()}  # the program's k is its copies' k
    assert [n.target for n in bound.program.gm.graph.nodes].count(split_linear) == 2 * 4 + 1
    assert _params_read_by_products(bound.program.gm, inputs) == []
    assert auto.plan.split_copy_bytes == sum(t.nbytes for t in split.values()) and "split over the threads" in \
        auto.plan.summary()


@pytest.mark.parametrize("write", ["copy", "lora_merge", "one_token_row"])
def test_weights_written_through_data_after_serve_are_packed_again_too(write: str) -> None:
    """`p.data` has its own version counter: a write through it (a copy from another model, a
    LoRA merge, a new token's row of a tied head) changed neither version nor storage, and the
    packed copies went on computing with the old weights (every request's tokens wrong)."""
    model = _hf("gpt2")
    packed = fxspeed.serve(model, **SMALL)
    packed.generate(PROMPTS, max_new_tokens=NEW)
    torch.manual_seed(1)
    for p in model.parameters():
        if write == "copy":
            p.data.copy_(0.2 * torch.randn_like(p))
        elif write == "lora_merge" and p.dim() == 2:
            p.data += torch.randn(p.shape[0], 2) @ torch.randn(2, p.shape[1])
    if write == "one_token_row":
        model.transformer.wte.weight.data[PROMPTS[0][0]] *= 40.0  # tied: the head's row for that token
    _same_generation(packed, fxspeed.serve(model, config=UNPACKED, **SMALL))


class _TinyLM(nn.Module):
    """A causal LM of drawn shapes: nn.Linear or Conv1D-style ([in, out] through addmm) layers,
    with or without biases, the head tied to the embedding or not."""

    def __init__(self, layers: int, width: int, bias: bool, conv1d: bool, tied: bool) -> None:
        super().__init__()
        self.config = types.SimpleNamespace(vocab_size=V, max_position_embeddings=64)
        self.emb, self.pos = nn.Embedding(V, width), nn.Embedding(64, width)
        self.conv1d, self.width = conv1d, width

        def proj(i: int, o: int) -> nn.Module:
            if not conv1d:
                return nn.Linear(i, o, bias=bias)
            m = nn.Module()
            m.weight = nn.Parameter(torch.randn(i, o) / i ** 0.5)
            m.bias = nn.Parameter(torch.randn(o) * 0.1) if bias else None
            return m

        self.blocks = nn.ModuleList(nn.ModuleDict({"qkv": proj(width, 3 * width), "out": proj(width, width),
                                                   "up": proj(width, 2 * width), "down": proj(2 * width, width)})
                                    for _ in range(layers))
        self.head = nn.Linear(width, V, bias=False)
        if tied:
            self.head.weight = self.emb.weight

    def _apply_proj(self, m: nn.Module, x: torch.Tensor) -> torch.Tensor:
        if not self.conv1d:
            return m(x)
        flat = x.reshape(-1, x.shape[-1])
        y = torch.addmm(m.bias, flat, m.weight) if m.bias is not None else flat @ m.weight
        return y.view(*x.shape[:-1], -1)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        if position_ids is None:
            position_ids = torch.arange(input_ids.shape[1], device=input_ids.device)[None]
        x = self.emb(input_ids) + self.pos(position_ids)
        B, T, D = x.shape
        for b in self.blocks:
            q, k, v = self._apply_proj(b["qkv"], x).view(B, T, 3, 2, D // 2).permute(2, 0, 3, 1, 4)
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, T, D)
            x = x + self._apply_proj(b["out"], a)
            x = x + self._apply_proj(b["down"], F.gelu(self._apply_proj(b["up"], x)))
        return self.head(x)


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(layers=st.integers(1, 2), width=st.sampled_from([8, 16]), bias=st.booleans(), conv1d=st.booleans(),
       tied=st.booleans(), seed=st.integers(0, 2**16))
def test_packing_any_drawn_stack_of_linears_keeps_its_tokens_and_logits_and_leaves_no_product_on_a_parameter(
        layers, width, bias, conv1d, tied, seed):
    torch.manual_seed(seed)
    model = _TinyLM(layers, width, bias, conv1d, tied).eval()
    with torch.no_grad():
        model.emb.weight.mul_(4.0)  # away from near-uniform logits, so greedy choices are not ties
    packed, plain = fxspeed.serve(model, **SMALL), fxspeed.serve(model, config=UNPACKED, **SMALL)
    _same_generation(packed, plain, PROMPTS[:3], NEW[:3])
    names = {n for n, _ in model.named_parameters()}
    for bound in packed._serving.programs.values():
        prog = bound.program
        assert _params_read_by_products(prog.gm, prog.signature.inputs) == []
        packed_inputs = [s for s in prog.signature.inputs if s.kind in PACKED_KINDS]
        assert len(packed_inputs) == 4 * layers + 1 and {s.target for s in packed_inputs} <= names
        head = {"head.weight", "emb.weight"}  # the head's weight (the embedding's where tied): [out, in] as is
        assert all((s.kind == "packed_weight_t") == (conv1d and s.target not in head) for s in packed_inputs)
