"""Pipeline schedules measured on 2 gloo ranks: balance, bubble vs the simulator, activation memory.

    python benchmarks/bench_pipeline_schedules.py --out pp_sched.json            # GPT 8 x 256, batch 16 x 128
    python benchmarks/bench_pipeline_schedules.py --tiny --out /tmp/pps.json     # seconds: smoke test
    python benchmarks/bench_pipeline_schedules.py --schedules gpipe,1f1b --offload-activations /tmp \
        --out pp_off.json   # the same with saved activations moved by OFFLOAD/RELOAD actions

For each schedule (gpipe, 1f1b, interleaved with 2 chunks per rank, zb = ZB-H1 with the
backward split into input- and weight-gradient programs) one torch.distributed.run launch
trains the same GPT (same weights, same batches, M micro-batches, AdamW) for --warmup +
--steps steps, one intra-op thread per rank (benchmarks/workers/pp_schedule_worker.py).
Per rank and timed step the runtime records when each compute action ran; from that:

    idle fraction      time blocked in receives (and at STEP waiting for sends to be taken) /
                       time of the rank's action list (engine.stats["idle_fraction"])
    simulated idle     fxspeed.simulator.simulate(schedule, stage costs measured in that step,
                       each rank's overhead - posting sends, glue between actions - spread over
                       its compute so the simulated rank is as busy as the real one, and every
                       message delayed by the one-way latency a ping-pong of the activation
                       measured before training: engine.measure_p2p_latency())
                       -> the same quantity for this rank: waiting within its own action list
                       (SimResult.own_idle_fraction; a rank's list ends when its last action
                       does, before the slowest rank's); the check is |measured - simulated| <= 5
                       points. The pipeline-level bubble (idle up to the slowest rank's end) is
                       in the JSON too (sim_pipeline_idle_fraction).
    planner idle       the same simulation from the planner's predicted stage times (reported)
    balance            per stage, measured seconds per micro-batch of F + backward; the slowest
                       stage vs the mean of the stages (target <= 10%, on the 1f1b run)
    peak RSS growth    VmHWM - VmRSS after a reset taken after the first step, per rank, with
                       MALLOC_MMAP_THRESHOLD_=65536 so freed activations leave RSS; 1F1B holds at
                       most P micro-batches of activations, GPipe all M: 1f1b < gpipe at M = 4P

Medians over the timed steps. Checks (printed and in the JSON): balance, bubble vs simulator
for every schedule and rank, 1f1b peak RSS below gpipe's on every rank, interleaved and zb
idle fraction (mean over ranks) below 1f1b's.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WORKER = ROOT / "benchmarks" / "workers" / "pp_schedule_worker.py"
SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb")
BUBBLE_POINTS = 0.05
BALANCE = 0.10


def launch(schedule: str, a: argparse.Namespace, out: Path) -> list[dict]:
    out.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={a.nproc}", str(WORKER),
           "--schedule", schedule, "--microbatches", str(a.microbatches), "--layers", str(a.layers),
           "--width", str(a.width), "--heads", str(a.heads), "--batch", str(a.batch), "--seq", str(a.seq),
           "--steps", str(a.steps), "--warmup", str(a.warmup), "--out", str(out)]
    if a.offload_activations:
        cmd += ["--offload-activations", a.offload_activations]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MALLOC_MMAP_THRESHOLD_": "65536",
           "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=a.timeout)
    if proc.returncode != 0:
        raise SystemExit(f"{schedule}: launch failed ({proc.returncode})\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(a.nproc)]


def stage_seconds(ranks: list[dict]) -> dict[int, float]:
    """Median over timed steps of each stage's F + backward seconds per micro-batch."""
    per: dict[int, list[float]] = {}
    for st in ranks[0]["steps"]:
        for s, c in st["stage_s"].items():
            per.setdefault(int(s), []).append(c["F"] + c["I"] + c["W"])
    return {s: statistics.median(v) for s, v in sorted(per.items())}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--tiny", action="store_true", help="tiny model and few steps (a smoke test)")
    ap.add_argument("--schedules", default=",".join(SCHEDULES))
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--microbatches", type=int, default=None, help="default 4 x nproc (M = 4P)")
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--width", type=int, default=None)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--batch", type=int, default=None)
    ap.add_argument("--seq", type=int, default=None)
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--timeout", type=float, default=1200.0)
    ap.add_argument("--offload-activations", default=None, metavar="DIR",
                    help="run every schedule with Config(offload='activations', nvme_path=DIR)")
    a = ap.parse_args()
    a.microbatches = a.microbatches or 4 * a.nproc
    for k, full, tiny in (("layers", 8, 4), ("width", 256, 32), ("batch", 16, 8), ("seq", 128, 16), ("steps", 5, 2)):
        if getattr(a, k) is None:
            setattr(a, k, tiny if a.tiny else full)
    load0 = os.getloadavg()[0]
    t0 = time.time()
    rows: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for sched in a.schedules.split(","):
            print(f"[{sched}] launching {a.nproc} ranks ...", file=sys.stderr, flush=True)
            ranks = launch(sched, a, Path(tmp) / sched)
            stages = stage_seconds(ranks)
            mean = statistics.mean(stages.values())
            rows[sched] = {
                "schedule": ranks[0]["schedule"],
                "step_s": max(r["median"]["wall_s"] for r in ranks),
                "idle_fraction": [r["median"]["idle_fraction"] for r in ranks],
                "sim_idle_fraction": [r["median"]["sim_idle_fraction"] for r in ranks],
                "planner_idle_fraction": [r["planner_idle_fraction"] for r in ranks],
                "stage_s": stages, "imbalance": max(stages.values()) / mean - 1.0,
                "peak_growth_bytes": [r["peak_growth_bytes"] for r in ranks],
                "losses": ranks[0]["losses"], "n_params": ranks[0]["n_params"],
                "p2p_latency_s": ranks[0]["p2p_latency_s"],
                "plan_stages": ranks[0]["plan_stages"]}
    checks: dict[str, bool] = {}
    for s, r in rows.items():
        checks[f"{s}_bubble_within_5_points_of_simulator"] = all(
            abs(m - p) <= BUBBLE_POINTS for m, p in zip(r["idle_fraction"], r["sim_idle_fraction"]))
    if "1f1b" in rows:
        checks["1f1b_balance_within_10pct"] = rows["1f1b"]["imbalance"] <= BALANCE
        if "gpipe" in rows:
            checks["1f1b_peak_rss_below_gpipe"] = all(
                o < g for o, g in zip(rows["1f1b"]["peak_growth_bytes"], rows["gpipe"]["peak_growth_bytes"]))
        for s in ("interleaved", "zb"):
            if s in rows:
                checks[f"{s}_idle_below_1f1b"] = (statistics.mean(rows[s]["idle_fraction"])
                                                  < statistics.mean(rows["1f1b"]["idle_fraction"]))
    setup = {k: getattr(a, k) for k in ("nproc", "microbatches", "layers", "width", "heads", "batch", "seq", "steps",
                                        "warmup", "tiny")}
    n_params = next(iter(rows.values()))["n_params"] if rows else 0
    print(f"\nGPT {a.layers} x {a.width} ({n_params / 1e6:.2f}M params), batch {a.batch} x {a.seq}, "
          f"{a.nproc} gloo ranks, M={a.microbatches}, 1 thread per rank; medians of {a.steps} steps")
    print(f"{'schedule':<12}{'step s':>8}  {'idle (measured)':<18}{'idle (sim, measured costs)':<28}"
          f"{'idle (planner)':<18}{'imbalance':>10}  {'peak RSS growth MiB':<20}")
    fmt = lambda v: " ".join(f"{x:.3f}" for x in v)  # noqa: E731
    for s, r in rows.items():
        print(f"{s:<12}{r['step_s']:8.3f}  {fmt(r['idle_fraction']):<18}{fmt(r['sim_idle_fraction']):<28}"
              f"{fmt(r['planner_idle_fraction']):<18}{r['imbalance'] * 100:9.1f}%  "
              f"{' '.join(f'{b / 2**20:.0f}' for b in r['peak_growth_bytes']):<20}")
    for s, r in rows.items():
        print(f"  {s}: p2p latency {r['p2p_latency_s'] * 1e3:.2f} ms per message; stage seconds per micro-batch (F+backward): "
              + ", ".join(f"stage {k}: {v * 1e3:.1f} ms" for k, v in r["stage_s"].items()))
    print("checks: " + ", ".join(f"{k}={'yes' if v else 'NO'}" for k, v in checks.items()))
    print(f"total {time.time() - t0:.0f} s; load average start {load0:.2f}, end {os.getloadavg()[0]:.2f} "
          f"({os.cpu_count()} CPUs)")
    if a.out:
        a.out.write_text(json.dumps({"setup": setup, "rows": rows, "checks": checks,
                                     "machine": {"cpus": os.cpu_count(), "python": platform.python_version()}},
                                    indent=1))


if __name__ == "__main__":
    main()
