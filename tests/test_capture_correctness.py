"""Capture correctness (issue 12, items 1, 3, 7, 9, 15): what a graph is traced on must not
change what a later batch computes, a loss is only what is clearly a loss, and capture
failures that are torch's limitations or user mistakes say so, naming module, parameter, line."""

from __future__ import annotations

import copy
import inspect
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from conftest import assert_close_rel, check_parity, eager_train
from hypothesis import given, settings
from hypothesis import strategies as st

import fxspeed
from fxspeed.errors import CaptureError
from fxspeed.ir.batch import batch_digest, input_key, tensor_leaves
from fxspeed.models import GPT, GPTConfig

CFG = fxspeed.Config(lr=0.05)


class TwoInputs(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return ((self.lin(a) - b) ** 2).mean()


def _tiny_gpt() -> GPT:
    return GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=1, n_head=2, n_embd=16, dropout=0.0))


def _line_of(obj: object, marker: str) -> int:
    lines, start = inspect.getsourcelines(obj)
    return start + next(i for i, line in enumerate(lines) if marker in line)


# --------------------------------------------------------------------------------------------
# Item 1: aliasing in the example batch is not baked into the graph
# --------------------------------------------------------------------------------------------

def test_aliased_example_inputs_are_traced_as_separate_inputs() -> None:
    x = torch.randn(3, 4)
    batches = [(x, x), (torch.randn(3, 4), torch.randn(3, 4)), (torch.randn(3, 4), torch.randn(3, 4))]
    engine, _ = check_parity(TwoInputs(), batches, CFG)
    assert engine.stats["compiles"] == 1  # aliasing is not part of the key: one trace serves both


