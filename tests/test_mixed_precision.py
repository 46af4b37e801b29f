"""Mixed precision as passes: the cast policy seen in the compiled graph, training that
tracks fp32, fp16 loss scaling with overflow skipping, and ZeRO-3 gathers in bf16."""

from __future__ import annotations

import copy
import math
import operator
from pathlib import Path

import pytest
import torch
import torch.nn as nn

import fxspeed
from fxspeed.ir import META_KEY
from fxspeed.models import GPT, GPTConfig
from fxspeed.passes.graph.insert_casts import LOW_OPS
from tests.multiprocess import launch_worker

aten = torch.ops.aten
FP32_OPS = {aten.native_layer_norm.default, aten.native_layer_norm_backward.default, aten._log_softmax.default,
            aten._softmax.default, aten.nll_loss_forward.default, aten.nll_loss_backward.default,
            aten.sum.dim_IntList, aten.mean.dim}
LOW = {"bf16": torch.bfloat16, "fp16": torch.float16}
# The tests of the cast policy read the graph insert_casts leaves: on a CPU without native
# bf16/fp16 arithmetic upcast_cpu_compute would then compute those ops in fp32 from the same
# rounded values (tests/test_upcast_cpu_compute.py).
POLICY = dict(disable_passes=("upcast_cpu_compute",))


def tiny_gpt() -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=64, block_size=32, n_layer=2, n_head=2, n_embd=32))


def batch(seed: int = 0, rows: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, 64, (rows, 16), generator=g)
    return x, x.clone()  # a copy task: learnable within a few dozen steps


def out_dtypes(n: torch.fx.Node) -> list[torch.dtype]:
    v = n.meta.get("val")
    vals = [v] if isinstance(v, torch.Tensor) else [t for t in (v or ()) if isinstance(t, torch.Tensor)]
    return [t.dtype for t in vals]


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_matmuls_and_attention_run_in_low_precision_while_norms_softmax_and_loss_stay_fp32(precision: str) -> None:
    x, y = batch()
    engine = fxspeed.compile(tiny_gpt(), 1, fxspeed.Config(precision=precision, **POLICY), example_inputs=(x, y))
    nodes = [n for n in engine.graph().graph.nodes if n.op == "call_function"]
    low_ops = [n for n in nodes if n.target in LOW_OPS]
    assert len(low_ops) >= 10
    for n in low_ops:
        assert out_dtypes(n)[0] == LOW[precision], n.format_node()
    fp32_ops = [n for n in nodes if n.target in FP32_OPS]
    assert {n.target for n in fp32_ops} >= {aten.native_layer_norm.default, aten._log_softmax.default,
                                            aten.nll_loss_forward.default}
    for n in fp32_ops:
        assert all(d == torch.float32 for d in out_dtypes(n)), n.format_node()
        for a in n.all_input_nodes:
            assert all(d in (torch.float32, torch.int64, torch.bool) for d in out_dtypes(a)), n.format_node()


def test_each_parameter_is_cast_to_low_precision_once_for_forward_and_backward() -> None:
    x, y = batch()
    model = tiny_gpt()
    linear = {f"{m}.{p}" for m, mod in model.named_modules() if isinstance(mod, nn.Linear)
              for p, _ in mod.named_parameters(recurse=False)}
    engine = fxspeed.compile(model, 1, fxspeed.Config(precision="bf16"), example_inputs=(x, y))
    gm = engine.graph()
    sig = engine._executors[next(iter(engine._executors))].program.signature
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    casts_per_param = {}
    for spec, ph in zip(sig.inputs, placeholders):
        if spec.kind == "param":
            casts_per_param[spec.target] = sum(1 for u in ph.users if u.target == aten._to_copy.default)
    assert max(casts_per_param.values()) == 1
    fed_linear = linear & casts_per_param.keys()  # the tied head weight is fed as wte.weight
    assert len(fed_linear) >= 16 and all(casts_per_param[k] == 1 for k in fed_linear), casts_per_param
    assert casts_per_param["wte.weight"] == 1  # the tied embedding/head weight: one cast for the head


