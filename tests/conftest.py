"""Shared helpers: an eager PyTorch reference for fxspeed's training step, and comparisons.

The reference does exactly what fxspeed promises to do, with plain torch: forward, loss
(`fxspeed.extract_loss`), backward, optional `clip_grad_norm_`, the torch.optim twin of the
configured optimizer and its learning-rate schedule.
"""

from __future__ import annotations

import copy
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable, Sequence

import pytest
import torch
import torch.nn as nn

import fxspeed
from fxspeed.runtime.optimizer import OptimizerSpec, lr_lambda

# One thread: the models are tiny, and on a busy 2-core box more threads only contend.
torch.set_num_threads(1)

RTOL = 1e-5  # fp32 relative error allowed between fxspeed and eager


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| (absolute when b is zero)."""
    a, b = a.detach().double(), b.detach().double()
    diff = (a - b).norm().item()
    ref = b.norm().item()
    return diff / ref if ref > 0 else diff


def assert_close_rel(a: Any, b: Any, what: str, rtol: float = RTOL) -> None:
    if isinstance(a, torch.Tensor):
        assert a.shape == b.shape, f"{what}: shape {tuple(a.shape)} != {tuple(b.shape)}"
        if not a.is_floating_point():
            assert torch.equal(a, b), f"{what}: {a} != {b}"
            return
        e = rel_err(a, b)
        assert e <= rtol, f"{what}: relative error {e:.3g} > {rtol:g}"
    else:
        a, b = float(a), float(b)
        e = abs(a - b) / abs(b) if b != 0 else abs(a - b)
        assert e <= rtol, f"{what}: {a!r} vs eager {b!r} (relative error {e:.3g} > {rtol:g})"


def assert_models_match(model: nn.Module, ref: nn.Module, rtol: float = RTOL) -> None:
    """Every parameter and buffer (under every name) equal within rtol."""
    sd, ref_sd = model.state_dict(), ref.state_dict()
    assert sd.keys() == ref_sd.keys()
    for name in ref_sd:
        assert_close_rel(sd[name], ref_sd[name], name, rtol)


def torch_optimizer(params: list[torch.Tensor], config: fxspeed.Config) -> tuple[torch.optim.Optimizer, Any]:
    """The torch.optim twin of `config`'s optimizer and schedule, built independently (with
    torch's fused kernel, the implementation fxspeed's runtime uses on CPU and CUDA)."""
    c = config
    if c.optimizer == "adamw":
        opt = torch.optim.AdamW(params, lr=c.lr, betas=c.betas, eps=c.eps, weight_decay=c.weight_decay, fused=True)
    elif c.optimizer == "adam":
        opt = torch.optim.Adam(params, lr=c.lr, betas=c.betas, eps=c.eps, weight_decay=c.weight_decay, fused=True)
    else:
        opt = torch.optim.SGD(params, lr=c.lr, momentum=c.momentum, weight_decay=c.weight_decay, fused=True)
    spec = OptimizerSpec(lr_schedule=c.lr_schedule, warmup_steps=c.warmup_steps, total_steps=c.total_steps)
    return opt, torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(spec))


def eager_train(model: nn.Module, batches: Sequence[Any], config: fxspeed.Config,
                loss_fn: Callable | None = None) -> list[float]:
    """Train `model` in eager PyTorch on `batches` (each a tuple of args or a dict of kwargs)."""
    model.train()
    opt, sched = torch_optimizer([p for p in model.parameters() if p.requires_grad], config)
    losses = []
    for batch in batches:
        args, kwargs = ((), batch) if isinstance(batch, dict) else (tuple(batch), {})
        opt.zero_grad(set_to_none=True)
        loss = fxspeed.extract_loss(model(*args, **kwargs), loss_fn, args, kwargs)
        loss.backward()
        if config.grad_clip is not None:
            torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.grad is not None], config.grad_clip)
        opt.step()
        sched.step()
        losses.append(loss.item())
    return losses


def fxspeed_train(model: nn.Module, batches: Sequence[Any], config: fxspeed.Config,
                  loss_fn: Callable | None = None) -> tuple[fxspeed.Engine, list[float]]:
    first = batches[0]
    engine = fxspeed.compile(model, 1, config, example_inputs=first if isinstance(first, dict) else tuple(first),
                             loss_fn=loss_fn)
    losses = []
    for batch in batches:
        losses.append(engine.train_step(**batch) if isinstance(batch, dict) else engine.train_step(*batch))
    return engine, losses


def check_parity(model: nn.Module, batches: Sequence[Any], config: fxspeed.Config | None = None,
                 loss_fn: Callable | None = None, rtol: float = RTOL) -> tuple[fxspeed.Engine, nn.Module]:
    """Train a deepcopy eagerly and the model through fxspeed on the same batches; assert the
    losses and every parameter/buffer agree. Returns (engine, eager model)."""
    config = config or fxspeed.Config()
    ref = copy.deepcopy(model)
    ref_losses = eager_train(ref, batches, config, loss_fn)
    engine, losses = fxspeed_train(model, batches, config, loss_fn)
    for i, (a, b) in enumerate(zip(losses, ref_losses)):
        assert_close_rel(a, b, f"loss at step {i}", rtol)
    assert_models_match(model, ref, rtol)
    return engine, ref


@pytest.fixture(autouse=True)
def _seeded() -> None:
    torch.manual_seed(0)


# --- Triton kernels under the interpreter ---------------------------------------------------------
# TRITON_INTERPRET=1 must be set before triton is first imported (importing fxspeed imports it,
# through torch's AOT autograd), so a kernel test file runs its interpreted tests in a child pytest
# started with it; in the parent those tests skip.

INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1"  # set by the caller, before triton was imported


def _interpreter_scalars_as_ints() -> None:
    """Triton 3.6's interpreter turns a scalar tensor into an int (`range(0, V, BLOCK)` with a runtime
    V) with int() of its 1-element 1-D array, which NumPy >= 2.4 refuses ("only 0-dimensional arrays
    can be converted to Python scalars"); later Tritons squeeze first. Do the same here."""
    try:
        from triton.runtime import interpreter
    except ImportError:
        return
    patch = getattr(interpreter, "_patch_lang_tensor", None)
    if patch is None or getattr(patch, "_fxspeed_squeezes", False):
        return

    def _patch_lang_tensor(tensor: Any, scope: Any) -> None:
        patch(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.squeeze()))

    _patch_lang_tensor._fxspeed_squeezes = True  # type: ignore[attr-defined]
    interpreter._patch_lang_tensor = _patch_lang_tensor


