"""A model built on the meta device: compile gives it its values one bucket at a time
(runtime/deferred_init.py), the same values `fxspeed.materialize` gives eagerly."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn
from hypothesis import given, settings
from hypothesis import strategies as st

import fxspeed
from fxspeed.errors import ConfigError
from fxspeed.models import GPT, GPTConfig
from fxspeed.runtime.deferred_init import DeferredInit

CFG = GPTConfig(vocab_size=128, n_layer=2, n_head=2, n_embd=32, block_size=16, dropout=0.0)


def _meta_gpt() -> GPT:
    with fxspeed.parameters_on_meta():
        return GPT(CFG)


def _steps_match(engine: fxspeed.Engine, ref: nn.Module, opt: torch.optim.Optimizer, steps: int, tol: float,
                 *args: torch.Tensor, **kwargs: torch.Tensor) -> None:
    """`steps` steps of the engine and of eager `ref` with `opt` on one batch give the same losses."""
    for _ in range(steps):
        got = engine.train_step(*args, **kwargs)
        opt.zero_grad()
        out = ref(*args, **kwargs)
        want = out if isinstance(out, torch.Tensor) else out.loss
        want.backward()
        opt.step()
        assert got == pytest.approx(want.item(), rel=tol, abs=tol)


@pytest.mark.parametrize("config", [
    dict(zero=0), dict(zero=3), dict(zero=1, precision="bf16"), dict(zero=1, precision="bf16", offload="optimizer"),
], ids=["fp32", "zero3", "bf16-master-weights", "bf16-optimizer-offload"])
def test_a_model_built_on_meta_trains_as_its_eagerly_materialized_twin(config: dict, tmp_path: Path) -> None:
    """compile(meta model) equals torch's AdamW on `fxspeed.materialize(copy)`: losses and the
    trained weights (fp32 to 1e-5; bf16 to bf16's rounding). eps=1e-3: the key bias's gradient is
    rounding noise (softmax ignores it), which Adam at eps=1e-8 turns into full-size steps."""
    if config.get("offload"):
        config = dict(config, nvme_path=str(tmp_path))
    meta = _meta_gpt()
    ref = fxspeed.materialize(copy.deepcopy(meta), seed=3)
    x = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    engine = fxspeed.compile(meta, 1, fxspeed.Config(lr=1e-2, eps=1e-3, seed=3, **config), example_inputs=(x, x))
    assert not any(t.is_meta for t in (*meta.parameters(), *meta.buffers()))
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, eps=1e-3, weight_decay=engine.config.weight_decay)
    tol = 1e-5 if engine.config.precision == "fp32" else 2e-2
    _steps_match(engine, ref, opt, 3, tol, x, x)
    for name, value in engine.state_dict().items():
        torch.testing.assert_close(value, ref.state_dict()[name], rtol=tol, atol=tol, msg=name)


class _TiedPair(nn.Module):
    """An embedding and a head sharing one weight, the head with a bias of its own, and a norm:
    what asks for the tied weight first decides nothing."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(16, 8)
        self.norm = nn.LayerNorm(8)
        self.head = nn.Linear(8, 16)
        self.head.weight = self.emb.weight
        self.block = nn.Sequential(nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 8))


def _parent_rescales(m: nn.Module) -> None:
    """An init with a parent-level rule, as transformers' GPT-2 rescales c_proj from its attention
    module: the Sequential redraws its last Linear's weight after that Linear's own init."""
    if isinstance(m, (nn.Linear, nn.Embedding)):
        nn.init.normal_(m.weight, std=0.02)
        if isinstance(m, nn.Linear) and m.bias is not None:
            nn.init.zeros_(m.bias)
    elif isinstance(m, nn.LayerNorm):
        m.reset_parameters()
    elif isinstance(m, nn.Sequential):
        nn.init.normal_(m[2].weight, std=0.5)


@settings(max_examples=15, deadline=None)
@given(st.permutations(list(range(8))), st.integers(0, 2**31 - 1), st.sampled_from([None, _parent_rescales]))
def test_values_are_the_same_whatever_order_the_buckets_ask_for_the_parameters_in(order: list[int], seed: int,
                                                                                  init: object) -> None:
    with fxspeed.parameters_on_meta():
        model = _TiedPair()
    whole = fxspeed.materialize(copy.deepcopy(model), init=init, seed=seed)
    if init is not None:  # the parent's rule came after the Linear's own, wherever it was asked from
        assert float(whole.block[2].weight.detach().std()) > 0.2
    params = list(model.parameters())
    assert len(params) == 8
    deferred = DeferredInit(model, "cpu", seed, init)
    for i in order:
        deferred.materialize([params[i]])
    assert deferred.done and model.head.weight is model.emb.weight  # still tied
    for (name, got), want in zip(model.named_parameters(), whole.parameters()):
        torch.testing.assert_close(got, want, rtol=0, atol=0, msg=name)


