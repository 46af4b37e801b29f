"""Checkpoints: engine.save / engine.load resume bit-exactly on CPU for every ZeRO stage, a
checkpoint loads under another ZeRO stage or world size (one format: torch.distributed.checkpoint
with full tensors by name), and engine.state_dict() exports full tensors under the model's own names.

Two launches of `fxspeed run -n 2` (so the resumed run is a fresh process group), each going
through every ZeRO stage in turn: the first trains 3 steps, saves, trains 2 more; the second
builds the model from another seed, loads the checkpoint and trains the same 2 steps. Losses and
final parameters must be identical.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import fxspeed
from tests.test_data_parallel import key_bias_masked
from tests.workers.common import build_model, global_batches
from tests.multiprocess import rank_env, run_ranks

ROOT = Path(__file__).resolve().parents[1]
STAGES = (0, 1, 2, 3)


def fxspeed_run(n: int, *args: str, timeout: int = 240) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "fxspeed", "run", "-n", str(n), "-m", "tests.workers.checkpoint_worker", *args]
    env = rank_env()
    proc = run_ranks(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return proc


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Both launches, every ZeRO stage in each (a launch costs more than a stage's run):
    out/{save,load}_zero{z}.pt, ckpt/zero{z}/. The resumed run also loads stage 1's checkpoint
    into a ZeRO-2 engine (out/mismatch_rank{r}.txt)."""
    runs = tmp_path_factory.mktemp("checkpoint")
    ckpt, out = runs / "ckpt", runs / "out"
    out.mkdir()
    common = ("--zero", ",".join(map(str, STAGES)), "--ckpt", str(ckpt), "--out", str(out))
    fxspeed_run(2, "--phase", "save", *common, timeout=600)
    fxspeed_run(2, "--phase", "load", *common, "--mismatch-zero", "2", "--mismatch-from", "1", timeout=600)
    return runs


@pytest.mark.parametrize("zero", STAGES)
def test_resuming_from_a_checkpoint_in_a_fresh_process_group_reproduces_losses_and_weights_bit_exactly(
        base: Path, zero: int) -> None:
    runs = base
    saved = torch.load(runs / "out" / f"save_zero{zero}.pt")
    loaded = torch.load(runs / "out" / f"load_zero{zero}.pt")
    assert loaded["losses"] == saved["losses"], (zero, loaded["losses"], saved["losses"])
    assert loaded["state"].keys() == saved["state"].keys()
    for k, want in saved["state"].items():
        assert torch.equal(loaded["state"][k], want), f"zero={zero}: {k} differs after resuming"


def test_a_checkpoint_is_one_complete_dcp_directory_whatever_the_zero_stage(base: Path) -> None:
    for zero in STAGES:
        files = set(os.listdir(base / "ckpt" / f"zero{zero}"))
        assert {".metadata", "COMPLETE", "extra.pt"} <= files, files
        assert any(f.endswith(".distcp") for f in files), files


def test_zero3_state_dict_has_full_tensors_under_the_original_names_equal_to_a_zero0_run(base: Path) -> None:
    runs = base
    reference = build_model("gpt").state_dict()
    z0 = torch.load(runs / "out" / "save_zero0.pt")
    z3 = torch.load(runs / "out" / "save_zero3.pt")
    assert list(z3["initial_state"].keys()) == list(reference.keys())
    for k, want in reference.items():
        # Right after compile: exactly the model's weights, although each rank holds only a shard.
        assert torch.equal(z3["initial_state"][k], want), k
        assert torch.equal(z0["initial_state"][k], want), k
        # After training: the same weights as data parallel without sharding (reduction order may
        # differ between all-reduce and reduce-scatter, hence a float tolerance; the attention key
        # bias has a zero true gradient whose float noise AdamW amplifies: see test_data_parallel).
        have, ref = key_bias_masked(k, z3["state"][k]), key_bias_masked(k, z0["state"][k])
        assert have.shape == ref.shape == want.shape, k
        err = ((have - ref).double().norm() / ref.double().norm().clamp_min(1e-12)).item()
        assert err <= 1e-5, f"{k}: relative error {err:.2e} between ZeRO-3 and ZeRO-0"


@pytest.mark.parametrize("zero", STAGES)
def test_an_exported_state_dict_loads_strictly_into_a_plain_pytorch_model(base: Path, zero: int) -> None:
    runs = base
    state = torch.load(runs / "out" / f"save_zero{zero}.pt")["state"]
    plain = build_model("gpt")
    plain.load_state_dict(state, strict=True)
    for k, v in plain.state_dict().items():
        assert torch.equal(v, state[k]), k
    # and that plain model computes the loss fxspeed would report for the next batch
    x, y = global_batches("gpt", 1)[0]
    assert torch.isfinite(plain(x, y))


def test_a_zero1_checkpoint_loads_into_a_zero2_engine_on_every_rank(base: Path) -> None:
    runs = base
    for r in range(2):
        msg = (runs / "out" / f"mismatch_rank{r}.txt").read_text()
        assert msg == "no error", msg


