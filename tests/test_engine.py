"""The Engine: eval_step, the cache of compiled programs keyed by batch signature, stats."""

from __future__ import annotations

import copy
import logging

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from conftest import assert_close_rel, assert_models_match, eager_train

import fxspeed
from fxspeed.runtime.engine import RETRACE_WARN_AFTER


class Classifier(nn.Module):
    """BatchNorm and Dropout: both behave differently in train and eval mode."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(6, 16)
        self.bn = nn.BatchNorm1d(16)
        self.drop = nn.Dropout(0.5)
        self.fc2 = nn.Linear(16, 3)

    def forward(self, x: torch.Tensor, y: torch.Tensor | None = None) -> torch.Tensor:
        logits = self.fc2(self.drop(F.relu(self.bn(self.fc1(x)))))
        return logits if y is None else F.cross_entropy(logits, y)


def batch(n: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(n, 6), torch.randint(0, 3, (n,))


def snapshot(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items()}


def assert_unchanged(model: nn.Module, before: dict[str, torch.Tensor]) -> None:
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), f"{k} changed"


# --------------------------------------------------------------------------------------------
# eval_step
# --------------------------------------------------------------------------------------------

def test_eval_step_returns_the_eval_mode_loss_as_float_and_changes_nothing() -> None:
    model = Classifier()
    x, y = batch()
    engine = fxspeed.compile(model, 1, example_inputs=(x, y))
    engine.train_step(x, y)  # buffers and optimizer state are non-trivial now
    before = snapshot(model)
    loss = engine.eval_step(x, y)
    assert isinstance(loss, float)
    assert_unchanged(model, before)  # parameters and BatchNorm running stats
    ref = copy.deepcopy(model).eval()
    with torch.no_grad():
        assert_close_rel(loss, ref(x, y).item(), "eval loss")
    assert model.training, "eval_step must restore the model's mode"
    assert engine.stats["steps"] == 1
    assert engine.module is model  # DeepSpeed's name for it


def test_eval_step_is_deterministic_with_dropout() -> None:
    model = Classifier()
    x, y = batch()
    engine = fxspeed.compile(model, 1, example_inputs=(x, y))
    assert engine.eval_step(x, y) == engine.eval_step(x, y)


def test_eval_step_without_loss_returns_outputs_equal_to_eager_eval_no_grad() -> None:
    model = Classifier()
    x, y = batch()
    engine = fxspeed.compile(model, 1, fxspeed.Config(lr=0.05), example_inputs=(x, y))
    for _ in range(2):
        engine.train_step(*batch())
    before = snapshot(model)
    out = engine.eval_step(x)  # no target: the model returns logits
    assert isinstance(out, torch.Tensor) and out.shape == (8, 3)
    assert not out.requires_grad
    ref = copy.deepcopy(model)
    ref.eval()
    with torch.no_grad():
        expected = ref(x)
    assert_close_rel(out, expected, "eval logits")
    assert_unchanged(model, before)


def test_eval_step_of_hf_model_without_labels_returns_the_models_output_class() -> None:
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=1, n_head=2,
                                  bos_token_id=0, eos_token_id=0)
    model = transformers.GPT2LMHeadModel(cfg)
    ids = torch.randint(0, 64, (2, 8))
    engine = fxspeed.compile(model, 1, example_inputs={"input_ids": ids, "labels": ids})
    out = engine.eval_step(input_ids=ids)  # the KV cache object is left out of the outputs
    assert set(out) == {"logits"}
    model.eval()
    with torch.no_grad():
        expected = model(input_ids=ids)
    assert type(out) is type(expected) and out.past_key_values is None  # `out.logits` works, as eager's
    assert_close_rel(out.logits, expected.logits, "logits")
    assert_close_rel(out["logits"], expected.logits, "logits")
    assert isinstance(engine.eval_step(input_ids=ids, labels=ids), float)


def test_eval_step_with_loss_fn_returns_the_loss_fn_value() -> None:
    model = nn.Linear(4, 2)
    x, y = torch.randn(3, 4), torch.randn(3, 2)

    def loss_fn(out: torch.Tensor, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(out, y)

    class TwoArgs(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = model

        def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            return self.lin(x)

    engine = fxspeed.compile(TwoArgs(), 1, example_inputs=(x, y), loss_fn=loss_fn)
    with torch.no_grad():
        expected = F.mse_loss(model(x), y).item()
    assert_close_rel(engine.eval_step(x, y), expected, "eval loss")


# --------------------------------------------------------------------------------------------
# The cache of compiled programs, and stats
# --------------------------------------------------------------------------------------------

def test_compile_traces_the_example_batch_once_and_builds_a_plan() -> None:
    model = Classifier()
    engine = fxspeed.compile(model, 1, example_inputs=batch())
    assert engine.stats == {"steps": 0, "compiles": 1, "skipped_steps": 0}
    assert engine.plan is not None
    assert engine.plan.n_params == sum(p.numel() for p in model.parameters())


def test_train_and_eval_programs_are_cached_separately_per_batch_signature() -> None:
    model = Classifier()
    x, y = batch()
    engine = fxspeed.compile(model, 1, example_inputs=(x, y))
    engine.train_step(x, y)
    engine.train_step(*batch())  # same shapes: cached
    assert engine.stats["compiles"] == 1
    engine.eval_step(x, y)  # eval program: a new trace
    assert engine.stats["compiles"] == 2
    engine.eval_step(*batch())
    engine.train_step(*batch())
    assert engine.stats["compiles"] == 2
    engine.train_step(*batch(4))  # new batch size: one new trace, then reused
    engine.train_step(*batch(4))
    engine.eval_step(*batch(4))
    assert engine.stats["compiles"] == 4
    assert engine.stats["steps"] == 5
    assert engine.stats["skipped_steps"] == 0


def test_training_across_batch_sizes_matches_eager() -> None:
    model = Classifier()
    ref = copy.deepcopy(model)
    batches = [batch(8), batch(4), batch(8), batch(4)]
    config = fxspeed.Config(optimizer="adam", lr=1e-2)
    engine = fxspeed.compile(model, 1, config, example_inputs=batches[0])
    torch.manual_seed(7)
    ref_losses = eager_train(ref, batches, config)
    torch.manual_seed(7)
    losses = [engine.train_step(*b) for b in batches]
    for i, (a, b) in enumerate(zip(losses, ref_losses)):
        assert_close_rel(a, b, f"loss at step {i}")
    assert_models_match(model, ref)
    assert engine.stats["compiles"] == 2


def test_many_batch_signatures_log_a_warning_to_pad_batches(caplog: pytest.LogCaptureFixture) -> None:
    model = nn.Linear(3, 1)
    engine = fxspeed.compile(model, 1, example_inputs=(torch.randn(1, 3),), loss_fn=lambda out, x: out.mean())
    with caplog.at_level(logging.WARNING, logger="fxspeed"):
        for n in range(2, RETRACE_WARN_AFTER + 1):
            engine.train_step(torch.randn(n, 3))
    assert engine.stats["compiles"] == RETRACE_WARN_AFTER
    assert any("pad batches" in r.getMessage() for r in caplog.records)


def test_train_step_returns_a_python_float_and_frees_gradients() -> None:
    model = Classifier()
    engine = fxspeed.compile(model, 1, example_inputs=batch())
    loss = engine.train_step(*batch())
    assert type(loss) is float
    assert all(p.grad is None for p in model.parameters())


def test_state_dict_has_the_models_keys_and_shapes() -> None:
    model = Classifier()
    untouched = copy.deepcopy(model)
    engine = fxspeed.compile(model, 1, example_inputs=batch())
    engine.train_step(*batch())
    sd = engine.state_dict()
    assert list(sd) == list(untouched.state_dict())
    assert all(sd[k].shape == v.shape and sd[k].dtype == v.dtype for k, v in untouched.state_dict().items())


def test_load_state_dict_restores_parameters_used_by_the_next_step() -> None:
    model = Classifier()
    x, y = batch()
    engine = fxspeed.compile(model, 1, fxspeed.Config(optimizer="sgd", lr=0.1), example_inputs=(x, y))
    saved = snapshot(model)
    first = engine.eval_step(x, y)
    engine.train_step(x, y)
    assert engine.eval_step(x, y) != first
    engine.load_state_dict(saved)
    assert engine.eval_step(x, y) == first


# --------------------------------------------------------------------------------------------
# what a trace baked in: replaced Parameters, loss_fn's numbers, edits inside gathered()
# --------------------------------------------------------------------------------------------

def test_a_parameter_replaced_after_compile_is_refused_naming_it_rather_than_silently_ignored() -> None:
    model = Classifier()
    engine = fxspeed.compile(model, 1, example_inputs=batch())
    engine.train_step(*batch())
    model.fc2.weight = nn.Parameter(model.fc2.weight.detach() * 0.5)
    with pytest.raises(fxspeed.FxspeedError, match=r"\['fc2.weight'\] were replaced.*load_state_dict"):
        engine.train_step(*batch())
    fresh = Classifier()
    model.load_state_dict(fresh.state_dict(), assign=True)
    with pytest.raises(fxspeed.FxspeedError, match="assign=True"):
        engine.eval_step(*batch())


def test_a_model_converted_to_another_dtype_after_compile_is_refused_naming_the_parameter() -> None:
    """model.double() after compile ended in a raw 'mat1 and mat2 must have the same dtype' from
    inside the program."""
    model = Classifier()
    engine = fxspeed.compile(model, 1, example_inputs=batch())
    engine.train_step(*batch())
    model.double()
    with pytest.raises(fxspeed.FxspeedError, match=r"parameter \S+ is torch.float64 on cpu now but was torch.float32"):
        engine.train_step(*batch())


def test_a_number_loss_fn_reads_from_its_closure_or_globals_retraces_when_it_changes() -> None:
    """A trace bakes loss_fn's Python numbers in (as module attributes); changing one retraces."""
    scale = {"s": 1.0}
    model = Classifier().eval()  # no dropout: eager and compiled see the same function
    ref = copy.deepcopy(model)

    def scaled(out: torch.Tensor, *batch: torch.Tensor) -> torch.Tensor:
        return out * scale["s"]  # the model returns its cross-entropy when given labels

    x, y = batch()
    engine = fxspeed.compile(model, 1, fxspeed.Config(optimizer="sgd", lr=0.1), example_inputs=(x, y), loss_fn=scaled)
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for s in (1.0, 3.0, 3.0, 0.5):
        scale["s"] = s
        got = engine.train_step(x, y)
        opt.zero_grad()
        want = scaled(ref(x, y))
        want.backward()
        opt.step()
        assert got == pytest.approx(want.item(), rel=1e-6), s
    assert_models_match(model, ref, rtol=1e-5)
    assert engine.stats["compiles"] == 3  # scales 1, 3 and 0.5; the second 3 reused its program