def test_a_hugging_face_llama_built_with_parameters_on_meta_keeps_its_rotary_buffers_and_trains_as_eager() -> None:
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
    eager = transformers.LlamaForCausalLM(cfg)
    with fxspeed.parameters_on_meta():
        meta = transformers.LlamaForCausalLM(cfg)
    assert all(p.is_meta for p in meta.parameters()) and not any(b.is_meta for b in meta.buffers())
    torch.testing.assert_close(meta.model.rotary_emb.inv_freq, eager.model.rotary_emb.inv_freq)
    ref = fxspeed.materialize(copy.deepcopy(meta))
    emb = ref.model.embed_tokens.weight.detach()
    assert 0.015 < float(emb.std()) < 0.025  # its own _init_weights (normal, initializer_range 0.02)
    assert torch.equal(ref.model.norm.weight, torch.ones(32))
    x = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    engine = fxspeed.compile(meta, 1, fxspeed.Config(lr=1e-2, zero=3), example_inputs={"input_ids": x, "labels": x})
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=engine.config.weight_decay)
    _steps_match(engine, ref, opt, 2, 1e-6, input_ids=x, labels=x)
    # one trace: giving the values changed no module state the compile-time trace keyed on
    # (deleting transformers' `_is_hf_initialized` flags retraced, gathering the ZeRO-3 model whole)
    assert engine.stats["compiles"] == 1


def test_transformers_gpt2_gets_its_parent_level_rescaled_residual_projections() -> None:
    """GPT-2's init redraws each c_proj from its attention / MLP module (std 0.02 / sqrt(2 n_layer)):
    modules holding no tensors of their own still run their init, after their children's."""
    transformers = pytest.importorskip("transformers")
    with fxspeed.parameters_on_meta():
        meta = transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=128, n_embd=64, n_layer=8, n_head=2,
                                                                    n_positions=32))
    model = fxspeed.materialize(meta)
    assert 0.003 < float(model.transformer.h[0].attn.c_proj.weight.detach().std()) < 0.007  # 0.02 / 4
    assert 0.017 < float(model.transformer.h[0].attn.c_attn.weight.detach().std()) < 0.023
    assert model.lm_head.weight is model.transformer.wte.weight


class _OwnScale(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(3))
        self.l = nn.Linear(3, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.l(x) * self.scale).sum()


def test_a_module_with_no_way_to_initialize_it_is_named_and_an_init_that_misses_a_tensor_is_refused() -> None:
    with fxspeed.parameters_on_meta():
        model = _OwnScale()
    with pytest.raises(ConfigError, match=r"_OwnScale \(the root module\) holds tensors on the meta device.*init=fn"):
        fxspeed.compile(model, 1, example_inputs=(torch.ones(2, 3),))
    # an init that fills the Linear only: `scale` would be uninitialized memory, trained on
    with pytest.raises(ConfigError, match=r"_OwnScale \(the root module\) holds tensors on the meta device that no "
                                          r"init gives values to.*init given does not write them"):
        fxspeed.materialize(model, init=lambda m: m.reset_parameters() if isinstance(m, nn.Linear) else None)
    # one that fills part of it
    with pytest.raises(ConfigError, match=r"left scale unset \(NaN where it gave no value\)"):
        fxspeed.materialize(model, init=lambda m: m.reset_parameters() if isinstance(m, nn.Linear) else
                            torch.nn.init.ones_(m.scale[:2]))
    # a buffer computed in __init__ is gone under torch.device("meta"): said, with the way out
    with torch.device("meta"):
        norm = nn.BatchNorm1d(3)
    norm.register_buffer("table", torch.empty(3, device="meta"))
    with pytest.raises(ConfigError, match="parameters_on_meta"):
        fxspeed.materialize(norm)