def test_modules_named_in_fp32_modules_keep_their_matmuls_in_fp32() -> None:
    x, y = batch()
    cfg = fxspeed.Config(precision="bf16", fp32_modules=("blocks.1.mlp",), **POLICY)
    engine = fxspeed.compile(tiny_gpt(), 1, cfg, example_inputs=(x, y))
    for n in engine.graph().graph.nodes:
        inf = n.meta.get(META_KEY)
        if n.target in LOW_OPS and inf is not None:
            want = torch.float32 if inf.module.startswith("blocks.1.mlp") else torch.bfloat16
            assert out_dtypes(n)[0] == want, (inf.module, n.format_node())


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_low_precision_training_tracks_fp32_losses(precision: str) -> None:
    losses = {}
    for p in ("fp32", precision):
        model = tiny_gpt()
        x, y = batch(rows=8)
        engine = fxspeed.compile(model, 1, fxspeed.Config(precision=p, lr=3e-3), example_inputs=(x, y))
        losses[p] = [engine.train_step(*batch(i % 4, rows=8)) for i in range(40)]
        assert engine.stats["skipped_steps"] == 0
    a, b = losses["fp32"], losses[precision]
    assert all(torch.isfinite(torch.tensor(b)))
    assert b[-1] < 0.8 * b[0]
    assert abs(sum(b[-5:]) - sum(a[-5:])) / sum(a[-5:]) < 0.02, (a[-5:], b[-5:])


def test_a_model_already_in_bf16_keeps_its_matmuls_bf16_and_its_first_loss_is_its_eager_loss() -> None:
    """insert_casts casts a matmul's output back to fp32 only where it was fp32 before: a model
    converted to bf16 gave bf16 there, and an fp32 copy fed the next bf16 matmul an fp32 operand
    ("mat1 and mat2 must have the same dtype", in training and in serving)."""
    model = tiny_gpt().to(torch.bfloat16)
    x, y = batch()
    with torch.no_grad():
        eager = float(model(x, y))
    engine = fxspeed.compile(model, 1, fxspeed.Config(precision="bf16"), example_inputs=(x, y))
    mms = [n for n in engine.graph().graph.nodes if n.op == "call_function" and n.target in LOW_OPS]
    assert mms and all(out_dtypes(n)[0] == torch.bfloat16 for n in mms)
    for n in mms:  # no fp32 round trip after a matmul
        assert not any(u.target is aten._to_copy.default and u.kwargs.get("dtype") == torch.float32 for u in n.users)
    losses = [engine.train_step(x, y) for _ in range(3)]
    assert abs(losses[0] - eager) <= 2e-2 * abs(eager), (losses[0], eager)
    assert losses[-1] < losses[0]


