"""`fxspeed demo` end to end, as a user runs it: a subprocess of `python -m fxspeed demo`."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from fxspeed.tools.cli import build_parser
from fxspeed.tools.demo import get_batch, load_corpus

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(*args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    return subprocess.run([sys.executable, "-m", "fxspeed", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=timeout)


def test_demo_with_five_steps_prints_the_plan_then_a_falling_loss_report() -> None:
    r = _run("demo", "--steps", "5", "--batch-size", "4", "--seq-len", "32")
    out = r.stdout + r.stderr
    assert r.returncode == 0, out
    assert "fxspeed plan · GPT" in r.stdout and "memory per rank" in r.stdout and "time per step" in r.stdout
    m = re.search(r"loss: first \d+ steps ([0-9.]+) -> last \d+ steps ([0-9.]+)", r.stdout)
    assert m, out
    first, last = map(float, m.groups())
    assert 0 < last < 6.0 and 0 < first < 6.0  # byte-level cross-entropy starts near ln(256) = 5.55
    assert r.stdout.index("fxspeed plan") < r.stdout.index("loss: first")  # plan printed before training
    assert "5/5" in r.stderr  # the progress bar reached the end


def test_cli_defaults_are_the_ones_measured_to_finish_in_two_minutes() -> None:
    a = build_parser().parse_args(["demo"])
    assert (a.model, a.batch_size, a.seq_len) == ("tiny", 16, 64)
    assert 100 <= a.steps <= 400


def test_cli_without_a_command_prints_help_and_fails() -> None:
    from fxspeed.tools.cli import main

    assert main([]) == 1


def test_corpus_is_the_standard_library_source_in_a_deterministic_order() -> None:
    a, b = load_corpus(cap=200_000), load_corpus(cap=200_000)
    assert a.numel() == 200_000 and a.equal(b)
    assert int(a.max()) < 256 and int(a.min()) >= 0
    text = bytes(a[:100_000].tolist()).decode("utf-8", errors="replace")
    assert "def " in text and "import " in text


def test_batches_are_next_byte_targets_of_their_inputs() -> None:
    import torch

    data = load_corpus(cap=50_000)
    x, y = get_batch(data, 3, 16, torch.Generator().manual_seed(0))
    assert x.shape == y.shape == (3, 16)
    assert torch.equal(x[:, 1:], y[:, :-1])


@pytest.mark.parametrize("flag", ["--model", "--lr"])
def test_cli_rejects_bad_values_for(flag: str) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["demo", flag, "huge" if flag == "--model" else "fast"])


@pytest.mark.slow
def test_demo_as_two_pipelines_of_two_stages_with_zero1_trains_and_samples_from_the_merged_weights() -> None:
    r = _run("demo", "--devices", "4", "--pipeline", "2", "--zero", "1", "--model", "tiny", "--steps", "3",
             "--batch-size", "8", "--seq-len", "32", "--sample", "16", timeout=400)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-4000:]
    assert "2-stage pipeline x 2 replicas" in r.stdout and "pipeline: 2 stages, schedule 1f1b" in r.stdout
    assert "loss: first" in r.stdout and "sample:" in r.stdout


def test_demo_with_zero1_bf16_on_two_ranks_samples_from_the_fp32_masters() -> None:
    """The module holds 0-size Parameters under master weights: sampling from it raised after
    training (the demo gathered the weights for pipelines and ZeRO-3 only)."""
    r = _run("demo", "--devices", "2", "--zero", "1", "--precision", "bf16", "--model", "tiny", "--steps", "2",
             "--batch-size", "4", "--seq-len", "32", "--sample", "8", timeout=400)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-4000:]
    assert "loss: first" in r.stdout and "sample:" in r.stdout
