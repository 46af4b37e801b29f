"""What the user sees when a model cannot be captured or the configuration is wrong, and how
fxspeed handles a batch of a new shape."""

from __future__ import annotations

import copy
import inspect
import os

import pytest
import torch
import torch.nn as nn
from conftest import assert_close_rel, assert_models_match, eager_train

import fxspeed
from fxspeed.models import GPT, GPTConfig


class BranchOnData(nn.Module):
    """Python `if` on a tensor's value: cannot be one static graph."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        if h.sum() > 0:  # BRANCH-LINE
            h = h * 2
        return h.pow(2).mean()


class ItemInForward(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = self.lin.weight.abs().max().item()  # ITEM-LINE
        return (self.lin(x) / scale).mean()


class NoLoss(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x)


def _line_of(cls: type, marker: str) -> int:
    lines, start = inspect.getsourcelines(cls)
    return start + next(i for i, line in enumerate(lines) if marker in line)


# --------------------------------------------------------------------------------------------
# Capture errors
# --------------------------------------------------------------------------------------------

def test_data_dependent_if_raises_capture_error_naming_source_line_and_op() -> None:
    with pytest.raises(fxspeed.CaptureError) as info:
        fxspeed.compile(BranchOnData(), 1, example_inputs=(torch.randn(2, 4),))
    msg = str(info.value)
    where = f"{os.path.abspath(__file__)}:{_line_of(BranchOnData, 'BRANCH-LINE')}"
    assert where in msg
    assert "_local_scalar_dense" in msg
    assert "if h.sum() > 0" in msg  # the offending source line is quoted
    assert "How to fix" in msg and "torch.where" in msg
    assert info.value.source == where
    assert "_local_scalar_dense" in info.value.op


def test_item_call_in_forward_raises_capture_error_naming_its_line() -> None:
    with pytest.raises(fxspeed.CaptureError) as info:
        fxspeed.compile(ItemInForward(), 1, example_inputs=(torch.randn(2, 4),))
    assert f"{os.path.basename(__file__)}:{_line_of(ItemInForward, 'ITEM-LINE')}" in str(info.value)
    assert ".item()" in str(info.value)


class _Regression(nn.Linear):
    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return nn.functional.mse_loss(super().forward(x), y)


def test_an_empty_batch_is_told_to_be_empty_not_to_rewrite_the_loss_line(recwarn: pytest.WarningsRecorder) -> None:
    """mse_loss's backward divides by the batch's numel: the capture failed with "float division
    by zero ... rewrite that line", naming the user's loss line."""
    x, y = torch.randn(4, 4), torch.randn(4, 4)
    engine = fxspeed.compile(_Regression(4, 4), 1, example_inputs=(x, y))
    with pytest.raises(fxspeed.CaptureError, match=r"the batch holds empty tensors \(batch value 0: \(0, 4\), 1: "
                                                   r"\(0, 4\)\); an empty batch has no loss to train on"):
        engine.train_step(x[:0], y[:0])
    # torch's anomaly-mode traceback ("Error detected in MseLossBackward0") is not printed beside it
    assert not [w for w in recwarn if "Error detected in" in str(w.message)]


def test_a_batch_tensor_that_requires_grad_is_warned_to_get_no_grad(caplog: pytest.LogCaptureFixture) -> None:
    """Eager backward fills x.grad; the compiled step differentiates the parameters only."""
    model = nn.Sequential(nn.Linear(4, 4))
    x = torch.randn(4, 4, requires_grad=True)
    engine = fxspeed.compile(model, 1, example_inputs=(x,), loss_fn=lambda out, x: out.square().mean())
    with caplog.at_level("WARNING", logger="fxspeed"):
        engine.train_step(x)
    assert x.grad is None
    assert "batch value(s) [0] require grad; train_step computes the parameters' gradients only" in caplog.text


def test_labels_of_the_wrong_batch_size_are_told_to_check_the_shapes_not_to_rewrite_the_line() -> None:
    """cross_entropy's "Expected input batch_size (4) to match target batch_size (32)" (per-token
    labels given to a classifier) was not read as a shape error: its capital E."""
    class Classifier(nn.Linear):
        def forward(self, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
            return nn.functional.cross_entropy(super().forward(x), labels.view(-1))

    with pytest.raises(fxspeed.CaptureError) as info:
        fxspeed.compile(Classifier(8, 3), 1, example_inputs=(torch.randn(4, 8), torch.randint(0, 3, (4, 8))))
    msg = str(info.value)
    assert "Expected input batch_size (4) to match target batch_size (32). How to fix: the model raises this for " \
           "the example's shapes" in msg and "unsupported construct" not in msg


def test_a_loss_fn_that_does_not_take_a_keyword_batch_is_told_how_it_is_called() -> None:
    model = GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=1, n_head=2, n_embd=32))
    x = torch.randint(0, 64, (2, 16))
    with pytest.raises(fxspeed.CaptureError) as info:
        fxspeed.compile(model, 1, example_inputs={"idx": x}, loss_fn=lambda out, *batch: out.float().mean())
    msg = str(info.value)
    assert "loss_fn <lambda> is called as loss_fn(output, *args, **kwargs) with the whole batch, here the output and " \
           "0 positional arguments and keywords idx, and it does not accept that (got an unexpected keyword " \
           "argument 'idx')" in msg and "unsupported construct" not in msg