class Scaler(nn.Module):
    """A model whose gradients overflow fp16 for a batch with huge values."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.l1 = nn.Linear(8, 16)
        self.l2 = nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.l2(torch.relu(self.l1(x))).pow(2).mean()


def test_an_fp16_overflow_skips_that_step_lowers_the_scale_and_training_continues_as_if_unseen() -> None:
    g = torch.Generator().manual_seed(0)
    good = [torch.randn(4, 8, generator=g) for _ in range(4)]
    bad = torch.full((4, 8), 6e4)  # fp16 matmuls overflow to inf
    cfg = fxspeed.Config(precision="fp16", lr=1e-2, loss_scale=2.0**10)
    seen, unseen = Scaler(), Scaler()
    e1 = fxspeed.compile(seen, 1, cfg, example_inputs=(good[0],))
    e2 = fxspeed.compile(unseen, 1, copy.deepcopy(cfg), example_inputs=(good[0],))
    e1.train_step(good[0])
    e2.train_step(good[0])
    before = {k: v.clone() for k, v in seen.state_dict().items()}
    e1.train_step(bad)
    assert e1.stats["skipped_steps"] == 1 and e1.stats["loss_scale"] == 2.0**9
    for k, v in seen.state_dict().items():
        assert torch.equal(v, before[k]), k  # the overflowing step changed nothing
    for b in good[1:]:
        e1.train_step(b)
        e2.train_step(b)
    for (k, a), b in zip(seen.state_dict().items(), unseen.state_dict().values()):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7, msg=k)
    assert e1.optimizer.state_dict()["state"][0]["step"] == e2.optimizer.state_dict()["state"][0]["step"]


def test_the_gradient_norm_of_a_skipped_step_is_nan_not_the_last_clipped_steps() -> None:
    """An overflowing fp16 step is skipped before clipping: grad_norm() said the step before's
    norm (h43: 1.451 on two overflowed steps), which read as a normal step in a log."""
    g = torch.Generator().manual_seed(0)
    good = [torch.randn(4, 8, generator=g) for _ in range(2)]
    engine = fxspeed.compile(Scaler(), 1, fxspeed.Config(precision="fp16", lr=1e-2, loss_scale=2.0**10, grad_clip=1.0),
                             example_inputs=(good[0],))
    engine.train_step(good[0])
    assert math.isfinite(engine.grad_norm())
    engine.train_step(torch.full((4, 8), 6e4))
    assert engine.stats["skipped_steps"] == 1 and math.isnan(engine.grad_norm())
    engine.train_step(good[1])
    assert math.isfinite(engine.grad_norm())


def test_the_loss_scale_grows_after_a_window_of_clean_steps() -> None:
    x = torch.randn(4, 8)
    engine = fxspeed.compile(Scaler(), 1, fxspeed.Config(precision="fp16", loss_scale=8.0, loss_scale_window=3),
                             example_inputs=(x,))
    for _ in range(6):
        engine.train_step(x)
    assert engine.stats["loss_scale"] == 32.0 and engine.stats["skipped_steps"] == 0


@pytest.mark.slow
def test_on_two_ranks_an_overflow_on_one_rank_skips_everywhere_is_said_once_and_zero3_gathers_half_the_bytes_in_bf16(
        tmp_path: Path) -> None:
    launch_worker("tests.workers.mixed_precision_worker", 2, tmp_path, timeout=600)
    res = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    for r in res:
        assert r["skipped"] == [0, 1, 0], r["skipped"]  # step 2 overflowed on rank 1 only
        # Bytes per gathered element (how many gathers a precision needs can differ a little:
        # shard_parameters re-gathers a bucket whose readers are far apart).
        (b32, n32), (b16, n16) = r["gather_bytes"]["fp32"], r["gather_bytes"]["bf16"]
        assert n32 > 0 and n16 > 0
        assert b32 == 4 * n32 and b16 == 2 * n16
        assert r["workspaces"]["fp32"] > 0 and r["workspaces"]["bf16"] > 0
    assert res[0]["state"].keys() == res[1]["state"].keys()
    for k in res[0]["state"]:
        assert torch.equal(res[0]["state"][k], res[1]["state"][k]), k
    # The skip is agreed, so one rank says it (every rank's line was the same line twice).
    assert [r["overflow_lines"] for r in res] == [1, 0]


# ------------------------------------------------------------------------------------------
# Attention masks follow the query's dtype (CUDA's memory-efficient kernel refuses an fp32
# bias next to a bf16 query); fp16 loss scaling keeps its flag on the gradients' device
# ------------------------------------------------------------------------------------------

def _attention_masks(gm: torch.fx.GraphModule) -> list[tuple[torch.fx.Node, torch.dtype, torch.dtype]]:
    """(node, query dtype, mask dtype) of every attention node given a tensor mask."""
    from fxspeed.passes.graph.insert_casts import MASK_ARGS

    found = []
    for n in gm.graph.nodes:
        if n.op != "call_function" or n.target not in MASK_ARGS:
            continue
        q_pos, (m_pos, key) = MASK_ARGS[n.target]
        m = n.args[m_pos] if m_pos is not None and m_pos < len(n.args) else n.kwargs.get(key)
        if isinstance(m, torch.fx.Node):
            found.append((n, n.args[q_pos].meta["val"].dtype, m.meta["val"].dtype))
    return found


def _run_insert_casts(gm: torch.fx.GraphModule, precision: str) -> torch.fx.GraphModule:
    from fxspeed.compiler.annotate import make_annotate_pass
    from fxspeed.compiler.pass_manager import PassContext, PassManager
    from fxspeed.ir import IOSpec, StepSignature
    from fxspeed.passes import insert_casts

    n_in = sum(n.op == "placeholder" for n in gm.graph.nodes)
    n_out = len(next(n for n in gm.graph.nodes if n.op == "output").args[0])
    sig = StepSignature([IOSpec("input", str(i)) for i in range(n_in)], [IOSpec("output", str(i)) for i in range(n_out)])
    ctx = PassContext(signature=sig, options={"precision": precision})
    return PassManager([insert_casts], analyses=[make_annotate_pass()]).run(gm, ctx)


def _hf_lm(kind: str) -> nn.Module:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    if kind == "gpt2":
        cfg = transformers.GPT2Config(vocab_size=64, n_positions=32, n_embd=32, n_layer=2, n_head=2, resid_pdrop=0.0,
                                      embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
        cfg._attn_implementation = "sdpa"
        return transformers.GPT2LMHeadModel(cfg)
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32,
                                   bos_token_id=0, eos_token_id=0, pad_token_id=0)
    cfg._attn_implementation = "sdpa"
    return transformers.LlamaForCausalLM(cfg)


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_a_padded_hf_models_attention_mask_is_cast_to_the_querys_dtype(kind: str, precision: str) -> None:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, 64, (2, 16), generator=g)
    mask = torch.ones(2, 16, dtype=torch.long)
    mask[0, 12:] = 0  # padding: the model builds a floating mask rather than is_causal=True
    b = {"input_ids": ids, "attention_mask": mask, "labels": ids}
    engine = fxspeed.compile(_hf_lm(kind), 1, fxspeed.Config(precision=precision, **POLICY), example_inputs=b)
    masks = _attention_masks(engine.graph())
    assert len(masks) >= 4, "no attention node with a mask: the test would prove nothing"  # 2 layers x fwd+bwd
    for n, q, m in masks:
        assert q == LOW[precision] and m == q, n.format_node()
    # the masks are cast once per tensor, shared by forward and backward
    assert len({n.kwargs.get("attn_mask", None) for n, _, _ in masks}) <= len(masks) // 2
    losses = [engine.train_step(**b) for _ in range(3)]
    assert all(torch.isfinite(torch.tensor(losses))) and losses[-1] < losses[0]


def _efficient_attention_step(q, k, v, bias, go):  # noqa: ANN001, ANN202 - traced by make_fx
    # The CUDA kernels' forward and backward, as capture emits them for a masked attention.
    out, lse, seed, offset = aten._scaled_dot_product_efficient_attention.default(q, k, v, bias, True, 0.0, False)
    gq, gk, gv, _ = aten._scaled_dot_product_efficient_attention_backward.default(
        go, q, k, v, bias, out, lse, seed, offset, 0.0, [True, True, True, False], False)
    return out, gq, gk, gv


def _padded_bias(b: torch.Tensor, rows: int) -> torch.Tensor:  # noqa: ANN202 - traced
    # What SDPA's composite does on CUDA for the memory-efficient kernel: broadcast the mask to
    # [B, H, L, S] and pad its last dimension to a multiple of 16, sliced back.
    full = aten.expand.default(b, [2, 2, rows, rows])
    padded = aten.constant_pad_nd.default(full, [0, 16 - rows % 16])
    return aten.slice.Tensor(padded, -1, 0, rows)


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_efficient_attentions_bias_and_its_backwards_out_follow_the_query_into_low_precision(precision: str) -> None:
    from torch.fx.experimental.proxy_tensor import make_fx

    rows = 12

    def step(q, k, v, b, go):  # noqa: ANN001, ANN202
        return _efficient_attention_step(q, k, v, _padded_bias(b, rows), go)

    qkv = [torch.randn(2, 2, rows, 8) for _ in range(3)]
    gm = make_fx(step, tracing_mode="fake")(*qkv, torch.randn(2, 1, rows, rows), torch.randn(2, 2, rows, 8))
    gm = _run_insert_casts(gm, precision)
    low = LOW[precision]
    fwd = next(n for n in gm.graph.nodes if n.target is aten._scaled_dot_product_efficient_attention.default)
    bwd = next(n for n in gm.graph.nodes if n.target is aten._scaled_dot_product_efficient_attention_backward.default)
    for n in (fwd, bwd):
        q = n.args[0 if n is fwd else 1]
        bias = n.args[3 if n is fwd else 4]
        assert q.meta["val"].dtype == low and bias.meta["val"].dtype == low, n.format_node()
        # cast at the root of the view chain: the slice of the padded tensor keeps its aligned row stride
        assert bias.target is aten.slice.Tensor and bias.meta["val"].stride()[-2] == 16, bias.format_node()
    assert fwd.args[3] is bwd.args[4], "forward and backward read one low-precision bias"
    out = bwd.args[5]  # the forward's raw low-precision output, not an fp32 round trip
    assert out.target is operator.getitem and out.args[0] is fwd and out.meta["val"].dtype == low
    assert bwd.args[6].meta["val"].dtype == torch.float32  # logsumexp stays as produced
    assert sum(n.target is aten._to_copy.default and n.kwargs.get("dtype") == low for n in gm.graph.nodes) == 5


def test_causal_efficient_attentions_backward_reads_the_forwards_low_precision_output() -> None:
    # fxspeed's GPT on CUDA: captured in fp32, SDPA picks the memory-efficient kernel (is_causal,
    # no bias). Its backward's `out` is argument 5 (4 is the bias): left as the fp32 cast-back,
    # the bf16 kernel would read fp32 bytes as bf16 (it checks the bias dtype, not out's) and
    # compute the softmax-gradient row sums from the wrong values.
    from torch.fx.experimental.proxy_tensor import make_fx

    def step(q, k, v, go):  # noqa: ANN001, ANN202
        out, lse, seed, offset = aten._scaled_dot_product_efficient_attention.default(q, k, v, None, True, 0.0, True)
        gq, gk, gv, _ = aten._scaled_dot_product_efficient_attention_backward.default(
            go, q, k, v, None, out, lse, seed, offset, 0.0, [True, True, True, False], True)
        return out, gq, gk, gv

    gm = make_fx(step, tracing_mode="fake")(*[torch.randn(2, 2, 16, 8) for _ in range(4)])
    gm = _run_insert_casts(gm, "bf16")
    fwd = next(n for n in gm.graph.nodes if n.target is aten._scaled_dot_product_efficient_attention.default)
    bwd = next(n for n in gm.graph.nodes if n.target is aten._scaled_dot_product_efficient_attention_backward.default)
    assert bwd.args[4] is None
    for i in (0, 1, 2, 3, 5):
        assert bwd.args[i].meta["val"].dtype == torch.bfloat16, (i, bwd.format_node())
    assert bwd.args[5].target is operator.getitem and bwd.args[5].args == (fwd, 0)
    assert bwd.args[6].meta["val"].dtype == torch.float32


def test_a_bool_mask_stays_bool_and_a_mask_already_in_the_querys_dtype_is_left_alone() -> None:
    from torch.fx.experimental.proxy_tensor import make_fx

    def step(q, k, v, m):  # noqa: ANN001, ANN202
        out, _ = aten._scaled_dot_product_flash_attention_for_cpu.default(q, k, v, attn_mask=m)
        return (out,)

    qkv = [torch.randn(1, 2, 8, 4) for _ in range(3)]
    gm = _run_insert_casts(make_fx(step, tracing_mode="fake")(*qkv, torch.ones(8, 8, dtype=torch.bool).tril()),
                           "bf16")
    [(_, q, m)] = _attention_masks(gm)
    assert (q, m) == (torch.bfloat16, torch.bool)

    def composite(q, k, v, m):  # noqa: ANN001, ANN202 - the composite op, mask in fp32
        return (aten.scaled_dot_product_attention.default(q, k, v, m),)

    gm = _run_insert_casts(make_fx(composite, tracing_mode="fake", pre_dispatch=True)(*qkv, torch.zeros(8, 8)),
                           "bf16")
    masks = _attention_masks(gm)
    assert masks and all(m == q == torch.bfloat16 for _, q, m in masks), [n.format_node() for n, _, _ in masks]


def test_the_loss_scaler_unscales_on_the_cpu_exactly_as_before() -> None:
    from fxspeed.runtime.loss_scale import DynamicLossScaler

    s = DynamicLossScaler(init_scale=4.0)
    grads = [torch.tensor([4.0, 8.0]), torch.tensor([[2.0]])]
    assert s.unscale_and_check(grads) is False
    assert torch.equal(grads[0], torch.tensor([1.0, 2.0])) and torch.equal(grads[1], torch.tensor([[0.5]]))
    assert s.scale.device.type == "cpu"
    assert s.unscale_and_check([torch.tensor([float("inf")])]) is True
    assert s.unscale_and_check([]) is False


def test_the_loss_scalers_overflow_flag_and_scale_live_on_the_gradients_device(monkeypatch) -> None:  # noqa: ANN001
    from fxspeed.runtime import loss_scale

    seen = []

    def check(grads, found, inv_scale):  # noqa: ANN001, ANN202 - the CUDA kernel's device check
        seen.append((found.device, inv_scale.device))
        assert found.device == inv_scale.device == grads[0].device, "found_inf / inv_scale off the gradients' device"

    monkeypatch.setattr(torch, "_amp_foreach_non_finite_check_and_unscale_", check)
    monkeypatch.setattr(torch.Tensor, "item", lambda self: 0.0)  # meta tensors hold no value to read
    s = loss_scale.DynamicLossScaler(init_scale=8.0)
    grads = [torch.empty(3, device="meta"), torch.empty(2, 2, device="meta")]
    assert s.unscale_and_check(grads) is False
    assert seen == [(torch.device("meta"), torch.device("meta"))]
    assert s.scale.device.type == "meta"  # moved once, where the gradients are
    s.update(overflow=True)
    assert s.scale.device.type == "meta"


def test_fp32_modules_keeps_a_bias_free_linear_heads_matmul_in_fp32() -> None:
    """The head's mm reads its weight through t(): its module was taken from its other input (the
    last block's), so a bias-free head named in fp32_modules computed in bf16 with no word."""
    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body = nn.Linear(16, 16)
            self.head = nn.Linear(16, 8, bias=False)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(torch.tanh(self.body(x))).square().mean()

    x = torch.randn(4, 16)
    engine = fxspeed.compile(Net(), 1, fxspeed.Config(precision="bf16", fp32_modules=("head",)), example_inputs=(x,))
    engine.train_step(x)
    gm = engine.graph()
    head_mm = [n for n in gm.graph.nodes if n.target is torch.ops.aten.mm.default
               and n.args[0].meta["val"].shape == (4, 16) and n.meta["val"].shape == (4, 8)]
    assert head_mm and all(a.meta["val"].dtype == torch.float32 for a in head_mm[0].all_input_nodes)


