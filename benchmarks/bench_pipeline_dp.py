"""Pipeline x data parallel on CPU (gloo, 4 ranks = 2 replicas x 2 stages): step time of this
checkout, optionally against another checkout's interpreter, launches alternating.

    python benchmarks/bench_pipeline_dp.py --zero 0,1 --out ppdp.json
    python benchmarks/bench_pipeline_dp.py --baseline-python /path/to/old/.venv/bin/python --out ppdp.json

What it is for: the gradient reduction over the replicas runs per stage at its REDUCE action,
overlapped with the rest of the rank's schedule (runtime/engine.py); a checkout that reduces
after the whole schedule is the baseline. Launches alternate (ours, baseline, ours, ...) so the
machine's load hits both alike; per launch, the median of the timed steps (each the slower
rank's); reported: the median over launches and the ratio ours / baseline per ZeRO stage.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WORKER = ROOT / "benchmarks" / "workers" / "pp_dp_worker.py"


def launch(python: str, zero: int, a: argparse.Namespace) -> list[float]:
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "r.json")
        cmd = [python, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=4", str(WORKER),
               "--zero", str(zero), "--preset", a.preset, "--batch", str(a.batch), "--seq", str(a.seq),
               "--microbatches", str(a.microbatches), "--steps", str(a.steps), "--out", out]
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        env.pop("PYTHONPATH", None)
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800, cwd=tempfile.gettempdir())
        if proc.returncode != 0:
            sys.exit(f"launch failed ({python}):\n{proc.stderr[-4000:]}")
        return json.load(open(out))["step_s"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--zero", default="0,1")
    ap.add_argument("--preset", default="small")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--microbatches", type=int, default=4)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--baseline-python", default=None)
    ap.add_argument("--out", default="bench_pipeline_dp.json")
    a = ap.parse_args()
    result: dict = {"args": vars(a), "rows": {}}
    for zero in map(int, a.zero.split(",")):
        ours, base = [], []
        for _ in range(a.rounds):
            ours.append(statistics.median(launch(sys.executable, zero, a)))
            if a.baseline_python:
                base.append(statistics.median(launch(a.baseline_python, zero, a)))
        row = {"ours_s": statistics.median(ours), "ours_launches": ours}
        if base:
            row |= {"baseline_s": statistics.median(base), "baseline_launches": base,
                    "ratio": statistics.median(ours) / statistics.median(base)}
        result["rows"][f"zero{zero}"] = row
        print(f"zero={zero}: " + ", ".join(f"{k}={v:.4f}" for k, v in row.items() if isinstance(v, float)), flush=True)
    Path(a.out).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