def test_an_aliased_example_dict_like_hugging_face_labels_is_traced_as_separate_inputs() -> None:
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(vocab_size=64, n_positions=16, n_embd=16, n_layer=1, n_head=2,
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    model = transformers.GPT2LMHeadModel(cfg)
    ids = torch.randint(0, 64, (2, 8))
    labels = torch.randint(0, 64, (2, 8))
    labels[:, :3] = -100  # would index out of range if `labels` were read from `input_ids`
    batches = [dict(input_ids=ids, labels=ids), dict(input_ids=torch.randint(0, 64, (2, 8)), labels=labels)]
    check_parity(model, batches, CFG)


class _OptionalMask(nn.Module):
    """forward(x, mask=None, y=None), as Hugging Face's optional inputs."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None, y: torch.Tensor | None = None) -> torch.Tensor:
        h = self.lin(x) if mask is None else self.lin(x) * mask
        return ((h - y) ** 2).mean()


def test_a_batch_value_that_is_none_is_passed_as_none_between_tensors() -> None:
    """`token_type_ids=None` in a dict batch (or None between positional tensors): capture failed
    with a bare StopIteration, None being its marker of a tensor leaf."""
    batches = [(torch.randn(3, 4), None, torch.randn(3, 4)) for _ in range(2)]
    check_parity(_OptionalMask(), batches, CFG)
    batches = [dict(x=torch.randn(3, 4), mask=None, y=torch.randn(3, 4)) for _ in range(2)]
    check_parity(_OptionalMask(), batches, CFG)


def test_inputs_that_are_views_of_one_tensor_are_traced_as_separate_inputs() -> None:
    d = torch.randint(0, 64, (2, 9))
    e, f = torch.randint(0, 64, (2, 9)), torch.randint(0, 64, (2, 9))
    batches = [(d[:, :-1], d[:, 1:]), (e[:, :-1], e[:, 1:]), (f[:, 1:].contiguous(), f[:, :-1].contiguous())]
    engine, _ = check_parity(_tiny_gpt(), batches, CFG)
    assert engine.stats["compiles"] == 1


def test_the_traced_batch_shares_no_storage_with_the_example() -> None:
    from fxspeed.compiler.capture import capture_step

    x = torch.randn(3, 4)
    cap = capture_step(TwoInputs(), (x, x), {})
    assert sum(s.kind == "input" for s in cap.signature.inputs) == 2
    # both inputs are read by the graph (neither is a duplicate of the other)
    placeholders = [n for n in cap.gm.graph.nodes if n.op == "placeholder"]
    users = [len(p.users) for p, s in zip(placeholders, cap.signature.inputs) if s.kind == "input"]
    assert all(u > 0 for u in users)


# --------------------------------------------------------------------------------------------
# Item 7: layout (strides, memory format) of a batch vs the traced graph
# --------------------------------------------------------------------------------------------

def test_a_graph_traced_on_contiguous_inputs_runs_sliced_lm_batches() -> None:
    d = torch.randint(0, 64, (2, 9))
    e = torch.randint(0, 64, (2, 9))
    batches = [(d[:, :-1].contiguous(), d[:, 1:].contiguous()), (d[:, :-1], d[:, 1:]), (e[:, :-1], e[:, 1:])]
    engine, ref = check_parity(_tiny_gpt(), batches, CFG)
    assert engine.stats["compiles"] == 1
    with torch.no_grad():
        ref.eval()
        assert_close_rel(engine.eval_step(e[:, :-1], e[:, 1:]), ref(e[:, :-1], e[:, 1:]), "eval loss")


def test_a_transposed_input_is_fed_as_the_contiguous_layout_it_was_traced_with() -> None:
    class Flat(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(6, 3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.lin(x.view(x.shape[0], -1)).pow(2).mean()  # view: needs the traced strides

    batches = [(torch.randn(4, 2, 3),), (torch.randn(4, 3, 2).transpose(1, 2),),
               (torch.randn(2, 3, 4).permute(2, 0, 1),)]
    ref = Flat()
    m = copy.deepcopy(ref)
    # eager needs contiguous inputs for .view; fxspeed makes them so (the traced layout)
    eager = eager_train(ref, [tuple(t.contiguous() for t in b) for b in batches], CFG)
    engine = fxspeed.compile(m, 1, CFG, example_inputs=batches[0])
    for i, b in enumerate(batches):
        assert_close_rel(engine.train_step(*b), eager[i], f"loss at step {i}")
    assert engine.stats["compiles"] == 1


def test_tensor_leaves_copy_only_inputs_not_in_the_traced_layout() -> None:
    x = torch.randn(2, 3, 4, 5)
    cl = x.to(memory_format=torch.channels_last)
    sliced = torch.randn(2, 9)[:, 1:]
    out = tensor_leaves((x, cl, sliced), {})
    assert out[0] is x and out[1] is cl  # already dense in their format: no copy
    assert out[2].is_contiguous() and torch.equal(out[2], sliced)
    assert input_key((x,), {}) != input_key((cl,), {})  # the memory format is part of the key
    assert input_key((sliced,), {}) == input_key((sliced.contiguous(),), {})  # strides are not


class ConvHead(nn.Module):
    """A frozen conv (its input's memory format flows through it) and a trainable head."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.conv.weight.requires_grad_(False)  # weight gradient layout is issue 12 item 2, not this test
        self.head = nn.Linear(4 * 5 * 5, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.conv(x))
        return self.head(h.reshape(h.shape[0], -1)).pow(2).mean()


@pytest.mark.parametrize("example_format", ["contiguous", "channels_last"])
def test_channels_last_and_contiguous_inputs_both_give_eager_results(example_format: str) -> None:
    def fmt(t: torch.Tensor, name: str) -> torch.Tensor:
        return t.contiguous(memory_format=torch.channels_last if name == "channels_last" else torch.contiguous_format)

    xs = [torch.randn(2, 3, 5, 5) for _ in range(4)]
    other = "contiguous" if example_format == "channels_last" else "channels_last"
    batches = [(fmt(xs[0], example_format),), (fmt(xs[1], other),), (fmt(xs[2], example_format),),
               (fmt(torch.randn(2, 3, 7, 5), other)[:, :, 1:6],)]  # a non-dense slice
    check_parity(ConvHead(), batches, CFG)


class MHA(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.att = nn.MultiheadAttention(16, 2, batch_first=True)
        self.out = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h, _ = self.att(x, x, x)
        return ((self.out(h) - y) ** 2).mean()


def test_multihead_attention_batch_first_matches_eager_on_sliced_and_resized_batches() -> None:
    d = torch.randn(3, 7, 16)
    y = torch.randn(3, 6, 4)
    batches = [(d[:, :-1].contiguous(), y), (d[:, :-1], y), (d[:, 1:], y), (d[:2, 1:], y[:2]),
               (d.transpose(0, 1).contiguous().transpose(0, 1)[:, 1:], y), (torch.randn(1, 6, 16), y[:1])]
    engine, ref = check_parity(MHA(), batches, CFG)
    with torch.no_grad():
        ref.eval()
        assert_close_rel(engine.eval_step(d[:, 1:], y), ref(d[:, 1:], y), "eval loss")
        assert_close_rel(engine.eval_step(d[:2, :-1], y[:2]), ref(d[:2, :-1], y[:2]), "eval loss, batch 2")


class MHALanguageModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(50, 16)
        self.att = nn.MultiheadAttention(16, 2, batch_first=True)
        self.out = nn.Linear(16, 50)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx)
        T = idx.shape[1]
        mask = torch.triu(torch.ones(T, T, dtype=torch.bool, device=idx.device), 1)
        h, _ = self.att(x, x, x, attn_mask=mask)
        return F.cross_entropy(self.out(h).reshape(-1, 50), targets.reshape(-1))


def test_multihead_attention_lm_compiled_on_contiguous_batches_trains_on_shifted_views() -> None:
    d = torch.randint(0, 50, (4, 9))
    e = torch.randint(0, 50, (4, 9))
    batches = [(d[:, :-1].contiguous(), d[:, 1:].contiguous()), (d[:, :-1], d[:, 1:]), (e[:2, :-1], e[:2, 1:])]
    engine, ref = check_parity(MHALanguageModel(), batches, CFG)
    with torch.no_grad():
        ref.eval()
        assert_close_rel(engine.eval_step(e[:, :-1], e[:, 1:]), ref(e[:, :-1], e[:, 1:]), "eval loss")


# --------------------------------------------------------------------------------------------
# Item 3: what is a loss
# --------------------------------------------------------------------------------------------

def test_a_one_element_prediction_is_not_taken_for_the_loss() -> None:
    with pytest.raises(CaptureError) as err:
        fxspeed.compile(nn.Linear(4, 1), 1, CFG, example_inputs=(torch.randn(1, 4),))
    msg = str(err.value)
    assert "(1, 1)" in msg and "0-dim" in msg and "loss_fn" in msg and ".mean()" in msg


class FirstOfTuple(nn.Module):
    def __init__(self, first_shape: tuple[int, ...]) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 1)
        self.first_shape = first_shape

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        pred = self.lin(x)
        return pred.pow(2).mean().reshape(self.first_shape), pred


def test_a_first_tuple_element_of_shape_one_is_not_taken_for_the_loss() -> None:
    with pytest.raises(CaptureError, match=r"first element has shape \(1,\)"):
        fxspeed.compile(FirstOfTuple((1,)), 1, CFG, example_inputs=(torch.randn(1, 4),))


def test_a_zero_dim_first_tuple_element_and_a_named_loss_fn_are_losses() -> None:
    batches = [(torch.randn(1, 4),), (torch.randn(1, 4),)]
    check_parity(FirstOfTuple(()), batches, CFG)
    # loss_fn is the user's word: a one-element loss of any shape is accepted
    check_parity(nn.Linear(4, 1), batches, CFG, loss_fn=lambda out, x: out.pow(2).mean().reshape(1, 1))


# --------------------------------------------------------------------------------------------
# Item 9: RNN modules
# --------------------------------------------------------------------------------------------

class WithRNN(nn.Module):
    def __init__(self, rnn: nn.RNNBase, initial_state: bool = False) -> None:
        super().__init__()
        self.rnn = rnn
        self.initial_state = initial_state

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.initial_state:
            r = self.rnn
            n = r.num_layers * (2 if r.bidirectional else 1)
            b = x.shape[0] if r.batch_first else x.shape[1]
            h = torch.full((n, b, r.proj_size or r.hidden_size), 0.1)
            out, state = r(x, (h, torch.full((n, b, r.hidden_size), 0.2)) if isinstance(r, nn.LSTM) else h)
        else:
            out, state = self.rnn(x)
        state = state if isinstance(state, tuple) else (state,)
        return out.pow(2).mean() + sum(s.pow(2).mean() for s in state)


@pytest.mark.parametrize("case", [
    "lstm", "lstm_2_layers_bidirectional_proj", "lstm_initial_state", "lstm_unbatched",
    "gru_2_layers_bidirectional", "gru_no_bias_initial_state", "rnn_relu_2_layers"])
def test_rnn_modules_train_as_in_eager(case: str) -> None:
    rnn, shape, init = {
        "lstm": (nn.LSTM(4, 8, batch_first=True), (2, 5, 4), False),
        "lstm_2_layers_bidirectional_proj": (nn.LSTM(4, 8, num_layers=2, bidirectional=True, proj_size=3),
                                             (5, 2, 4), False),
        "lstm_initial_state": (nn.LSTM(4, 8, num_layers=2, batch_first=True), (2, 5, 4), True),
        "lstm_unbatched": (nn.LSTM(4, 8), (5, 4), False),
        "gru_2_layers_bidirectional": (nn.GRU(4, 8, num_layers=2, bidirectional=True, batch_first=True),
                                       (2, 5, 4), False),
        "gru_no_bias_initial_state": (nn.GRU(4, 8, bias=False), (5, 2, 4), True),
        "rnn_relu_2_layers": (nn.RNN(4, 8, nonlinearity="relu", num_layers=2), (5, 2, 4), False),
    }[case]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # eager's "RNN weights are not part of a single contiguous chunk"
        engine, ref = check_parity(WithRNN(rnn, init), [(torch.randn(*shape),) for _ in range(3)], CFG)
        if case == "lstm":  # torch cannot export this one's backward: it is unrolled over time steps
            from fxspeed.compiler.capture import capture_step

            gm = capture_step(WithRNN(nn.LSTM(4, 8, batch_first=True)), (torch.randn(*shape),), {}).gm
            assert not any("lstm" in str(n.target) for n in gm.graph.nodes)
        x = torch.randn(*shape)
        with torch.no_grad():
            ref.eval()
            assert_close_rel(engine.eval_step(x), ref(x), "eval loss")


class WithLSTM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lstm = nn.LSTM(4, 8, num_layers=2, dropout=0.1, batch_first=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lstm(x)[0].mean()


def test_an_rnn_that_cannot_be_captured_is_named_with_the_way_out() -> None:
    with pytest.raises(CaptureError) as err:
        fxspeed.compile(WithLSTM(), 1, CFG, example_inputs=(torch.randn(2, 3, 4),))
    msg = str(err.value)
    assert "`lstm` (LSTM)" in msg and "dropout" in msg and "nn.LSTMCell" in msg
    assert "rewrite that line" not in msg


# --------------------------------------------------------------------------------------------
# Item 15: errors say what the user did
# --------------------------------------------------------------------------------------------

def test_a_model_without_trainable_parameters_gets_a_no_trainable_parameters_error() -> None:
    model = nn.Sequential(nn.Linear(4, 4))
    model.requires_grad_(False)
    with pytest.raises(CaptureError) as err:
        fxspeed.compile(model, 1, CFG, example_inputs=(torch.randn(2, 4),), loss_fn=lambda out, x: out.mean())
    msg = str(err.value)
    assert "Sequential has no trainable parameters" in msg and "requires_grad is False" in msg
    assert "rewrite that line" not in msg


class IntegerLoss(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.l(x) > 0).sum()


def test_an_integer_loss_is_reported_as_an_integer_loss() -> None:
    with pytest.raises(CaptureError) as err:
        fxspeed.compile(IntegerLoss(), 1, CFG, example_inputs=(torch.randn(2, 4),))
    msg = str(err.value)
    assert "integer tensor (torch.int64)" in msg and "does not depend on any trainable parameter" in msg
    assert "rewrite that line" not in msg


class LossOfBatchOnly(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.l(x).detach().mean() + x.mean()


def test_a_loss_that_does_not_depend_on_parameters_says_so() -> None:
    with pytest.raises(CaptureError) as err:
        fxspeed.compile(LossOfBatchOnly(), 1, CFG, example_inputs=(torch.randn(2, 4),))
    msg = str(err.value)
    assert "does not depend on any trainable parameter" in msg and "rewrite that line" not in msg


class MutatesWeight(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.l.weight.data.mul_(1.0)  # MUTATION-LINE
        return self.l(x).mean()


def test_an_in_place_parameter_mutation_names_the_parameter_and_the_line() -> None:
    with pytest.raises(CaptureError) as err:
        fxspeed.compile(MutatesWeight(), 1, CFG, example_inputs=(torch.randn(2, 4),))
    msg = str(err.value)
    assert "`l.weight`" in msg and "in place" in msg
    assert err.value.source == f"{__file__}:{_line_of(MutatesWeight, 'MUTATION-LINE')}"
    assert "MUTATION-LINE" in msg


class Plain(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l = nn.Linear(4, 4)
        self.m = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.m(torch.tanh(self.l(x))).pow(2).mean()


@pytest.mark.parametrize("where", ["model", "submodule"])
def test_a_torch_compiled_model_is_compiled_as_its_original_module(where: str) -> None:
    ref = Plain()
    inner = copy.deepcopy(ref)
    if where == "model":
        model = torch.compile(inner)
    else:
        inner.l = torch.compile(inner.l)
        model = inner
    batches = [(torch.randn(2, 4),), (torch.randn(2, 4),)]
    eager = eager_train(ref, batches, CFG)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        engine = fxspeed.compile(model, 1, CFG, example_inputs=batches[0])
    assert any("fxspeed compiles the original module" in str(w.message) for w in caught)
    for i, b in enumerate(batches):
        assert_close_rel(engine.train_step(*b), eager[i], f"loss at step {i}")
    params = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        assert_close_rel(p, params[name.replace("_orig_mod.", "")], name)


@given(st.sampled_from([torch.int64, torch.int32, torch.float32, torch.bfloat16, torch.float16, torch.bool]),
       st.integers(2, 6), st.integers(1, 9), st.booleans())
@settings(max_examples=40, deadline=None)
def test_the_batch_digest_sees_contents_not_layout(dtype: torch.dtype, rows: int, cols: int, transposed: bool) -> None:
    """What the per-step replica check compares: the same values in another layout digest alike,
    other rows (another rank's slice) or one changed element do not."""
    g = torch.Generator().manual_seed(rows * 10 + cols)
    x = (torch.randn(rows, cols, generator=g) * 50).to(dtype)
    y = x.t().contiguous().t() if transposed else x.clone()
    assert batch_digest((x,), {"mask": x > 0}) == batch_digest((y,), {"mask": y > 0})
    changed, at = x.clone(), (rows * cols) // 2
    old = x.view(-1)[at]
    # (2x + 1 and not x + 1 for floats: a large bf16 x + 1 can round back to x)
    changed.view(-1)[at] = ~old if dtype == torch.bool else old * 2 + 1 if dtype.is_floating_point else old + 1
    assert batch_digest((changed,), {"mask": x > 0}) != batch_digest((x,), {"mask": x > 0})
    if not torch.equal(x[1:], x[:-1]):
        assert batch_digest((x[1:],), {}) != batch_digest((x[:-1],), {})


class _HeldSettings(nn.Module):
    """Reads its temperature through a held config object and a held dict, as Hugging Face models
    read `self.config.X`."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.config = type("Cfg", (), {})()
        self.config.temp = 1.0
        self.opts = {"scale": 1.0}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.lin(x) / self.config.temp * self.opts["scale"]).square().mean()


def test_a_setting_changed_in_a_held_config_object_or_dict_retraces_as_eager_reads_it() -> None:
    """It kept training with the traced value (a helper: Gemma2's config.final_logit_softcapping
    changed after two steps was ignored)."""
    torch.manual_seed(0)
    model = _HeldSettings()
    ref = copy.deepcopy(model)
    x = torch.randn(3, 4)
    engine = fxspeed.compile(model, 1, fxspeed.Config(lr=0.0), example_inputs=(x,))
    def replace_config(m: nn.Module) -> None:  # a new object of another value: nothing else changed
        m.config = type("Cfg", (), {})()
        m.config.temp = 0.25

    for change in (lambda m: setattr(m.config, "temp", 0.5), lambda m: m.opts.__setitem__("scale", 3.0),
                   replace_config, lambda m: setattr(m.config, "temp", 2.0), lambda m: setattr(m, "opts", {"scale": 0.5})):
        change(model)
        change(ref)
        assert engine.train_step(x) == pytest.approx(float(ref(x)), rel=1e-6)


MODE = "plain"  # read by _ReadsEverywhere.forward: a module global


class _ReadsEverywhere(nn.Module):
    """Branches on a class attribute, a module global, a list and a tuple, and scales by a plain
    tensor attribute (not a buffer): every one of them used to keep the first trace's branch."""

    extra = True

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.skips = [False]
        self.order = (1, 2)
        self.gain = torch.ones(4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.lin(x) * self.gain
        if self.extra:
            y = y + 1
        if MODE == "double":
            y = y * 2
        if not self.skips[0]:
            y = y.relu()
        return (y * self.order[0]).square().mean()


def test_class_attributes_globals_lists_tuples_and_plain_tensor_attributes_forward_reads_retrace_when_changed() -> None:
    """torch.compile guards on these; fxspeed's key held the module's own numbers and strings only."""
    global MODE
    torch.manual_seed(0)
    model = _ReadsEverywhere()
    ref = copy.deepcopy(model)
    x = torch.randn(3, 4)
    engine = fxspeed.compile(model, 1, fxspeed.Config(lr=0.0), example_inputs=(x,))
    assert engine.train_step(x) == pytest.approx(float(ref(x)), rel=1e-6)

    def set_global(_: nn.Module) -> None:
        global MODE
        MODE = "double"

    changes = [lambda m: setattr(m, "extra", False),           # an instance attribute over the class's
               lambda m: delattr(m, "extra"),                   # and the class's again
               lambda m: setattr(type(m), "extra", False),      # the class attribute itself
               set_global,
               lambda m: m.skips.__setitem__(0, True),          # a list changed in place
               lambda m: setattr(m, "order", (3, 2)),           # a tuple replaced
               lambda m: setattr(m, "gain", torch.full((4,), 0.5))]  # a plain tensor replaced
    try:
        for change in changes:
            change(model)
            if change is not set_global:
                change(ref)
            got = engine.train_step(x)
            assert got == pytest.approx(float(ref(x)), rel=1e-6), change
    finally:
        MODE = "plain"
        _ReadsEverywhere.extra = True
    # one program per state, none for a state seen before (deleting the instance attribute is the first state again)
    assert len(engine._executors) == len(changes)


def test_private_bookkeeping_in_a_held_object_is_not_part_of_the_step_key() -> None:
    """HF's generation_config._original_object_hash is a hash() that differs per process: in the
    key, two ranks of `fxspeed run` (not forked from one server) disagreed on every step."""
    from fxspeed.runtime.python_state import scalars as _scalars

    model = _HeldSettings()
    model.config._original_object_hash = hash("differs with PYTHONHASHSEED")
    names = [name for name, _ in _scalars(model)]
    assert "config.temp" in names and "config._original_object_hash" not in names


# ------------------------------------------------------------------------------------------
# Python state a trace used to miss (a helper's new-user sweep): hooks added or removed after
# compile, a buffer rebound in forward, a generator the module holds, counters in lists, RNG
# control and Python's random in forward, buffers replaced after compile
# ------------------------------------------------------------------------------------------

class _Ema(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.register_buffer("ema", torch.zeros(()))
        # torch 2.11's export takes no Generator argument inside forward (a clear CaptureError);
        # 2.13's does: the noise is then drawn from it
        self.gen = torch.Generator().manual_seed(7) if torch.__version__ >= "2.13" else None
        self.calls = [0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.ema = self.ema * 0.5 + 1.0  # rebinds the buffer
        self.calls[0] += 1
        noise = torch.rand(4, generator=self.gen) if self.gen is not None else 0.0
        return (self.lin(x) + noise).square().mean() * self.calls[0] + self.ema


def test_hooks_added_or_removed_after_compile_retrace_and_state_forward_keeps_follows_eager() -> None:
    torch.manual_seed(0)
    model = _Ema()
    ref = copy.deepcopy(model)
    x = torch.randn(3, 4)
    engine = fxspeed.compile(model, 1, fxspeed.Config(optimizer="sgd", lr=0.0), example_inputs=(x,))
    first = float(ref(x))  # eager's first call: calls = 1
    assert engine.train_step(x) == pytest.approx(first, rel=1e-6)
    for step in range(2):  # the step computes eager's first call's counter at every step (documented)
        ref.calls[0] = 0
        assert engine.train_step(x) == pytest.approx(float(ref(x)), rel=1e-6), step  # ema and noise move on
    assert float(model.ema) == pytest.approx(float(ref.ema)) and model.calls == [1]
    hook = lambda m, args, out: out * 10  # noqa: E731
    handles = [m.lin.register_forward_hook(hook) for m in (model, ref)]
    ref.calls[0] = model.calls[0]  # a new trace starts from the counter as the module holds it
    assert engine.train_step(x) == pytest.approx(float(ref(x)), rel=1e-6)
    for h in handles:
        h.remove()
    ref.calls[0] = model.calls[0]
    assert engine.train_step(x) == pytest.approx(float(ref(x)), rel=1e-6)
    if model.gen is not None:  # a generator put in the traced one's place: retraced, drawn from as eager
        model.gen, ref.gen = torch.Generator().manual_seed(11), torch.Generator().manual_seed(11)
        ref.calls[0] = model.calls[0]
        assert engine.train_step(x) == pytest.approx(float(ref(x)), rel=1e-6)
    model.ema = torch.zeros(())  # replaced, not written: the program would read the old one
    with pytest.raises(fxspeed.FxspeedError, match=r"buffer\(s\) \['ema'\] were replaced"):
        engine.train_step(x)


class _StatOfActivations(nn.Module):
    def __init__(self, grow: bool = False) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.register_buffer("stat", torch.zeros(()))
        self.grow = grow

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        if self.grow:  # a history that grows every step: no fixed buffer can hold it
            self.stat = torch.cat([self.stat.reshape(-1), h.mean().detach().reshape(1)])
        else:  # the new value requires grad; eager keeps it, graph and all
            self.stat = self.stat * 0.9 + h.mean() * 0.1
        return h.square().mean()


def test_a_buffer_rebound_to_a_value_that_requires_grad_keeps_eagers_values() -> None:
    torch.manual_seed(0)
    model = _StatOfActivations()
    check_parity(model, [(torch.randn(3, 4),)] * 3, fxspeed.Config(optimizer="sgd", lr=0.1))
    assert float(model.stat) != 0.0  # was left at its first value


def test_a_buffer_rebound_to_another_shape_is_refused_naming_it() -> None:
    x = torch.randn(3, 4)
    with pytest.raises(fxspeed.FxspeedError, match=r"rebinds its buffer `stat` to a tensor of shape \(2,\)"):
        fxspeed.compile(_StatOfActivations(grow=True), 1, fxspeed.Config(lr=0.1), example_inputs=(x,))


class _Seeds(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        import random

        torch.manual_seed(3)
        h = F.dropout(self.lin(x), 0.5)
        return h.square().mean() * (2.0 if random.random() < 0.5 else 1.0)


def test_seeding_or_drawing_from_python_random_in_forward_is_said(caplog: pytest.LogCaptureFixture) -> None:
    x = torch.randn(3, 4)
    with caplog.at_level("WARNING", logger="fxspeed"):
        fxspeed.compile(_Seeds(), 1, fxspeed.Config(lr=0.0), example_inputs=(x,)).train_step(x)
    assert "calls torch.manual_seed while traced" in caplog.text
    assert "draws from Python's random while traced" in caplog.text


def test_the_step_key_holds_nothing_rank_specific_and_numbers_each_object_once() -> None:
    """Keys are compared across ranks: a hook's handle id (counting every hook the process made)
    and a device's index (the rank's) made them differ; a reused id once gave two objects one number."""
    from fxspeed.runtime.python_state import ModuleState

    class Net(nn.Module):
        def __init__(self, index: int) -> None:
            super().__init__()
            self.lin = nn.Linear(2, 2)
            self.device = torch.device("cpu", index)

    keys = []
    for extra_hooks, index in ((0, 0), (3, 1)):
        for _ in range(extra_hooks):  # other hooks this process registered first
            torch.zeros(1, requires_grad=True).register_hook(lambda g: g)
        net = Net(index)
        net.lin.register_forward_hook(lambda m, a, o: o)
        keys.append(ModuleState(net).key(True))
    assert keys[0] == keys[1]
    state = ModuleState(nn.Linear(1, 1))
    numbers = []
    for _ in range(4):
        numbers.append(state._tag(lambda: None))  # each dies at once: ids are reused
    assert len(set(numbers)) == 4


def test_the_step_key_keeps_a_bounded_number_of_objects_the_model_stopped_holding() -> None:
    """A dict (no weak reference allowed) held by value: replaced every step, each old one was
    kept alive by the key's numbering; one switching between two keeps both keys (a reviewer
    saw every step retrace when only the objects held now were remembered)."""
    from fxspeed.runtime.python_state import _STRONG_KEPT, ModuleState

    net = nn.Linear(1, 1)
    state = ModuleState(net)
    keys = set()
    for step in range(50):
        net.options = {"step": step % 3}
        keys.add(state.key(True))
    assert len(state._tags) <= _STRONG_KEPT + 1 and len(keys) == 50  # a new object: a new key, never an old number
    a, b = {"mode": "a"}, {"mode": "b"}
    keys = set()
    for step in range(8):
        net.options = a if step % 2 else b
        keys.add(state.key(True))
    assert len(keys) == 2


class _OneBlockThreeTimes(nn.Module):
    """ALBERT's layout: one block under three names, and an alias attribute of another module."""

    def __init__(self) -> None:
        super().__init__()
        block = nn.Linear(4, 4)
        self.layers = nn.ModuleList([block, block, block])
        self.out = nn.Linear(4, 2)
        self.head = self.out  # the same module under a second name, called through the first

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return F.mse_loss(self.out(x), y)


def test_a_module_registered_under_several_names_trains_as_eager() -> None:
    """Was "CaptureError: 'Linear' object has no attribute 'weight'": the trace bound a tensor per
    name on the one module object, and hiding the names that got no gradient deleted its weight."""
    torch.manual_seed(0)
    engine, ref = check_parity(_OneBlockThreeTimes(), [(torch.randn(5, 4), torch.randn(5, 2))] * 3,
                               fxspeed.Config(optimizer="sgd", lr=0.1))
    state = engine.state_dict()
    assert list(state) == list(ref.state_dict())
    for k, v in ref.state_dict().items():
        torch.testing.assert_close(state[k], v, rtol=0, atol=1e-6)


class _OneHotLoss(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 10)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.binary_cross_entropy_with_logits(self.lin(x), F.one_hot(y, 10).float())


def test_a_loss_on_one_hot_labels_trains_as_eager_and_keeps_one_hots_range_check() -> None:
    """F.one_hot traces a value check (aten._assert_async) that returns nothing: it was a
    PassError ("node '_assert_async' has no meta['val']")."""
    torch.manual_seed(0)
    x, y = torch.randn(4, 8), torch.randint(0, 10, (4,))
    engine, ref = check_parity(_OneHotLoss(), [(x, y)] * 2, fxspeed.Config(optimizer="sgd", lr=0.1))
    with pytest.raises(Exception, match="must be smaller than num_classes|one_hot"):
        ref(x, torch.full((4,), 12))
    with pytest.raises(Exception, match="must be smaller than num_classes|one_hot"):
        engine.train_step(x, torch.full((4,), 12))


def test_a_training_trace_owns_each_forward_node_by_the_module_whose_call_made_it() -> None:
    """AOT export retraces the graph the module hooks saw by calling it as a GraphModule; that
    call used to reset the record, so a training step had no owners at all and every node's module
    was guessed from its inputs (the attention op went to whichever Linear fed it)."""
    from fxspeed.compiler.capture import capture_step

    model = GPT(GPTConfig(n_layer=2, n_embd=32, n_head=2, vocab_size=64, block_size=16))
    x = torch.randint(0, 64, (2, 8))
    step = capture_step(model, (x, x), {}, train=True)
    nodes = {n.name: n for n in step.gm.graph.nodes}
    attention = [n for n, node in nodes.items() if "scaled_dot_product" in str(node.target)
                 and "backward" not in str(node.target)]
    assert [step.module_of[n] for n in attention] == ["blocks.0.attn", "blocks.1.attn"]
    lookups = [n for n, node in nodes.items() if node.target is torch.ops.aten.embedding.default]
    assert [step.module_of[n] for n in lookups] == ["wte", "wpe"]
    # a name is kept only where the final node is the traced one: same op, same inputs
    evals = capture_step(model, (x, x), {}, train=False)
    shared = set(step.module_of) & set(evals.module_of)
    assert len(shared) > 80 and all(step.module_of[n] == evals.module_of[n] for n in shared)