def test_a_model_already_in_fp16_trains_under_fp16_loss_scaling_as_eager_scaled_backward_does() -> None:
    """Its loss is fp16, and the seed times the fp32 scale promoted to fp32, which the first
    backward op refused ("expected scalar type Half but found Float") at the first step."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=1, n_embd=32, n_head=2, vocab_size=64, block_size=16)).half()
    ref = copy.deepcopy(model)
    x = torch.randint(0, 64, (2, 8))
    engine = fxspeed.compile(model, config=fxspeed.Config(precision="fp16", optimizer="sgd", lr=0.1),
                             example_inputs=(x, x))
    opt, scale = torch.optim.SGD(ref.parameters(), lr=0.1), 2.0 ** 16
    for _ in range(3):
        loss = engine.train_step(x, x)
        opt.zero_grad()
        ref_loss = ref(x, x)
        (ref_loss * torch.tensor(scale)).backward()  # GradScaler refuses fp16 gradients: its steps by hand
        grads = [p.grad for p in ref.parameters()]
        if all(torch.isfinite(g).all() for g in grads):
            for g in grads:
                g.div_(scale)
            opt.step()
        else:
            scale /= 2
        # (bit for bit where fp16 is native; a CPU without it computes fp16 matmuls in fp32
        # from the rounded values, upcast_cpu_compute, which rounds otherwise than eager's kernels)
        assert loss == pytest.approx(ref_loss.item(), rel=1e-2)
    assert float(engine.scaler.scale) == scale == 2.0 ** 15  # the first step's fp16 seed 65536 overflowed
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.float(), q.float(), rtol=2e-2, atol=2e-3)


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_parameters_that_are_not_fp32_under_mixed_precision_are_said_to_train_in_their_own_dtype(
        dtype: torch.dtype, caplog: pytest.LogCaptureFixture) -> None:
    """precision='bf16' casts fp32 values only: a float64 model trained entirely in float64, a
    bf16 one in pure bf16 without masters, and nothing said so."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=1, n_embd=32, n_head=2, vocab_size=64, block_size=16)).to(dtype)
    x = torch.randint(0, 64, (2, 8))
    with caplog.at_level("WARNING", logger="fxspeed"):
        fxspeed.compile(model, config=fxspeed.Config(precision="bf16"), example_inputs=(x, x))
    assert f"has {str(dtype).removeprefix('torch.')} trainable parameters" in caplog.text