def test_weights_edited_inside_gathered_are_kept_under_master_weights(tmp_path) -> None:
    """Under master weights (bf16, the fp32 masters in the optimizer's offload file) the module
    inside gathered() holds gathered fp32 copies: an edit there goes into the masters and the
    working copies, as load_state_dict would."""
    model = Classifier().eval()
    x, y = batch()
    config = fxspeed.Config(optimizer="adamw", lr=1e-2, precision="bf16", zero=1, offload="optimizer",
                            offload_device="nvme", nvme_path=str(tmp_path))
    engine = fxspeed.compile(model, 1, config, example_inputs=(x, y))
    engine.train_step(x, y)
    with engine.gathered(), torch.no_grad():
        model.fc1.weight.mul_(0.5)
        halved = model.fc1.weight.clone()
    with engine.gathered():
        torch.testing.assert_close(model.fc1.weight, halved, rtol=0, atol=0)
    other = fxspeed.compile(Classifier().eval(), 1, config, example_inputs=(x, y))  # loaded with the edited state
    other.load_state_dict(engine.state_dict())
    assert engine.eval_step(x, y) == other.eval_step(x, y)


def test_an_optimizer_over_no_weights_builds_and_steps_for_a_pipeline_stage_whose_weights_are_all_frozen() -> None:
    """torch refuses an empty parameter list: a last stage with every weight frozen failed on its
    rank only ("optimizer got an empty parameter list") while the other rank went into the step."""
    from fxspeed.runtime.optimizer import OptimizerSpec, build_optimizer

    for name in ("adamw", "adam", "sgd"):
        opt, schedule = build_optimizer([], OptimizerSpec(name=name, lr=1e-3))
        opt.step()
        schedule.step()
        assert opt.param_groups[0]["params"] == []


