"""Optimizer offload on CPU: the fused Adam against this machine's memory bandwidth, and training
with Adam's moments in files (Config(offload="optimizer", nvme_path=...)) against the same run
with them in memory.

    python benchmarks/bench_offload.py --out offload.json              # ~350M GPT, 2 gloo ranks, ZeRO-2
    python benchmarks/bench_offload.py --batch 4 --out offload.json    # a second operating point
    python benchmarks/bench_offload.py --tiny --out /tmp/o.json        # seconds: smoke test
    python benchmarks/bench_offload.py --nproc 1 --layers 48 --width 1600 --zero 1 --precision bf16 \
        --batch 1 --seq 64 --modes nvme --rounds 1 --warmup 1 --steps 2 --skip-bandwidth \
        --out big.json   # 1.5B, one process: bf16 working copies, fp32 masters + Adam in the file
                         # (+ --meta: built on the meta device, so building never holds the fp32 model)
    python benchmarks/bench_offload.py --nproc 1 --layers 48 --width 1600 --zero 3 --precision bf16 \
        --batch 1 --seq 64 --modes nvme,all --rounds 1 --warmup 1 --steps 2 --skip-bandwidth \
        --out big3.json  # the same with the bf16 working shards in files too (ZeRO-Infinity)

1. Bandwidth: a STREAM-like copy and triad over 256 MB arrays (torch, --threads threads) and
   torch's fused AdamW over 32M parameters (what runtime/offloaded_optimizer.py calls per chunk).
   AdamW touches 28 bytes per parameter (read p, g, m, v; write p, m, v), so bandwidth / 28 is the
   parameters-per-second limit; the ratio to it is reported.
2. Training: one torch.distributed.run launch per (round, mode), rounds alternating the order
   (plain, nvme, nvme, plain, ...) so drift hits both; step time = median over rounds and timed
   steps of the slowest rank; peak RSS = each rank's VmHWM (the kernel's counter). The RSS saving
   is compared with the bytes offloaded (8 bytes per parameter in this rank's optimizer partition;
   12 with --precision bf16/fp16 and zero >= 1, where the fp32 masters go to the file too).
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

import torch

ROOT = Path(__file__).resolve().parents[1]
WORKER = ROOT / "benchmarks" / "workers" / "offload_worker.py"


def median_time(fn, repeats: int = 7) -> float:  # noqa: ANN001
    ts = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return statistics.median(ts)


def bandwidth(threads: int, tiny: bool) -> dict:
    from torch.optim.adam import adam

    torch.set_num_threads(threads)
    n = (1 if tiny else 64) * 2**20
    a, b, c = torch.rand(n), torch.empty(n), torch.rand(n)
    copy = 2 * 4 * n / median_time(lambda: b.copy_(a))
    triad = 3 * 4 * n / median_time(lambda: torch.add(a, c, alpha=2.0, out=b))
    m = n // 2
    p, g, ea, es, st = torch.rand(m), torch.rand(m), torch.zeros(m), torch.zeros(m), torch.zeros(())

    def step() -> None:
        adam([p], [g], [ea], [es], [], [st], fused=True, decoupled_weight_decay=True, amsgrad=False, beta1=0.9,
             beta2=0.999, lr=1e-3, weight_decay=0.01, eps=1e-8, maximize=False)

    rate = m / median_time(step)
    return {"threads": threads, "copy_GBps": copy / 1e9, "triad_GBps": triad / 1e9, "fused_adamw_Mparams_s": rate / 1e6,
            "limit_by_copy_Mparams_s": copy / 28 / 1e6, "ratio_to_copy_limit": rate / (copy / 28),
            "ratio_to_triad_limit": rate / (triad / 28)}


def launch(mode: str, a: argparse.Namespace, out: Path, swap: str) -> list[dict]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MALLOC_MMAP_THRESHOLD_": "65536", "DS_ACCELERATOR": "cpu",
           "PYTHONPATH": os.pathsep.join([str(ROOT)] + ([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else []))}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={a.nproc}", str(WORKER),
           "--mode", mode, "--layers", str(a.layers), "--width", str(a.width), "--batch", str(a.batch),
           "--seq", str(a.seq), "--zero", str(a.zero), "--precision", a.precision, "--warmup", str(a.warmup), "--steps", str(a.steps),
           "--nvme-path", swap, "--out", str(out)] + (["--meta"] if a.meta else [])
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=a.launch_timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"{mode} launch failed (rc {proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    return [json.loads((out / f"{mode}_rank{r}.json").read_text()) for r in range(a.nproc)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=27)   # 27 x d=1024 blocks + 8192 vocab: ~348M parameters
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--zero", type=int, default=2)
    ap.add_argument("--precision", default="fp32", choices=("fp32", "bf16", "fp16"))
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--nvme-path", default=None, help="directory for the swap files (default: a temp dir)")
    ap.add_argument("--launch-timeout", type=float, default=3600)
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--meta", action="store_true", help="build the model under fxspeed.parameters_on_meta(): compile "
                    "gives it its values bucket by bucket, never holding the fp32 model (not with --deepspeed)")
    ap.add_argument("--skip-train", action="store_true")
    ap.add_argument("--skip-bandwidth", action="store_true")
    ap.add_argument("--modes", default="plain,nvme",
                    help="comma-separated: plain, nvme (optimizer offload), params (ZeRO-3 parameter offload), all "
                         "(both); <mode>_end: the same with the optimizer stepped after the program, not per "
                         "bucket inside backward; ds with --deepspeed")
    ap.add_argument("--deepspeed", action="store_true",
                    help="also DeepSpeed ZeRO-<zero> with offload_optimizer=cpu (needs `import deepspeed`)")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    if a.tiny:
        a.layers, a.width, a.seq, a.steps, a.warmup, a.rounds = 2, 128, 32, 2, 1, 1
    result: dict = {}
    if not a.skip_bandwidth:
        result["bandwidth"] = bw = bandwidth(a.threads, a.tiny)
        print(f"memory: copy {bw['copy_GBps']:.2f} GB/s, triad {bw['triad_GBps']:.2f} GB/s ({a.threads} threads); fused AdamW "
              f"{bw['fused_adamw_Mparams_s']:.0f} M params/s = {bw['ratio_to_copy_limit']:.2f}x the copy-bandwidth limit "
              f"({bw['limit_by_copy_Mparams_s']:.0f} M/s at 28 B/param)", flush=True)
    if not a.skip_train:
        modes = tuple(a.modes.split(",")) + (("ds",) if a.deepspeed else ())
        runs: dict[str, list[list[dict]]] = {m: [] for m in modes}
        with tempfile.TemporaryDirectory() as tmp:
            swap = a.nvme_path or tmp
            for r in range(a.rounds):
                for mode in (modes if r % 2 == 0 else modes[::-1]):
                    out = Path(tmp) / f"round{r}"
                    out.mkdir(exist_ok=True)
                    t = time.perf_counter()
                    runs[mode].append(launch(mode, a, out, swap))
                    print(f"round {r} {mode}: {time.perf_counter() - t:.0f} s", flush=True)
        rows = {}
        for mode, rounds in runs.items():
            times = [t for recs in rounds for t in recs[0]["step_times_s"]]
            rows[mode] = {"step_s": statistics.median(times), "step_times_s": times,
                          "peak_rss_GB": [max(rec["peak_rss_kb"] for rec in (recs[i] for recs in rounds)) * 1024 / 1e9
                                          for i in range(a.nproc)],
                          "losses_rank0": rounds[0][0]["losses"], "optimizer": rounds[0][0]["optimizer"],
                          # VmRSS after the model is built / after compile (the state laid out)
                          "rss_after_model_GB": [rec["rss_after_model_kb"] * 1024 / 1e9 for rec in rounds[0]],
                          "rss_after_compile_GB": [rec.get("rss_after_compile_kb", 0) * 1024 / 1e9 for rec in rounds[0]],
                          # the peaks of building + laying out the model, and of training alone
                          "peak_rss_build_GB": [rec.get("peak_rss_build_kb", 0) * 1024 / 1e9 for rec in rounds[0]],
                          "peak_rss_train_GB": [rec.get("peak_rss_train_kb", 0) * 1024 / 1e9 for rec in rounds[0]],
                          "plan_peak_GB": [(rec.get("plan_peak_bytes") or 0) / 1e9 for rec in rounds[0]]}
        n = runs[modes[0]][0][0]["n_params"]
        # Adam moments of one rank's partition (and its fp32 masters under bf16/fp16 master weights)
        per_param = 12 if a.precision != "fp32" and a.zero >= 1 else 8
        offloaded = per_param * n / (a.nproc if a.zero >= 1 else 1)
        result.update(rows=rows, n_params=n, offloaded_GB_per_rank=offloaded / 1e9,
                      setup={k: getattr(a, k) for k in ("layers", "width", "batch", "seq", "zero", "precision", "nproc",
                                                        "steps", "warmup", "rounds")})
        print(f"GPT {n / 1e6:.1f}M params, {a.nproc} ranks, ZeRO-{a.zero}, {a.batch}x{a.seq} tokens per rank")
        for mode in modes:
            print(f"  {mode:<6} step {rows[mode]['step_s']:.3f} s   peak RSS per rank "
                  + ", ".join(f"{g:.2f} GB" for g in rows[mode]["peak_rss_GB"]) + "   (building "
                  + ", ".join(f"{g:.2f}" for g in rows[mode]["peak_rss_build_GB"]) + "; training "
                  + ", ".join(f"{g:.2f}" for g in rows[mode]["peak_rss_train_GB"]) + ")")
        if "plain" in rows and "nvme" in rows:
            saved = [p - q for p, q in zip(rows["plain"]["peak_rss_GB"], rows["nvme"]["peak_rss_GB"])]
            result.update(rss_saved_GB_per_rank=saved,
                          rss_saved_fraction_of_offloaded=[s / (offloaded / 1e9) for s in saved],
                          step_ratio_nvme_over_plain=rows["nvme"]["step_s"] / rows["plain"]["step_s"],
                          losses_equal=rows["plain"]["losses_rank0"] == rows["nvme"]["losses_rank0"])
            print(f"  nvme / plain step time {result['step_ratio_nvme_over_plain']:.3f}x; RSS saved per rank "
                  + ", ".join(f"{s:.2f} GB" for s in saved) + f" of {offloaded / 1e9:.2f} GB offloaded ("
                  + ", ".join(f"{f:.0%}" for f in result["rss_saved_fraction_of_offloaded"]) + f"); losses equal: "
                  f"{result['losses_equal']}")
        for m in [m for m in modes if m.endswith("_end") and m[:-4] in rows]:
            result[f"step_ratio_{m[:-4]}_inside_over_end"] = r = rows[m[:-4]]["step_s"] / rows[m]["step_s"]
            print(f"  {m[:-4]}: optimizer stepped per bucket inside backward / after the program: step time {r:.3f}x")
        if a.deepspeed and "nvme" in rows:
            result["step_ratio_nvme_over_deepspeed"] = rows["nvme"]["step_s"] / rows["ds"]["step_s"]
            print(f"  fxspeed nvme / DeepSpeed ZeRO-{a.zero} offload_optimizer=cpu step time "
                  f"{result['step_ratio_nvme_over_deepspeed']:.3f}x")
    Path(a.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