def test_init_for_a_model_that_has_its_values_is_refused_by_compile_and_by_materialize() -> None:
    with pytest.raises(ConfigError, match="init= gives values to a model built on the meta device"):
        fxspeed.compile(_OwnScale(), 1, example_inputs=(torch.ones(2, 3),), init=lambda m: None)
    # materialize ran the init on nothing and returned the model unchanged, in silence
    with pytest.raises(ConfigError, match=r"materialize: init= .* _OwnScale holds none there.*model.apply\(init\)"):
        fxspeed.materialize(_OwnScale(), init=lambda m: nn.init.zeros_(m.weight) if isinstance(m, nn.Linear) else None)
    model = _OwnScale()
    assert fxspeed.materialize(model) is model  # without init: nothing to do


_PEAK_PREAMBLE = r"""
import json
import torch, torch.nn as nn
import fxspeed
from fxspeed.runtime.deferred_init import DeferredInit

def kb(field):
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024

with fxspeed.parameters_on_meta():
    model = nn.Sequential(*[nn.Linear(1024, 1024, bias=False) for _ in range(16)])  # 64 MB in fp32
params = {n: p for n, p in model.named_parameters()}

def eager_twin():  # (after the peak is read: the same model made eagerly)
    return fxspeed.materialize(nn.Sequential(*[nn.Linear(1024, 1024, bias=False, device="meta") for _ in range(16)]), seed=5)

deferred = DeferredInit(model, "cpu", seed=5)
base = kb("VmRSS")
open("/proc/self/clear_refs", "w").write("5")
"""


def _layout_peak(script: str) -> dict:
    """Runs `script` after the preamble in a fresh process (its own peak RSS); its last line is JSON."""
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "65536", "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-c", _PEAK_PREAMBLE + script], env=env, capture_output=True, text=True,
                         check=True, timeout=120)
    return json.loads(out.stdout.strip().splitlines()[-1])


_LAYOUT_PEAK = r"""
from fxspeed.ir import Bucket
from fxspeed.runtime.flat_parameters import FlatParameters

buckets = [Bucket(k, [n], [(1024, 1024)], [0], 1 << 20, 1 << 20) for k, n in enumerate(params)]
flat = FlatParameters(params, buckets, rank=0, world=2, zero=3, group=None, materialize=deferred.materialize,
                      device=torch.device("cpu"))
grown = kb("VmHWM") - base
whole = eager_twin()
same = all(torch.equal(s, w.weight.reshape(-1)[: 1 << 19]) for s, w in zip(flat.shards, whole))
print(json.dumps({"grown": grown, "same": same, "released": all(p.numel() == 0 for p in params.values())}))
"""


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux's peak-RSS reset")
def test_laying_out_a_meta_model_under_zero3_holds_this_ranks_half_and_a_bucket_never_the_whole_model() -> None:
    """Rank 0 of 2 under ZeRO-3 keeps half of a 64 MB model: it makes each bucket's values just
    before reading them and releases them at once, so it peaks at its half and a few buckets (43 MB
    measured; all at once: 74)."""
    r = _layout_peak(_LAYOUT_PEAK)
    assert r["same"] and r["released"]
    kept, bucket = 8 << 22, 4 << 20
    assert r["grown"] < kept + 4 * bucket, f"laying out the meta model peaked {r['grown'] / 1e6:.1f} MB (keeps 33.6)"


_TP_LAYOUT_PEAK = r"""
from fxspeed.runtime.tensor_parallel import TensorParallelParameters, take_slice

layout = {n: (k % 2, 1) for k, n in enumerate(params)}  # column- and row-parallel in turn
tp = TensorParallelParameters(None, 0, 2)
tp.apply(params, layout, make=deferred.materialize)
grown = kb("VmHWM") - base
whole = eager_twin()
same = all(torch.equal(p, take_slice(w.weight.detach(), layout[n][0], 1, 0, 2)) for (n, p), w in zip(params.items(), whole))
print(json.dumps({"grown": grown, "same": same, "done": deferred.done}))
"""


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux's peak-RSS reset")
def test_laying_out_a_meta_model_under_tensor_parallelism_cuts_each_group_as_it_is_made_never_the_whole_model() -> None:
    """Rank 0 of 2 under tensor=2 keeps half of every weight of a 64 MB model: each init group is
    made whole (its init draws the full tensor, so the values are fxspeed.materialize's) and cut
    to this rank's slice at once, so it peaks at its half and a group or two (44 MB measured; made
    all at once and then sliced, as the engine did: 75)."""
    r = _layout_peak(_TP_LAYOUT_PEAK)
    assert r["same"] and r["done"]
    kept, group = 8 << 22, 4 << 20
    assert r["grown"] < kept + 4 * group, f"laying out the meta model peaked {r['grown'] / 1e6:.1f} MB (keeps 33.6)"


