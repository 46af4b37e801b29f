"""Activation offload (Config.offload="activations"): forward's saved activations leave the
device after forward makes them and come back ahead of backward's first reader
(passes/memory/offload_activations.py, runtime/offloaded_activations.py). On the CPU they go to a
swap file under nvme_path.

The bytes come back exactly, so parity with the same run without offload is bit for bit."""

from __future__ import annotations

import gc
import operator
from pathlib import Path

import pytest
import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import fxspeed
from fxspeed.compiler.options import PassOptions
from fxspeed.compiler.pipelines import compile_step
from fxspeed.errors import ConfigError, FxspeedError
from fxspeed.ir import BACKWARD, META_KEY
from fxspeed.models import GPT, GPTConfig
from fxspeed.runtime.offloaded_activations import (ActivationOffload, offload_activation_op,
                                                   prefetch_activation_op, register, reload_activation_op)

V, T = 256, 64


def _gpt(seed: int = 0, layers: int = 2, width: int = 128) -> GPT:
    torch.manual_seed(seed)
    return GPT(GPTConfig(vocab_size=V, block_size=T, n_layer=layers, n_head=4, n_embd=width))


def _batch(b: int = 8, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, V, (b, T), generator=g), torch.randint(0, V, (b, T), generator=g)


def _swap_dirs(root: Path) -> list[Path]:
    return list(root.glob("fxspeed-swap-*"))


# --------------------------------------------------------------------------------------------
# The engine: parity, what moved, cleanup
# --------------------------------------------------------------------------------------------

# (bf16 with zero=1: activation offload alone once switched on the fp32 masters of the optimizer
# offload's layout on one process, which rounds the update differently)
@pytest.mark.parametrize("precision, zero", [("fp32", 0), ("bf16", 1)])
def test_training_with_offloaded_activations_equals_training_without_bit_for_bit(tmp_path: Path,
                                                                                precision: str, zero: int) -> None:
    x, y = _batch(16)
    # recompute_pointwise off: the counts below are of the values autograd saves (with it on, a
    # bf16 program keeps fewer of them at >= 1 MiB, and fewer move). upcast_cpu_compute off: on a
    # CPU without native bf16 its fp32 copies of a weight and of an activation live at the peak,
    # next to the saved values offloading halves (planned activations 7.9 -> 5.8 MB with it on).
    cfg = dict(lr=1e-3, precision=precision, zero=zero, disable_passes=("recompute_pointwise", "upcast_cpu_compute"))
    plain = fxspeed.compile(_gpt(), 1, fxspeed.Config(**cfg), example_inputs=(x, y))
    off = fxspeed.compile(_gpt(), 1, fxspeed.Config(**cfg, offload="activations", nvme_path=str(tmp_path)),
                          example_inputs=(x, y))
    for step in range(3):
        xs, ys = _batch(16, seed=10 + step)
        assert plain.train_step(xs, ys) == off.train_step(xs, ys), f"step {step}"
    for (name, a), b in zip(plain.model.named_parameters(), off.model.parameters()):
        assert torch.equal(a, b), name
    store = off._activations
    n = len(off._executors[next(iter(off._executors))].program.signature.offloaded_activations)
    assert n >= 4 and store.stats["offloads"] == store.stats["reloads"] == 3 * n
    assert store.stats["waited_reads"] == 0  # every read was started ahead of its reload
    moved = off.plan.offloaded["activations (disk)"]
    assert moved == sum(store.sizes.values())
    assert off.plan.memory(0)["activations"] < plain.plan.memory(0)["activations"] / 2
    assert "activations (disk)" in off.plan.summary()
    assert len(_swap_dirs(tmp_path)) == 1
    del off, store
    gc.collect()
    assert _swap_dirs(tmp_path) == []  # the engine's swap directory goes with it


def test_an_hf_llama_with_a_non_contiguous_batch_trains_the_same_with_its_activations_offloaded(
        tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=V, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=T,
                                   bos_token_id=0, eos_token_id=0, pad_token_id=0)
    cfg._attn_implementation = "sdpa"

    def build() -> nn.Module:
        torch.manual_seed(0)
        return transformers.LlamaForCausalLM(cfg)

    ids = torch.randint(1, V, (16, T + 1), generator=torch.Generator().manual_seed(3))
    batch = {"input_ids": ids[:, :-1], "labels": ids[:, :-1]}  # a non-contiguous view of a wider tensor
    assert not batch["input_ids"].is_contiguous()
    plain = fxspeed.compile(build(), 1, fxspeed.Config(lr=1e-3), example_inputs=batch)
    off = fxspeed.compile(build(), 1, fxspeed.Config(lr=1e-3, offload="activations", nvme_path=str(tmp_path)),
                          example_inputs=batch)
    for _ in range(2):
        assert plain.train_step(**batch) == off.train_step(**batch)
    assert off._activations.stats["offloads"] > 0
    for (name, a), b in zip(plain.model.named_parameters(), off.model.parameters()):
        assert torch.equal(a, b), name


