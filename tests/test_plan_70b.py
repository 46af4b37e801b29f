"""Planning a 70B Llama on 64 H100s with ZeRO-3, from the meta device: fast and allocation-free.

The model (Llama-3-70B shape: hidden 8192, 80 layers, 64 heads, 8 kv heads, intermediate 28672,
vocab 128256) is built under torch.device("meta"). The planner traces it as fake CPU tensors,
and since its 80 decoder layers are identical, with 2, 3 and 4 layers only, extrapolating
time and FLOPs linearly to 80 and the peak memory over the timeline's points (checked against
the 4-layer trace).
"""

from __future__ import annotations

import json
import resource
import time

import pytest
import torch

import fxspeed

transformers = pytest.importorskip("transformers")


def _llama(**kw):
    cfg = transformers.LlamaConfig(**kw)
    with torch.device("meta"):
        return transformers.LlamaForCausalLM(cfg)


LLAMA_70B = dict(hidden_size=8192, num_hidden_layers=80, num_attention_heads=64, num_key_value_heads=8,
                 intermediate_size=28672, vocab_size=128256)


def test_a_70b_llama_on_the_meta_device_is_planned_for_64_h100s_with_zero_3_in_under_60_seconds():
    model = _llama(**LLAMA_70B)
    ids = torch.zeros(1, 4096, dtype=torch.long, device="meta")
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t0 = time.perf_counter()
    plan = fxspeed.plan(model, fxspeed.devices("H100-80GB", 64), fxspeed.Config(zero=3),
                        example_inputs={"input_ids": ids, "labels": ids})
    seconds = time.perf_counter() - t0
    grown_mb = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss0) / 1024
    print(f"70B plan in {seconds:.1f}s, peak RSS grew {grown_mb:.0f} MB\n{plan.summary()}")

    assert seconds < 60
    assert grown_mb < 2048  # fake tensors: nothing the size of a weight is allocated
    assert all(p.is_meta for p in model.parameters()) and len(model.model.layers) == 80

    n = sum(p.numel() for p in model.parameters())
    assert plan.n_params == n and 70e9 < n < 71e9
    mem = plan.memory(0)
    assert mem["parameters"] == pytest.approx(4 * n / 64, rel=1e-6)  # ZeRO-3: a 1/64 shard of fp32 weights
    assert mem["optimizer_states"] == pytest.approx(8 * n / 64, rel=1e-6)
    # Without activation checkpointing, fp32 activations of 80 layers x 4096 tokens dwarf an H100.
    assert mem["activations"] > 100e9 and not plan.fits()
    # Training FLOPs of a dense transformer: about 6 x params x tokens (plus attention).
    assert plan.flops["total"] == pytest.approx(6 * n * 4096, rel=0.1)
    assert len(plan.rank_memory) == 64 and plan.zero_formula[0] == pytest.approx(16 * n / 64, rel=1e-6)
    assert any("repeated-layer extrapolation" in note and "80 identical" in note for note in plan.notes)

    again = fxspeed.Plan.from_json(plan.to_json())
    assert again == plan and json.loads(again.to_json()) == plan.to_dict()
    text = plan.summary()
    for words in ("LlamaForCausalLM", "70,553.7M params", "64 × H100-80GB", "zero=3", "activations",
                  "DOES NOT FIT", "time per step", "FLOPs per step", "note: repeated-layer extrapolation"):
        assert words in text


def test_a_small_llama_extrapolated_from_its_first_layers_equals_the_llama_traced_whole():
    model = _llama(hidden_size=64, num_hidden_layers=5, num_attention_heads=4, num_key_value_heads=2,
                   intermediate_size=128, vocab_size=256)
    ids = torch.zeros(2, 32, dtype=torch.long, device="meta")
    kw = dict(example_inputs={"input_ids": ids, "labels": ids})
    devs = fxspeed.devices("H100-80GB", 4)
    whole = fxspeed.plan(model, devs, fxspeed.Config(zero=2, layer_extrapolation=False), **kw)
    extra = fxspeed.plan(model, devs, fxspeed.Config(zero=2, layer_extrapolation=True), **kw)
    assert extra.n_params == whole.n_params
    assert extra.flops == whole.flops
    assert extra.phase_memory == whole.phase_memory
    assert extra.time["total"] == pytest.approx(whole.time["total"], rel=1e-9)