def test_a_batch_dict_given_as_one_positional_argument_is_told_to_be_unpacked_as_keywords() -> None:
    """train_step(batch) with a Hugging Face style dict: forward's first parameter got the whole
    dict and failed inside the model (ViT: "'dict' object has no attribute 'dtype'" at a
    transformers line, with "rewrite that line" as the fix)."""
    class KeywordBatch(nn.Linear):
        def forward(self, pixel_values: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:  # type: ignore[override]
            return nn.functional.cross_entropy(super().forward(pixel_values.flatten(1)), labels)

    batch = {"pixel_values": torch.randn(4, 8), "labels": torch.randint(0, 3, (4,))}
    engine = fxspeed.compile(KeywordBatch(8, 3), 1, example_inputs=batch)
    for call in (lambda: engine.train_step(batch), lambda: engine.eval_step(batch),
                 lambda: fxspeed.compile(KeywordBatch(8, 3), 1, example_inputs=(batch,))):
        with pytest.raises(fxspeed.CaptureError) as info:
            call()
        msg = str(info.value)
        assert "KeywordBatch.forward's `pixel_values` received the whole batch dict (keys pixel_values, labels)" in msg
        assert "engine.train_step(**batch)" in msg and "unsupported construct" not in msg
    assert engine.train_step(**batch) > 0


def test_a_float64_batch_into_float32_weights_is_refused_at_capture_as_eager_refuses_it() -> None:
    """Fake tensors' addmm does not check dtypes: the step traced, then failed when it ran (on
    several ranks as "the ranks are out of step", though every rank failed alike)."""
    x, y = torch.randn(4, 4), torch.randn(4, 4)
    engine = fxspeed.compile(_Regression(4, 4), 1, example_inputs=(x, y))
    with pytest.raises(fxspeed.CaptureError, match=r"a matrix multiply \(aten.addmm.default\) of float32 and "
                                                   r"float64 tensors; eager PyTorch refuses it too"):
        engine.train_step(x.double(), y.double())
    engine.train_step(x, y)  # the engine goes on


def test_a_model_whose_width_does_not_split_into_its_heads_is_told_to_check_its_shapes_not_to_rewrite_the_line() -> None:
    """64 wide with 12 heads: the view in attention fails eagerly too; that is a config error,
    not a construct fxspeed cannot trace."""
    model = GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=1, n_head=12, n_embd=64))
    x = torch.randint(0, 64, (2, 16))
    with pytest.raises(fxspeed.CaptureError) as info:
        fxspeed.compile(model, 1, example_inputs=(x, x))
    msg = str(info.value)
    assert "is invalid for input of size" in msg and "gpt.py" in msg
    assert "check the example inputs' shapes and the model's config" in msg and "unsupported construct" not in msg


@pytest.mark.skipif(torch.__version__ < "2.13", reason="torch 2.11's fake embedding takes float ids: the first "
                    "step then fails with torch's own dtype error instead")
def test_float_token_ids_are_told_to_be_int64_not_to_rewrite_the_line_and_torch_logs_no_traceback(
        capfd: pytest.CaptureFixture) -> None:
    """Float ids into an embedding (and float class labels into cross_entropy's gather) fail
    eagerly too: a dtype mistake in the example, said as one, without FakeTensor's logged
    traceback before the error."""
    model = GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=1, n_head=2, n_embd=32))
    ids = torch.randint(0, 64, (2, 16))
    for x, y in ((ids.float(), ids), (ids, ids.float())):
        with pytest.raises(fxspeed.CaptureError) as info:
            fxspeed.compile(model, 1, example_inputs=(x, y))
        msg = str(info.value)
        assert "must be int64 (torch.long)" in msg and "unsupported construct" not in msg, msg
    assert "Traceback" not in capfd.readouterr().err