def test_a_checkpoint_saved_with_offloaded_activations_resumes_the_same_run(tmp_path: Path) -> None:
    x, y = _batch(16)
    swap = tmp_path / "swap"
    swap.mkdir()
    cfg = fxspeed.Config(lr=1e-3, offload="activations", nvme_path=str(swap))
    a = fxspeed.compile(_gpt(), 1, cfg, example_inputs=(x, y))
    a.train_step(x, y)
    a.save(tmp_path / "ck")
    want = [a.train_step(x, y) for _ in range(2)]
    b = fxspeed.compile(_gpt(seed=5), 1, cfg, example_inputs=(x, y))
    b.load(tmp_path / "ck")
    assert [b.train_step(x, y) for _ in range(2)] == want


def test_plan_shows_the_offloaded_activations_and_counts_them_gone_on_a_meta_model() -> None:
    with torch.device("meta"):
        model = GPT(GPTConfig(vocab_size=V, block_size=T, n_layer=4, n_head=4, n_embd=256))
    x = torch.randint(0, V, (16, T), device="meta")
    plain = fxspeed.plan(model, 1, fxspeed.Config(), example_inputs=(x, x))
    off = fxspeed.plan(model, 1, fxspeed.Config(offload="activations", nvme_path="/tmp"), example_inputs=(x, x))
    assert off.offloaded["activations (disk)"] > 0.5 * plain.memory(0)["activations"]
    assert off.memory(0)["total"] < plain.memory(0)["total"]
    assert any("offload_activations" in n for n in off.notes)


def test_a_pipeline_plan_moves_the_saved_activations_of_micro_batches_waiting_for_their_backward() -> None:
    with torch.device("meta"):
        model = GPT(GPTConfig(vocab_size=V, block_size=T, n_layer=4, n_head=4, n_embd=512))
    x = torch.randint(0, V, (64, T), device="meta")  # micro-batches of 8 x 64 x 512: 1 MiB activations
    # recompute_pointwise off: the halving below is of every saved activation (with it on, the
    # GELU outputs are recomputed, not saved, and the plain plan has fewer to move)
    cfg = dict(pipeline=2, microbatches=8, schedule="gpipe", disable_passes=("recompute_pointwise",))
    plain = fxspeed.plan(model, 2, fxspeed.Config(**cfg), example_inputs=(x, x))
    off = fxspeed.plan(model, 2, fxspeed.Config(**cfg, offload="activations", nvme_path="/tmp"), example_inputs=(x, x))
    # gpipe holds every micro-batch's activations until backward: moved, rank 0 peaks lower
    assert off.memory(0)["activations"] < plain.memory(0)["activations"] / 2
    assert off.memory(0)["total"] < plain.memory(0)["total"]


@pytest.mark.parametrize("cfg, words", [
    (dict(offload="activations", offload_device="cpu"), ["offload_device='cpu'", "nvme"]),
    (dict(offload="activations"), ["nvme_path"]),
])
def test_activation_offload_settings_that_cannot_work_here_are_errors_naming_the_key(cfg: dict,
                                                                                     words: list[str]) -> None:
    x, y = _batch(2)
    with pytest.raises((ConfigError, FxspeedError)) as e:
        fxspeed.compile(_gpt(), 1, fxspeed.Config(**cfg), example_inputs=(x, y))
    assert all(w in str(e.value) for w in words), str(e.value)


def test_the_pass_is_disabled_by_name_and_then_nothing_moves(tmp_path: Path) -> None:
    x, y = _batch(16)
    e = fxspeed.compile(_gpt(), 1, fxspeed.Config(offload="activations", nvme_path=str(tmp_path),
                                                   disable_passes=("offload_activations",)), example_inputs=(x, y))
    e.train_step(x, y)
    assert e._activations.stats["offloads"] == 0 and "activations (disk)" not in e.plan.offloaded


# --------------------------------------------------------------------------------------------
# The rewrite: random models, every activation offloaded, checked by a validator
# --------------------------------------------------------------------------------------------

