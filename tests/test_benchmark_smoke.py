"""The single-device benchmark runs end to end in its --tiny mode and writes its JSON."""

from __future__ import annotations

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_tiny_benchmark_finishes_and_writes_step_and_compile_results_as_json(tmp_path) -> None:
    out = tmp_path / "bench.json"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    r = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "bench_single_device.py"), "--tiny",
                        "--out", str(out)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "ratio fxspeed/eager" in r.stdout and "capture+passes+plan" in r.stdout
    d = json.loads(out.read_text())
    s, c = d["step"], d["compile"]
    assert s["eager_median_s"] > 0 and s["fxspeed_median_s"] > 0 and s["ratio"] > 0
    assert len(s["eager_times_s"]) == len(s["fxspeed_times_s"]) == s["steps"]
    assert s["max_loss_diff"] < 1e-4  # same model, same weights, same batches: same losses
    assert c["plan_seconds_cold"] > 0 and c["params"] > 0
