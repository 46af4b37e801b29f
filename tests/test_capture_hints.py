"""Forwards fxspeed cannot capture as written: each error names the user's module and line and
says the way out, and where the advised rewrite exists it trains exactly as eager does."""

from __future__ import annotations

import copy
import inspect
import logging
import math
import os

import pytest
import torch
import torch.nn as nn
from conftest import assert_close_rel, assert_models_match, check_parity

import fxspeed


def _line_of(cls: type, marker: str) -> int:
    lines, start = inspect.getsourcelines(cls)
    return start + next(i for i, line in enumerate(lines) if marker in line)


def _compile(model: nn.Module, batch: tuple, **kw):  # noqa: ANN202
    return fxspeed.compile(model, 1, fxspeed.Config(), example_inputs=batch, **kw)


# --------------------------------------------------------------------------------------------
# forward writes into its input
# --------------------------------------------------------------------------------------------

class ScalesItsInput(nn.Module):
    def __init__(self, only_in_eval: bool = False) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.only_in_eval = only_in_eval

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if not (self.only_in_eval and self.training):
            x.mul_(2)  # MUTATE-LINE
        return ((self.a(x) - y) ** 2).mean()


def test_a_forward_that_modifies_its_input_in_place_is_refused_naming_the_input_and_its_line() -> None:
    with pytest.raises(fxspeed.CaptureError) as info:
        _compile(ScalesItsInput(), (torch.randn(4, 8), torch.randn(4, 8)))
    msg = str(info.value)
    assert "KeyError" not in msg and "`x`" in msg and "in place" in msg
    assert f"test_capture_hints.py:{_line_of(ScalesItsInput, 'MUTATE-LINE')}" in msg
    assert "x = x * 2" in msg and "does not write" in msg


def test_an_eval_step_that_modifies_its_input_in_place_is_refused_the_same_way() -> None:
    batch = (torch.randn(4, 8), torch.randn(4, 8))
    engine = _compile(ScalesItsInput(only_in_eval=True), batch)
    with pytest.raises(fxspeed.CaptureError, match=r"eval step .*modifies its input `x` in place"):
        engine.eval_step(*batch)


# --------------------------------------------------------------------------------------------
# forward stores a tensor on self
# --------------------------------------------------------------------------------------------

