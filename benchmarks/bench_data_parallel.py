"""Data-parallel benchmark on CPU (gloo): fxspeed ZeRO 0-3 vs torch DDP, torch FSDP2 (and DeepSpeed).

    python benchmarks/bench_data_parallel.py --paired --out dp.json     # GPT 100m (105.7M params), 2 ranks
    python benchmarks/bench_data_parallel.py --out dp.json              # one clean launch per row
    python benchmarks/bench_data_parallel.py --tiny --out /tmp/dp.json  # seconds: smoke test

Each configuration trains the same fxspeed.models.GPT (same initial weights) with torch Adam
(lr 1e-4, fused kernel) on `--nproc` gloo ranks, one intra-op thread per rank, the same local
batch per rank and step (default 2 x 128 tokens); a step ends with the global-batch loss (see
benchmarks/workers/dp_worker.py). Rows:

    ddp      torch DistributedDataParallel
    fx0-fx3  fxspeed.compile(..., Config(zero=0..3, optimizer="adam"))
    fsdp2    torch fully_shard per transformer block, then the root
    ds1-ds3  DeepSpeed ZeRO-1/2/3 (only when `import deepspeed` works; DS_ACCELERATOR=cpu)

Measured per row: step time = median over the timed steps (after --warmup) of the slowest
rank's step; peak RSS growth per rank = VmHWM - VmRSS, with the peak reset right after the
model is built (so growth covers wrapping/compiling, gradients, optimizer state, buckets and
activations). By default every row runs in its own torch.distributed.run launch (a clean
process for memory); --rounds R repeats all rows R times, alternating the order, and pools
the step times, so slow phases of a shared machine hit all rows alike. Ratios are vs DDP.

--paired (recommended on a shared machine): one launch per round; DDP is built first and
stays alive, every other row is built after it and its timed steps alternate with DDP's
(DDP, X, X, DDP, ...). The step-time ratio is then the median of the per-pair ratios, which
cancels load that changes over seconds. Peak growth of each row is measured over its setup
and warmup steps with DDP idle (DDP's memory is in the baseline), so --warmup must be >= 2
for the growth to include a steady-state step with the optimizer state allocated.

Bytes each row's collectives send per step: benchmarks/count_collective_bytes.py; the gloo
collectives themselves, one bucket at a time: benchmarks/bench_gloo_collectives.py.
"""

from __future__ import annotations

import argparse
import importlib.util
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
WORKER = ROOT / "benchmarks" / "workers" / "dp_worker.py"
BASE_CONFIGS = ["ddp", "fx0", "fx1", "fx2", "fx3", "fsdp2"]
DS_CONFIGS = ["ds1", "ds2", "ds3"]
# Step-time targets vs DDP.
TARGETS = {"fx0": 1.02, "fx1": 1.05, "fx2": 1.05, "fx3": 1.15}
LABELS = {"ddp": "torch DDP", "fx0": "fxspeed zero=0", "fx1": "fxspeed zero=1", "fx2": "fxspeed zero=2",
          "fx3": "fxspeed zero=3", "fsdp2": "torch FSDP2", "ds1": "DeepSpeed ZeRO-1", "ds2": "DeepSpeed ZeRO-2",
          "ds3": "DeepSpeed ZeRO-3"}


def launch(configs: list[str], a: argparse.Namespace, out: Path) -> float:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MALLOC_MMAP_THRESHOLD_": "65536", "DS_ACCELERATOR": "cpu",
           "PYTHONPATH": os.pathsep.join([str(ROOT)] + ([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else []))}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={a.nproc}", str(WORKER),
           "--configs", ",".join(configs), "--preset", a.preset, "--batch", str(a.batch), "--seq", str(a.seq),
           "--warmup", str(a.warmup), "--steps", str(a.steps), "--out", str(out)] + (["--paired"] if a.paired else [])
    t = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=a.launch_timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"launch {configs} failed (rc {proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    return time.perf_counter() - t


