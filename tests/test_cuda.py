"""The `cuda` tier: fxspeed on a CUDA device, against eager PyTorch on the same device.

    python -m pytest -m cuda -q tests/test_cuda.py          # on a machine with a GPU

Skipped as a whole without CUDA. For every model of the parity suite that matters on GPUs
(fxspeed's GPT, Hugging Face GPT-2 and Llama, the HF ones with a padded attention mask, so
attention runs with a bias) and each precision, 3 AdamW steps (torch's fused kernel on both
sides) on one batch:

- fp32: losses and every parameter within 1e-4 relative of eager (TF32 off on both sides);
- bf16 / fp16: eager is `torch.autocast` (fp16 with torch's GradScaler at fxspeed's initial
  scale); the losses agree loosely, the loss is finite and falls, no fp16 step is skipped, and
  the parameter updates point the same way as autocast's and are no farther from the fp32
  updates than a few times autocast's own distance;
- bf16 / fp16, one SGD step: weight by weight, the gradient is as close to the fp32 gradient
  as a few times autocast's (catches a wrong attention backward, which shows in the query and
  key weights only); and a bf16 attention bias padded for an unaligned sequence length.

And NCCL at world size 1: a script that initializes the process group itself, then compiles
with ZeRO-1 and ZeRO-3, trains to the losses of a run without a process group.

FXSPEED_CUDA_TIER_DEVICE=cpu runs the same checks on the CPU (a dry run of the tier's logic;
the tolerances are meant for CUDA).
"""

from __future__ import annotations

import copy
import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn as nn
from conftest import assert_close_rel, rel_err, torch_optimizer

import fxspeed
from fxspeed.models import GPT, GPTConfig
from tests.workers.common import key_bias_masked
from tests.workers.nccl_worker import RUNS as NCCL_RUNS
from tests.workers.nccl_worker import train as nccl_train

_DRY_RUN = os.environ.get("FXSPEED_CUDA_TIER_DEVICE") == "cpu"
# The whole module: marked `cuda`, and skipped without a CUDA device (collected, then skipped:
# `pytest tests/test_cuda.py` and `pytest -m cuda` exit 0 on a machine without one).
pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available() and not _DRY_RUN,
                                 reason="the cuda tier needs a CUDA device")]

ROOT = Path(__file__).resolve().parents[1]
DEVICE = torch.device("cpu") if _DRY_RUN else torch.device("cuda", 0)
LOW = {"bf16": torch.bfloat16, "fp16": torch.float16}
STEPS = 3
V, T, B = 512, 128, 4
FP32_RTOL = 1e-4  # TF32 off; cuBLAS / attention kernels may still order sums differently
LOSS_RTOL = {"bf16": 3e-2, "fp16": 1e-2}  # fxspeed low precision vs eager autocast, per step
MIN_UPDATE_COSINE = 0.8  # cos(fxspeed's parameter update, autocast's)
MAX_DRIFT_RATIO = 3.0  # |update - fp32 update|: fxspeed's at most this times autocast's (+ floor)
DRIFT_FLOOR = 0.05


@pytest.fixture(autouse=True, scope="module")
def _exact_fp32() -> Any:
    """fp32 means fp32: no TF32 in matmuls or convolutions (on both sides)."""
    old = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = old


# --------------------------------------------------------------------------------------------
# Models and batches (on DEVICE)
# --------------------------------------------------------------------------------------------