def test_grad_norm_is_the_global_norm_before_clipping_as_clip_grad_norm_returns_it() -> None:
    """p.grad stays None (the gradients live in the engine's buffers): a user logging the norm
    reads engine.grad_norm(), computed where clipping computes it."""
    from tests.workers.common import build_model, global_batches

    x, y = global_batches("gpt", 1)[0]
    ref = build_model("gpt")
    ref(x, y).backward()
    want = float(torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5))
    engine = fxspeed.compile(build_model("gpt"), 1, fxspeed.Config(grad_clip=0.5), example_inputs=(x, y))
    assert engine.grad_norm() is None  # no step yet
    engine.train_step(x, y)
    assert engine.grad_norm() == pytest.approx(want, rel=1e-6)
    unclipped = fxspeed.compile(build_model("gpt"), 1, fxspeed.Config(), example_inputs=(x, y))
    unclipped.train_step(x, y)
    assert unclipped.grad_norm() is None  # not computed without Config.grad_clip


def test_a_dropped_engine_leaves_no_traced_graph_alive() -> None:
    """torch's make_fx kept the last trace's nodes in a module global, so the last compiled
    program's graph and its fake tensors outlived the engine until the next trace."""
    import gc
    import weakref

    torch.manual_seed(0)
    x, y = batch()
    gc.collect()
    before = weakref.WeakSet(o for o in gc.get_objects() if isinstance(o, torch.fx.Graph))  # (other tests')
    engine = fxspeed.compile(Classifier(), 1, fxspeed.Config(lr=1e-2), example_inputs=(x, y))
    engine.train_step(x, y)
    graphs = [weakref.ref(o) for o in gc.get_objects() if isinstance(o, torch.fx.Graph) and o not in before]
    assert graphs, "the engine's program has a graph"
    del engine
    gc.collect()
    alive = sum(r() is not None for r in graphs)
    assert alive == 0, f"{alive} traced graph(s) outlived their engine"


def test_a_compiled_program_leaves_only_its_own_generated_source_in_torch_fx_s_cache() -> None:
    """torch.fx keeps the source of every GraphModule it generated code for, never freed: each
    pass that rewrote the program recompiled it, so a compile left ten sources behind (1.3 MB for
    an 18M HF Llama), and each new batch signature ten more."""
    from torch.fx import graph_module

    torch.manual_seed(0)
    x, y = batch()
    before = set(graph_module._loader.eval_cache)
    engine = fxspeed.compile(Classifier(), 1, fxspeed.Config(lr=1e-2), example_inputs=(x, y))
    engine.train_step(x, y)
    engine.eval_step(x, y)  # the eval program too (compiled through another entry point)
    added = set(graph_module._loader.eval_cache) - before
    kept = {type(ex.program.gm).forward.__code__.co_filename for ex in engine._executors.values()}
    assert len(kept) == 2 and added == kept, sorted(added)
