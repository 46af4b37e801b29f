"""The gradient-accumulation benchmark runs end to end on a tiny GPT and writes its JSON."""

from __future__ import annotations

import json
import os
import sys

import pytest

from tests.multiprocess import rank_env, run_ranks

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_tiny_grad_accum_benchmark_times_every_row_and_the_fxspeed_rows_agree_on_the_losses(tmp_path) -> None:
    out = tmp_path / "ga.json"
    cmd = [sys.executable, "-m", "fxspeed", "run", "-n", "2", os.path.join(ROOT, "benchmarks", "bench_grad_accum.py"),
           "--preset", "tiny", "--accum", "2", "--seq", "32", "--steps", "1", "--out", str(out)]
    r = run_ranks(cmd, cwd=ROOT, env=rank_env(), capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    d = json.loads(out.read_text())
    assert set(d["median_step_s"]) == {"fx0", "fx0-every", "fx1", "fx1-every", "ddp"}
    assert all(t > 0 for t in d["median_step_s"].values())
    losses = d["losses"]
    for z in ("fx0", "fx1"):  # the same steps, gradients summed in another order
        assert losses[z] == pytest.approx(losses[f"{z}-every"], rel=1e-5)