class Random(nn.Module):
    """Blocks drawn by hypothesis; "tanh_t" saves a transposed (permuted, dense) activation,
    "split" reads views of one activation through split/getitem in backward, "as_strided" views
    one at an absolute storage offset."""

    def __init__(self, width: int, blocks: list[str]) -> None:
        super().__init__()
        self.blocks = blocks
        self.lins = nn.ModuleList(nn.Linear(width, width) for _ in blocks)
        self.norms = nn.ModuleList(nn.LayerNorm(width) for _ in blocks)
        self.head = nn.Linear(width, 5)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = x
        for kind, lin, norm in zip(self.blocks, self.lins, self.norms):
            if kind == "gelu":
                h = F.gelu(lin(h))
            elif kind == "tanh_t":
                h = torch.tanh(lin(h).t()).t()
            elif kind == "norm_residual":
                h = h + lin(norm(h))
            elif kind == "as_strided":  # a view at an absolute storage offset: must stay on the device
                h = F.gelu(lin(h))
                u = h.as_strided((h.shape[0], h.shape[1] // 2), (h.shape[1], 1), 1)
                h = h * u.sin().sum(-1, keepdim=True)
            elif kind == "split":
                a, b = lin(h).chunk(2, dim=-1)
                h = torch.cat([a * torch.sigmoid(b), b * a], dim=-1)
            else:
                h = torch.softmax(lin(h), dim=-1) * h
        return F.cross_entropy(self.head(h), y)


def _program(model: nn.Module, batch: tuple, store: str = ""):
    opts = PassOptions.single_device(fxspeed.Config(), activation_store=store, activation_offload_min_bytes=0,
                                     activation_offload_flops_per_byte=0.0)
    return compile_step(model, batch, {}, config=fxspeed.Config(), loss_fn=None, options=opts).captured


def _run(cap, model: nn.Module, batch: tuple) -> list[torch.Tensor]:
    params, it = dict(model.named_parameters()), iter(batch)
    args = [params[s.target] if s.kind == "param" else next(it) for s in cap.signature.inputs]
    with torch.no_grad():
        return [o for o in cap.gm(*args) if isinstance(o, torch.Tensor)]


def check_offloads(gm: fx.GraphModule) -> None:
    """Each key offloaded once and reloaded once, later; no backward node reads an offloaded
    value or a forward view of it; reloads chain their reads in the order they run; the first
    read starts before the first reload."""
    nodes = list(gm.graph.nodes)
    order = {n: i for i, n in enumerate(nodes)}
    offloads = {n.args[2]: n for n in nodes if n.target is offload_activation_op}
    reloads = {n.args[1]: n for n in nodes if n.target is reload_activation_op}
    assert len(offloads) == sum(n.target is offload_activation_op for n in nodes)
    assert offloads.keys() == reloads.keys() and offloads
    for k, off in offloads.items():
        assert order[off] < order[reloads[k]]
        assert all(order[u] > order[reloads[k]] for u in reloads[k].users)
        stack = [off.args[0]]
        while stack:  # the root and its views: only forward reads them
            v = stack.pop()
            for u in v.users:
                if u is off:
                    continue
                assert u.meta[META_KEY].role != BACKWARD, f"backward node {u.name} reads offloaded {v.name}"
                if isinstance(u.target, torch._ops.OpOverload) and u.target.is_view or u.target is operator.getitem:
                    stack.append(u)
    ran = sorted(reloads.values(), key=order.__getitem__)
    assert [r.args[2] for r in ran] == [r.args[1] for r in ran[1:]] + [-1]
    prefetch = [n for n in nodes if n.target is prefetch_activation_op]
    assert len(prefetch) == 1 and prefetch[0].args[1] == ran[0].args[1] and order[prefetch[0]] < order[ran[0]]


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(blocks=st.lists(st.sampled_from(["gelu", "tanh_t", "norm_residual", "split", "softmax", "as_strided"]), min_size=1,
                       max_size=4),
       width=st.sampled_from([8, 12]), rows=st.integers(1, 9), dtype=st.sampled_from([torch.float32, torch.bfloat16]))
def test_offloading_every_saved_activation_of_random_models_computes_the_same_outputs_and_gradients(
        tmp_path: Path, blocks: list[str], width: int, rows: int, dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    model = Random(width, blocks).to(dtype)
    g = torch.Generator().manual_seed(rows)
    batch = (torch.randn(rows, width, generator=g).to(dtype), torch.randint(0, 5, (rows,), generator=g))
    want = _run(_program(model, batch), model, batch)
    cap = _program(model, batch, store="test-random")
    check_offloads(cap.gm)
    store = ActivationOffload(torch.device("cpu"), str(tmp_path), name="t")
    register("test-random", store)
    store.reserve(cap.signature.offloaded_activations)
    try:
        got = _run(cap, model, batch)
    finally:
        store.close()
    assert len(got) == len(want)
    for a, b in zip(got, want):
        assert a.dtype == b.dtype and torch.equal(a, b)
    assert store.stats["offloads"] == store.stats["reloads"] == len(cap.signature.offloaded_activations)


def test_small_activations_and_ones_read_back_at_once_stay_on_the_device() -> None:
    """The choice: below activation_offload_min_bytes nothing moves; with a slow link only the
    activations with enough compute between their forward and backward readers move."""
    model, batch = _gpt(), _batch(16)
    base = dict(activation_store="choice")
    n = {}
    for name, extra in [("all", dict(activation_offload_min_bytes=0, activation_offload_flops_per_byte=0.0)),
                        ("cpu", {}), ("big", dict(activation_offload_min_bytes=2**40)),
                        ("slow", dict(activation_offload_flops_per_byte=1e6))]:
        opts = PassOptions.single_device(fxspeed.Config(), **base, **extra)
        cap = compile_step(model, batch, {}, config=fxspeed.Config(), loss_fn=None, options=opts).captured
        n[name] = len(cap.signature.offloaded_activations)
    assert n["all"] > n["cpu"] > 0 and n["big"] == 0 and n["slow"] < n["cpu"]


@pytest.mark.slow
def test_zero2_tensor_parallel_and_pipeline_ranks_offload_their_activations_and_train_the_same(
        tmp_path: Path) -> None:
    """2 gloo ranks (tests/workers/offload_activations_worker.py); no swap directory left behind."""
    from tests.multiprocess import check_swap_worker

    check_swap_worker("tests.workers.offload_activations_worker", tmp_path)


def test_an_activation_viewed_at_an_absolute_storage_offset_stays_and_the_rest_moves() -> None:
    model = Random(8, ["as_strided", "gelu"])
    batch = (torch.randn(6, 8), torch.randint(0, 5, (6,)))
    cap = _program(model, batch, store="x")
    moved = {n.args[0] for n in cap.gm.graph.nodes if n.target is offload_activation_op}
    strided = [n for n in cap.gm.graph.nodes if n.target is torch.ops.aten.as_strided.default]
    assert strided and moved and not {n.args[0] for n in strided} & moved


def test_a_value_being_offloaded_is_never_given_to_a_reused_workspace() -> None:
    """reuse_buffers reuses memory after a value's last use; an offload reads it asynchronously."""
    from fxspeed.passes.memory.reuse_buffers import last_use

    g = fx.Graph()
    x = g.placeholder("x")
    y = g.call_function(torch.ops.aten.cat.default, ([x, x],))
    g.call_function(offload_activation_op, (y, "s", 0))
    z = g.call_function(torch.ops.aten.relu.default, (y,))
    g.output((z,))
    order = {n: i for i, n in enumerate(g.nodes)}
    assert last_use(y, order) is None
    assert last_use(x, order) is not None


def test_a_failed_write_fails_its_own_step_and_not_the_next(tmp_path: Path) -> None:
    store = ActivationOffload(torch.device("cpu"), str(tmp_path), name="t")
    store.reserve({0: 4096})
    x = torch.arange(16.0)
    real = store.swap.write_copy

    def broken(*args):  # a disk error on this write only
        fut = real(*args)
        fut.result()
        from concurrent.futures import Future
        bad: Future = Future()
        bad.set_exception(OSError(28, "No space left on device"))
        return bad

    store.swap.write_copy = broken
    store.offload(0, x)
    with pytest.raises(OSError):
        store.reload(0, -1, [16], torch.float32)
    store.swap.write_copy = real
    store.offload(0, x)  # the next step: the old failure does not resurface
    assert torch.equal(store.reload(0, -1, [16], torch.float32), x)
    # a write that failed and was never read (its step died earlier) is logged, not raised
    store.swap.write_copy = broken
    store.offload(0, x)
    store.swap.write_copy = real
    store.offload(0, x + 1)
    assert torch.equal(store.reload(0, -1, [16], torch.float32), x + 1)
    store.close()


def test_a_pipeline_moves_only_saved_activations_that_own_their_memory() -> None:
    """Not a view of a parameter (t(weight) saved for backward), not one of two outputs sharing
    one storage: moving those would free nothing and bring back a copy."""
    from fxspeed.compiler.pipelines import compile_program
    from fxspeed.passes.memory.offload_activations import storage_root

    model, batch = _gpt(), _batch(16)
    cfg = fxspeed.Config(pipeline=2, microbatches=2)
    opts = PassOptions.single_device(cfg, activation_store="p", activation_offload_min_bytes=0)
    cp = compile_program(model, tuple(b[:8] for b in batch), {}, config=cfg, replicas=1, options=opts)
    assert any(p.offload_saved for p in cp.stages)
    for p in cp.stages:
        out = next(n for n in reversed(p.forward.graph.nodes) if n.op == "output")
        outs = [v for v in out.args[0] if isinstance(v, fx.Node)]
        saved = list(out.args[0])[len(p.send_f):len(p.send_f) + p.n_saved]
        for i in p.offload_saved:
            root = storage_root(saved[i])
            assert root.op == "call_function", f"stage {p.stage} moves a view of input {root.name}"
            assert sum(storage_root(v) is root for v in outs) == 1
    assert "OFFLOAD(" in cp.schedule.format() or cp.schedule.n_microbatches < 3
