"""drop_clones: a serving program reads a value itself where the capture copied it, and only where
no reader can tell (the layout kept, nothing written in place, no output aliasing another value)."""

from __future__ import annotations

import pytest
import torch
import torch.fx as fx
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.fx.experimental.proxy_tensor import make_fx

import fxspeed
from fxspeed.compiler.annotate import make_annotate_pass
from fxspeed.compiler.capture_inference import compile_inference
from fxspeed.compiler.pass_manager import PassContext, PassManager
from fxspeed.config import Config
from fxspeed.ir import IOSpec, StepSignature
from fxspeed.passes.inference.drop_clones import drop_clones

aten = torch.ops.aten
LAYOUTS = {"contiguous": lambda x: x * 1, "transposed": lambda x: (x * 1).t(), "sliced": lambda x: (x * 1)[:, 1:],
           "an input": lambda x: x}
FORMATS = {"unset": {}, "preserve": {"memory_format": torch.preserve_format},
           "contiguous": {"memory_format": torch.contiguous_format}}


def _clones(gm: fx.GraphModule) -> int:
    return sum(n.target is aten.clone.default for n in gm.graph.nodes)


def _run(gm: fx.GraphModule) -> fx.GraphModule:
    n_in = sum(n.op == "placeholder" for n in gm.graph.nodes)
    n_out = len(next(n for n in gm.graph.nodes if n.op == "output").args[0])
    sig = StepSignature([IOSpec("input", str(i)) for i in range(n_in)], [IOSpec("output", str(i)) for i in range(n_out)])
    return PassManager([drop_clones], analyses=[make_annotate_pass()]).run(gm, PassContext(signature=sig))


@settings(max_examples=40, deadline=None)
@given(layout=st.sampled_from(sorted(LAYOUTS)), fmt=st.sampled_from(sorted(FORMATS)), returned=st.booleans(),
       written=st.booleans(), flat_reader=st.booleans())
def test_a_copy_is_dropped_exactly_when_its_layout_is_kept_nothing_writes_its_input_and_it_is_not_returned(
        layout, fmt, returned, written, flat_reader):
    """Every value the program returns is the same before and after, no output shares memory with
    an input or another output where it did not, and the copy goes only under all three conditions."""

    def f(x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        y = LAYOUTS[layout](x)
        c = aten.clone.default(y, **FORMATS[fmt])
        if written:
            y.add_(1.0)  # an in-place write after the copy: the copy's value is the one before it
        r = c.reshape(-1) * 2 if flat_reader else c * 2  # a flat view of c needs c's layout
        return (c, r) if returned else (r,)

    x = torch.randn(4, 6)
    gm = make_fx(f, tracing_mode="fake")(x)
    ours = next(n.name for n in gm.graph.nodes if n.target is aten.clone.default)  # (a reshape may add one)
    before = gm(x.clone())
    gm = _run(gm)
    a = x.clone()
    after = gm(a)
    assert all(torch.equal(p, q) for p, q in zip(before, after))
    ptrs = [t.untyped_storage().data_ptr() for t in after]
    assert a.untyped_storage().data_ptr() not in ptrs and len(set(ptrs)) == len(ptrs)
    # a clone that asks for a layout stays even where it has it already (the pass does not reason about formats)
    same_layout = layout in ("contiguous", "transposed", "an input") and fmt != "contiguous"
    kept = any(n.name == ours for n in gm.graph.nodes)
    assert kept != (same_layout and not written and not returned)


def test_a_copy_of_a_view_of_a_value_written_in_place_stays():
    """The write reaches the copied value through its base: the copy must keep the value before."""

    def f(x: torch.Tensor) -> tuple[torch.Tensor]:
        base = x * 1
        c = aten.clone.default(base.view(2, 12))
        base.mul_(3.0)
        return (c + base.view(2, 12),)

    x = torch.randn(4, 6)
    gm = _run(make_fx(f, tracing_mode="fake")(x))
    assert _clones(gm) == 1
    torch.testing.assert_close(gm(x)[0], (x + 3 * x).view(2, 12))


def test_a_copy_written_through_a_piece_of_a_split_of_its_input_or_returned_through_a_view_stays():
    """A write into one chunk of a split of the copied value reaches the value; a returned view of
    the copy would alias the input (here the program's own input) once the copy is gone."""

    def written(x: torch.Tensor) -> tuple[torch.Tensor]:
        base = x * 1
        c = aten.clone.default(base)
        base.split(2)[0].add_(5.0)
        return (c + base,)

    def returned(x: torch.Tensor) -> tuple[torch.Tensor]:
        return (aten.clone.default(x).view(-1),)

    x = torch.randn(4, 6)
    for f in (written, returned):
        gm = _run(make_fx(f, tracing_mode="fake")(x))
        assert _clones(gm) == 1, f.__name__
        a = x.clone()
        torch.testing.assert_close(gm(a)[0], f(x.clone())[0])
    out = gm(a)[0]
    assert out.untyped_storage().data_ptr() != a.untyped_storage().data_ptr()


def test_a_gpt2_serving_program_reads_its_residual_branches_without_copying_them_and_generates_the_same_tokens():
    """An eval-mode capture of HF GPT-2 copies the embedding sum and both residual branches of
    every layer (dropout): the serving program copies none of them, and serves the same tokens."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=4, n_positions=64, vocab_size=96,
                                  attn_implementation="sdpa")
    model = transformers.GPT2LMHeadModel(cfg).eval()
    assert _clones(compile_inference(model, 8, config=Config()).gm) == 0
    kept = Config(disable_passes=("drop_clones",))
    assert _clones(compile_inference(model, 8, config=kept).gm) == 1 + 2 * 2
    small = dict(token_budget=8, max_batch=3, block_size=4, cache_tokens=96)
    prompts = [[5, 17, 3], list(range(10, 30)), [7]]
    assert fxspeed.serve(model, **small).generate(prompts, max_new_tokens=6) == \
        fxspeed.serve(model, config=kept, **small).generate(prompts, max_new_tokens=6)


if __name__ == "__main__":
    pytest.main([__file__, "-q"])
