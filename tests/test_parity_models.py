"""fxspeed trains exactly like eager PyTorch.

Each test runs the same optimizer steps on a model through `fxspeed.compile(...).train_step`
and on a deepcopy in eager PyTorch with the torch.optim twin of the configured optimizer,
then asserts the losses and every parameter and buffer agree to fp32 relative error 1e-5
(see conftest.check_parity). Models are tiny so the whole file runs in about a minute on two
CPU cores.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from conftest import assert_close_rel, assert_models_match, check_parity, eager_train

import fxspeed
from fxspeed.models import GPT, GPTConfig

transformers = pytest.importorskip("transformers")

V = 64  # vocabulary of every language model here
STEPS = 5


def lm_batches(n: int = STEPS, batch: int = 2, seq: int = 8) -> list[dict[str, torch.Tensor]]:
    out = []
    for _ in range(n):
        ids = torch.randint(1, V, (batch, seq))
        out.append({"input_ids": ids, "labels": ids})
    return out


def tiny_gpt(dropout: float = 0.0) -> GPT:
    return GPT(GPTConfig(vocab_size=V, block_size=16, n_layer=2, n_head=2, n_embd=32, dropout=dropout))


def gpt_batches(n: int = STEPS) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(torch.randint(0, V, (2, 8)), torch.randint(0, V, (2, 8))) for _ in range(n)]


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4))

    def forward(self, x: torch.Tensor, y: torch.Tensor | None = None) -> torch.Tensor:
        return self.net(x)  # y is the target, read by loss_fn(output, x, y)


def mse(out: torch.Tensor, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(out, y)


def mlp_batches(n: int = STEPS, batch: int = 8) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(torch.randn(batch, 8), torch.randn(batch, 4)) for _ in range(n)]


class ConvNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)
        self.head = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = F.relu(self.bn(self.conv(x))).mean(dim=(2, 3))
        return F.cross_entropy(self.head(h), y)


# --------------------------------------------------------------------------------------------
# Models
# --------------------------------------------------------------------------------------------

def test_mlp_with_loss_fn_matches_eager() -> None:
    check_parity(MLP(), mlp_batches(), fxspeed.Config(lr=1e-2), loss_fn=mse)


def test_cnn_batchnorm_running_stats_update_exactly_as_eager() -> None:
    model = ConvNet()
    batches = [(torch.randn(4, 3, 6, 6) * 2 + 1, torch.randint(0, 3, (4,))) for _ in range(STEPS)]
    _, ref = check_parity(model, batches, fxspeed.Config(lr=1e-2))
    assert model.bn.num_batches_tracked.item() == STEPS
    assert torch.equal(model.bn.num_batches_tracked, ref.bn.num_batches_tracked)
    assert_close_rel(model.bn.running_mean, ref.bn.running_mean, "running_mean")
    assert_close_rel(model.bn.running_var, ref.bn.running_var, "running_var")
    assert not torch.equal(model.bn.running_var, torch.ones(4)), "running stats were not updated"


def test_fxspeed_gpt_with_tied_weights_matches_eager_and_stays_tied() -> None:
    model = tiny_gpt()
    untouched = copy.deepcopy(model)
    engine, _ = check_parity(model, gpt_batches())
    assert model.head.weight is model.wte.weight
    assert model.head.weight.data_ptr() == model.wte.weight.data_ptr()
    sd, ref_sd = engine.state_dict(), untouched.state_dict()
    assert list(sd) == list(ref_sd)
    assert {k: v.shape for k, v in sd.items()} == {k: v.shape for k, v in ref_sd.items()}
    assert sd["head.weight"].data_ptr() == sd["wte.weight"].data_ptr()


def test_hf_gpt2_lm_head_model_matches_eager_and_keeps_lm_head_tied() -> None:
    cfg = transformers.GPT2Config(vocab_size=V, n_positions=16, n_embd=32, n_layer=2, n_head=2, resid_pdrop=0.0,
                                  embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    model = transformers.GPT2LMHeadModel(cfg)
    untouched = copy.deepcopy(model)
    engine, _ = check_parity(model, lm_batches())
    assert model.lm_head.weight.data_ptr() == model.transformer.wte.weight.data_ptr()
    sd, ref_sd = engine.state_dict(), untouched.state_dict()
    assert list(sd) == list(ref_sd)
    assert all(sd[k].shape == ref_sd[k].shape for k in ref_sd)


def test_hf_llama_for_causal_lm_matches_eager() -> None:
    cfg = transformers.LlamaConfig(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=16,
                                   bos_token_id=0, eos_token_id=0, pad_token_id=0)
    check_parity(transformers.LlamaForCausalLM(cfg), lm_batches())


def tiny_bert_config() -> "transformers.BertConfig":
    return transformers.BertConfig(vocab_size=V, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                   intermediate_size=64, max_position_embeddings=16, hidden_dropout_prob=0.0,
                                   attention_probs_dropout_prob=0.0, pad_token_id=0)


def test_hf_bert_masked_lm_with_tied_bias_alias_matches_eager() -> None:
    # cls.predictions.bias is the same Parameter as cls.predictions.decoder.bias, but the
    # forward only reads it under the second name: capture must hide the unread alias.
    model = transformers.BertForMaskedLM(tiny_bert_config())
    untouched = copy.deepcopy(model)
    engine, _ = check_parity(model, lm_batches())
    assert model.cls.predictions.bias is model.cls.predictions.decoder.bias
    assert model.cls.predictions.decoder.weight.data_ptr() == model.bert.embeddings.word_embeddings.weight.data_ptr()
    sd, ref_sd = engine.state_dict(), untouched.state_dict()
    assert list(sd) == list(ref_sd)
    assert list(dict(model.named_parameters(remove_duplicate=False))) == \
        list(dict(untouched.named_parameters(remove_duplicate=False))), "capture reordered the parameters"


class BertTokenTagger(nn.Module):
    """BERT with its pooler, trained with a per-token loss: the pooler gets no gradient."""

    def __init__(self) -> None:
        super().__init__()
        self.bert = transformers.BertModel(tiny_bert_config(), add_pooling_layer=True)
        self.tag = nn.Linear(32, 5)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        h = self.bert(input_ids=input_ids).last_hidden_state
        return F.cross_entropy(self.tag(h).flatten(0, 1), (labels % 5).flatten())


def test_bert_params_without_gradient_stay_unchanged() -> None:
    model = BertTokenTagger()
    pooler_before = copy.deepcopy(model.bert.pooler.state_dict())
    # weight decay would move a parameter whose gradient is zero rather than absent
    check_parity(model, lm_batches(), fxspeed.Config(weight_decay=0.1))
    for k, v in model.bert.pooler.state_dict().items():
        assert torch.equal(v, pooler_before[k]), f"pooler.{k} changed without a gradient"
    assert all(p.requires_grad for p in model.parameters()), "capture left a parameter frozen"


def test_hf_t5_for_conditional_generation_matches_eager() -> None:
    cfg = transformers.T5Config(vocab_size=V, d_model=32, d_kv=16, d_ff=64, num_layers=1, num_decoder_layers=1,
                                num_heads=2, dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0,
                                eos_token_id=1)
    model = transformers.T5ForConditionalGeneration(cfg)
    untouched = copy.deepcopy(model)
    engine, _ = check_parity(model, lm_batches())
    shared = model.shared.weight
    for w in (model.encoder.embed_tokens.weight, model.decoder.embed_tokens.weight, model.lm_head.weight):
        assert w.data_ptr() == shared.data_ptr()
    assert list(engine.state_dict()) == list(untouched.state_dict())


# --------------------------------------------------------------------------------------------
# Optimizers, clipping, schedules, accumulation (on the MLP: cheap to compile)
# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("config", [
    fxspeed.Config(optimizer="adamw", lr=1e-2, weight_decay=0.1, betas=(0.8, 0.99)),
    fxspeed.Config(optimizer="adam", lr=1e-2, weight_decay=0.01, eps=1e-6),
    fxspeed.Config(optimizer="sgd", lr=0.05, momentum=0.9, weight_decay=0.01),
], ids=["adamw", "adam", "sgd_momentum"])
def test_each_optimizer_matches_its_torch_optim_twin(config: fxspeed.Config) -> None:
    model = MLP()
    before = copy.deepcopy(model)
    check_parity(model, mlp_batches(), config, loss_fn=mse)
    assert any(not torch.equal(a, b) for a, b in zip(model.parameters(), before.parameters()))


def test_grad_clip_matches_clip_grad_norm() -> None:
    # lr and targets chosen so every step's gradient norm is well above the clip
    batches = [(torch.randn(8, 8), torch.randn(8, 4) * 50) for _ in range(STEPS)]
    config = fxspeed.Config(optimizer="sgd", lr=0.01, grad_clip=0.5)
    model = MLP()
    check_parity(model, batches, config, loss_fn=mse)
    unclipped = MLP()
    unclipped.load_state_dict(copy.deepcopy(model.state_dict()))
    clipped = copy.deepcopy(unclipped)
    eager_train(unclipped, batches[:1], fxspeed.Config(optimizer="sgd", lr=0.01), loss_fn=mse)
    eager_train(clipped, batches[:1], config, loss_fn=mse)
    assert any(not torch.allclose(a, b) for a, b in zip(unclipped.parameters(), clipped.parameters())), \
        "the clip was never active: the test would not detect a missing clip"


def test_linear_lr_schedule_with_warmup_matches_lambda_lr() -> None:
    config = fxspeed.Config(optimizer="sgd", lr=0.1, lr_schedule="linear", warmup_steps=2, total_steps=6)
    engine, _ = check_parity(MLP(), mlp_batches(), config, loss_fn=mse)
    # warmup 1/2, 2/2, then linear decay: after 5 steps the factor is 1 - (5-2)/(6-2)
    assert engine.optimizer.param_groups[0]["lr"] == pytest.approx(0.1 * (1 - 3 / 4))


def test_grad_accum_two_equals_one_full_batch_step() -> None:
    batches = mlp_batches(batch=8)
    model = MLP()
    ref = copy.deepcopy(model)
    ref_losses = eager_train(ref, batches, fxspeed.Config(lr=1e-2), loss_fn=mse)  # full batch, grad_accum=1
    engine = fxspeed.compile(model, 1, fxspeed.Config(lr=1e-2, grad_accum=2), example_inputs=batches[0], loss_fn=mse)
    losses = [engine.train_step(*b) for b in batches]
    for i, (a, b) in enumerate(zip(losses, ref_losses)):
        assert_close_rel(a, b, f"loss at step {i}")
    assert_models_match(model, ref)
    assert engine.stats["steps"] == STEPS


def test_grad_accum_with_indivisible_batch_raises_value_error_naming_grad_accum() -> None:
    model = MLP()
    engine = fxspeed.compile(model, 1, fxspeed.Config(grad_accum=3), example_inputs=mlp_batches(1)[0], loss_fn=mse)
    with pytest.raises(ValueError, match="grad_accum"):
        engine.train_step(torch.randn(8, 8), torch.randn(8, 4))


# --------------------------------------------------------------------------------------------
# Dropout: random ops draw from torch's global RNG in eager order
# --------------------------------------------------------------------------------------------

def test_compile_does_not_consume_the_global_rng() -> None:
    model = tiny_gpt(dropout=0.1)
    batch = gpt_batches(1)[0]
    state = torch.random.get_rng_state()
    fxspeed.compile(model, 1, example_inputs=batch)
    assert torch.equal(torch.random.get_rng_state(), state)


def test_dropout_gpt_matches_eager_under_the_same_seed() -> None:
    # dropout > 0 in nn.Dropout (embeddings, MLP) and in scaled_dot_product_attention
    model = tiny_gpt(dropout=0.2)
    batches = gpt_batches()
    ref = copy.deepcopy(model)
    torch.manual_seed(1234)
    ref_losses = eager_train(ref, batches, fxspeed.Config())
    torch.manual_seed(1234)
    engine = fxspeed.compile(model, 1, fxspeed.Config(), example_inputs=batches[0])
    losses = [engine.train_step(*b) for b in batches]
    for i, (a, b) in enumerate(zip(losses, ref_losses)):
        assert_close_rel(a, b, f"loss at step {i}")
    assert_models_match(model, ref)
    # and dropout really is active: at the same parameters, the eval loss (no dropout) differs
    eval_loss = engine.eval_step(*batches[0])
    assert engine.train_step(*batches[0]) != pytest.approx(eval_loss, rel=1e-4)


def test_dropout_with_p_1_draws_no_random_numbers_as_in_eager_so_later_dropouts_match() -> None:
    """ATen's dropout returns input * 0 for p = 1 without drawing; the trace's native_dropout drew
    a whole mask, so every later random op (here a p = 0.5 dropout, then the user's next
    torch.rand) saw other numbers than eager under the same seed."""

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b, self.c = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = F.dropout(self.a(x), 1.0, self.training) + F.dropout(self.b(x), 0.5, self.training)
            return self.c(h).pow(2).mean()

    torch.manual_seed(0)
    model = Net()
    ref, x = copy.deepcopy(model), torch.randn(4, 8)
    engine = fxspeed.compile(model, 1, fxspeed.Config(), example_inputs=(x,))
    torch.manual_seed(7)
    got, got_next = engine.train_step(x), torch.rand(3)
    torch.manual_seed(7)
    want, want_next = float(ref(x)), torch.rand(3)
    assert got == pytest.approx(want, rel=1e-6) and torch.equal(got_next, want_next)