def test_a_two_rank_checkpoint_loads_into_one_process_and_continues_the_same_run(base: Path) -> None:
    runs = base
    batches = global_batches("gpt", 5)
    engine = fxspeed.compile(build_model("gpt"), 1, fxspeed.Config(zero=0, lr=1e-2, grad_clip=0.5, optimizer="adamw"),
                             example_inputs=batches[0])
    engine.load(runs / "ckpt" / "zero0")
    losses = [engine.train_step(*b) for b in batches[3:]]
    saved = torch.load(runs / "out" / "save_zero0.pt")
    for have, want in zip(losses, saved["losses"]):
        assert abs(have - want) <= 1e-6 * abs(want), (losses, saved["losses"])


def test_loading_a_checkpoint_of_another_model_names_the_parameter(tmp_path: Path) -> None:
    batches = global_batches("gpt", 2)
    engine = fxspeed.compile(build_model("gpt"), 1, fxspeed.Config(lr=1e-2), example_inputs=batches[0])
    engine.train_step(*batches[0])
    engine.save(tmp_path / "ck")
    other = torch.nn.Sequential(torch.nn.Linear(16, 4))
    x = torch.randn(2, 16)
    e2 = fxspeed.compile(other, 1, fxspeed.Config(lr=1e-2), example_inputs=(x,), loss_fn=lambda out, x: out.sum())
    with pytest.raises(fxspeed.FxspeedError, match=r"0\.weight"):
        e2.load(tmp_path / "ck")


def test_a_loaded_checkpoint_restores_the_runs_progress_not_the_saving_engines_own_counters(tmp_path: Path) -> None:
    # (h48: a resumed run reported the saving engine's compiles on top of its own, and a ZeRO-2
    # engine loading a pipeline's checkpoint reported the pipeline's step timings)
    batches = global_batches("gpt", 4)
    saver = fxspeed.compile(build_model("gpt"), 1, fxspeed.Config(lr=1e-2, grad_accum=2), example_inputs=batches[0])
    for b in batches[:3]:
        saver.train_step(*b)
    saver.stats["idle_fraction"] = 0.5  # as a pipeline engine keeps
    saver.save(tmp_path / "ck")
    loader = fxspeed.compile(build_model("gpt"), 1, fxspeed.Config(lr=1e-2), example_inputs=batches[0])
    own = loader.stats["compiles"]
    assert own < saver.stats["compiles"]
    loader.load(tmp_path / "ck")
    assert loader.stats == {"steps": 3, "compiles": own, "skipped_steps": 0}
    loader.train_step(*batches[3])
    assert loader.stats["steps"] == 4


def test_a_missing_checkpoint_names_the_directory(tmp_path: Path) -> None:
    x, y = global_batches("gpt", 1)[0]
    engine = fxspeed.compile(build_model("gpt"), 1, fxspeed.Config(lr=1e-2), example_inputs=(x, y))
    with pytest.raises(fxspeed.FxspeedError, match="nowhere"):
        engine.load(tmp_path / "nowhere")


def _reshard_run(n: int, *args: str) -> None:
    cmd = [sys.executable, "-m", "fxspeed", "run", "-n", str(n), "-m", "tests.workers.reshard_worker", *args]
    env = rank_env()
    proc = run_ranks(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]


@pytest.mark.slow
def test_a_zero3_checkpoint_of_4_ranks_resumes_under_pipeline_2_x_dp_2_zero1_and_on_one_device(
        tmp_path: Path) -> None:
    ckpt, out = tmp_path / "ckpt", tmp_path / "out"
    out.mkdir()
    # One launch: save under ZeRO-3 data parallel, then (the saving engine deleted) load under
    # pipeline 2 x data parallel 2, ZeRO-1. A launch of 4 ranks on 2 cores costs more than a phase.
    _reshard_run(4, "--phase", "save,load", "--ckpt", str(ckpt), "--out", str(out), "--pipeline", "2", "--zero", "1",
                 "--tag", "pp2_dp2_zero1")
    # One device: the global batch in another process (this one), from the same checkpoint.
    batches = global_batches("gpt", 5)
    cfg = fxspeed.Config(zero=0, lr=1e-2, grad_clip=0.5, optimizer="adamw")
    one = fxspeed.compile(build_model("gpt"), 1, cfg, example_inputs=batches[0])
    one.load(ckpt)
    single = [one.train_step(*b) for b in batches[3:]]
    straight = torch.load(out / "straight.pt")
    resumed = torch.load(out / "resumed_pp2_dp2_zero1.pt")
    for losses in (resumed["losses"], single):
        for have, want in zip(losses, straight["losses"]):
            assert abs(have - want) <= 1e-6 * abs(want), (losses, straight["losses"])
    for k, want in straight["state"].items():
        for have in (resumed["state"][k], one.state_dict()[k]):
            h, w = key_bias_masked(k, have), key_bias_masked(k, want)
            err = ((h - w).double().norm() / w.double().norm().clamp_min(1e-12)).item()
            assert err <= 1e-5, f"{k}: relative error {err:.2e} after resharding"


