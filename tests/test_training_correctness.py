"""Regression tests for silent wrong results in the training step (issue "Correctness first"):
gradient layout, the learning-rate rule, the NaN guard, and a user module whose weights the
engine holds elsewhere. Each compares with eager PyTorch using the same fused optimizer."""

from __future__ import annotations

import copy
import logging
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn

import fxspeed
from fxspeed.errors import FxspeedError
from tests.multiprocess import rank_env, run_ranks

ROOT = Path(__file__).resolve().parents[1]


class ConvAndTransposed(nn.Module):
    """A conv fed channels_last input (its weight gradient comes out channels_last) and a
    Parameter that is itself a transposed view (its gradient comes out contiguous)."""

    def __init__(self) -> None:
        super().__init__()
        self.c = nn.Conv2d(3, 4, 3)
        self.w = nn.Parameter(torch.randn(6, 5).t())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(x).square().mean() + (x.flatten(1)[:, :5] @ self.w).square().mean()


def _eager_adamw(model: nn.Module, lr: float) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0, fused=True)


@pytest.mark.parametrize("zero", [0, 1, 3])
def test_gradients_reach_the_fused_optimizer_in_their_parameters_layout(zero: int) -> None:
    torch.manual_seed(0)
    model = ConvAndTransposed()
    ref = copy.deepcopy(model)
    x = torch.randn(2, 3, 8, 8).to(memory_format=torch.channels_last)
    engine = fxspeed.compile(model, 1, fxspeed.Config(lr=0.1, zero=zero), example_inputs=(x,))
    opt = _eager_adamw(ref, 0.1)
    for _ in range(3):
        loss = engine.train_step(x)
        opt.zero_grad()
        ref_loss = ref(x)
        ref_loss.backward()
        opt.step()
        assert loss == pytest.approx(float(ref_loss.detach()), rel=1e-6)
    state = engine.state_dict()
    for name, p in ref.state_dict().items():
        torch.testing.assert_close(state[name], p, rtol=1e-6, atol=1e-7, msg=name)


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l = nn.Linear(4, 4)

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return ((self.l(a) - b) ** 2).mean()


def _tiny_engine(**cfg: object) -> tuple[fxspeed.Engine, tuple[torch.Tensor, torch.Tensor]]:
    torch.manual_seed(0)
    batch = (torch.randn(3, 4), torch.randn(3, 4))
    return fxspeed.compile(Tiny(), 1, fxspeed.Config(**cfg), example_inputs=batch), batch


def test_changing_a_param_groups_lr_behind_the_schedule_is_an_error_that_names_manual() -> None:
    engine, batch = _tiny_engine(lr=0.1)
    engine.train_step(*batch)
    engine.optimizer.param_groups[0]["lr"] = 0.0
    with pytest.raises(FxspeedError, match="lr_schedule='manual'"):
        engine.train_step(*batch)


def test_a_manual_schedule_leaves_the_lr_to_the_user_and_a_torch_scheduler_drives_it() -> None:
    engine, batch = _tiny_engine(lr=0.1, lr_schedule="manual")
    sched = torch.optim.lr_scheduler.StepLR(engine.optimizer, step_size=1, gamma=0.5)
    seen = []
    for _ in range(3):
        engine.train_step(*batch)
        sched.step()
        seen.append(engine.optimizer.param_groups[0]["lr"])
    assert seen == pytest.approx([0.05, 0.025, 0.0125])
    engine.optimizer.param_groups[0]["lr"] = 0.0
    before = {k: v.clone() for k, v in engine.state_dict().items()}
    engine.train_step(*batch)
    for k, v in engine.state_dict().items():
        torch.testing.assert_close(v, before[k], rtol=0, atol=0)  # lr 0 is honoured: nothing moves