def test_weights_another_stage_holds_are_never_made_and_the_rest_keep_their_values() -> None:
    """A pipeline rank releases the weights of the stages it does not run: an init group made of
    them only is never made (0-size on the device, as the engine frees them); a group that also
    holds a kept tensor is made whole when asked for, with fxspeed.materialize's values."""
    with fxspeed.parameters_on_meta():
        model = _TiedPair()
    whole = dict(fxspeed.materialize(copy.deepcopy(model), init=_parent_rescales, seed=4).named_parameters())
    deferred = DeferredInit(model, "cpu", 4, _parent_rescales)
    # block.0 is a group of its own; block.2's weight shares its group with its (kept) bias
    released = [model.block[0].weight, model.block[0].bias, model.block[2].weight]
    deferred.release(released)
    assert all(not t.is_meta and t.numel() == 0 and isinstance(t, nn.Parameter) for t in released[:2])
    assert model.block[2].weight.is_meta and not deferred.done
    made = deferred.materialize([model.block[2].bias])
    assert {id(t) for t in made} == {id(model.block[2].weight), id(model.block[2].bias)}
    deferred.materialize_all()
    assert deferred.done and model.block[0].weight.numel() == 0  # not made by materialize_all either
    for name, p in model.named_parameters():
        if not name.startswith("block.0."):
            torch.testing.assert_close(p, whole[name], rtol=0, atol=0, msg=name)


def _data_idiom_init(m: nn.Module) -> None:
    """The `.data` idiom of many user inits (and transformers 4.x's `_init_weights`): the write goes
    through an alias that is neither the Parameter object nor a view of it."""
    if isinstance(m, nn.Linear):
        m.weight.data.normal_(0.0, 0.02)
        m.bias.data.zero_()


def _meta_only_noop_init(m: nn.Module) -> None:
    """torch.nn.init functions that return at once on a meta tensor (trunc_normal_, orthogonal_,
    dirac_, sparse_): the probe sees no write inside them. transformers' ViT, Swin, DeiT... use
    trunc_normal_."""
    if isinstance(m, nn.Linear):
        nn.init.trunc_normal_(m.weight, std=0.02)
        nn.init.zeros_(m.bias)
    elif isinstance(m, nn.Conv1d):
        nn.init.dirac_(m.weight)
    elif isinstance(m, nn.GRU):
        for name, p in m.named_parameters():
            (nn.init.orthogonal_ if name.startswith("weight") else nn.init.zeros_)(p)


@pytest.mark.parametrize("init", [_data_idiom_init, _meta_only_noop_init], ids=["data-alias", "meta-noop-init"])
def test_an_init_writing_through_data_or_an_init_function_that_skips_meta_tensors_is_seen_and_run(init) -> None:
    with fxspeed.parameters_on_meta():
        model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2), nn.Conv1d(2, 2, 1, bias=False), nn.GRU(2, 2))
    if init is _data_idiom_init:
        model = model[:2]
    eager = copy.deepcopy(model).to_empty(device="cpu")
    torch.manual_seed(0)
    eager.apply(init)
    got = fxspeed.materialize(model, init=init)
    assert float(got[0].weight.detach().std()) < 0.05 and torch.equal(got[0].bias, torch.zeros(4))
    for (name, p), q in zip(got.named_parameters(), eager.parameters()):
        assert p.shape == q.shape and not torch.isnan(p).any(), name
        if name.startswith("2.") or ".bias" in name:  # dirac_ and zeros_: no draw, so equal to eager
            torch.testing.assert_close(p, q, rtol=0, atol=0, msg=name)


def test_transformers_vit_whose_init_uses_trunc_normal_is_given_its_values() -> None:
    transformers = pytest.importorskip("transformers")
    cfg = transformers.ViTConfig(image_size=8, patch_size=4, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                 num_attention_heads=2, num_labels=3)
    with fxspeed.parameters_on_meta():
        meta = transformers.ViTForImageClassification(cfg)
    model = fxspeed.materialize(meta)
    assert 0.015 < float(model.vit.embeddings.patch_embeddings.projection.weight.detach().std()) < 0.025
    assert 0.01 < float(model.vit.embeddings.cls_token.detach().abs().max()) < 0.1  # trunc_normal_, std 0.02


