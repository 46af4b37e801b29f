"""Pipeline parallelism: the split of the joint graph into stage programs (in one process), and
gpipe / 1F1B training on several gloo processes matching one eager process on the whole batch.

The model is the tiny GPT with tied weights: `wte` (first stage) and `head` (last stage) are
one Parameter; both ranks hold it and sum its gradient before the step.

Parity metric as in test_data_parallel: per-tensor ‖a − b‖ / ‖b‖ ≤ 1e-5 after 5 AdamW steps,
losses within 1e-5 relative; the key part of the QKV bias (mathematically zero gradient, Adam
turns its float noise into ±lr steps) is masked.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import pytest
import torch

import fxspeed
from fxspeed.compiler import compile_step
from fxspeed.devices import normalize_devices
from fxspeed.errors import ConfigError
from fxspeed.passes.split_stages import split_stages
from tests.workers.common import build_model, global_batches
from tests.multiprocess import run_ranks

ROOT = Path(__file__).resolve().parents[1]
TOL = 1e-5


def _joint(model, batch):
    cfg = fxspeed.Config(disable_passes=("dedupe_tied_parameters",))
    c = compile_step(model, batch, {}, config=cfg, loss_fn=None, devices=normalize_devices(1),
                     options={"world_size": 1})
    return c.captured


def _run_stages_in_one_process(progs, params, batch):
    """F of every stage in order, then B of every stage in reverse, messages passed by hand."""
    bind = lambda s: params[s.target]  # noqa: E731
    acts, saved, loss = [], {}, None
    for p in progs:
        outs = p.forward(*[bind(s) for s in p.state], *batch, *acts)
        k = len(p.send_f)
        acts, saved[p.stage] = list(outs[:k]), list(outs[k:k + p.n_saved])
        if p.has_loss:
            loss = outs[-1]
    grads, g = {}, []
    for p in reversed(progs):
        outs = p.backward(*[bind(s) for s in p.state], *batch, *saved[p.stage], *g)
        k = len(p.send_b)
        g = list(outs[:k])
        for n, t in zip(p.grads, outs[k:]):
            grads[n] = t
    return loss, grads


@pytest.mark.parametrize("P", [2, 3, 4])
def test_stage_programs_compose_to_the_joint_graph(P: int) -> None:
    model = build_model("gpt")
    x, y = global_batches("gpt", 1)[0]
    cap = _joint(model, (x[:4], y[:4]))
    progs = split_stages(cap.gm, cap.signature, P)
    assert len(progs) == P and progs[-1].has_loss and not any(p.has_loss for p in progs[:-1])
    # One activation forward and one gradient backward per boundary for a residual stack.
    for p in progs[:-1]:
        assert [m.shape for m in p.send_f] == [(4, 16, 32)], p.describe()
    for p in progs[1:]:
        assert [m.shape for m in p.send_b] == [(4, 16, 32)], p.describe()
    # The tied weight is held by the first and the last stage only.
    holders = [p.stage for p in progs if p.names() & {"wte.weight", "head.weight"}]
    assert holders == [0, P - 1]
    params = dict(model.named_parameters(remove_duplicate=False))
    loss, grads = _run_stages_in_one_process(progs, params, [x[:4], y[:4]])
    ref = cap.gm(*[params[s.target] if s.kind == "param" else (x[:4], y[:4])[int(s.target)]
                   for s in cap.signature.inputs])
    assert torch.equal(loss, ref[0])
    want = {s.target: o for s, o in zip(cap.signature.outputs, ref) if s.kind == "grad"}
    assert grads.keys() == want.keys()
    for k in want:
        assert torch.equal(grads[k], want[k]), k


def test_too_many_stages_names_the_limit_and_the_split_points() -> None:
    model = build_model("gpt")  # 2 blocks: embeddings | blocks.0 | blocks.1 | ln_f+head -> at most 4 stages
    x, y = global_batches("gpt", 1)[0]
    cap = _joint(model, (x[:4], y[:4]))
    with pytest.raises(ConfigError,
                       match=r"Config.pipeline=5.*at most 4 stages.*blocks.0, blocks.1, ln_f.*pipeline <= 4"):
        split_stages(cap.gm, cap.signature, 5, model_name="GPT")


def test_user_split_points() -> None:
    model = build_model("gpt")
    x, y = global_batches("gpt", 1)[0]
    cap = _joint(model, (x[:4], y[:4]))
    progs = split_stages(cap.gm, cap.signature, 2, split_points=["ln_f"])
    assert "blocks.1.mlp.fc.weight" in progs[0].names() and "ln_f.weight" in progs[1].names()
    with pytest.raises(ConfigError, match="split point 'nope'"):
        split_stages(cap.gm, cap.signature, 2, split_points=["nope"])


def test_bad_pipeline_configs_are_refused_with_what_works() -> None:
    with pytest.raises(ConfigError,
                       match=r"microbatches=3 is not a multiple of Config.pipeline=2.*microbatches=2 or 4"):
        fxspeed.Config(pipeline=2, microbatches=3, schedule="interleaved")
    fxspeed.Config(pipeline=2, microbatches=3, schedule="1f1b")  # any M works for 1f1b / gpipe
    model = build_model("gpt")
    x, y = global_batches("gpt", 1)[0]
    with pytest.raises(ConfigError, match=r"microbatches=2 needs pipeline > 1"):
        fxspeed.compile(model, 1, fxspeed.Config(microbatches=2), example_inputs=(x, y))
    with pytest.raises(ConfigError, match=r"pipeline=2 with devices=1.*devices=2"):
        fxspeed.compile(model, 1, fxspeed.Config(pipeline=2, microbatches=2), example_inputs=(x, y))


def test_microbatches_must_divide_the_batch() -> None:
    from fxspeed.pipeline_engine import split_batch

    x, y = global_batches("gpt", 1)[0]  # 8 rows
    with pytest.raises(ConfigError, match=r"microbatches=3 must divide the batch dimension.*\(8, 16\)"):
        split_batch((x, y), {}, 3)
    assert [a[0].shape[0] for a, _ in split_batch((x, y), {}, 4)] == [2, 2, 2, 2]


# --------------------------------------------------------------------------------------------
# Multi-process parity
# --------------------------------------------------------------------------------------------

def launch(n: int, out: Path, *args: str, timeout: int = 900) -> float:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={n}",
           "-m", "tests.workers.pipeline_worker", "--out", str(out), *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    t0 = time.perf_counter()
    proc = run_ranks(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return time.perf_counter() - t0


def _key_bias_masked(name: str, t: torch.Tensor) -> torch.Tensor:
    if name.endswith("qkv.bias"):
        t = t.clone()
        c = t.numel() // 3
        t[c:2 * c] = 0
    return t


def eager_reference(steps: int = 5, clip: float | None = None):
    torch.set_num_threads(1)
    model = build_model("gpt")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0)
    losses = []
    for x, y in global_batches("gpt", steps):
        opt.zero_grad()
        loss = model(x, y)
        loss.backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        losses.append(loss.item())
    return losses, {k: v.detach() for k, v in model.named_parameters()}


def assert_parity(out: Path, tag: str, world: int, ref) -> None:
    losses, state = ref
    merged: dict[str, torch.Tensor] = {}
    for r in range(world):
        got = torch.load(out / f"{tag}_rank{r}.pt")
        for a, b in zip(got["losses"], losses):
            assert abs(a - b) <= TOL * abs(b), (tag, r, got["losses"], losses)
        for k, v in got["state"].items():
            if k in merged:  # a tied weight held by two ranks: both copies agree exactly
                assert torch.equal(merged[k], v), (tag, k)
            merged[k] = v
    assert merged.keys() >= state.keys(), sorted(set(state) - set(merged))
    for k, want in state.items():
        have, want = _key_bias_masked(k, merged[k]), _key_bias_masked(k, want)
        err = ((have - want).norm() / want.norm().clamp_min(1e-12)).item()
        assert err <= TOL, f"{tag}: {k} relative error {err:.2e}"


@pytest.mark.slow
def test_pipeline_2_ranks_every_schedule_matches_eager(tmp_path: Path) -> None:
    # zb runs I as the full backward and W as a no-op (correct, not yet zero-bubble);
    # interleaved puts 2 chunks per rank: 4 stages (embeddings | blocks.0 | blocks.1 | head).
    launch(2, tmp_path, "--schedules", "gpipe,1f1b,zb,interleaved", "--microbatches", "2,4")
    ref = eager_reference()
    for sched in ("gpipe", "1f1b", "zb", "interleaved"):
        for M in (2, 4):
            assert_parity(tmp_path, f"{sched}_m{M}", 2, ref)


@pytest.mark.slow
def test_pipeline_4_ranks_1f1b_with_clipping_matches_eager(tmp_path: Path) -> None:
    launch(4, tmp_path, "--schedules", "gpipe,1f1b", "--microbatches", "4,8", "--grad-clip", "0.5")
    ref = eager_reference(clip=0.5)
    for sched in ("gpipe", "1f1b"):
        for M in (4, 8):
            assert_parity(tmp_path, f"{sched}_m{M}", 4, ref)