def test_a_resumed_run_uses_the_new_configs_lr_and_the_saved_schedule_position(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    engine, batch = _tiny_engine(lr=0.1, lr_schedule="linear", total_steps=10)
    for _ in range(4):
        engine.train_step(*batch)
    engine.save(tmp_path / "ck")
    resumed, _ = _tiny_engine(lr=0.02, lr_schedule="linear", total_steps=10)
    with caplog.at_level(logging.WARNING, logger="fxspeed"):
        resumed.load(tmp_path / "ck")
    assert "Config.lr=0.02" in caplog.text
    # step 4 of a linear decay over 10 steps: 0.6 of the (new) base lr
    assert resumed.optimizer.param_groups[0]["lr"] == pytest.approx(0.02 * 0.6)
    resumed.train_step(*batch)
    assert resumed.optimizer.param_groups[0]["lr"] == pytest.approx(0.02 * 0.5)


def test_a_nan_batch_poisons_nothing_with_nan_check_skip() -> None:
    engine, (a, b) = _tiny_engine(lr=0.1, nan_check="skip")
    engine.train_step(a, b)
    before = {k: v.clone() for k, v in engine.state_dict().items()}
    engine.train_step(a * float("nan"), b)
    assert engine.stats["skipped_steps"] == 1
    for k, v in engine.state_dict().items():
        torch.testing.assert_close(v, before[k], rtol=0, atol=0)
    assert math.isfinite(engine.train_step(a, b))


def test_a_nan_batch_raises_naming_the_step_with_nan_check_raise() -> None:
    engine, (a, b) = _tiny_engine(lr=0.1, nan_check="raise")
    engine.train_step(a, b)
    before = {k: v.clone() for k, v in engine.state_dict().items()}
    b_inf = b.clone()
    b_inf[0, 0] = float("inf")
    with pytest.raises(FxspeedError, match="train_step 1: .*NaN or inf"):
        engine.train_step(a, b_inf)
    for k, v in engine.state_dict().items():
        torch.testing.assert_close(v, before[k], rtol=0, atol=0)


def test_without_nan_check_a_nan_batch_still_trains_as_eager_does() -> None:
    engine, (a, b) = _tiny_engine(lr=0.1)
    engine.train_step(a * float("nan"), b)
    assert math.isnan(engine.train_step(a, b))  # the default is off: no hidden cost, eager's behaviour


def _worker(case: str, tmp: Path) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "fxspeed", "run", "-n", "2", "-m", "tests.workers.correctness_worker",
           "--case", case, "--out", str(tmp)]
    env = rank_env()
    return run_ranks(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


def test_two_rank_correctness_cases(tmp_path: Path) -> None:
    """zero3_module: calling the user's module (or its state_dict / load_state_dict) under ZeRO-3
    or ZeRO-1 bf16 names the engine and the way out, and `engine.gathered()` makes it usable; a
    write to its 0-size Parameters outside gathered() is said; repointed_zero12: `p.data = t`
    under ZeRO-1/2 trains from the new values; raced_write_zero12: under ZeRO-1/2 the module (or a submodule) called right
    after train_step waits for the step's gathers (before the user's own pre-hooks), an in-place write after engine.synchronize() trains as eager, one racing the step's in-flight gathers is refused, a deepcopy or pickle of the module is called as any module, a dropped engine takes its hooks off; pipeline_batchnorm: BatchNorm's statistics under a
    pipeline equal eager's over the micro-batches; pipeline_shared_block: ALBERT's one block in
    four slots trains under a pipeline as eager; nan_one_rank: a NaN on one rank's batch skips the step on
    both; eval_global: eval_step returns the global mean on every rank; layout_dp: channels_last/transposed gradients under DP x ZeRO-1/2 equal one process;
    token_mean: the README's recipe for the exact global token mean with -100 labels spread
    unevenly (one rank's all -100) gives one process's steps on the global batch; no_decay_zero:
    Config.no_weight_decay under ZeRO-0..3 (shards cutting Parameters) equals torch param groups;
    accum_once: grad_accum under ZeRO-0/1 reduces once per step (the last slice's program, the sum
    of every slice) and equals eager on the global batch, a slice's own buckets dead before the next runs; tie_second_name: a tie the forward reaches
    through its second name only (T5's shared / encoder.embed_tokens) under ZeRO-3 and ZeRO-1 bf16
    trains as eager, comes back whole from state_dict and resumes from a checkpoint exactly;
    scripted_submodule: a torch.jit.script'ed submodule (torch refuses hooks on it) under ZeRO-1/2
    compiles and trains as eager; deferred_init: a GPT built on the meta device, compiled on 2 ranks
    (ZeRO-2/3, ZeRO-1 bf16, tensor=2, pipeline=2), trains as one process from fxspeed.materialize of
    it, a tp rank never holding the whole model at once and a pipeline rank never making another
    stage's weights; dropout_replicas / dropout_stages: replicas and pipeline stages seeded alike
    draw their dropout masks from streams of their own (they drew the same masks), and train as
    eager with those masks; a pipeline eval_step that draws keeps the ranks' generators in step,
    and a generator put on a module after a pipeline compiled is refused."""
    proc = _worker("all", tmp_path)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    for case in ("zero3_module", "repointed_zero12", "raced_write_zero12", "pipeline_batchnorm", "pipeline_shared_block", "nan_one_rank", "eval_global", "layout_dp", "token_mean", "no_decay_zero", "accum_once",
                 "tie_second_name", "scripted_submodule", "deferred_init", "dropout_replicas", "dropout_stages"):
        for r in range(2):
            got = (tmp_path / f"{case}_rank{r}.txt").read_text()
            assert got == "ok", f"{case} rank {r}: {got}"


class FrozenNorm(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l = nn.Linear(8, 8)
        self.bn = nn.BatchNorm1d(8)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return ((self.bn(self.l(x)) - y) ** 2).mean()


def _train_both(model: nn.Module, batches: list, setup=None) -> tuple[fxspeed.Engine, nn.Module, list, list]:
    ref = copy.deepcopy(model)
    engine = fxspeed.compile(model, 1, fxspeed.Config(lr=1e-2), example_inputs=batches[0])
    opt = _eager_adamw(ref, 1e-2)
    got, want = [], []
    for i, batch in enumerate(batches):
        if setup is not None:
            setup(i, model, ref)
        got.append(engine.train_step(*batch))
        opt.zero_grad()
        loss = ref(*batch)
        loss.backward()
        opt.step()
        want.append(float(loss.detach()))
    return engine, ref, got, want


def test_a_submodule_the_user_put_in_eval_mode_stays_in_eval_mode_when_training() -> None:
    torch.manual_seed(0)
    model = FrozenNorm()
    model.bn.eval()  # a frozen BatchNorm: running statistics, no update
    batches = [(torch.randn(4, 8), torch.randn(4, 8)) for _ in range(3)]
    engine, ref, got, want = _train_both(model, batches)
    assert got == pytest.approx(want, rel=1e-6)
    assert not model.bn.training and model.training
    torch.testing.assert_close(engine.state_dict()["bn.running_mean"], ref.bn.running_mean)


class NormOverChannels(nn.Module):
    """BatchNorm over the channels of (batch, time, channels) rows, by transposing in and out (a
    TCN's or a conformer's layout), and over a transposed 2-D input."""

    def __init__(self) -> None:
        super().__init__()
        self.bn, self.bn2 = nn.BatchNorm1d(16), nn.BatchNorm1d(4)
        self.l = nn.Linear(16, 4)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        h = self.bn(h.transpose(1, 2)).transpose(1, 2)
        out = self.l(h)  # a view of the transposed-back output: the trace's layout decides it
        return self.bn2(out.flatten(0, 1).t().contiguous().t()).pow(2).mean()


def test_batch_norm_over_a_transposed_input_trains_and_evaluates_as_eager() -> None:
    """ATen's CPU batch norm returns its output contiguous, its fake kernel in the input's strides:
    the trace viewed the transposed-back output and the first step failed ("view size is not
    compatible with input tensor's size and stride"), in eval_step too."""
    torch.manual_seed(0)
    batches = [(torch.randn(4, 8, 16),) for _ in range(3)]
    engine, ref, got, want = _train_both(NormOverChannels(), batches)
    assert got == pytest.approx(want, rel=1e-5)
    ref.eval()
    with torch.no_grad():
        want_eval = float(ref(*batches[0]))
    assert engine.eval_step(*batches[0]) == pytest.approx(want_eval, rel=1e-5)
    torch.testing.assert_close(engine.state_dict()["bn.running_var"], ref.bn.running_var)


def test_switching_a_module_to_eval_between_steps_is_followed_as_eager_follows_it() -> None:
    torch.manual_seed(0)
    batches = [(torch.randn(4, 8), torch.randn(4, 8)) for _ in range(4)]

    def setup(i: int, model: nn.Module, ref: nn.Module) -> None:
        if i == 2:
            model.bn.eval()
            ref.bn.eval()

    _, _, got, want = _train_both(FrozenNorm(), batches, setup)
    assert got == pytest.approx(want, rel=1e-6)


class Tempered(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l = nn.Linear(4, 4)
        self.temperature = 1.0

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return ((self.l(a) / self.temperature - b) ** 2).mean()


def test_a_python_attribute_changed_between_steps_is_used_as_eager_uses_it() -> None:
    torch.manual_seed(0)
    batches = [(torch.randn(3, 4), torch.randn(3, 4)) for _ in range(3)]

    def setup(i: int, model: nn.Module, ref: nn.Module) -> None:
        model.temperature = ref.temperature = 1.0 / (i + 1)  # annealing

    _, _, got, want = _train_both(Tempered(), batches, setup)
    assert got == pytest.approx(want, rel=1e-6)


class Counting(Tiny):
    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return super().forward(a, b)


def test_a_forward_that_changes_python_state_is_named_in_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="fxspeed"):
        engine, batch = None, (torch.randn(3, 4), torch.randn(3, 4))
        engine = fxspeed.compile(Counting(), 1, fxspeed.Config(), example_inputs=batch)
        engine.train_step(*batch)
        engine.train_step(*batch)
    assert "calls" in caplog.text and "register_buffer" in caplog.text
    assert engine.stats["compiles"] == 1  # warned once, not traced again at every step


class Scaled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(()))
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        self.seen = getattr(self, "seen", 0) + 1  # an attribute forward creates
        return (self.w * x).sum() * self.calls * self.seen


def test_a_counter_forward_bumps_is_baked_in_at_eager_first_call_value_not_after_the_traces_extra_runs() -> None:
    """AOT export runs forward's Python twice (metadata, then the trace): the step computed with
    calls = 2 (loss 8 where eager's first step gives 4) and left calls at 2."""
    engine = fxspeed.compile(Scaled(), 1, fxspeed.Config(optimizer="sgd", lr=0.0), example_inputs=(torch.ones(4),))
    loss = engine.train_step(torch.ones(4))
    assert loss == pytest.approx(4.0)
    assert engine.model.calls == 1 and engine.model.seen == 1


def test_changing_requires_grad_after_compile_is_an_error_naming_the_parameter() -> None:
    engine, batch = _tiny_engine()
    engine.model.l.weight.requires_grad_(False)
    with pytest.raises(FxspeedError, match=r"l\.weight \(True -> False\).*before fxspeed.compile"):
        engine.train_step(*batch)


def test_a_gradient_hook_on_a_parameter_is_refused_rather_than_ignored() -> None:
    torch.manual_seed(0)
    model = Tiny()
    model.l.weight.register_hook(lambda g: torch.zeros_like(g))
    with pytest.raises(FxspeedError, match="'l.weight'.*gradient hook"):
        fxspeed.compile(model, 1, fxspeed.Config(), example_inputs=(torch.randn(3, 4), torch.randn(3, 4)))


def test_non_tensor_batch_values_that_compare_equal_get_their_own_traces() -> None:
    class Signed(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.l = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor, z: object) -> torch.Tensor:
            shift = (1.0 if str(z).startswith("-") else 0.0) + (2.0 if type(z) is bool else 0.0)
            return (self.l(x) + shift).square().mean()

    torch.manual_seed(0)
    model = Signed()
    ref = copy.deepcopy(model)
    x = torch.randn(3, 4)
    engine = fxspeed.compile(model, 1, fxspeed.Config(lr=0.0), example_inputs=(x, 0.0))
    for z in (0.0, -0.0, 0, False):
        assert engine.train_step(x, z) == pytest.approx(float(ref(x, z).detach()), rel=1e-6), repr(z)


def test_a_batch_value_without_a_faithful_key_is_refused() -> None:
    class WithTable(nn.Module):  # a numpy array's repr elides its middle: no key tells two apart
        def __init__(self) -> None:
            super().__init__()
            self.l = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor, table: object) -> torch.Tensor:
            return self.l(x).square().mean() + float(sum(table))

    with pytest.raises(fxspeed.ConfigError, match="bytearray is neither a tensor nor hashable"):
        fxspeed.compile(WithTable(), 1, fxspeed.Config(), example_inputs=(torch.randn(3, 4), bytearray(2)))