def test_a_70b_llama_with_tensor_8_x_pipeline_2_x_data_4_plans_megatrons_layout_and_the_closed_form_model_states():
    """TP=8 x PP=2 x DP=4 (ZeRO-1) on 64 H100s from the meta device, 4 micro-batches of 1 x 4096:
    the stack is traced with 1, 2 and 3 layers per stage and extrapolated (the layout presolved on
    two layers), so it plans in seconds. The solver's layout is Megatron's (q/k/v, gate/up by rows,
    o/down by columns, embedding and head by vocabulary rows); rank 0 (pipeline position 0: the
    embedding and the first n0 layers) runs Megatron's 4 all-reduces of [tokens, hidden] per
    layer per micro-batch and nothing gathered; its model states are the closed form: fp32
    weights and gradients of its slices (1/8 of each sliced weight, the norms whole) and Adam's
    two fp32 moments of them over the 4 replicas."""
    model = _llama(**LLAMA_70B)
    ids = torch.zeros(4, 4096, dtype=torch.long, device="meta")
    t0 = time.perf_counter()
    plan = fxspeed.plan(model, fxspeed.devices("H100-80GB", 64),
                        fxspeed.Config(tensor=8, pipeline=2, zero=1, microbatches=4),
                        example_inputs={"input_ids": ids, "labels": ids})
    seconds = time.perf_counter() - t0
    print(f"TP=8 x PP=2 x DP=4 70B plan in {seconds:.1f}s\n{plan.summary()}")
    assert seconds < 90  # about 25 s here; the whole 80-layer trace took 150-200 s
    assert plan.strategy["tp"] == 8 and plan.strategy["pp"] == 2 and plan.strategy["dp"] == 4
    placed = plan.tp_placements
    for name, want in (("q_proj", "S(0)"), ("k_proj", "S(0)"), ("v_proj", "S(0)"), ("o_proj", "S(1)")):
        assert placed[f"model.layers.#.self_attn.{name}.weight"] == want
    for name, want in (("gate_proj", "S(0)"), ("up_proj", "S(0)"), ("down_proj", "S(1)")):
        assert placed[f"model.layers.#.mlp.{name}.weight"] == want
    assert placed["model.embed_tokens.weight"] == placed["lm_head.weight"] == "S(0)"

    first = plan.pipeline["stages"][0]["modules"]
    n0 = sum(1 for m in first if m.startswith("model.layers."))
    assert 36 <= n0 <= 44 and "model.embed_tokens" in first  # a balanced cut of 80 layers
    assert set(plan.tp_communication) == {"tp_all_reduce"}  # nothing gathered
    megatron = 4 * n0 * 4 * 4096 * 8192 * 4  # micro-batches x layers x 4 all-reduces x [4096, 8192] fp32
    assert megatron <= plan.tp_communication["tp_all_reduce"] <= megatron * 1.02

    h, f, kv = 8192, 28672, 1024
    layer = 2 * h * h + 2 * h * kv + 3 * h * f  # q, o; k, v; gate, up, down: all sliced over 8
    weights = 4 * (128256 * h / 8 + n0 * (layer / 8 + 2 * h))
    states = plan.model_states
    assert states["parameters"] == pytest.approx(weights, rel=0.05)
    assert states["gradients"] == pytest.approx(weights, rel=0.05)
    assert states["optimizer_states"] == pytest.approx(2 * weights / 4, rel=0.05)
    assert any("repeated-layer extrapolation (pipeline)" in note for note in plan.notes)
