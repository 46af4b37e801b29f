"""Pipeline-parallel benchmark on CPU (gloo, 2 ranks): fxspeed vs torch.distributed.pipelining,
and vs one process on the global batch.

    python benchmarks/bench_pipeline.py --out pp.json              # GPT 'small' (6 x 512), batch 8 x 128, M=4
    python benchmarks/bench_pipeline.py --rounds 2 --out pp.json   # two launches, step times pooled
    python benchmarks/bench_pipeline.py --tiny --out /tmp/pp.json  # seconds: smoke test
    python benchmarks/bench_pipeline.py --vocab 50257 --n-layer 2 --schedules 1f1b --no-single --out pp.json
                                                                   # GPT-2's vocabulary: embedding-heavy stages

Rows, for each schedule S in --schedules (gpipe, 1f1b, interleaved, zb):

    fx:S      fxspeed.compile(GPT, devices=2, Config(pipeline=2, microbatches=M, schedule=S,
              optimizer="adamw", lr)); interleaved with pipeline_chunks=--chunks
    torch:S   torch.distributed.pipelining with the SAME split (stage modules built by hand from
              the GPT's submodules at fxspeed's block boundaries, read off engine.describe()),
              the same schedule (ScheduleGPipe, Schedule1F1B, ScheduleInterleaved1F1B, and for
              zb ScheduleInterleavedZeroBubble with one stage per rank, i.e. ZB-H1), the same M,
              loss and AdamW; the tied wte/head weight has a copy on the first and last stage
              whose gradients are all-reduced before the step (as Megatron does)
    single    plain eager torch, one process (rank 0; the other rank waits), the global batch

Same for every row: the GPT (seed 0), global batch per step (every pipeline rank passes the
same full batch), torch AdamW with its fused kernel (what fxspeed's runtime uses on CPU; lr 3e-4,
weight_decay 0, no clipping), one intra-op thread per
process. A pipeline step ends with the mean loss on every rank (see workers/pp_worker.py), so
fxspeed and torch rows do the same work; their losses must agree (same weights, same math).

How numbers are measured: one torch.distributed.run launch per round builds every row, then
runs the steps in lockstep: step s of every row, in an order that rotates with s, before step
s+1 of any row, each step after a barrier. A row's step time is the slower rank's; its
reported time is the median over the timed steps (after --warmup) pooled over --rounds.
Ratios pair the rows step by step (fx step s / torch step s, run seconds apart), and report
the median of those ratios, so load changes of a shared machine hit both sides alike; the
ratio of the medians is in the JSON too. CPU seconds per step and rank (process time, all
threads) are recorded as well: a measure of work that other load on the machine barely
changes, a cross-check when wall times are noisy. Idle fraction per rank is fxspeed's own
engine.stats["idle_fraction"] (waiting for messages / step time), when the engine has it.
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
WORKER = ROOT / "benchmarks" / "workers" / "pp_worker.py"
SCHEDULES = ["gpipe", "1f1b", "interleaved", "zb"]
TORCH_NAMES = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B", "interleaved": "ScheduleInterleaved1F1B",
               "zb": "ScheduleInterleavedZeroBubble"}
TARGET_VS_TORCH = 1.0  # fxspeed's step time / torch.distributed.pipelining's, same schedule
NPROC = 2


def launch(rows: list[str], a: argparse.Namespace, out: Path) -> float:
    """One torch.distributed.run launch of the worker over `rows`; returns its wall time."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "FXSPEED_BACKEND": "gloo",
           "PYTHONPATH": os.pathsep.join([str(ROOT)] + ([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else []))}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={NPROC}", str(WORKER),
           "--rows", ",".join(rows), "--preset", a.preset, "--batch", str(a.batch), "--seq", str(a.seq),
           "--microbatches", str(a.microbatches), "--chunks", str(a.chunks), "--lr", str(a.lr),
           "--warmup", str(a.warmup), "--steps", str(a.steps), "--out", str(out)]
    if a.n_layer is not None:
        cmd += ["--n-layer", str(a.n_layer)]
    if a.vocab is not None:
        cmd += ["--vocab", str(a.vocab)]
    t = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=a.launch_timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"launch failed (rc {proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    return time.perf_counter() - t


def per_step(recs: list[dict], row: str) -> list[float]:
    """The slower rank's time of each timed step (the one-process row runs on rank 0 only)."""
    if row == "single":
        return list(recs[0]["rows"][row]["step_times_s"])
    return [max(ts) for ts in zip(*(r["rows"][row]["step_times_s"] for r in recs))]


def cpu_per_rank(rounds: list[list[dict]], row: str) -> list[float]:
    """Median CPU seconds per timed step of each rank (pooled over rounds)."""
    return [statistics.median([c for recs in rounds for c in recs[k]["rows"][row]["cpu_times_s"]])
            for k in range(NPROC)]