if INTERPRETING:
    _interpreter_scalars_as_ints()
ROOT = Path(__file__).resolve().parents[1]


def needs_interpreter() -> None:
    """Skips a kernel test outside the TRITON_INTERPRET=1 child of its file's `run_interpreted`."""
    pytest.importorskip("triton")
    if not INTERPRETING:
        pytest.skip("runs in a child pytest with TRITON_INTERPRET=1 (its file's run_interpreted test)")


def run_interpreted(test_file: str, tests: Sequence[str], timeout: int = 900) -> None:
    """Runs `tests` (names in `test_file`) in a child pytest with TRITON_INTERPRET=1 set from the
    start; asserts it passed at least one test per name and skipped none."""
    pytest.importorskip("triton")
    if INTERPRETING:
        pytest.skip("this is the interpreted run")
    here = Path(test_file).resolve().relative_to(ROOT)
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs",
                        *(f"{here}::{t}" for t in tests)],
                       cwd=ROOT, env={**os.environ, "TRITON_INTERPRET": "1"}, capture_output=True, text=True,
                       timeout=timeout)
    passed = re.search(r"(\d+) passed", r.stdout)
    assert r.returncode == 0 and passed and int(passed[1]) >= len(tests) and " skipped" not in r.stdout, \
        r.stdout[-4000:] + r.stderr[-2000:]


def needs_compiled_kernels() -> None:
    """Skips a cuda-tier kernel test in the TRITON_INTERPRET=1 run (it checks the compiled kernel)."""
    pytest.importorskip("triton")
    if INTERPRETING:
        pytest.skip("TRITON_INTERPRET=1: this test checks the compiled kernels")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Files holding `slow` tests (multi-process launches, mostly) run first, the rest after in
    their usual order. README's command runs the suite on two pytest-xdist workers, a file to a
    worker (`--dist loadfile --no-loadscope-reorder`): started last, a 5-minute file would run
    alone at the end while the other worker sat idle."""
    slow_files = {item.path for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: item.path not in slow_files)  # stable: order kept within each group


# FXSPEED_CPU_REPORT=FILE: one line per test, "nodeid<TAB>cpu s of the test process<TAB>cpu s of
# the processes it launched and waited for" (rank processes included). CPU seconds, unlike the
# --durations wall times, do not grow when the other xdist worker competes for the cores, so
# they say what the suite's wall time is made of: on 2 cores it is about their sum / 2.
if os.environ.get("FXSPEED_CPU_REPORT"):
    import resource
    import time

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Any:
        from tests.multiprocess import forked_cpu_s

        kids = resource.getrusage(resource.RUSAGE_CHILDREN)
        own, forked = time.process_time(), forked_cpu_s[0]
        yield
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        kid_s = (after.ru_utime + after.ru_stime) - (kids.ru_utime + kids.ru_stime) + forked_cpu_s[0] - forked
        with open(os.environ["FXSPEED_CPU_REPORT"], "a") as f:
            f.write(f"{item.nodeid}\t{time.process_time() - own:.2f}\t{kid_s:.2f}\n")