class _ComplexRotaryLM(nn.Module):
    """Rotary embeddings through complex numbers, as the original Llama code writes them."""

    def __init__(self) -> None:
        super().__init__()
        self.emb, self.qkv, self.out, self.head = nn.Embedding(64, 32), nn.Linear(32, 96), nn.Linear(32, 32), nn.Linear(32, 64)
        freqs = 1.0 / (10000 ** (torch.arange(0, 16, 2).float() / 16))
        self.register_buffer("cis", torch.polar(torch.ones(16, 8), torch.outer(torch.arange(16).float(), freqs)),
                             persistent=False)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.emb(x)
        B, T, D = h.shape
        q, k, v = self.qkv(h).view(B, T, 3, 2, D // 2).unbind(2)
        cis = self.cis[:T, None, :]

        def rotate(t: torch.Tensor) -> torch.Tensor:
            c = torch.view_as_complex(t.float().reshape(*t.shape[:-1], -1, 2))
            return torch.view_as_real(c * cis).flatten(3).type_as(t)

        a = torch.nn.functional.scaled_dot_product_attention(rotate(q).transpose(1, 2), rotate(k).transpose(1, 2),
                                                             v.transpose(1, 2), is_causal=True)
        h = h + self.out(a.transpose(1, 2).reshape(B, T, D))
        return torch.nn.functional.cross_entropy(self.head(h).flatten(0, 1), y.flatten())


def test_a_complex_rotary_trains_under_bf16_as_eager_autocast_computes_it() -> None:
    """insert_casts moved its cast in front of `view_as_real` onto the complex value ("view_as_real
    is only supported for complex tensors"); a view that changes the dtype is not looked through."""
    torch.manual_seed(0)
    model = _ComplexRotaryLM()
    ref = copy.deepcopy(model)
    x = torch.randint(0, 64, (2, 8))
    engine = fxspeed.compile(model, config=fxspeed.Config(precision="bf16"), example_inputs=(x, x))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = ref(x, x).item()
    assert engine.train_step(x, x) == pytest.approx(want, rel=5e-3)  # bf16 kernels may differ by CPU
