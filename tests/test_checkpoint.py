"""Checkpoints: engine.save / engine.load resume bit-exactly on CPU for every ZeRO stage, and
engine.state_dict() exports full tensors under the model's own names.

Two launches of `fxspeed run -n 2` (so the resumed run is a fresh process group): the first
trains 3 steps, saves, trains 2 more; the second builds the model from another seed, loads
the checkpoint and trains the same 2 steps. Losses and final parameters must be identical.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import fxspeed
from fxspeed.errors import ConfigError
from tests.test_data_parallel import key_bias_masked
from tests.workers.common import build_model, global_batches
from tests.multiprocess import run_ranks

ROOT = Path(__file__).resolve().parents[1]
STAGES = (0, 1, 2, 3)


def fxspeed_run(n: int, *args: str, timeout: int = 240) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "fxspeed", "run", "-n", str(n), "-m", "tests.workers.checkpoint_worker", *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    proc = run_ranks(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return proc


_launched: dict[int, Path] = {}


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("checkpoint")


def launched(base: Path, zero: int) -> Path:
    """Both launches for one ZeRO stage (once per module): out/{save,load}_zero{z}.pt, ckpt/zero{z}/.
    Stage 1's resumed run also loads its checkpoint into a ZeRO-2 engine (out/mismatch_rank{r}.txt)."""
    if zero not in _launched:
        ckpt, out = base / "ckpt", base / "out"
        out.mkdir(exist_ok=True)
        common = ("--zero", str(zero), "--ckpt", str(ckpt), "--out", str(out))
        fxspeed_run(2, "--phase", "save", *common)
        fxspeed_run(2, "--phase", "load", *common, *(("--mismatch-zero", "2") if zero == 1 else ()))
        _launched[zero] = base
    return _launched[zero]


@pytest.mark.parametrize("zero", STAGES)
def test_resuming_from_a_checkpoint_in_a_fresh_process_group_reproduces_losses_and_weights_bit_exactly(
        base: Path, zero: int) -> None:
    runs = launched(base, zero)
    saved = torch.load(runs / "out" / f"save_zero{zero}.pt")
    loaded = torch.load(runs / "out" / f"load_zero{zero}.pt")
    assert loaded["losses"] == saved["losses"], (zero, loaded["losses"], saved["losses"])
    assert loaded["state"].keys() == saved["state"].keys()
    for k, want in saved["state"].items():
        assert torch.equal(loaded["state"][k], want), f"zero={zero}: {k} differs after resuming"


def test_each_rank_writes_its_own_checkpoint_file(base: Path) -> None:
    for zero in STAGES:
        runs = launched(base, zero)
        assert sorted(os.listdir(runs / "ckpt" / f"zero{zero}")) == ["rank0.pt", "rank1.pt"]


def test_zero3_state_dict_has_full_tensors_under_the_original_names_equal_to_a_zero0_run(base: Path) -> None:
    runs = launched(base, 0) and launched(base, 3)
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
    runs = launched(base, zero)
    state = torch.load(runs / "out" / f"save_zero{zero}.pt")["state"]
    plain = build_model("gpt")
    plain.load_state_dict(state, strict=True)
    for k, v in plain.state_dict().items():
        assert torch.equal(v, state[k]), k
    # and that plain model computes the loss fxspeed would report for the next batch
    x, y = global_batches("gpt", 1)[0]
    assert torch.isfinite(plain(x, y))


def test_loading_a_checkpoint_saved_with_another_zero_stage_fails_on_every_rank(base: Path) -> None:
    runs = launched(base, 1)
    for r in range(2):
        msg = (runs / "out" / f"mismatch_rank{r}.txt").read_text()
        assert msg.startswith("ConfigError") and "zero=1" in msg and "zero=2" in msg, msg


def test_loading_a_two_rank_checkpoint_into_one_process_fails_with_a_clear_error(base: Path) -> None:
    runs = launched(base, 0)
    x, y = global_batches("gpt", 1)[0]
    engine = fxspeed.compile(build_model("gpt"), 1, fxspeed.Config(lr=1e-2), example_inputs=(x, y))
    with pytest.raises(ConfigError, match=r"world_size=2.*world_size=1"):
        engine.load(runs / "ckpt" / "zero0")


def test_loading_into_an_engine_of_another_ZeRO_stage_or_world_size_names_both(tmp_path: Path) -> None:
    batches = global_batches("gpt", 2)
    engine = fxspeed.compile(build_model("gpt"), 1, fxspeed.Config(lr=1e-2), example_inputs=batches[0])
    engine.train_step(*batches[0])
    engine.save(tmp_path)
    state = torch.load(tmp_path / "rank0.pt", weights_only=False)
    state["world_size"], state["zero"] = 4, 2
    torch.save(state, tmp_path / "rank0.pt")
    with pytest.raises(ConfigError, match=r"saved with world_size=4 zero=2.*world_size=1 zero=0"):
        engine.load(tmp_path)


def test_a_missing_rank_file_says_which_world_size_is_expected(tmp_path: Path) -> None:
    x, y = global_batches("gpt", 1)[0]
    engine = fxspeed.compile(build_model("gpt"), 1, fxspeed.Config(lr=1e-2), example_inputs=(x, y))
    with pytest.raises(FileNotFoundError, match="rank0.pt"):
        engine.load(tmp_path / "nowhere")


def test_one_process_save_and_load_resume_bit_exactly(tmp_path: Path) -> None:
    batches = global_batches("gpt", 5)
    cfg = fxspeed.Config(lr=1e-2, grad_clip=0.5, lr_schedule="cosine", warmup_steps=2, total_steps=5)
    a = fxspeed.compile(build_model("gpt"), 1, cfg, example_inputs=batches[0])
    for b in batches[:3]:
        a.train_step(*b)
    a.save(tmp_path)
    losses_a = [a.train_step(*b) for b in batches[3:]]

    torch.manual_seed(99)
    b_model = build_model("gpt")
    for p in b_model.parameters():
        torch.nn.init.normal_(p.data)
    b = fxspeed.compile(b_model, 1, cfg, example_inputs=batches[0])
    b.load(tmp_path)
    assert b.stats["steps"] == 3
    losses_b = [b.train_step(*x) for x in batches[3:]]
    assert losses_b == losses_a
    for k, v in a.state_dict().items():
        assert torch.equal(b.state_dict()[k], v), k
