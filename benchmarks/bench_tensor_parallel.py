"""Tensor parallelism on CPU (gloo): fxspeed Config(tensor=2) against torch DTensor's Megatron plan
on the same GPT, and both against one process.

    python benchmarks/bench_tensor_parallel.py --out tp.json                # 109M GPT, global batch 8 x 64
    python benchmarks/bench_tensor_parallel.py --batch 2 --out tp_b2.json   # a second operating point
    python benchmarks/bench_tensor_parallel.py --tiny --out /tmp/tp.json    # seconds: smoke test
    python benchmarks/bench_tensor_parallel.py --dropout 0.1 --rows eager,dtensor,fxtp --out tp_drop.json

Rows (benchmarks/workers/tp_worker.py): eager (plain PyTorch, one process), fx (fxspeed, one
process), dtensor (DTensor parallelize_module: q/k/v and fc ColwiseParallel, the projections
RowwiseParallel, on --nproc ranks), fxtp (fxspeed Config(tensor=--nproc), the solver's layout),
fxsp (the same with Config(sequence_parallel=True)); with --nproc 4, fxpp (TP=2 x PP=2, 4
micro-batches) and fxppsp (the same with sequence parallelism):

    python benchmarks/bench_tensor_parallel.py --nproc 4 --rows fxtp,fxpp,fxppsp --out tp_pp.json
The model is fxspeed's GPT (default 8 blocks, d=1024, vocab 8192, seq 64: 109.2M parameters,
the embedding tied to the head; the issue's "about 118M" counts an untied head) with q, k and v as separate Linears, torch Adam, lr 1e-4.

One torch.distributed.run launch per (round, row), rounds alternating the row order so a slow
phase of a shared machine hits all rows; step time = median over rounds and timed steps of the
slowest rank's step. Memory: each rank's VmHWM (the kernel's peak RSS, absolute) and its growth
over the RSS right after the model was built. Targets (issue 14): fxtp step time <= 1.0x
dtensor's; fxtp peak RSS per rank <= dtensor's and <= 0.6x one process's (eager).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WORKER = ROOT / "benchmarks" / "workers" / "tp_worker.py"
ROWS = ("eager", "fx", "dtensor", "fxtp", "fxsp")
PARALLEL = ("dtensor", "fxtp", "fxsp", "fxpp", "fxppsp")  # fxpp*: not default rows (they need --nproc 4)


def launch(mode: str, a: argparse.Namespace, out: Path) -> list[dict]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MALLOC_MMAP_THRESHOLD_": "65536",
           "PYTHONPATH": os.pathsep.join([str(ROOT)] + ([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else []))}
    nproc = a.nproc if mode in PARALLEL else 1
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", str(WORKER),
           "--mode", mode, "--layers", str(a.layers), "--width", str(a.width), "--vocab", str(a.vocab),
           "--batch", str(a.batch), "--seq", str(a.seq), "--dropout", str(a.dropout), "--warmup", str(a.warmup),
           "--steps", str(a.steps),
           "--out", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=a.launch_timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"{mode} launch failed (rc {proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    return [json.loads((out / f"{mode}_rank{r}.json").read_text()) for r in range(nproc)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--dropout", type=float, default=0.0, help="embedding, attention and residual dropout")
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--rows", default=",".join(ROWS))
    ap.add_argument("--launch-timeout", type=float, default=1800)
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    if a.tiny:
        a.layers, a.width, a.vocab, a.batch, a.seq, a.warmup, a.steps, a.rounds = 2, 128, 256, 2, 16, 1, 2, 1
    rows = a.rows.split(",")
    runs: dict[str, list[list[dict]]] = {m: [] for m in rows}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(a.rounds):
            for mode in (rows if r % 2 == 0 else rows[::-1]):
                out = Path(tmp) / f"round{r}"
                out.mkdir(exist_ok=True)
                t = time.perf_counter()
                runs[mode].append(launch(mode, a, out))
                print(f"round {r} {mode}: {time.perf_counter() - t:.0f} s", flush=True)
    result: dict = {"setup": {k: getattr(a, k) for k in ("layers", "width", "vocab", "batch", "seq", "dropout", "nproc",
                                                          "warmup", "steps", "rounds")}, "rows": {}}
    for mode, rounds in runs.items():
        result["rows"][mode] = {
            "step_s": statistics.median(t for recs in rounds for t in recs[0]["step_times_s"]),
            "peak_rss_MB": [max(recs[i]["peak_rss_bytes"] for recs in rounds) / 1e6 for i in range(len(rounds[0]))],
            "peak_growth_MB": [max(recs[i]["peak_growth_bytes"] for recs in rounds) / 1e6 for i in range(len(rounds[0]))],
            "setup_s": statistics.median(recs[0]["setup_s"] for recs in rounds),
            "losses": rounds[0][0]["losses"]}
    res = result["rows"]
    result["n_params"] = runs[rows[0]][0][0]["n_params"]
    print(f"GPT {result['n_params'] / 1e6:.1f}M params, global batch {a.batch} x {a.seq}, dropout {a.dropout}, "
          f"{a.nproc} tp ranks")
    for mode in rows:
        r = res[mode]
        print(f"  {mode:<8} step {r['step_s']:.3f} s  peak RSS per rank " + ", ".join(f"{m:.0f}" for m in r["peak_rss_MB"])
              + " MB (growth " + ", ".join(f"{m:.0f}" for m in r["peak_growth_MB"]) + f" MB)  setup {r['setup_s']:.1f} s")
    ref = res.get("eager") or res.get("fx")
    if ref is not None:
        # same init, same batches: every row's first loss is the same number (to float rounding)
        result["first_loss_max_rel_diff"] = max(abs(r["losses"][0] - ref["losses"][0]) / abs(ref["losses"][0])
                                                for r in res.values())
    if "fxtp" in res and "dtensor" in res:
        result["fxtp_over_dtensor_step"] = res["fxtp"]["step_s"] / res["dtensor"]["step_s"]
        result["fxtp_over_dtensor_peak_rss"] = max(res["fxtp"]["peak_rss_MB"]) / max(res["dtensor"]["peak_rss_MB"])
        print(f"  fxtp / dtensor: step {result['fxtp_over_dtensor_step']:.3f}x, peak RSS "
              f"{result['fxtp_over_dtensor_peak_rss']:.3f}x")
    if "fxsp" in res and "fxtp" in res:
        result["fxsp_over_fxtp_step"] = res["fxsp"]["step_s"] / res["fxtp"]["step_s"]
        result["fxsp_over_fxtp_peak_rss"] = max(res["fxsp"]["peak_rss_MB"]) / max(res["fxtp"]["peak_rss_MB"])
        print(f"  fxsp / fxtp (sequence parallelism): step {result['fxsp_over_fxtp_step']:.3f}x, peak RSS "
              f"{result['fxsp_over_fxtp_peak_rss']:.3f}x")
    if "fxsp" in res and "eager" in res:
        result["fxsp_over_one_process_peak_rss"] = max(res["fxsp"]["peak_rss_MB"]) / max(res["eager"]["peak_rss_MB"])
        print(f"  fxsp peak RSS / one process (eager): {result['fxsp_over_one_process_peak_rss']:.3f}x")
    if "fxtp" in res and "eager" in res:
        result["fxtp_over_one_process_peak_rss"] = max(res["fxtp"]["peak_rss_MB"]) / max(res["eager"]["peak_rss_MB"])
        print(f"  fxtp peak RSS / one process (eager): {result['fxtp_over_one_process_peak_rss']:.3f}x")
    if "first_loss_max_rel_diff" in result:
        print(f"  first-step losses agree to {result['first_loss_max_rel_diff']:.1e} (relative)")
    Path(a.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
