"""The pipeline benchmark runs end to end in its --tiny mode (2 gloo ranks) and writes its JSON."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCHEDULES = ["gpipe", "1f1b"]  # the must-have rows; the smoke test keeps to them to stay fast


@pytest.mark.slow
def test_tiny_pipeline_benchmark_times_fxspeed_torch_pipelining_and_one_process_with_matching_losses(tmp_path) -> None:
    out = tmp_path / "pp.json"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    r = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "bench_pipeline.py"), "--tiny",
                        "--schedules", ",".join(SCHEDULES), "--out", str(out)],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "fx:1f1b" in r.stdout and "torch:1f1b" in r.stdout and "checks:" in r.stdout
    d = json.loads(out.read_text())
    assert d["setup"]["nproc"] == 2 and d["setup"]["preset"] == "tiny"
    rows = [f"{k}:{s}" for s in SCHEDULES for k in ("fx", "torch")] + ["single"]
    assert list(d["rows"]) == rows
    for k in rows:
        row = d["rows"][k]
        assert len(row["step_times_s"]) == d["setup"]["steps"] == 2
        assert row["median_step_s"] > 0 and all(t > 0 for t in row["step_times_s"])
    for s in SCHEDULES:
        fx, tp = d["rows"][f"fx:{s}"], d["rows"][f"torch:{s}"]
        # Same weights, batch, split, schedule and AdamW: both pipelines report the same losses,
        # and the same as one process on the whole batch (up to float summation order).
        assert fx["max_loss_diff_vs_torch"] < 1e-4, (s, fx["losses"], tp["losses"])
        assert fx["max_loss_diff_vs_single"] < 1e-4, (s, fx["losses"], d["rows"]["single"]["losses"])
        assert fx["split_blocks"] == tp["split_blocks"] and len(fx["split_blocks"]) == 2
        assert fx["ratio_vs_torch"] > 0 and fx["ratio_vs_single"] > 0
        assert f"fx_{s}_le_torch" in d["checks"]