def build(kind: str, seq: int = T) -> tuple[nn.Module, Any]:
    """(model on DEVICE, one batch: a tuple for fxspeed's GPT, a dict with labels for HF)."""
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    if kind == "gpt":
        model = GPT(GPTConfig(vocab_size=V, block_size=seq, n_layer=2, n_head=4, n_embd=128))
        x, y = (torch.randint(0, V, (B, seq), generator=g) for _ in range(2))
        return model.to(DEVICE), (x.to(DEVICE), y.to(DEVICE))
    transformers = pytest.importorskip("transformers")
    if kind == "hf_gpt2":
        cfg = transformers.GPT2Config(vocab_size=V, n_positions=seq, n_embd=128, n_layer=2, n_head=4,
                                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
        cfg._attn_implementation = "sdpa"
        model = transformers.GPT2LMHeadModel(cfg)
    elif kind == "hf_llama":
        cfg = transformers.LlamaConfig(vocab_size=V, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=seq,
                                       bos_token_id=0, eos_token_id=0, pad_token_id=0)
        cfg._attn_implementation = "sdpa"
        model = transformers.LlamaForCausalLM(cfg)
    else:
        raise ValueError(kind)
    ids = torch.randint(1, V, (B, seq), generator=g)
    mask = torch.ones(B, seq, dtype=torch.long)
    mask[0, seq - seq // 8:] = 0  # right padding on one row: a floating attention bias, not is_causal
    labels = ids.masked_fill(mask == 0, -100)
    batch = {"input_ids": ids, "attention_mask": mask, "labels": labels}
    return model.to(DEVICE), {k: v.to(DEVICE) for k, v in batch.items()}


def _call(batch: Any) -> tuple[tuple, dict]:
    return ((), batch) if isinstance(batch, dict) else (tuple(batch), {})


def eager_steps(model: nn.Module, batch: Any, config: fxspeed.Config, amp: torch.dtype | None = None,
                steps: int = STEPS) -> list[float]:
    """`steps` eager steps on `batch`: fused AdamW (as fxspeed), under autocast when `amp` is set
    (fp16 with a GradScaler at fxspeed's initial loss scale and growth window)."""
    model.train()
    opt, sched = torch_optimizer([p for p in model.parameters() if p.requires_grad], config)
    scaler = torch.amp.GradScaler(DEVICE.type, init_scale=config.loss_scale or 2.0**16,
                                  growth_interval=config.loss_scale_window, enabled=amp is torch.float16)
    args, kwargs = _call(batch)
    losses = []
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        with torch.autocast(DEVICE.type, dtype=amp or torch.bfloat16, enabled=amp is not None):
            loss = fxspeed.extract_loss(model(*args, **kwargs), None, args, kwargs)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        sched.step()
        losses.append(loss.item())
    return losses


def fxspeed_steps(model: nn.Module, batch: Any, config: fxspeed.Config, steps: int = STEPS
                  ) -> tuple[fxspeed.Engine, list[float]]:
    args, kwargs = _call(batch)
    engine = fxspeed.compile(model, devices=1, config=config, example_inputs=batch if kwargs else args)
    return engine, [engine.train_step(*args, **kwargs) for _ in range(steps)]


def params(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter (tied ones once), detached fp32 copies, the key bias zeroed (its true
    gradient is zero: float noise becomes +-lr Adam steps that differ between equal programs)."""
    return {n: key_bias_masked(n, p.detach().float().clone()) for n, p in model.named_parameters()}


def flat_update(after: dict[str, torch.Tensor], before: dict[str, torch.Tensor]) -> torch.Tensor:
    return torch.cat([(after[n] - before[n]).flatten().double() for n in before])


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(torch.dot(a, b) / (a.norm() * b.norm()).clamp_min(1e-30))


# --------------------------------------------------------------------------------------------
# Parity on CUDA
# --------------------------------------------------------------------------------------------

KINDS = ["gpt", "hf_gpt2", "hf_llama"]


@pytest.mark.parametrize("kind", KINDS)
def test_fp32_training_matches_eager(kind: str) -> None:
    model, batch = build(kind)
    ref = copy.deepcopy(model)
    config = fxspeed.Config(lr=1e-3)
    want = eager_steps(ref, batch, config)
    engine, got = fxspeed_steps(model, batch, config)
    for i, (a, b) in enumerate(zip(got, want)):
        assert_close_rel(a, b, f"loss at step {i}", FP32_RTOL)
    have, ref_params = params(model), params(ref)
    assert have.keys() == ref_params.keys()
    for n in ref_params:
        assert_close_rel(have[n], ref_params[n], n, FP32_RTOL)
    assert all(p.device == batch_device(batch) for p in model.parameters())
    assert got[-1] < got[0]


def batch_device(batch: Any) -> torch.device:
    return next(iter(batch.values()) if isinstance(batch, dict) else iter(batch)).device


def _low_precision(kind: str, precision: str, seq: int = T) -> dict[str, Any]:
    model, batch = build(kind, seq)
    before = params(model)
    fp32_ref, amp_ref = copy.deepcopy(model), copy.deepcopy(model)
    config = fxspeed.Config(lr=1e-3, precision=precision)
    fp32_losses = eager_steps(fp32_ref, batch, fxspeed.Config(lr=1e-3))
    amp_losses = eager_steps(amp_ref, batch, config, amp=LOW[precision])
    engine, losses = fxspeed_steps(model, batch, config)
    u_fx = flat_update(params(model), before)
    u_amp = flat_update(params(amp_ref), before)
    u_32 = flat_update(params(fp32_ref), before)
    report = {"kind": kind, "precision": precision, "seq": seq, "fxspeed": losses, "autocast": amp_losses,
              "fp32": fp32_losses, "cos_fx_amp": cosine(u_fx, u_amp),
              "drift_fx": rel_err(u_fx, u_32), "drift_amp": rel_err(u_amp, u_32), "stats": dict(engine.stats)}
    print(json.dumps(report))  # shown with -s or on failure: how far each is from fp32
    return report


def _check_low_precision(r: dict[str, Any]) -> None:
    p, losses = r["precision"], r["fxspeed"]
    assert all(torch.isfinite(torch.tensor(losses))), losses
    assert losses[-1] < losses[0], f"the loss does not fall: {losses}"
    for i, (a, b) in enumerate(zip(losses, r["autocast"])):
        assert_close_rel(a, b, f"{p} loss at step {i} vs eager autocast", LOSS_RTOL[p])
    assert r["cos_fx_amp"] >= MIN_UPDATE_COSINE, r
    assert r["drift_fx"] <= MAX_DRIFT_RATIO * r["drift_amp"] + DRIFT_FLOOR, r
    if p == "fp16":
        assert r["stats"]["skipped_steps"] == 0 and r["stats"]["loss_scale"] == 2.0**16, r["stats"]


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
@pytest.mark.parametrize("kind", KINDS)
def test_low_precision_training_tracks_eager_autocast(kind: str, precision: str) -> None:
    _check_low_precision(_low_precision(kind, precision))


GRAD_DRIFT_RATIO, GRAD_DRIFT_FLOOR = 3.0, 0.02


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
@pytest.mark.parametrize("kind", KINDS)
def test_every_weights_low_precision_gradient_is_as_close_to_fp32_as_autocasts(kind: str, precision: str) -> None:
    # One SGD step, so each update is -lr x the gradient: weight by weight (the attention
    # projections above all: a wrong softmax-gradient row sum in the attention backward shows
    # in the query and key weights only), fxspeed's gradient is no farther from the fp32
    # gradient than a few times autocast's own distance.
    model, batch = build(kind)
    before = params(model)
    fp32_ref, amp_ref = copy.deepcopy(model), copy.deepcopy(model)
    config = fxspeed.Config(optimizer="sgd", lr=0.1, precision=precision)
    eager_steps(fp32_ref, batch, fxspeed.Config(optimizer="sgd", lr=0.1), steps=1)
    eager_steps(amp_ref, batch, config, amp=LOW[precision], steps=1)
    fxspeed_steps(model, batch, config, steps=1)
    have, amp, want = params(model), params(amp_ref), params(fp32_ref)
    rows = []
    for n in before:
        u32 = want[n] - before[n]
        if u32.abs().max() == 0:
            continue  # no gradient (an unused embedding row block, a zeroed key bias)
        d_fx, d_amp = rel_err(have[n] - before[n], u32), rel_err(amp[n] - before[n], u32)
        rows.append((d_fx - GRAD_DRIFT_RATIO * d_amp - GRAD_DRIFT_FLOOR, n, d_fx, d_amp))
    rows.sort(reverse=True)
    print(json.dumps({"kind": kind, "precision": precision,
                      "worst": [{"param": n, "fxspeed": f, "autocast": a} for _, n, f, a in rows[:4]]}))
    bad = [(n, f, a) for excess, n, f, a in rows if excess > 0]
    assert not bad, f"gradients farther from fp32 than {GRAD_DRIFT_RATIO} x autocast's + {GRAD_DRIFT_FLOOR}: {bad}"


def test_bf16_attention_bias_of_an_unaligned_sequence_length() -> None:
    # 100 tokens: SDPA pads the bias to a multiple of 16 and slices it back for the
    # memory-efficient kernel, which checks the row stride's alignment in bf16.
    _check_low_precision(_low_precision("hf_gpt2", "bf16", seq=100))


# --------------------------------------------------------------------------------------------
# NCCL at world size 1
# --------------------------------------------------------------------------------------------

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.skipif(_DRY_RUN, reason="NCCL needs CUDA")
def test_nccl_world_size_one_with_zero_trains_like_no_process_group() -> None:
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()), "RANK": "0",
           "WORLD_SIZE": "1", "LOCAL_RANK": "0", "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-m", "tests.workers.nccl_worker"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("LOSSES "))
    got = json.loads(line[len("LOSSES "):])
    assert got.keys() == NCCL_RUNS.keys()
    for name, (zero, precision) in NCCL_RUNS.items():
        want = nccl_train(DEVICE, zero, precision)  # the same run without a process group
        assert all(torch.isfinite(torch.tensor(got[name]))) and got[name][-1] < got[name][0], (name, got[name])
        # bf16: the attention backward accumulates with atomics (run-to-run bf16 roundings differ)
        rtol = FP32_RTOL if precision == "fp32" else 2e-3
        for i, (a, b) in enumerate(zip(got[name], want)):
            assert_close_rel(a, b, f"{name}: loss at step {i} under NCCL", rtol)


# --------------------------------------------------------------------------------------------
# Activation offload to pinned host memory (runtime/offloaded_activations.py's CUDA tier)
# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_activation_offload_to_pinned_host_memory_trains_like_keeping_them(tmp_path: Path, precision: str) -> None:
    """Saved activations go to pinned host buffers on a side stream and come back ahead of
    backward; losses and weights follow the same run without offload (exactly but for the
    attention backward's atomics). Activations of 8 MiB: enough compute lies between their uses
    for the planner to move them over PCIe."""
    def model() -> nn.Module:
        torch.manual_seed(0)
        return GPT(GPTConfig(vocab_size=V, block_size=512, n_layer=4, n_head=8, n_embd=512)).to(DEVICE)

    g = torch.Generator().manual_seed(1)
    batch = tuple(torch.randint(0, V, (8, 512), generator=g).to(DEVICE) for _ in range(2))
    cfg = dict(lr=1e-3, precision=precision)
    plain, want = fxspeed_steps(model(), batch, fxspeed.Config(**cfg))
    off, got = fxspeed_steps(model(), batch, fxspeed.Config(**cfg, offload="activations", nvme_path=str(tmp_path)))
    stats = off._activations.stats
    assert stats["offloads"] > 0 and stats["offloads"] == stats["reloads"], stats
    assert any(k.startswith("activations") for k in off.plan.offloaded)
    rtol = FP32_RTOL if precision == "fp32" else 2e-3
    for i, (a, b) in enumerate(zip(got, want)):
        assert_close_rel(a, b, f"loss at step {i}", rtol)
    for (name, p), q in zip(plain.model.named_parameters(), off.model.parameters()):
        assert_close_rel(q, p, name, rtol * 10)


# --------------------------------------------------------------------------------------------
# Optimizer and parameter offload to pinned host memory (runtime/host_tier.py)
# --------------------------------------------------------------------------------------------

def _host_tier_steps(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, **cfg: Any) -> tuple[fxspeed.Engine, list[float]]:
    """3 steps of the GPT of this tier with `cfg`; a dry run lets the CPU run the host tier."""
    if _DRY_RUN:
        monkeypatch.setenv("FXSPEED_HOST_TIER_ON_CPU", "1")
    if cfg.get("offload_device") == "nvme":
        cfg["nvme_path"] = str(tmp_path)
    model, batch = build("gpt")
    return fxspeed_steps(model, batch, fxspeed.Config(lr=1e-3, bucket_mb=1, **cfg))


def _pinned(engine: fxspeed.Engine) -> None:
    """On a GPU: the optimizer's staging and resident states are pinned host tensors."""
    opt = engine.optimizer
    assert opt.stats["host_tier"], opt.stats
    if not _DRY_RUN:
        assert engine._link.cuda and all(st.grads.is_pinned() and st.weights.is_pinned() for st in opt._staging)
        assert all(buf.is_pinned() for _, buf in opt._resident)


def test_fp32_optimizer_offload_to_pinned_host_memory_trains_like_no_offload(monkeypatch: pytest.MonkeyPatch,
                                                                              tmp_path: Path) -> None:
    """Adam's moments in pinned host memory, the step on the host (torch's fused CPU Adam over the
    weights and gradients copied in, the new weights copied back): the losses and weights of the
    run without offload (CUDA's fused Adam: the same update rule, within its rounding), and bit
    for bit those of the files tier (offload_device="nvme": the same host step)."""
    plain, want = _host_tier_steps(monkeypatch, tmp_path)
    host, got = _host_tier_steps(monkeypatch, tmp_path, offload="optimizer", offload_device="cpu")
    files, again = _host_tier_steps(monkeypatch, tmp_path, offload="optimizer", offload_device="nvme")
    _pinned(host)
    assert host.optimizer.swap is None and files.optimizer.stats["chunks"] > 0
    assert got == again and host._link.stats["to_device_bytes"] > 0
    for i, (a, b) in enumerate(zip(got, want)):
        assert_close_rel(a, b, f"loss at step {i}", FP32_RTOL)
    sh, sp, sf = host.state_dict(), plain.state_dict(), files.state_dict()
    for name in sp:
        assert_close_rel(sh[name].cpu(), sp[name].cpu(), name, FP32_RTOL * 10)
        assert torch.equal(sh[name], sf[name]), name
    assert all(p.device == DEVICE for p in host.model.parameters())


def test_bf16_zero_3_masters_and_working_shards_in_pinned_host_memory_train_like_the_files_tier(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """ZeRO-3 under bf16 on one device: the fp32 masters and moments on the host (each reduced
    bucket stepped there inside backward), and the working shards on the host too, copied to the
    device one bucket ahead of their gathers. The optimizer tier trains like the files tier (the
    same program and host step; attention's backward may differ in the last bits between runs);
    the parameter tier (masters and torch's CUDA Adam on the device) close to it."""
    cfg = dict(zero=3, precision="bf16")
    files, want = _host_tier_steps(monkeypatch, tmp_path, offload="optimizer", offload_device="nvme", **cfg)
    host, got = _host_tier_steps(monkeypatch, tmp_path, offload="optimizer", offload_device="cpu", **cfg)
    shards, theirs = _host_tier_steps(monkeypatch, tmp_path, offload="parameters", offload_device="cpu", **cfg)
    _pinned(host)
    assert host._in_backward is not None and host._in_backward.calls > 0
    fetched = shards._flat.files
    assert fetched.host is not None and fetched.stats["fetches"] >= 3 * 2 * len(shards._flat.buckets)
    assert all(t.untyped_storage().nbytes() == 0 for t in shards._flat.work_shards)
    if not _DRY_RUN:
        assert all(h.is_pinned() for h in fetched.host)
    for i, (a, b, c) in enumerate(zip(got, want, theirs)):
        assert_close_rel(a, b, f"loss at step {i} (host tier vs files)", 1e-5)
        assert_close_rel(c, b, f"loss at step {i} (working shards on the host)", 2e-3)
    sh, sf = host.state_dict(), files.state_dict()
    for name in sf:
        assert_close_rel(sh[name].cpu(), sf[name].cpu(), name, 1e-4)


# --------------------------------------------------------------------------------------------
# FlashAttention for low-precision attention (passes/graph/select_attention_kernel.py)
# --------------------------------------------------------------------------------------------

@pytest.mark.skipif(_DRY_RUN, reason="the pass applies to CUDA programs only")
@pytest.mark.parametrize("kind", ["gpt", "hf_gpt2"])
def test_bf16_attention_runs_flash_and_trains_like_the_memory_efficient_kernel(kind: str) -> None:
    """fp32 capture records the memory-efficient kernel; under bf16 the program runs flash (as
    autocast's dispatch picks), and trains as with the pass disabled by name (attention kernels
    order their sums differently: bf16 tolerance)."""
    if kind == "hf_gpt2":  # no padding: flash takes no mask
        model, batch = build(kind)
        batch = {k: v for k, v in batch.items() if k != "attention_mask"}
        batch["labels"] = batch["input_ids"]
    else:
        model, batch = build(kind)
    twin = copy.deepcopy(model)
    cfg = dict(lr=1e-3, precision="bf16")
    on, got = fxspeed_steps(model, batch, fxspeed.Config(**cfg))
    off, want = fxspeed_steps(twin, batch, fxspeed.Config(**cfg, disable_passes=("select_attention_kernel",)))
    flash = torch.ops.aten._scaled_dot_product_flash_attention.default
    graphs = [ex.program.gm.graph for ex in on._executors.values()]
    assert any(n.target is flash for g in graphs for n in g.nodes), "no flash attention in the bf16 program"
    assert any(r["name"] == "select_attention_kernel" and r["modified"] for r in on.plan.passes)
    for i, (a, b) in enumerate(zip(got, want)):
        assert_close_rel(a, b, f"loss at step {i}", 2e-2)


# --------------------------------------------------------------------------------------------
# Serving on CUDA: the fused serving programs, the Triton paged attention, CUDA graphs
# --------------------------------------------------------------------------------------------

SERVE_PROMPTS = [[5, 17, 3], list(range(10, 30)), [7], [40, 41, 42, 43, 44, 45, 46, 47, 48], list(range(60, 72))]
SERVE_NEW = [6, 5, 7, 4, 6]
SERVE_OPTIONS = dict(token_budget=8, max_batch=3, block_size=4, cache_tokens=96)


def _served_model() -> nn.Module:
    model, _ = build("hf_llama")
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(8.0)  # away from near-uniform logits, so greedy choices are not ties
    return model.eval()


def test_fp32_serving_with_cuda_graphs_gives_hugging_faces_greedy_tokens() -> None:
    """HF Llama (GQA) served on the device: the fusion passes and the Triton paged attention run,
    the decode buckets are replayed as CUDA graphs (not in the CPU dry run), and every request's
    greedy tokens are those of HF `generate` on the same device."""
    from fxspeed.runtime.serving import _Static

    model = _served_model()
    engine = fxspeed.serve(model, **SERVE_OPTIONS)
    outs = engine.generate(SERVE_PROMPTS, max_new_tokens=SERVE_NEW)
    with torch.no_grad():
        for p, n, o in zip(SERVE_PROMPTS, SERVE_NEW, outs):
            ref = model.generate(torch.tensor([p], device=DEVICE), max_new_tokens=n, do_sample=False,
                                 eos_token_id=None, pad_token_id=0)[0, len(p):].tolist()
            assert o == ref, (p, o, ref)
    static = [b for b in engine._serving.programs.values() if isinstance(b, _Static)]
    if not _DRY_RUN:
        assert static and all(b.graph is not None for b in static), "no decode bucket was captured"


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_cuda_graph_replays_give_the_logits_of_steps_launched_one_by_one(precision: str) -> None:
    """The same engine options with cuda_graphs on and off: logits within rounding (up to the first
    differing token in bf16, where a near tie may break either way), fp32 tokens equal."""
    model = _served_model()
    cfg = fxspeed.Config(precision=precision)
    graphed = fxspeed.serve(model, config=cfg, **SERVE_OPTIONS)
    launched = fxspeed.serve(model, config=cfg, **SERVE_OPTIONS, cuda_graphs=False)
    for e in (graphed, launched):
        e._serving.record_logits = {}
    a = graphed.generate(SERVE_PROMPTS, max_new_tokens=SERVE_NEW)
    b = launched.generate(SERVE_PROMPTS, max_new_tokens=SERVE_NEW)
    tol = 1e-4 if precision == "fp32" else 5e-2
    for i in range(len(SERVE_PROMPTS)):
        same = next((k for k, (u, v) in enumerate(zip(a[i], b[i])) if u != v), min(len(a[i]), len(b[i])))
        n = min(same + 1, len(a[i]), len(b[i]))  # rows past a differing token read other sequences
        x = torch.stack(graphed._serving.record_logits[i][:n])
        y = torch.stack(launched._serving.record_logits[i][:n])
        assert (x - y).abs().max() <= tol * (1 + y.abs().max()), i
        if precision == "fp32":
            assert a[i] == b[i], i