def test_capture_error_is_an_fxspeed_error_not_a_value_error() -> None:
    with pytest.raises(fxspeed.FxspeedError):
        fxspeed.compile(BranchOnData(), 1, example_inputs=(torch.randn(2, 4),))
    assert not issubclass(fxspeed.CaptureError, ValueError)


def test_model_without_loss_and_no_loss_fn_says_to_pass_loss_fn() -> None:
    with pytest.raises(fxspeed.CaptureError, match="loss_fn") as info:
        fxspeed.compile(NoLoss(), 1, example_inputs=(torch.randn(2, 4),))
    assert "(2, 3)" in str(info.value)  # the output's shape, not an internal tensor type
    assert "FunctionalTensor" not in str(info.value) and "FakeTensor" not in str(info.value)


def test_hf_style_output_without_loss_says_to_pass_labels_or_loss_fn() -> None:
    class DictOut(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 3)

        def forward(self, x: torch.Tensor) -> dict:
            return {"logits": self.lin(x), "loss": None}

    with pytest.raises(fxspeed.CaptureError, match="loss_fn") as info:
        fxspeed.compile(DictOut(), 1, example_inputs={"x": torch.randn(2, 4)})
    assert "labels" in str(info.value)


def test_loss_fn_returning_a_non_scalar_asks_to_reduce_it() -> None:
    with pytest.raises(fxspeed.CaptureError, match=r"scalar.*\(2, 3\).*mean") as info:
        fxspeed.compile(NoLoss(), 1, example_inputs=(torch.randn(2, 4),), loss_fn=lambda out, x: out * 2)
    assert "FunctionalTensor" not in str(info.value)


def test_failed_capture_leaves_the_model_untouched() -> None:
    model = BranchOnData()
    before = copy.deepcopy(model.state_dict())
    model.eval()
    with pytest.raises(fxspeed.CaptureError):
        fxspeed.compile(model, 1, example_inputs=(torch.randn(2, 4),))
    assert not model.training
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert all(p.requires_grad for p in model.parameters())


# --------------------------------------------------------------------------------------------
# Config and devices
# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize(("make", "key", "accepted"), [
    (lambda: fxspeed.Config(optimizer="lamb"), "optimizer", ["adamw", "adam", "sgd"]),
    (lambda: fxspeed.Config(lr=-1), "lr", [">= 0"]),
    (lambda: fxspeed.Config(zero=7), "zero", ["0", "1", "2", "3"]),
    (lambda: fxspeed.Config.from_dict({"lr_rate": 1}), "lr_rate", ["lr", "optimizer", "weight_decay"]),
    (lambda: fxspeed.Config(grad_accum=0), "grad_accum", [">= 1"]),
    (lambda: fxspeed.Config(lr_schedule="linear"), "total_steps", ["lr_schedule"]),
], ids=["optimizer_lamb", "negative_lr", "zero_7", "unknown_key_lr_rate", "grad_accum_0", "schedule_without_total"])
def test_bad_config_value_raises_value_error_naming_key_and_accepted_values(make, key: str, accepted: list[str]) -> None:
    with pytest.raises(ValueError) as info:
        make()
    msg = str(info.value)
    assert key in msg
    for a in accepted:
        assert a in msg, f"{a!r} missing from {msg!r}"
    assert isinstance(info.value, fxspeed.ConfigError)


@pytest.mark.parametrize("devices", [0, -1, "TPU-v9", [1, 2], True, []], ids=repr)
def test_bad_devices_raise_value_error_naming_devices(devices) -> None:
    with pytest.raises(ValueError, match="devices") as info:
        fxspeed.compile(NoLoss(), devices, example_inputs=(torch.randn(2, 4),), loss_fn=lambda out, x: out.mean())
    assert "H100-80GB" in str(info.value) or "accepted" in str(info.value)


# --------------------------------------------------------------------------------------------
# A batch of a new shape
# --------------------------------------------------------------------------------------------

def test_new_batch_shape_is_retraced_once_then_cached_and_matches_eager() -> None:
    model = GPT(GPTConfig(vocab_size=32, block_size=16, n_layer=1, n_head=2, n_embd=16))
    ref = copy.deepcopy(model)
    short = (torch.randint(0, 32, (2, 8)), torch.randint(0, 32, (2, 8)))
    long = (torch.randint(0, 32, (3, 12)), torch.randint(0, 32, (3, 12)))
    long2 = (torch.randint(0, 32, (3, 12)), torch.randint(0, 32, (3, 12)))
    batches = [short, long, long2, short]
    engine = fxspeed.compile(model, 1, example_inputs=short)
    assert engine.stats["compiles"] == 1
    ref_losses = eager_train(ref, batches, fxspeed.Config())
    compiles = []
    losses = []
    for b in batches:
        losses.append(engine.train_step(*b))
        compiles.append(engine.stats["compiles"])
    assert compiles == [1, 2, 2, 2]
    for i, (a, b) in enumerate(zip(losses, ref_losses)):
        assert_close_rel(a, b, f"loss at step {i}")
    assert_models_match(model, ref)