def test_grad_accum_refuses_a_batch_tensor_that_is_not_per_sample_and_repeats_0_dim_ones() -> None:
    class Weighted(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.l = nn.Linear(8, 8)

        def forward(self, x: torch.Tensor, y: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
            return ((self.l(x) * w - y) ** 2).mean()

    x, y = torch.randn(4, 8), torch.randn(4, 8)
    w2 = torch.ones(2, 1, 8)
    engine = fxspeed.compile(Weighted(), 1, fxspeed.Config(grad_accum=2), example_inputs=(x, y, w2))
    with pytest.raises(fxspeed.ConfigError, match=r"args\[2\] has 2 rows and args\[0\] has 4"):
        engine.train_step(x, y, w2)
    torch.manual_seed(0)
    model = Weighted()
    ref = copy.deepcopy(model)
    w = torch.tensor(3.0)  # a 0-dim tensor: repeated in every slice, never an error
    for k in (1, 2):
        engine = fxspeed.compile(copy.deepcopy(model), 1, fxspeed.Config(grad_accum=k, lr=0.0),
                                 example_inputs=(x, y, w))
        assert engine.train_step(x, y, w) == pytest.approx(float(ref(x, y, w).detach()), rel=1e-6)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_sgd_moves_a_low_precision_models_weights_as_eager_sgd_does(dtype: torch.dtype) -> None:
    """torch 2.13's fused CPU SGD skips bf16/fp16 elements in whole 16-element vectors, so a bf16
    model trained with SGD kept its initial weights (loss 5.53 at every step, eager 4.94)."""
    from fxspeed.models import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=1, n_embd=32, n_head=2, vocab_size=64, block_size=16)).to(dtype)
    ref = copy.deepcopy(model)
    start = [p.detach().clone() for p in model.parameters()]
    x = torch.randint(0, 64, (2, 8))
    engine = fxspeed.compile(model, config=fxspeed.Config(optimizer="sgd", lr=0.1), example_inputs=(x, x))
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)  # torch's default (foreach) implementation
    for _ in range(2):
        loss = engine.train_step(x, x)
        opt.zero_grad()
        ref_loss = ref(x, x)
        ref_loss.backward()
        opt.step()
        assert loss == pytest.approx(float(ref_loss), rel=1e-2)
    for (name, p), q, p0 in zip(model.named_parameters(), ref.parameters(), start):
        # equal where the CPU computes the dtype natively; close where its matmuls run in fp32
        # from the rounded values (upcast_cpu_compute). The bug moved nothing at all.
        torch.testing.assert_close(p.float(), q.float(), rtol=2e-2, atol=2e-3, msg=name)
        assert torch.equal(q, p0) or not torch.equal(p, p0), f"{name} never moved where eager's did"
