"""benchmarks/bench_gpu.py: without CUDA the command fails at once with a clear message; its
measuring logic (every mode, JSON, comparisons, table) runs on the CPU with --tiny models."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "benchmarks", "bench_gpu.py")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message given without CUDA")
def test_without_cuda_the_gpu_benchmark_fails_fast_and_says_why(tmp_path) -> None:
    out = tmp_path / "b.json"
    r = subprocess.run([sys.executable, SCRIPT, "--quick", "--out", str(out)], cwd=ROOT, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode != 0
    assert "needs a CUDA device" in r.stderr and "torch.cuda.is_available() is False" in r.stderr, r.stderr
    assert not out.exists()


def test_the_gpu_benchmarks_logic_runs_every_mode_on_tiny_models_on_the_cpu(tmp_path, monkeypatch) -> None:
    pytest.importorskip("transformers")
    spec = importlib.util.spec_from_file_location("bench_gpu_under_test", SCRIPT)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    monkeypatch.setattr(bench, "DEVICE", "cpu")
    out = tmp_path / "b.json"
    rc = bench.main(["--tiny", "--points", "2x32", "--warmup", "1", "--steps", "2", "--out", str(out)])
    assert rc == 0
    d = json.loads(out.read_text())
    assert {(r["model"], r["mode"]) for r in d["results"]} == {(m, mode) for m in bench.MODELS for mode in bench.MODES}
    for r in d["results"]:
        assert "error" not in r, r
        assert r["finite"] and len(r["losses"]) == 3 and len(r["step_times_s"]) == 2
        assert r["median_step_s"] > 0 and 0 < r["mfu"] and r["flops_per_step"] > 6 * r["params"] * 64
        if r["mode"].startswith("fxspeed"):
            assert r["plan_peak_bytes"] > 0 and r["fxspeed_compile_s"] > 0
    comps = {(c["model"], c["mode"]): c for c in d["comparisons"]}
    assert set(comps) == {(m, mode) for m in bench.MODELS for mode in ("fxspeed-fp32", "fxspeed-bf16")}
    for c in comps.values():
        assert math.isfinite(c["step_time_ratio"])
    for m in bench.MODELS:  # same seed, same batch: fxspeed fp32 trains like eager fp32
        assert comps[(m, "fxspeed-fp32")]["loss_rel_diff_last"] < 1e-4
        assert comps[(m, "fxspeed-bf16")]["loss_rel_diff_last"] < 1e-2