def load(out: Path, kind: str, nproc: int) -> list[dict]:
    return [json.loads((out / f"{kind}_rank{r}.json").read_text()) for r in range(nproc)]


def summarize(kind: str, rounds: list[list[dict]]) -> dict:
    """rounds: for each round, the per-rank records of this config."""
    step_times = []  # slowest rank per step, pooled over rounds
    pair_ratios = []  # paired mode: this step / the DDP step run right next to it
    for recs in rounds:
        step_times += [max(ts) for ts in zip(*(r["step_times_s"] for r in recs))]
        if recs[0].get("ref_step_times_s"):
            ref = [max(ts) for ts in zip(*(r["ref_step_times_s"] for r in recs))]
            pair_ratios += [x / y for x, y in zip(step_times[-len(ref):], ref)]
    growth = [[r["peak_growth_bytes"] for r in recs] for recs in rounds]
    first = rounds[0]
    return {"config": kind, "label": LABELS.get(kind, kind), "params": first[0]["params"],
            "median_step_s": statistics.median(step_times), "step_times_s": step_times,
            "min_step_s": min(step_times),
            "setup_s": max(r["setup_s"] for r in first),
            # per rank, the max over rounds (rounds agree closely; max is the conservative one)
            "peak_growth_bytes_per_rank": [max(g[r] for g in growth) for r in range(len(first))],
            "peak_growth_bytes": max(max(g) for g in growth),
            "baseline_rss_bytes_per_rank": [r["baseline_rss_bytes"] for r in first],
            "losses": first[0]["losses"], "pair_ratios_vs_ddp": pair_ratios,
            "median_pair_ratio_vs_ddp": statistics.median(pair_ratios) if pair_ratios else None}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="JSON results file")
    ap.add_argument("--tiny", action="store_true", help="tiny model, 2 steps, all rows in one launch (smoke test)")
    ap.add_argument("--configs", default=None,
                    help=f"comma-separated rows (default {','.join(BASE_CONFIGS)}, plus {','.join(DS_CONFIGS)} "
                         "when deepspeed imports and not --tiny)")
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--preset", default="100m")
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=1, help="repeat every row this many times, alternating order")
    ap.add_argument("--single-launch", action="store_true", help="run all rows in one launch (one process per rank)")
    ap.add_argument("--paired", action="store_true",
                    help="one launch per round: DDP stays alive and its steps alternate with each other row's "
                         "(ratios = median of per-pair ratios; cancels load changes on a shared machine)")
    ap.add_argument("--launch-timeout", type=float, default=1800)
    a = ap.parse_args()
    if a.tiny:
        a.preset, a.seq, a.warmup, a.steps, a.single_launch = "tiny", 32, 0, 2, True
    has_ds = importlib.util.find_spec("deepspeed") is not None
    configs = a.configs.split(",") if a.configs else BASE_CONFIGS + (DS_CONFIGS if has_ds and not a.tiny else [])
    if "ddp" not in configs:
        configs.insert(0, "ddp")

    load_before = os.getloadavg()
    results: dict[str, list[list[dict]]] = {k: [] for k in configs}
    launches = []
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(a.rounds):
            order = configs if r % 2 == 0 else configs[::-1]
            if a.paired:
                order = ["ddp"] + [k for k in order if k != "ddp"]
            groups = [order] if a.single_launch or a.paired else [[k] for k in order]
            for g in groups:
                out = Path(tmp) / f"round{r}_{'_'.join(g)}"
                out.mkdir()
                wall = launch(g, a, out)
                launches.append({"round": r, "configs": g, "wall_s": wall, "loadavg_after": os.getloadavg()})
                print(f"  round {r}: {','.join(g)} done in {wall:.0f} s (load avg {os.getloadavg()[0]:.2f})", flush=True)
                for k in g:
                    results[k].append(load(out, k, a.nproc))
    load_after = os.getloadavg()

    rows = {k: summarize(k, v) for k, v in results.items()}
    ddp = rows["ddp"]
    for k, row in rows.items():
        # Paired mode: the median of per-pair ratios (each step against the DDP step next to it).
        row["time_ratio_vs_ddp"] = (row["median_pair_ratio_vs_ddp"] if row["median_pair_ratio_vs_ddp"] is not None
                                    else 1.0 if k == "ddp" else row["median_step_s"] / ddp["median_step_s"])
        row["growth_ratio_vs_ddp"] = row["peak_growth_bytes"] / ddp["peak_growth_bytes"]
        # Same weights, same batches, same optimizer: every row should see the same losses.
        row["max_loss_diff_vs_ddp"] = max(abs(x - y) for x, y in zip(row["losses"], ddp["losses"]))
        if k in TARGETS:
            row["time_target"] = TARGETS[k]
            row["meets_time_target"] = row["time_ratio_vs_ddp"] <= TARGETS[k]
    checks = {k: rows[k]["meets_time_target"] for k in TARGETS if k in rows}
    if "fx3" in rows and "fsdp2" in rows:
        checks["fx3_faster_than_fsdp2"] = rows["fx3"]["median_step_s"] < rows["fsdp2"]["median_step_s"]
        checks["fx3_peak_rss_le_fsdp2"] = rows["fx3"]["peak_growth_bytes"] <= rows["fsdp2"]["peak_growth_bytes"]

    result = {"setup": {"nproc": a.nproc, "backend": "gloo", "preset": a.preset, "params": ddp["params"],
                        "local_batch": [a.batch, a.seq], "threads_per_rank": 1, "warmup": a.warmup, "steps": a.steps,
                        "rounds": a.rounds, "single_launch": a.single_launch, "paired": a.paired, "optimizer": "torch.optim.Adam(fused=True) lr=1e-4",
                        "deepspeed_available": has_ds, "torch": _version("torch"), "python": platform.python_version(),
                        "cpus": os.cpu_count(), "loadavg_before": load_before, "loadavg_after": load_after,
                        "command": " ".join([os.path.relpath(sys.executable, ROOT) if sys.executable.startswith(str(ROOT))
                                             else sys.executable] + sys.argv)},
              "rows": rows, "checks": checks, "launches": launches}
    Path(a.out).write_text(json.dumps(result, indent=1))
    print_table(result)