def test_export_of_an_hf_model_loads_with_from_pretrained_and_gives_the_same_logits(tmp_path: Path) -> None:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=100, n_positions=32))
    ids = torch.randint(0, 100, (2, 16))
    engine = fxspeed.compile(model, 1, fxspeed.Config(lr=1e-2), example_inputs=dict(input_ids=ids, labels=ids))
    engine.train_step(input_ids=ids, labels=ids)
    engine.export(tmp_path / "hf")
    loaded = GPT2LMHeadModel.from_pretrained(tmp_path / "hf").eval()
    model.eval()
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, model(ids).logits)


def test_export_of_a_plain_model_loads_strictly_into_the_model(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    batches = global_batches("gpt", 1)
    engine = fxspeed.compile(build_model("gpt"), 1, fxspeed.Config(lr=1e-2), example_inputs=batches[0])
    engine.train_step(*batches[0])
    engine.export(tmp_path / "gpt.safetensors")
    plain = build_model("gpt")
    plain.load_state_dict(load_file(tmp_path / "gpt.safetensors"), strict=True)
    for k, v in engine.state_dict().items():
        assert torch.equal(plain.state_dict()[k], v), k
    # a directory (existing, or named with a trailing slash) is an error that says to give a file
    for where in (tmp_path, f"{tmp_path}/new_dir/"):
        with pytest.raises(fxspeed.ConfigError, match="exported as one safetensors file and the path is a directory"):
            engine.export(where)


def test_a_resumed_manual_schedule_goes_on_from_the_lr_the_users_scheduler_had_set(tmp_path) -> None:
    """Under lr_schedule="manual" the engine's own schedule never steps, and load restored its
    stale lr (Config.lr): a resumed ExponentialLR went on from 8x its lr, silently."""
    from fxspeed.models import GPT, GPTConfig

    data = [torch.randint(0, 64, (4, 17), generator=torch.Generator().manual_seed(i)) for i in range(6)]

    def engine() -> tuple[fxspeed.Engine, torch.optim.lr_scheduler.LRScheduler]:
        torch.manual_seed(0)
        e = fxspeed.compile(GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=1, n_head=2, n_embd=32)),
                            config=fxspeed.Config(lr_schedule="manual", lr=1e-2),
                            example_inputs=(data[0][:, :-1], data[0][:, 1:]))
        return e, torch.optim.lr_scheduler.ExponentialLR(e.optimizer, gamma=0.5)

    def steps(e: fxspeed.Engine, sched: Any, batches: list) -> list[tuple[float, float]]:
        out = []
        for d in batches:
            out.append((e.optimizer.param_groups[0]["lr"], e.train_step(d[:, :-1], d[:, 1:])))
            sched.step()
        return out

    whole = steps(*engine(), data)
    e, sched = engine()
    resumed = steps(e, sched, data[:3])
    e.save(tmp_path / "ck")
    saved = sched.state_dict()
    e, sched = engine()
    e.load(tmp_path / "ck")
    sched.load_state_dict(saved)
    resumed += steps(e, sched, data[3:])
    assert resumed == whole


def test_a_manual_lr_set_from_numpy_is_saved(tmp_path) -> None:
    """The param_groups' settings go into the checkpoint: a numpy float (np.cos in a hand-written
    schedule) was refused by its safe load, and save failed."""
    import numpy as np

    from fxspeed.models import GPT, GPTConfig

    x = torch.randint(0, 64, (2, 8))
    e = fxspeed.compile(GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=1, n_head=2, n_embd=32)),
                        config=fxspeed.Config(lr_schedule="manual"), example_inputs=(x, x))
    e.optimizer.param_groups[0]["lr"] = 1e-3 * 0.5 * (1 + np.cos(np.pi * 0.25))
    e.train_step(x, x)
    e.save(tmp_path / "ck")
    e.load(tmp_path / "ck")
    assert e.optimizer.param_groups[0]["lr"] == pytest.approx(1e-3 * 0.5 * (1 + math.cos(math.pi * 0.25)))


def test_a_manual_schedule_resumed_under_another_optimizer_keeps_the_configs_update_rule(tmp_path) -> None:
    """Under lr_schedule="manual" load restores each group's saved settings (lr, betas: what a
    user's scheduler changes); torch's `decoupled_weight_decay` came along, so an
    optimizer="adam" engine resuming an AdamW checkpoint decayed its weights as AdamW, silently."""
    from fxspeed.models import GPT, GPTConfig

    x = torch.randint(0, 64, (2, 8))

    def engine(optimizer: str) -> fxspeed.Engine:
        torch.manual_seed(0)
        return fxspeed.compile(GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=1, n_head=2, n_embd=32)),
                               config=fxspeed.Config(lr_schedule="manual", optimizer=optimizer, weight_decay=0.1),
                               example_inputs=(x, x))

    e = engine("adamw")
    e.optimizer.param_groups[0]["lr"] = 5e-4
    e.save(tmp_path / "ck")
    adam = engine("adam")
    adam.load(tmp_path / "ck")
    group = adam.optimizer.param_groups[0]
    assert group["lr"] == 5e-4 and group["decoupled_weight_decay"] is False