class _Recurrent(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.rnn = nn.LSTM(4, 4, batch_first=True)
        self.head = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.rnn(x)[0]).sum()


def test_an_lstm_whose_module_holds_weak_references_to_its_parameters_is_materialized_and_runs() -> None:
    """torch's RNNs keep weakrefs to their Parameters, which swap_tensors refuses (it raised
    "Cannot swap t1 because it has weakref associated with it"); another holder is named."""
    with fxspeed.parameters_on_meta():
        model = _Recurrent()
    model = fxspeed.materialize(model)
    assert all(not p.is_meta and not torch.isnan(p).any() for p in model.parameters())
    assert all(w is getattr(model.rnn, n) for w, n in zip(model.rnn._flat_weights, model.rnn._flat_weights_names))
    assert torch.isfinite(model(torch.ones(1, 3, 4)))
    import weakref

    with fxspeed.parameters_on_meta():
        other = nn.Sequential(nn.Linear(2, 2))
    keep = weakref.ref(other[0].weight)  # held through the call
    with pytest.raises(ConfigError, match=r"Sequential\.0\.weight is on the meta device and something holds a weak"):
        fxspeed.materialize(other)
    assert keep() is other[0].weight


def test_a_hugging_face_composite_inits_each_sub_model_with_its_own_init_weights() -> None:
    """LLaVA holds a CLIP vision tower and a Llama, each a PreTrainedModel with its own
    `_init_weights` (transformers' smart_apply dispatches to it): the root's alone cannot init CLIP's
    embeddings (it was refused) and would draw CLIP's Linears at Llama's std."""
    transformers = pytest.importorskip("transformers")
    vision = transformers.CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                           num_attention_heads=4, image_size=8, patch_size=4, initializer_factor=5.0)
    text = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16)
    cfg = transformers.LlavaConfig(vision_config=vision, text_config=text, image_token_index=5, vision_feature_layer=-1)
    with fxspeed.parameters_on_meta():
        meta = transformers.LlavaForConditionalGeneration(cfg)
    model = fxspeed.materialize(meta)
    # CLIP's rule: q_proj std = hidden**-0.5 * (2 * layers)**-0.5 * factor = 0.625; Llama's: 0.02
    assert 0.5 < float(model.model.vision_tower.encoder.layers[0].self_attn.q_proj.weight.detach().std()) < 0.75
    assert 0.015 < float(model.model.language_model.layers[0].self_attn.q_proj.weight.detach().std()) < 0.025


class _Counts(nn.Module):
    """An integer buffer next to a weight: integers have no NaN to tell "unset" by."""

    def __init__(self) -> None:
        super().__init__()
        self.l = nn.Linear(3, 3)
        self.register_buffer("seen", torch.zeros(5, dtype=torch.long))


def test_an_integer_tensor_an_init_leaves_is_zero_not_allocator_garbage_and_the_probe_draws_nothing() -> None:
    with torch.device("meta"):
        model = _Counts()

    def init(m: nn.Module) -> None:  # writes the weight and the first count only, and draws out of place
        if isinstance(m, nn.Linear):
            m.reset_parameters()
        elif isinstance(m, _Counts):
            m.seen[:1].fill_(7)
            torch.randn(3)

    torch.manual_seed(11)
    before = torch.get_rng_state()
    deferred = DeferredInit(model, "cpu", init=init)
    assert torch.equal(torch.get_rng_state(), before)  # probing ran every init without moving the generator
    deferred.materialize_all()
    assert model.seen.tolist() == [7, 0, 0, 0, 0]


def test_a_parent_level_init_keeps_a_real_weight_it_writes_in_a_partly_meta_model() -> None:
    """A weight the user loaded into a child stays as loaded when a parent's init rule writes it
    together with a meta sibling's (the Sequential redraws both its Linears' weights, as
    transformers' Decision Transformer rescales every c_proj under a block)."""
    def init(m: nn.Module) -> None:
        _parent_rescales(m)
        if isinstance(m, nn.Sequential):
            nn.init.normal_(m[0].weight, std=0.5)

    with fxspeed.parameters_on_meta():
        model = _TiedPair()
    loaded = nn.Linear(8, 8)  # real: e.g. taken from a checkpoint
    model.block[2] = loaded
    want = loaded.weight.detach().clone()
    fxspeed.materialize(model, init=init)
    assert torch.equal(model.block[2].weight, want)
    assert float(model.block[0].weight.detach().std()) > 0.2  # the meta sibling got the parent's rule
