"""The mixed-precision benchmark runs end to end in its --tiny mode and writes its JSON."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_tiny_mixed_precision_benchmark_trains_all_precisions_and_measures_memory(tmp_path) -> None:
    out = tmp_path / "mp.json"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    r = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "bench_mixed_precision.py"), "--tiny",
                        "--out", str(out)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "convergence" in r.stdout and "activation memory" in r.stdout
    d = json.loads(out.read_text())
    train = d["train"]
    assert set(train) == {"fp32", "bf16", "fp16"}
    for p, rec in train.items():
        assert len(rec["losses"]) == rec["steps"] == len(rec["step_times_s"])
        assert not rec["any_nan"] and all(math.isfinite(x) for x in rec["losses"]), p
        assert rec["final_loss"] < rec["first_loss"], p  # it trains
        assert abs(rec["rel_diff_vs_fp32"]) < 0.05, p  # tiny model, few steps: loose bound
    assert train["fp32"]["rel_diff_vs_fp32"] == 0.0
    assert train["fp16"]["loss_scale"] > 0 and train["fp16"]["skipped_steps"] >= 0
    assert train["bf16"]["low_precision_ops"] and not train["fp32"]["low_precision_ops"]
    mem = d["memory"]
    assert {"fp32", "bf16"} <= set(mem)
    for rec in mem.values():
        assert rec["peak_growth_bytes"] >= 0 and rec["peak_rss_bytes"] > 0
    assert d["memory_ratio_bf16_vs_fp32"] == mem["bf16"]["ratio_vs_fp32"]
