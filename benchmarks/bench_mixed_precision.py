"""Mixed-precision benchmark on CPU: fxspeed fp32 vs bf16 vs fp16 (dynamic loss scaling).

    python benchmarks/bench_mixed_precision.py --out mp.json              # GPT 7x512 (22.3M params), 200 steps each
    python benchmarks/bench_mixed_precision.py --tiny --out /tmp/mp.json  # seconds: smoke test

(1) Convergence. The same byte-level GPT (same initial weights: torch.manual_seed(--seed)) is
    trained for --steps steps on the `fxspeed demo` corpus (Python standard library source,
    fxspeed.demo.load_corpus / get_batch; the same seeded batches for every precision) with
    fxspeed.compile(..., Config(precision=P, optimizer="adamw", lr=--lr, linear warmup of
    --warmup-steps, grad_clip=1.0)) for P in fp32, bf16 and fp16 (--precisions). Reported per precision: the final
    loss (mean of the last 10 steps), its relative difference to fp32 (target |diff| <= 2%),
    whether any loss was NaN/inf, fp16 skipped steps and the final loss scale, the median step
    time, and which ops the compiled graph runs in low precision. CPU bf16/fp16 speed is not a
    target (CPU kernels for half types are not tuned like GPU tensor cores); it is reported only.
(1b) fp16 (dynamic loss scaling, initial scale 2**16) trains on the main model too. On a CPU
    without native fp16/bf16 arithmetic (x86 without AVX512-FP16 / AVX-512) PyTorch's own kernels
    are 20-40x slower than fp32 (a bf16 step of this model at 8 x 128: 73.7 s against 2.0 s fp32);
    fxspeed's upcast_cpu_compute pass computes those ops in fp32 from the rounded values there
    (bf16 2.33 s, fp16 2.38 s). --fp16-small-steps N adds the older comparison of all three on
    SMALL_MODEL (0.12M params, batch --small-batch x --small-seq). --tiny trains all three on
    the tiny model.
(2) Activation memory. For a configuration where activations dominate (--mem-batch x
    --mem-seq, default 16 x 256 on the same model) each precision runs in its own process with
    MALLOC_MMAP_THRESHOLD_=65536 (large frees go back to the OS, so RSS follows live tensors).
    After compile + the first step (parameters, optimizer state and caches exist), the peak is
    reset (/proc/self/clear_refs <- 5: VmHWM := VmRSS); after --mem-steps more steps, peak RSS
    growth = VmHWM - VmRSS(at reset): activations saved for backward, gradients and
    temporaries. Reported for --mem-precisions (default fp32, bf16) with the ratio bf16/fp32.

Training runs one precision after another in this process; each memory run is a separate
subprocess of this script (so the runs do not share allocator state). All use --threads intra-op
threads (default 1). Results go to --out as JSON and a table is printed.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

PRECISIONS = ("fp32", "bf16", "fp16")
TARGET_REL = 0.02  # |final loss / fp32 final loss - 1|
LAST = 10  # final loss = mean of the last LAST steps

FULL_MODEL = dict(vocab_size=256, block_size=256, n_layer=7, n_head=8, n_embd=512)
# --fp16-small-steps: all three precisions on this small model as well (from when fp16 on the
# full model took minutes a step on CPUs without fp16 kernels; see (1b)).
SMALL_MODEL = dict(vocab_size=256, block_size=64, n_layer=2, n_head=4, n_embd=64)
TINY_MODEL = dict(vocab_size=256, block_size=64, n_layer=2, n_head=4, n_embd=64)


# ------------------------------------------------------------------------------------------
# worker side (one precision per process)
# ------------------------------------------------------------------------------------------
def _status_kb(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{key} not in /proc/self/status")


def _reset_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # VmHWM := current VmRSS
        return True
    except OSError:
        return False


def _low_precision_ops(gm, low: str) -> dict[str, int]:
    """Count call_function nodes of the compiled graph whose output is in the low dtype."""
    import torch

    want = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(low)
    counts: Counter = Counter()
    if want is None:
        return {}
    for n in gm.graph.nodes:
        if n.op != "call_function":
            continue
        val = n.meta.get("val")
        dt = getattr(val, "dtype", None)
        if dt is None:
            info = n.meta.get("fxspeed")
            dt = getattr(info, "dtype", None)
            if dt is not None and str(dt) in (str(want), str(want).replace("torch.", "")):
                dt = want
        if dt == want:
            name = getattr(n.target, "__name__", str(n.target))
            counts[name] += 1
    return dict(sorted(counts.items(), key=lambda kv: -kv[1]))


def _build(a: argparse.Namespace, precision: str, batch: int, seq: int, model: dict | None = None):
    import torch

    import fxspeed
    from fxspeed.tools.demo import get_batch, load_corpus
    from fxspeed.models.gpt import GPT, GPTConfig

    torch.set_num_threads(a.threads)
    torch.manual_seed(a.seed)
    model_cfg = dict(model or (TINY_MODEL if a.tiny else FULL_MODEL))
    model_cfg["block_size"] = max(model_cfg["block_size"], seq)
    model = GPT(GPTConfig(**model_cfg))
    n_params = sum(p.numel() for p in model.parameters())
    data = load_corpus()
    gen = torch.Generator().manual_seed(a.seed)
    x, y = get_batch(data, batch, seq, gen)
    cfg = fxspeed.Config(precision=precision, optimizer="adamw", lr=a.lr, warmup_steps=a.warmup_steps,
                         grad_clip=1.0, loss_scale=a.loss_scale)
    t = time.perf_counter()
    engine = fxspeed.compile(model, 1, cfg, example_inputs=(x, y))
    compile_s = time.perf_counter() - t
    return engine, data, gen, (x, y), n_params, model_cfg, compile_s


def train_one(a: argparse.Namespace, precision: str, model: dict, bsz: int, seq: int, steps: int) -> dict:
    from fxspeed.tools.demo import get_batch

    t0 = time.perf_counter()
    engine, data, gen, batch, n_params, model_cfg, compile_s = _build(a, precision, bsz, seq, model)
    losses, times = [], []
    first_bad = None
    for step in range(steps):
        if step:
            batch = get_batch(data, bsz, seq, gen)
        t = time.perf_counter()
        loss = engine.train_step(*batch)
        times.append(time.perf_counter() - t)
        losses.append(loss)
        if first_bad is None and not math.isfinite(loss):
            first_bad = step
        if a.progress and (step % 20 == 0 or step == steps - 1):
            print(f"[{precision}] step {step} loss {loss:.4f} {times[-1]:.2f} s", file=sys.stderr, flush=True)
    params_finite = all(bool(p.detach().isfinite().all()) for p in engine.model.parameters())
    k = min(LAST, len(losses))
    return {"precision": precision, "params": n_params, "model": model_cfg, "batch": bsz, "seq": seq,
            "steps": steps, "compile_s": compile_s, "losses": losses, "step_times_s": times,
            "final_loss": sum(losses[-k:]) / k, "first_loss": losses[0],
            "median_step_s": statistics.median(times[1:] if len(times) > 1 else times),
            "any_nan": first_bad is not None, "first_nonfinite_step": first_bad, "params_finite": params_finite,
            "skipped_steps": int(engine.stats.get("skipped_steps", 0)),
            "loss_scale": engine.stats.get("loss_scale"),
            "low_precision_ops": _low_precision_ops(engine.graph(), precision),
            "wall_s": time.perf_counter() - t0}


def worker_mem(a: argparse.Namespace) -> dict:
    from fxspeed.tools.demo import get_batch

    engine, data, gen, batch, n_params, model_cfg, compile_s = _build(a, a.precision, a.mem_batch, a.mem_seq)
    engine.train_step(*batch)  # first step: optimizer state, allocator and kernel caches
    batches = [get_batch(data, a.mem_batch, a.mem_seq, gen) for _ in range(a.mem_steps)]
    base_kb = _status_kb("VmRSS")
    reset_ok = _reset_peak()
    losses, times = [], []
    for b in batches:
        t = time.perf_counter()
        losses.append(engine.train_step(*b))
        times.append(time.perf_counter() - t)
    peak_kb = _status_kb("VmHWM")
    return {"precision": a.precision, "params": n_params, "batch": a.mem_batch, "seq": a.mem_seq,
            "steps": a.mem_steps, "baseline_rss_bytes": base_kb * 1024, "peak_rss_bytes": peak_kb * 1024,
            "peak_growth_bytes": (peak_kb - base_kb) * 1024, "clear_refs_ok": reset_ok,
            "losses": losses, "median_step_s": statistics.median(times),
            "malloc_mmap_threshold": os.environ.get("MALLOC_MMAP_THRESHOLD_")}


# ------------------------------------------------------------------------------------------
# driver side
# ------------------------------------------------------------------------------------------
def _spawn(kind: str, precision: str, a: argparse.Namespace, tmp: Path) -> dict:
    out = tmp / f"{kind}_{precision}.json"
    cmd = [sys.executable, str(Path(__file__).resolve()), "--_worker", kind, "--precision", precision,
           "--threads", str(a.threads), "--seed", str(a.seed), "--lr", str(a.lr), "--warmup-steps", str(a.warmup_steps),
           "--steps", str(a.steps), "--batch", str(a.batch), "--seq", str(a.seq), "--mem-batch", str(a.mem_batch),
           "--mem-seq", str(a.mem_seq), "--mem-steps", str(a.mem_steps), "--_result", str(out)]
    if a.tiny:
        cmd.append("--tiny")
    if a.progress:
        cmd.append("--progress")
    env = {**os.environ, "OMP_NUM_THREADS": str(a.threads), "MALLOC_MMAP_THRESHOLD_": "65536",
           "PYTHONPATH": os.pathsep.join([str(ROOT)] + ([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else []))}
    t = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=None if a.progress else subprocess.PIPE,
                          text=True, timeout=a.timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"{kind} {precision} failed (rc {proc.returncode}):\n{proc.stdout[-3000:]}\n"
                           f"{(proc.stderr or '')[-6000:]}")
    rec = json.loads(out.read_text())
    rec["wall_s"] = time.perf_counter() - t
    return rec


def convergence(a: argparse.Namespace, label: str, model: dict, precs: list[str], bsz: int, seq: int,
                steps: int) -> dict:
    runs = {p: train_one(a, p, model, bsz, seq, steps) for p in precs}
    ref = runs["fp32"]["final_loss"]
    for r in runs.values():
        r["rel_diff_vs_fp32"] = r["final_loss"] / ref - 1.0 if math.isfinite(r["final_loss"]) else float("nan")
        r["within_target"] = bool(math.isfinite(r["final_loss"]) and abs(r["rel_diff_vs_fp32"]) <= TARGET_REL
                                  and not r["any_nan"])
        r["step_ratio_vs_fp32"] = r["median_step_s"] / runs["fp32"]["median_step_s"]
    r0 = runs["fp32"]
    print(f"\n{label} convergence: byte-level GPT {r0['model']} = {r0['params']:,} params ({r0['params'] / 1e6:.2f}M), "
          f"batch {bsz} x {seq}, {steps} steps, AdamW lr {a.lr} (warmup {a.warmup_steps}), grad_clip 1.0, "
          f"seed {a.seed}, {a.threads} thread(s); final loss = mean of the last {min(LAST, steps)} steps")
    print(f"{'precision':<9} {'first loss':>10} {'final loss':>10} {'vs fp32':>8} {'<=2%':>5} {'NaN':>4} "
          f"{'skipped':>7} {'scale':>8} {'step s':>8} {'x fp32':>7}")
    for p, r in runs.items():
        scale = f"{r['loss_scale']:g}" if r.get("loss_scale") is not None else "-"
        print(f"{p:<9} {r['first_loss']:>10.4f} {r['final_loss']:>10.4f} {r['rel_diff_vs_fp32'] * 100:>7.2f}% "
              f"{'yes' if r['within_target'] else 'NO':>5} {'yes' if r['any_nan'] else 'no':>4} "
              f"{r['skipped_steps']:>7} {scale:>8} {r['median_step_s']:>8.3f} {r['step_ratio_vs_fp32']:>7.2f}")
    for p, r in runs.items():
        if r["low_precision_ops"]:
            print(f"  {p} graph nodes with {p} outputs: " + ", ".join(f"{k} x{v}" for k, v in r["low_precision_ops"].items()))
    return runs


def _mb(b: float) -> str:
    return f"{b / 2**20:,.1f} MB"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=None, help="write results as JSON here")
    ap.add_argument("--tiny", action="store_true", help="tiny model, few steps (a smoke test, seconds)")
    ap.add_argument("--precisions", default=None,
                    help="precisions trained on the main model (default fp32,bf16,fp16)")
    ap.add_argument("--fp16-small-steps", type=int, default=0,
                    help="steps of the fp32/bf16/fp16 comparison on the small model (not in --tiny; 0 skips it)")
    ap.add_argument("--small-batch", type=int, default=8)
    ap.add_argument("--small-seq", type=int, default=64)
    ap.add_argument("--steps", type=int, default=None, help="training steps per precision (default 200; tiny 12)")
    ap.add_argument("--batch", type=int, default=None, help="training batch (default 8; tiny 4)")
    ap.add_argument("--seq", type=int, default=None, help="training sequence length (default 128; tiny 32)")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--warmup-steps", type=int, default=None, help="linear lr warmup (default 20; tiny 2)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--loss-scale", type=float, default=None,
                    help="fp16 initial loss scale (default fxspeed's 2**16). At batch 2 x 64 the 22M model's "
                         "step 2 overflows at 2**16 (as eager autocast + GradScaler does); the skipped batch "
                         "alone moves the final loss by 0.7-2.4%% at this tiny batch, so a fair curve uses 2**15")
    ap.add_argument("--mem-batch", type=int, default=None, help="memory run batch (default 16; tiny 4)")
    ap.add_argument("--mem-seq", type=int, default=None, help="memory run sequence length (default 256; tiny 64)")
    ap.add_argument("--mem-steps", type=int, default=None, help="steps measured after the peak reset (default 3; tiny 2)")
    ap.add_argument("--mem-precisions", default="fp32,bf16",
                    help="precisions of the memory runs, one process each (default fp32,bf16; must include fp32)")
    ap.add_argument("--skip-train", action="store_true")
    ap.add_argument("--skip-mem", action="store_true")
    ap.add_argument("--threads", type=int, default=1, help="intra-op threads per run (default 1)")
    ap.add_argument("--timeout", type=float, default=3600.0, help="seconds per subprocess")
    ap.add_argument("--progress", action="store_true", help="workers print progress to stderr")
    ap.add_argument("--precision", default="fp32", help=argparse.SUPPRESS)
    ap.add_argument("--_worker", choices=("mem",), default=None, help=argparse.SUPPRESS)
    ap.add_argument("--_result", type=Path, default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    defaults = dict(steps=(12, 200), batch=(4, 8), seq=(32, 128), warmup_steps=(2, 20), mem_batch=(4, 16),
                    mem_seq=(64, 256), mem_steps=(2, 3))
    for k, (tiny, full) in defaults.items():
        if getattr(a, k) is None:
            setattr(a, k, tiny if a.tiny else full)

    if a._worker:
        rec = worker_mem(a)
        a._result.write_text(json.dumps(rec))
        return 0

    if a.precisions is None:
        a.precisions = ",".join(PRECISIONS)
    precs = [p.strip() for p in a.precisions.split(",") if p.strip()]
    bad = [p for p in precs if p not in PRECISIONS]
    if bad or "fp32" not in precs:
        ap.error(f"--precisions must include fp32 and only name {PRECISIONS}; got {a.precisions!r}")
    mem_bad = [p for p in a.mem_precisions.split(",") if p.strip() not in PRECISIONS]
    if mem_bad or "fp32" not in a.mem_precisions.split(","):
        ap.error(f"--mem-precisions must include fp32 and only name {PRECISIONS}; got {a.mem_precisions!r}")
    import torch

    load = os.getloadavg()
    result: dict = {"host": {"python": platform.python_version(), "torch": torch.__version__,
                             "machine": platform.machine(), "cpus": os.cpu_count(), "threads": a.threads,
                             "loadavg_start": load},
                    "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(a).items()
                             if not k.startswith("_")}}
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as td:
        tmp = Path(td)
        if not a.skip_train:
            main_model = TINY_MODEL if a.tiny else FULL_MODEL
            result["train"] = convergence(a, "(1)", main_model, precs, a.batch, a.seq, a.steps)
            if a.fp16_small_steps and not a.tiny:
                result["train_fp16_small"] = convergence(a, "(1b) fp16 on a small model (CPU fp16 matmuls are slow)",
                                                         SMALL_MODEL, list(PRECISIONS), a.small_batch, a.small_seq,
                                                         a.fp16_small_steps)
        if not a.skip_mem:
            mem_precs = [p.strip() for p in a.mem_precisions.split(",") if p.strip()]
            mems = {p: _spawn("mem", p, a, tmp) for p in mem_precs}
            ref = mems["fp32"]["peak_growth_bytes"]
            for r in mems.values():
                r["ratio_vs_fp32"] = r["peak_growth_bytes"] / ref if ref > 0 else float("nan")
            result["memory"] = mems
            print(f"\n(2) activation memory: batch {a.mem_batch} x {a.mem_seq}, peak RSS growth over {a.mem_steps} steps "
                  f"after compile + first step (MALLOC_MMAP_THRESHOLD_=65536, one process per precision)")
            print(f"{'precision':<9} {'baseline RSS':>14} {'peak growth':>14} {'x fp32':>7} {'step s':>8}")
            for p, r in mems.items():
                print(f"{p:<9} {_mb(r['baseline_rss_bytes']):>14} {_mb(r['peak_growth_bytes']):>14} "
                      f"{r['ratio_vs_fp32']:>7.3f} {r['median_step_s']:>8.3f}")
            if "bf16" in mems:
                result["memory_ratio_bf16_vs_fp32"] = mems["bf16"]["ratio_vs_fp32"]
    result["host"]["loadavg_end"] = os.getloadavg()
    result["total_s"] = time.perf_counter() - t0
    print(f"\ntotal {result['total_s']:.0f} s; load average start {load[0]:.2f}, end {result['host']['loadavg_end'][0]:.2f} "
          f"({os.cpu_count()} CPUs)")
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps(result, indent=1))
        print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
