"""The data-parallel benchmark runs end to end in its --tiny mode (2 gloo ranks) and writes its JSON."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ROWS = ["ddp", "fx0", "fx1", "fx2", "fx3", "fsdp2"]


@pytest.mark.slow
def test_tiny_data_parallel_benchmark_writes_every_row_with_times_memory_and_matching_losses(tmp_path) -> None:
    out = tmp_path / "dp.json"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    r = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "bench_data_parallel.py"), "--tiny",
                        "--out", str(out)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=180)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "torch DDP" in r.stdout and "fxspeed zero=3" in r.stdout and "torch FSDP2" in r.stdout
    d = json.loads(out.read_text())
    assert list(d["rows"]) == ROWS  # --tiny never adds the DeepSpeed rows
    assert d["setup"]["nproc"] == 2 and d["setup"]["preset"] == "tiny"
    for k in ROWS:
        row = d["rows"][k]
        assert len(row["step_times_s"]) == d["setup"]["steps"] == 2
        assert row["median_step_s"] > 0 and row["time_ratio_vs_ddp"] > 0
        assert len(row["peak_growth_bytes_per_rank"]) == 2 and row["peak_growth_bytes"] >= 0
        # Same weights, same per-rank batches, same Adam: every framework reports the same global loss.
        assert row["max_loss_diff_vs_ddp"] < 1e-4, (k, row["losses"], d["rows"]["ddp"]["losses"])
    assert d["rows"]["ddp"]["time_ratio_vs_ddp"] == 1.0
    assert set(d["checks"]) >= {"fx0", "fx1", "fx2", "fx3", "fx3_faster_than_fsdp2", "fx3_peak_rss_le_fsdp2"}