class StoresActivation(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        self.last = h.detach()
        self.history.append(h.detach())
        return ((h - y) ** 2).mean()


def test_a_tensor_stored_on_self_in_forward_is_taken_back_after_the_trace_with_a_warning_naming_it(
        caplog: pytest.LogCaptureFixture) -> None:
    inner = StoresActivation()
    inner.history = []
    before = torch.zeros(4, 8)
    inner.last = before
    wrapper = _Wrap(inner)
    batch = (torch.randn(4, 8), torch.randn(4, 8))
    with caplog.at_level(logging.WARNING, logger="fxspeed"):
        engine = _compile(wrapper, batch)
        engine.train_step(*batch)
    assert inner.last is before and inner.history == []  # no trace-time FunctionalTensor left behind
    wrapper(*batch)  # the model still runs in eager: nothing fake was left on it
    assert inner.last.norm() > 0
    text = caplog.text
    assert "`m` (StoresActivation)" in text and "self.last" in text and "self.history" in text
    assert "register_buffer" in text and "copy_" in text


class _Wrap(nn.Module):
    def __init__(self, m: nn.Module) -> None:
        super().__init__()
        self.m = m

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.m(x, y)


class KeepsActivationInBuffer(nn.Module):
    """The way out the warning gives: a buffer updated in place."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.register_buffer("last", torch.zeros(4, 8), persistent=False)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        self.last.copy_(h.detach())
        return ((h - y) ** 2).mean()


def test_a_buffer_updated_in_place_in_forward_holds_the_last_activation_as_in_eager(
        caplog: pytest.LogCaptureFixture) -> None:
    batches = [(torch.randn(4, 8), torch.randn(4, 8)) for _ in range(3)]
    model = KeepsActivationInBuffer()
    with caplog.at_level(logging.WARNING, logger="fxspeed"):
        _, ref = check_parity(model, batches)
    assert "stores a tensor" not in caplog.text
    assert model.last.norm() > 0
    assert_close_rel(model.last, ref.last, "buffer `last`")


# --------------------------------------------------------------------------------------------
# the batch does not fit forward's signature
# --------------------------------------------------------------------------------------------

def test_a_model_whose_forward_does_not_take_the_targets_is_told_it_is_called_with_the_whole_batch() -> None:
    x, y = torch.randn(4, 8), torch.randn(4, 8)
    with pytest.raises(fxspeed.CaptureError) as info:
        _compile(nn.Linear(8, 8), (x, y), loss_fn=lambda out, x, y: ((out - y) ** 2).mean())
    msg = str(info.value)
    assert "whole batch" in msg and "2 positional arguments" in msg and "Linear.forward(input" in msg
    assert "loss_fn(output, *args, **kwargs)" in msg and "y=None" in msg
    assert "rewrite that line" not in msg


def test_a_forward_that_takes_and_ignores_the_targets_trains_with_a_loss_fn_as_in_eager() -> None:
    class TakesTargets(nn.Module):  # the first way out of the error above
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(8, 8)

        def forward(self, x: torch.Tensor, y: torch.Tensor | None = None) -> torch.Tensor:
            return self.lin(x)

    batches = [(torch.randn(4, 8), torch.randn(4, 8)) for _ in range(2)]
    check_parity(TakesTargets(), batches, loss_fn=lambda out, x, y: ((out - y) ** 2).mean())


# --------------------------------------------------------------------------------------------
# data-dependent shapes: boolean-mask indexing
# --------------------------------------------------------------------------------------------

class MaskIndexed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, m: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        return ((h[m] - y[m]) ** 2).mean()  # MASK-LINE


class MaskWeighted(MaskIndexed):
    """The rewrite the error suggests."""

    def forward(self, x: torch.Tensor, m: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        w = m.unsqueeze(-1).to(h.dtype)
        return (((h - y) ** 2) * w).sum() / (w.sum() * h.shape[-1])


def _mask_batch() -> tuple:
    x = torch.randn(6, 8)
    return x, x[:, 0] > 0, torch.randn(6, 8)


def test_boolean_mask_indexing_is_explained_as_a_data_dependent_shape_with_a_masked_mean_instead() -> None:
    with pytest.raises(fxspeed.CaptureError) as info:
        _compile(MaskIndexed(), _mask_batch())
    msg = str(info.value)
    assert "aten.nonzero" in msg and "data-dependent shape" in msg and "torch.where" in msg
    assert f"test_capture_hints.py:{_line_of(MaskIndexed, 'MASK-LINE')}" in msg
    assert "w.sum() * h.shape[-1]" in msg and "rewrite that line" not in msg


def test_the_suggested_masked_mean_trains_exactly_as_eager_boolean_mask_indexing() -> None:
    _trains_as_eager_original(MaskWeighted, MaskIndexed)


def _trains_as_eager_original(rewritten: type, original: type) -> None:
    """The `rewritten` model, compiled, takes the losses and weights of the `original` in eager
    over three masked batches (the original starts from the rewritten one's weights)."""
    batches = [_mask_batch() for _ in range(3)]
    model, ref = rewritten(), original()
    ref.load_state_dict(model.state_dict())
    opt = torch.optim.AdamW(ref.parameters(), lr=fxspeed.Config().lr, weight_decay=fxspeed.Config().weight_decay)
    engine = _compile(model, batches[0])
    for i, b in enumerate(batches):
        loss = engine.train_step(*b)
        opt.zero_grad()
        ref_loss = ref(*b)
        ref_loss.backward()
        opt.step()
        assert_close_rel(loss, ref_loss.item(), f"loss at step {i}")
    assert_models_match(model, ref)


class MaskAssigned(nn.Module):
    """SpecAugment's pattern (Hugging Face Wav2Vec2, HuBERT): masked rows take a learned vector."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.fill = nn.Parameter(torch.randn(8))

    def forward(self, x: torch.Tensor, m: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        y = y.clone()
        y[y > 5] = 0.0  # no gradient through it: not the line to blame
        h = self.a(x)
        h[m] = self.fill  # ASSIGN-LINE
        return ((h - y) ** 2).mean()


class MaskSelected(MaskAssigned):
    """The rewrite the error suggests."""

    def forward(self, x: torch.Tensor, m: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        y = torch.where(y > 5, 0.0, y)
        h = torch.where(m.unsqueeze(-1), self.fill, self.a(x))
        return ((h - y) ** 2).mean()


def test_an_assignment_through_a_boolean_mask_is_refused_naming_its_line_and_a_where_instead() -> None:
    """torch fails in the backward it traces (index_put's gradient of the values reads the mask's
    True entries), where no user line is: the error named neither the line nor the assignment."""
    with pytest.raises(fxspeed.CaptureError) as info:
        _compile(MaskAssigned(), _mask_batch())
    msg = str(info.value)
    assert f"test_capture_hints.py:{_line_of(MaskAssigned, 'ASSIGN-LINE')}" in msg, msg
    assert "h[mask] = v" in msg and "torch.where(mask.unsqueeze(-1), v, h)" in msg


def test_the_suggested_where_trains_exactly_as_eager_mask_assignment() -> None:
    _trains_as_eager_original(MaskSelected, MaskAssigned)


def test_hugging_face_layerdrop_is_refused_with_the_config_key_that_turns_it_off() -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.Wav2Vec2Config(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64, conv_dim=(16, 16),
        conv_stride=(5, 2), conv_kernel=(10, 3), num_conv_pos_embeddings=16, num_conv_pos_embedding_groups=4,
        num_labels=3, mask_time_prob=0.0, layerdrop=0.1)
    torch.manual_seed(0)
    batch = {"input_values": torch.randn(2, 400), "labels": torch.tensor([0, 2])}
    with pytest.raises(fxspeed.CaptureError) as info:
        _compile(transformers.Wav2Vec2ForSequenceClassification(config), batch)
    msg = str(info.value)
    assert "LayerDrop" in msg and "config.layerdrop" in msg and "modeling_wav2vec2.py" in msg, msg
    config.layerdrop = 0.0
    engine = _compile(transformers.Wav2Vec2ForSequenceClassification(config), batch)
    assert math.isfinite(engine.train_step(**batch))


def test_hugging_faces_eager_experts_loop_is_refused_naming_the_experts_implementations_of_fixed_shapes() -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.Qwen3MoeConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16)
    torch.manual_seed(0)
    model = transformers.Qwen3MoeForCausalLM(config)
    if not hasattr(model, "set_experts_implementation"):
        pytest.skip("this transformers has one experts implementation")
    model.set_experts_implementation("eager")
    ids = torch.randint(0, 64, (2, 8))
    with pytest.raises(fxspeed.CaptureError, match=r"set_experts_implementation\('grouped_mm'\)"):
        _compile(model, {"input_ids": ids, "labels": ids})


# --------------------------------------------------------------------------------------------
# a tensor's value read inside torch's own modules
# --------------------------------------------------------------------------------------------

class CumulativeBN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.bn = nn.BatchNorm1d(8, momentum=None)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return ((self.bn(self.a(x)) - y) ** 2).mean()  # BN-LINE


def test_batchnorm_with_momentum_none_names_the_torch_module_and_asks_for_a_fixed_momentum() -> None:
    with pytest.raises(fxspeed.CaptureError) as info:
        _compile(CumulativeBN(), (torch.randn(4, 8), torch.randn(4, 8)))
    msg = str(info.value)
    assert "inside torch's `bn` (BatchNorm1d)" in msg and "momentum=None" in msg and "momentum=0.1" in msg
    assert "model.bn.momentum = 0.1" in msg
    assert "batchnorm.py" in msg
    assert f"test_capture_hints.py:{_line_of(CumulativeBN, 'BN-LINE')}" in msg


def test_sync_batchnorm_under_a_process_group_on_the_cpu_is_told_to_use_batchnorm() -> None:
    """torch's SyncBatchNorm has GPU kernels only: under a process group on the CPU eager raises
    too. The message said "rewrite that line"; it names the module and the BatchNorm to use."""
    import torch.distributed as dist

    model = nn.Sequential(nn.Linear(8, 4), nn.SyncBatchNorm(4))
    assert not dist.is_initialized()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        with pytest.raises(fxspeed.CaptureError) as info:
            fxspeed.compile(model, 1, fxspeed.Config(), example_inputs=(torch.randn(4, 8),),
                            loss_fn=lambda out, *rest: out.sum())
    finally:
        dist.destroy_process_group()
    msg = str(info.value)
    assert "nn.SyncBatchNorm runs only on GPUs" in msg and "nn.BatchNorm2d (or 1d/3d)" in msg
    assert "rewrite that line" not in msg


def test_a_submodule_in_a_sequential_is_named_as_python_that_reaches_it() -> None:
    from fxspeed.compiler.capture import _python_path

    assert _python_path("f.1") == "model.f[1]" and _python_path("blocks.0.ln.2") == "model.blocks[0].ln[2]"


class MaskedTransformer(nn.Module):
    def __init__(self, encoder_only: bool = False, causal: bool | None = None) -> None:
        super().__init__()
        self.encoder_only, self.causal = encoder_only, causal
        if encoder_only:
            self.t = nn.TransformerEncoder(nn.TransformerEncoderLayer(16, 2, 32, 0.0, batch_first=True), 1)
        else:
            self.t = nn.Transformer(16, 2, 1, 1, 32, dropout=0.0, batch_first=True)

    def forward(self, src: torch.Tensor, tgt: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        mask = nn.Transformer.generate_square_subsequent_mask(tgt.shape[1])
        if self.encoder_only:
            out = self.t(tgt, mask=mask, is_causal=self.causal)
        else:
            out = self.t(src, tgt, tgt_mask=mask, tgt_is_causal=self.causal)
        return ((out - y) ** 2).mean()


def _seq_batch() -> tuple:
    return torch.randn(3, 5, 16), torch.randn(3, 4, 16), torch.randn(3, 4, 16)


def test_nn_transformer_with_a_tgt_mask_and_no_causal_flag_is_told_to_pass_tgt_is_causal() -> None:
    with pytest.raises(fxspeed.CaptureError) as info:
        _compile(MaskedTransformer(), _seq_batch())
    msg = str(info.value)
    assert "inside torch's `t.decoder` (TransformerDecoder)" in msg
    assert "tgt_is_causal=True to `t` (Transformer)" in msg and "tgt_is_causal=False" in msg


def test_transformer_encoder_with_a_mask_and_no_causal_flag_is_told_to_pass_is_causal() -> None:
    with pytest.raises(fxspeed.CaptureError) as info:
        _compile(MaskedTransformer(encoder_only=True), _seq_batch())
    msg = str(info.value)
    assert "inside torch's `t` (TransformerEncoder)" in msg and "is_causal=True" in msg


@pytest.mark.parametrize("causal", [True, False])
def test_nn_transformer_with_the_advised_tgt_is_causal_flag_trains_as_in_eager(causal: bool) -> None:
    check_parity(MaskedTransformer(causal=causal), [_seq_batch() for _ in range(2)])


# --------------------------------------------------------------------------------------------
# gradients inside forward, sparse gradients
# --------------------------------------------------------------------------------------------

class GradientPenalty(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        x = x.requires_grad_(True)
        out = self.a(x)
        (g,) = torch.autograd.grad(out.sum(), x, create_graph=True)  # GRAD-LINE
        return ((out - y) ** 2).mean() + ((g.norm(dim=1) - 1) ** 2).mean()


def test_a_gradient_penalty_inside_forward_is_refused_as_unsupported_naming_the_line() -> None:
    with pytest.raises(fxspeed.CaptureError) as info:
        _compile(GradientPenalty(), (torch.randn(4, 8), torch.randn(4, 1)))
    msg = str(info.value)
    assert "torch.autograd.grad" in msg and "not supported" in msg and "expected grad to be None" not in msg
    assert f"test_capture_hints.py:{_line_of(GradientPenalty, 'GRAD-LINE')}" in msg


class SparseEmbedding(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 8, sparse=True)
        self.a = nn.Linear(8, 1)

    def forward(self, ids: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return ((self.a(self.emb(ids)) - y) ** 2).mean()


def test_an_embedding_with_sparse_gradients_is_refused_at_compile_with_sparse_false_as_the_way_out() -> None:
    with pytest.raises(fxspeed.CaptureError) as info:
        _compile(SparseEmbedding(), (torch.randint(0, 10, (4,)), torch.randn(4, 1)))
    msg = str(info.value)
    assert "`emb.weight`" in msg and "`emb` (Embedding)" in msg and "sparse gradient" in msg
    assert "sparse=False" in msg


def test_an_embedding_with_max_norm_in_a_sequential_is_refused_naming_max_norm_and_no_line_of_fxspeed() -> None:
    """max_norm renormalizes the looked-up rows in place in forward; the user wrote no in-place op.
    With no forward of the user's (a Sequential) the error named fxspeed's runtime/engine.py (h39)."""
    model = nn.Sequential(nn.Embedding(10, 8, max_norm=1.0), nn.Linear(8, 1))
    ids = torch.randint(0, 10, (4, 3))
    with pytest.raises(fxspeed.CaptureError) as info:
        fxspeed.compile(model, devices=1, example_inputs=(ids,), loss_fn=lambda out, *b: out.mean()).train_step(ids)
    msg = str(info.value)
    assert "max_norm=None" in msg and "`model[0]`" in msg and "embedding_renorm" in msg
    fxspeed_dirs = [os.path.dirname(os.path.dirname(fxspeed.__file__)) + f"/{d}/" for d in ("fxspeed", "runtime", "passes")]
    assert not any(d in msg for d in fxspeed_dirs), msg


class RealFFT(nn.Module):
    def __init__(self, rfft: bool) -> None:
        super().__init__()
        self.lin, self.rfft = nn.Linear(16, 16), rfft

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        if self.rfft:
            return torch.fft.irfft(torch.fft.rfft(h), n=16).pow(2).mean()
        return torch.fft.ifft(torch.fft.fft(h)[..., :9], n=16).real.pow(2).mean()  # the suggested form


def test_a_real_fft_that_export_cannot_differentiate_is_refused_with_a_complex_fft_instead() -> None:
    """torch's AOT export cannot differentiate rfft/irfft's complex outputs (eager can); the error
    said "rewrite that line" with no line of the user's on the trace."""
    x = torch.randn(4, 16)
    with pytest.raises(fxspeed.CaptureError) as info:
        fxspeed.compile(RealFFT(rfft=True), devices=1, example_inputs=(x,)).train_step(x)
    msg = str(info.value)
    assert "torch.fft.fft" in msg and "that line" not in msg
    torch.manual_seed(0)
    model = RealFFT(rfft=False)
    check_parity(model, [(torch.randn(4, 16),) for _ in range(2)])


class PaddedEncoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.enc = nn.TransformerEncoder(nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True), 2)

    def forward(self, x: torch.Tensor, pad: torch.Tensor, y: torch.Tensor | None = None) -> torch.Tensor:
        out = self.enc(x, src_key_padding_mask=pad)
        return out if y is None else ((out - y) ** 2).mean()


def test_a_transformer_encoder_s_nested_fast_path_is_named_when_its_eval_step_is_compiled() -> None:
    """Eager eval under no_grad returns 0 at padded positions (nested tensors); the compiled eval
    step computes them (h39). Said with the module's name; the unpadded positions are eager's."""
    x, pad = torch.randn(2, 5, 16), torch.zeros(2, 5, dtype=torch.bool)
    pad[1, 3:] = True
    model = PaddedEncoder()
    engine = _compile(model, (x, pad, torch.randn(2, 5, 16)))
    model.eval()
    with pytest.warns(UserWarning, match=r"enc \(nn.TransformerEncoder, enable_nested_tensor=True\).*padded positions"):
        out = engine.eval_step(x, pad)
    with torch.no_grad():
        want = model(x, pad)
    assert want[1, 3:].abs().max() == 0 and out[1, 3:].abs().max() > 0  # the fast path's zeros, computed here
    torch.testing.assert_close(out[~pad], want[~pad], rtol=1e-5, atol=1e-6)


def test_a_frozen_sparse_embedding_still_trains_as_in_eager() -> None:
    model = SparseEmbedding()
    model.emb.weight.requires_grad_(False)  # no gradient, so nothing sparse
    check_parity(model, [(torch.randint(0, 10, (4,)), torch.randn(4, 1)) for _ in range(2)])


class StoresThenBranches(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        self.last = h.detach()
        if h.sum() > 0:  # not capturable: the trace fails after `last` was set
            h = h * 2
        return ((h - y) ** 2).mean()


def test_a_tensor_stored_on_self_is_taken_back_even_when_the_capture_fails() -> None:
    model = StoresThenBranches()
    with pytest.raises(fxspeed.CaptureError):
        _compile(model, (torch.randn(4, 8), torch.randn(4, 8)))
    assert "last" not in model.__dict__
    copy.deepcopy(model)(torch.randn(4, 8), torch.randn(4, 8))


def test_int32_class_indices_train_exactly_as_int64_ones() -> None:
    """The fake nll_loss accepts int32 targets, so the trace passed and the first CPU train_step
    failed inside the compiled program with ATen's bare dtype error (eager refuses them too); the
    capture now reads them through an int64 copy, which changes no value."""
    from fxspeed.models import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig.preset("tiny"))
    twin = copy.deepcopy(model)
    x, y = torch.randint(0, 256, (2, 16)), torch.randint(0, 256, (2, 16))
    narrow, wide = _compile(model, (x, y.to(torch.int32))), _compile(twin, (x, y))
    assert [narrow.train_step(x, y.to(torch.int32)) for _ in range(2)] == [wide.train_step(x, y) for _ in range(2)]
    assert all(torch.equal(narrow.state_dict()[k], v) for k, v in wide.state_dict().items())


def test_example_inputs_as_torch_exports_args_kwargs_pair_trains_as_the_dict_form() -> None:
    """`((), {"input_ids": x, ...})`, as torch.export takes inputs, was read as two positional
    arguments: forward got an empty tuple for input_ids and the error blamed the model's code."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=64, n_embd=16, n_layer=1, n_head=2, n_positions=16, resid_pdrop=0.0,
                                  embd_pdrop=0.0, attn_pdrop=0.0)
    model = transformers.GPT2LMHeadModel(cfg)
    twin = copy.deepcopy(model)
    x = torch.randint(0, 64, (2, 8))
    pair = _compile(model, ((x,), {"labels": x}))
    as_dict = _compile(twin, {"input_ids": x, "labels": x})
    assert pair.train_step(x, labels=x) == as_dict.train_step(input_ids=x, labels=x)