def _version(mod: str) -> str:
    try:
        return __import__(mod).__version__
    except Exception:  # noqa: BLE001
        return "?"


def print_table(res: dict) -> None:
    s = res["setup"]
    print(f"\nGPT {s['preset']} ({s['params'] / 1e6:.1f}M params), {s['nproc']} gloo ranks x 1 thread, local batch "
          f"{s['local_batch'][0]}x{s['local_batch'][1]}, Adam; median of {s['steps'] * s['rounds']} steps "
          f"(after {s['warmup']} warmup); load avg {s['loadavg_before'][0]:.2f} -> {s['loadavg_after'][0]:.2f}")
    hdr = f"{'config':18} {'step s':>8} {'vs DDP':>7} {'target':>7} {'peak RSS growth/rank (MiB)':>28} {'vs DDP':>7} {'setup s':>8} {'loss diff':>9}"
    print(hdr)
    print("-" * len(hdr))
    for k, r in res["rows"].items():
        tgt = f"<={r['time_target']:.2f}" if "time_target" in r else ""
        growth = " / ".join(f"{g / 2**20:.0f}" for g in r["peak_growth_bytes_per_rank"])
        print(f"{r['label']:18} {r['median_step_s']:8.3f} {r['time_ratio_vs_ddp']:6.3f}x {tgt:>7} {growth:>28} "
              f"{r['growth_ratio_vs_ddp']:6.3f}x {r['setup_s']:8.1f} {r['max_loss_diff_vs_ddp']:9.2e}")
    print("checks: " + ", ".join(f"{k}={'PASS' if v else 'FAIL'}" for k, v in res["checks"].items()))


if __name__ == "__main__":
    main()
