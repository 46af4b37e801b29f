"""The plan-vs-RSS benchmark runs end to end on a tiny model (one process) and prints its JSON line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux's peak-RSS reset")
def test_tiny_plan_memory_benchmark_reports_the_plan_beside_compile_and_step_peaks(tmp_path: Path) -> None:
    env = dict(os.environ, OMP_NUM_THREADS="1", MALLOC_MMAP_THRESHOLD_="65536", MALLOC_TRIM_THRESHOLD_="65536")
    r = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "bench_plan_memory.py"), "--mode",
                        "z1+bf16+opt", "--nvme", str(tmp_path), "--layers", "2", "--width", "64", "--steps", "2"],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=180)
    assert r.returncode == 0, r.stdout + r.stderr
    row = json.loads(r.stdout.strip().splitlines()[-1])
    assert (row["rank"], row["world"], row["mode"]) == (0, 1, "z1+bf16+opt")
    assert row["plan_mb"] == row["plan_categories_mb"]["total"] > 0
    assert row["step_mb"] > 0 and row["compile_mb"] > 0 and row["plan_over_step"] > 0
    bad = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "bench_plan_memory.py"), "--mode", "z1+opt"],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert bad.returncode != 0 and "--nvme" in bad.stderr  # offload without a directory is said, not guessed