def paired_ratio(num: list[float], den: list[float]) -> float:
    return statistics.median(x / y for x, y in zip(num, den))


def max_diff(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) for x, y in zip(a, b))


def summarize(rows: list[str], rounds: list[list[dict]]) -> dict[str, dict]:
    """rounds: for each launch, the per-rank records."""
    times = {row: [t for recs in rounds for t in per_step(recs, row)] for row in rows}
    first = rounds[0]
    out: dict[str, dict] = {}
    for row in rows:
        kind, _, sched = row.partition(":")
        rec0 = first[0]["rows"][row]
        r = {"row": row, "framework": {"fx": "fxspeed", "torch": "torch.distributed.pipelining",
                                        "single": "eager torch, 1 process"}[kind],
             "schedule": sched or None, "median_step_s": statistics.median(times[row]),
             "min_step_s": min(times[row]), "step_times_s": times[row],
             "setup_s": max(rec["rows"][row]["setup_s"] for rec in first), "losses": rec0["losses"],
             # CPU seconds per step (the 'single' row: rank 0 is the one process; rank 1 waits).
             "cpu_s_per_rank": cpu_per_rank(rounds, row)}
        if kind == "torch":
            r["torch_schedule"] = TORCH_NAMES[sched]
        if "split_blocks" in rec0:
            r["split_blocks"] = rec0["split_blocks"]  # [lo, hi) transformer blocks per stage
        if kind == "fx":
            r["stage_params"] = [len(st["params"]) for st in rec0["stages"]]
            for key in ("idle_fraction", "step_s", "compute_s"):
                per_rank = [[v for recs in rounds for v in recs[k]["rows"][row].get(key, [])] for k in range(NPROC)]
                if all(per_rank):
                    r[f"{key}_per_rank"] = [statistics.median(v) for v in per_rank]
        if "single" in rows and kind != "single":
            r["ratio_vs_single"] = paired_ratio(times[row], times["single"])
            r["ratio_of_medians_vs_single"] = r["median_step_s"] / statistics.median(times["single"])
            r["max_loss_diff_vs_single"] = max_diff(r["losses"], first[0]["rows"]["single"]["losses"])
        out[row] = r
    for row, r in out.items():
        kind, _, sched = row.partition(":")
        other = f"torch:{sched}"
        if kind == "fx" and other in out:
            r["ratio_vs_torch"] = paired_ratio(times[row], times[other])
            r["ratio_of_medians_vs_torch"] = r["median_step_s"] / out[other]["median_step_s"]
            r["max_loss_diff_vs_torch"] = max_diff(r["losses"], out[other]["losses"])
            # Busiest rank's CPU time per step: a work measure that other load barely changes.
            r["cpu_ratio_vs_torch"] = max(r["cpu_s_per_rank"]) / max(out[other]["cpu_s_per_rank"])
            r["target_vs_torch"] = TARGET_VS_TORCH
            r["meets_target_vs_torch"] = r["ratio_vs_torch"] <= TARGET_VS_TORCH
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="JSON results file")
    ap.add_argument("--tiny", action="store_true", help="tiny 4-layer GPT, 2 timed steps (smoke test)")
    ap.add_argument("--schedules", default=",".join(SCHEDULES), help="comma-separated subset of " + ",".join(SCHEDULES))
    ap.add_argument("--no-single", action="store_true", help="skip the one-process row")
    ap.add_argument("--preset", default="small", help="GPTConfig.preset name")
    ap.add_argument("--n-layer", type=int, default=None, help="override the preset's layer count")
    ap.add_argument("--vocab", type=int, default=None, help="override the preset's vocabulary (GPT-2's: 50257)")
    ap.add_argument("--batch", type=int, default=8, help="global batch (rows)")
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--microbatches", type=int, default=4)
    ap.add_argument("--chunks", type=int, default=2, help="stages per rank for the interleaved schedule")
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--rounds", type=int, default=1, help="launches; step times are pooled over them")
    ap.add_argument("--launch-timeout", type=float, default=1800)
    a = ap.parse_args()
    if a.tiny:
        # 4 blocks so that the interleaved schedule gets its 4 stages.
        a.preset, a.n_layer, a.batch, a.seq, a.microbatches, a.warmup, a.steps = "tiny", 4, 4, 32, 2, 1, 2
    schedules = [s for s in a.schedules.split(",") if s]
    unknown = set(schedules) - set(SCHEDULES)
    if unknown:
        ap.error(f"unknown schedules {sorted(unknown)}; choose from {SCHEDULES}")
    # fx:S before torch:S: the torch row copies the split fxspeed chose.
    rows = [r for s in schedules for r in (f"fx:{s}", f"torch:{s}")] + ([] if a.no_single else ["single"])

    load_before = os.getloadavg()
    rounds: list[list[dict]] = []
    launches = []
    with tempfile.TemporaryDirectory() as tmp:
        for k in range(a.rounds):
            out = Path(tmp) / f"round{k}"
            out.mkdir()
            wall = launch(rows, a, out)
            launches.append({"round": k, "wall_s": wall, "loadavg_after": os.getloadavg()})
            print(f"  round {k}: {len(rows)} rows done in {wall:.0f} s (load avg {os.getloadavg()[0]:.2f})", flush=True)
            rounds.append([json.loads((out / f"rows_rank{r}.json").read_text()) for r in range(NPROC)])
    results = summarize(rows, rounds)
    checks = {f"fx_{s}_le_torch": results[f"fx:{s}"]["meets_target_vs_torch"] for s in schedules}
    checks.update({f"fx_{s}_losses_match_torch": results[f"fx:{s}"]["max_loss_diff_vs_torch"] < 1e-4
                   for s in schedules})
    w = rounds[0][0]
    result = {"setup": {"nproc": NPROC, "backend": "gloo", "preset": a.preset, "model": w["model"], "params": w["params"],
                        "global_batch": [a.batch, a.seq], "microbatches": a.microbatches, "chunks": a.chunks,
                        "schedules": schedules, "threads_per_process": w["threads"], "warmup": a.warmup,
                        "steps": a.steps, "rounds": a.rounds, "optimizer": f"torch.optim.AdamW(fused=True) lr={a.lr} weight_decay=0",
                        "grad_clip": None, "torch": _version("torch"), "python": platform.python_version(),
                        "cpus": os.cpu_count(), "loadavg_before": load_before, "loadavg_after": os.getloadavg(),
                        "command": " ".join([os.path.relpath(sys.executable, ROOT) if sys.executable.startswith(str(ROOT))
                                             else sys.executable] + sys.argv)},
              "rows": results, "checks": checks, "launches": launches}
    Path(a.out).write_text(json.dumps(result, indent=1))
    print_table(result)


