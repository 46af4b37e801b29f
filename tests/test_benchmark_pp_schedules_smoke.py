"""The pipeline-schedule benchmark runs end to end in its --tiny mode (2 gloo ranks) and writes its JSON."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow
def test_tiny_pipeline_schedule_benchmark_reports_idle_time_simulation_balance_and_memory_per_rank(tmp_path) -> None:
    out = tmp_path / "pps.json"
    r = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "bench_pipeline_schedules.py"), "--tiny",
                        "--schedules", "1f1b,zb", "--out", str(out)], cwd=ROOT, capture_output=True, text=True,
                       timeout=240)
    assert r.returncode == 0, r.stdout + r.stderr
    d = json.loads(out.read_text())
    assert list(d["rows"]) == ["1f1b", "zb"] and d["rows"]["zb"]["schedule"] == "zb-h1"
    for row in d["rows"].values():
        assert row["step_s"] > 0 and len(row["idle_fraction"]) == len(row["sim_idle_fraction"]) == 2
        assert all(0 <= f < 1 for f in row["idle_fraction"] + row["sim_idle_fraction"])
        assert len(row["stage_s"]) == 2 and all(v > 0 for v in row["stage_s"].values())
        assert len(row["peak_growth_bytes"]) == 2
    # Same weights, batches and optimizer: the schedule does not change the losses.
    assert d["rows"]["1f1b"]["losses"] == pytest.approx(d["rows"]["zb"]["losses"], rel=1e-5)
    assert {"1f1b_balance_within_10pct", "zb_idle_below_1f1b", "zb_bubble_within_5_points_of_simulator"} <= set(d["checks"])
