"""Torch's process-wide modes around fxspeed's public calls: autocast is refused by name (mixed
precision is Config.precision), grad and inference modes do not change what a step computes."""

from __future__ import annotations

import copy
import math

import pytest
import torch

import fxspeed
from fxspeed.errors import ConfigError
from fxspeed.models import GPT, GPTConfig


def _gpt() -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(n_layer=1, n_embd=32, n_head=2, vocab_size=64, block_size=16))


def test_compile_train_step_and_eval_step_under_autocast_are_refused_naming_config_precision() -> None:
    """An autocast around compile was baked into the program (later plain steps stayed bf16:
    loss 5.571388 where eager fp32 gives 5.571616); one around a replay changed some ops only."""
    model, x = _gpt(), torch.randint(0, 64, (2, 8))
    with torch.autocast("cpu", dtype=torch.bfloat16), pytest.raises(ConfigError, match="precision='bf16'"):
        fxspeed.compile(model, example_inputs=(x, x))
    engine = fxspeed.compile(model, example_inputs=(x, x))
    for call in (engine.train_step, engine.eval_step):
        with torch.autocast("cpu", dtype=torch.bfloat16), pytest.raises(ConfigError, match="torch.autocast"):
            call(x, x)
    assert engine.train_step(x, x) == pytest.approx(float(_gpt()(x, x)), rel=1e-5)


@pytest.mark.parametrize("mode", ["no_grad", "inference_mode"])
def test_a_step_traced_under_no_grad_or_inference_mode_trains_as_eager(mode: str) -> None:
    """The trace said "the loss does not depend on any trainable parameter"."""
    model, x, y = _gpt(), torch.randint(0, 64, (2, 8)), torch.randint(0, 64, (3, 8))
    ref = copy.deepcopy(model)
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, fused=True)
    ctx = torch.no_grad if mode == "no_grad" else torch.inference_mode
    with ctx():
        engine = fxspeed.compile(model, config=fxspeed.Config(lr=1e-3), example_inputs=(x, x))
        losses = [engine.train_step(b, b) for b in (x, y)]  # y: a new shape, traced here
    losses.append(engine.train_step(x, x))  # outside the mode now: states made under it still step
    for b, loss in zip((x, y, x), losses):
        opt.zero_grad()
        ref_loss = ref(b, b)
        ref_loss.backward()
        opt.step()
        assert loss == pytest.approx(float(ref_loss), rel=1e-5)  # conftest's RTOL: fp32 summation orders


def test_an_fp16_engine_compiled_under_inference_mode_trains_outside_it() -> None:
    """Its loss scale was an inference tensor, which the first step outside could not write."""
    model, x = _gpt(), torch.randint(0, 64, (2, 8))
    with torch.inference_mode():
        engine = fxspeed.compile(model, config=fxspeed.Config(precision="fp16"), example_inputs=(x, x))
    assert math.isfinite(engine.train_step(x, x))


def test_serving_under_inference_mode_or_a_stream_read_under_autocast_gives_the_same_tokens() -> None:
    """A cache made under inference_mode could not be written outside it; metadata made under it has
    no version counter (generate crashed in the paged attention's memo)."""
    model = _gpt()
    prompts = [[1, 2, 3, 4, 5], [7, 8, 9]]
    want = fxspeed.serve(copy.deepcopy(model)).generate(prompts, max_new_tokens=6)
    with torch.inference_mode():
        engine = fxspeed.serve(model)
        assert engine.generate(prompts, max_new_tokens=6) == want
    assert engine.generate(prompts, max_new_tokens=6) == want
    with torch.autocast("cpu", dtype=torch.bfloat16), pytest.raises(ConfigError, match="engine.generate"):
        engine.generate(prompts, max_new_tokens=6)
    got: dict[int, list[int]] = {0: [], 1: []}
    tokens = engine.stream(prompts, max_new_tokens=6)
    with torch.autocast("cpu", dtype=torch.bfloat16):  # the steps run as the caller iterates
        for req, token in tokens:
            got[req].append(token)
    assert [got[0], got[1]] == want