def _version(mod: str) -> str:
    try:
        return __import__(mod).__version__
    except Exception:  # noqa: BLE001
        return "?"


def print_table(res: dict) -> None:
    s, m = res["setup"], res["setup"]["model"]
    print(f"\nGPT {s['preset']} ({m['n_layer']} x {m['n_embd']}, {s['params'] / 1e6:.1f}M params), {s['nproc']} gloo "
          f"ranks x {s['threads_per_process']} thread, global batch {s['global_batch'][0]}x{s['global_batch'][1]}, "
          f"M={s['microbatches']}, AdamW; median of {s['steps'] * s['rounds']} steps (after {s['warmup']} warmup), "
          f"slower rank; load avg {s['loadavg_before'][0]:.2f} -> {s['loadavg_after'][0]:.2f}")
    hdr = (f"{'row':18} {'split':>8} {'step s':>7} {'vs torch':>8} {'target':>7} {'vs 1 proc':>9} "
           f"{'cpu s r0/r1':>11} {'cpu vs torch':>12} {'idle r0/r1':>11} {'loss diff torch':>15} {'loss diff 1proc':>15}")
    print(hdr)
    print("-" * len(hdr))
    for row, r in res["rows"].items():
        split = "/".join(str(hi - lo) for lo, hi in r.get("split_blocks", [])) or "-"
        vs_torch = f"{r['ratio_vs_torch']:7.3f}x" if "ratio_vs_torch" in r else ""
        tgt = f"<={r['target_vs_torch']:.2f}" if "target_vs_torch" in r else ""
        vs_one = f"{r['ratio_vs_single']:8.3f}x" if "ratio_vs_single" in r else ""
        idle = " / ".join(f"{v:.2f}" for v in r.get("idle_fraction_per_rank", [])) or ""
        d_t = f"{r['max_loss_diff_vs_torch']:15.2e}" if "max_loss_diff_vs_torch" in r else ""
        d_1 = f"{r['max_loss_diff_vs_single']:15.2e}" if "max_loss_diff_vs_single" in r else ""
        cpu = " / ".join(f"{v:.2f}" for v in (r["cpu_s_per_rank"][:1] if row == "single" else r["cpu_s_per_rank"]))
        cpu_t = f"{r['cpu_ratio_vs_torch']:11.3f}x" if "cpu_ratio_vs_torch" in r else ""
        print(f"{row:18} {split:>8} {r['median_step_s']:7.3f} {vs_torch:>8} {tgt:>7} {vs_one:>9} {cpu:>11} {cpu_t:>12} "
              f"{idle:>11} {d_t:>15} {d_1:>15}")
    print("split: transformer blocks per stage (embeddings on the first, norm + head on the last); vs torch / "
          "vs 1 proc: median of per-step ratios; cpu s: median CPU seconds per step and rank")
    print("checks: " + ", ".join(f"{k}={'PASS' if v else 'FAIL'}" for k, v in res["checks"].items()))


if __name__ == "__main__":
    main()