class Scaled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor, scale: float) -> torch.Tensor:
        return (self.lin(x) * scale).pow(2).mean()


def test_non_tensor_argument_with_a_new_value_is_retraced_and_baked_in() -> None:
    model = Scaled()
    ref = copy.deepcopy(model)
    x = torch.randn(2, 4)
    batches = [(x, 1.0), (x, 3.0), (x, 3.0), (x, 1.0)]
    engine = fxspeed.compile(model, 1, fxspeed.Config(optimizer="sgd", lr=0.1), example_inputs=batches[0])
    ref_losses = eager_train(ref, batches, fxspeed.Config(optimizer="sgd", lr=0.1))
    losses = [engine.train_step(*b) for b in batches]
    assert engine.stats["compiles"] == 2
    for i, (a, b) in enumerate(zip(losses, ref_losses)):
        assert_close_rel(a, b, f"loss at step {i}")
    assert_models_match(model, ref)


def test_an_in_place_write_of_a_tensor_backward_needs_says_so_instead_of_autograds_good_luck() -> None:
    class Doubles(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.a(x)
            x.mul_(2.0)  # x was saved for a's weight gradient
            return (h + self.a(x)).pow(2).mean()

    with pytest.raises(fxspeed.CaptureError) as info:
        fxspeed.compile(Doubles(), 1, fxspeed.Config(), example_inputs=(torch.randn(3, 4),))
    msg = str(info.value)
    assert "in-place operation in forward" in msg and "out-of-place" in msg and "Good luck" not in msg


def test_an_eval_step_whose_forward_writes_a_parameter_in_place_is_refused_naming_it() -> None:
    """Hugging Face RWKV rescales its weights in place in eval mode: eval_step failed with a bare
    KeyError from the step signature (the trace's parameter writes taken for gradients)."""
    class RescalesInEval(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(8, 1)

        def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            if not self.training:
                with torch.no_grad():
                    self.a.weight.div_(2.0)
            return nn.functional.mse_loss(self.a(x).squeeze(-1), y)

    x, y = torch.randn(4, 8), torch.randn(4)
    engine = fxspeed.compile(RescalesInEval(), example_inputs=(x, y))
    engine.train_step(x, y)
    with pytest.raises(fxspeed.CaptureError, match=r"eval step of RescalesInEval: forward modifies the parameter `a.weight`"):
        engine.eval_step(x, y)


def test_fxspeeds_own_error_raised_inside_the_trace_keeps_its_own_fix_not_rewrite_that_line():
    # (h49: a model whose parameters another engine holds, traced again, ended its message with
    # "How to fix: rewrite that line without the unsupported construct")
    from fxspeed.compiler.capture import _capture_error

    said = "Net was called directly, but fxspeed's engine holds its parameters as slices; use engine.gathered()"
    try:
        try:
            raise fxspeed.FxspeedError(said)
        except fxspeed.FxspeedError as inner:
            raise RuntimeError("while tracing") from inner
    except RuntimeError as e:
        err = _capture_error(nn.Linear(2, 2), e)
    assert said in str(err) and "rewrite that line" not in str(err) and "How to fix" not in str(err)


def test_a_retrace_of_t5_succeeds_where_the_released_module_guard_is_keyed_on_the_tied_alias_the_trace_hides() -> None:
    """The guard on a module whose weights the engine holds (ZeRO-3 shards, tensor-parallel
    slices: multi-rank) reads the guarded Parameter by its owner and name at call time; a train
    capture hides T5's tied alias `shared.weight`, so a retrace (a new batch shape) raised
    CaptureError "'weight'" (a KeyError in the hook) under tensor=2. Installed here on one process
    with the hidden alias as its key."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = transformers.T5ForConditionalGeneration(transformers.T5Config(
        vocab_size=32, d_model=16, d_kv=4, d_ff=32, num_layers=1, num_heads=2, dropout_rate=0.0))
    x = torch.randint(0, 32, (2, 8))
    engine = fxspeed.compile(model, 1, example_inputs={"input_ids": x, "labels": x, "decoder_input_ids": x})
    engine._guard_released_module([model.shared.weight], "as slices", "", partial=lambda t: t.shape[0] != 32)
    short = x[:, :4].contiguous()
    assert torch.isfinite(torch.tensor(engine.train_step(input_ids=short, labels=short, decoder_input_ids=short)))
