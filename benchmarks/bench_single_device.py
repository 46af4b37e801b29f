"""Single-device benchmark: fxspeed vs eager PyTorch step time, and compile (capture+plan+passes) time.

    python benchmarks/bench_single_device.py --out bench.json          # full: GPT >= 100M params, GPT-2 small
    python benchmarks/bench_single_device.py --tiny --out /tmp/b.json   # seconds: smoke test

(a) Step time. Two copies of the same fxspeed.models.GPT (same initial weights), each with
    AdamW (same hyper-parameters). Eager: loss = model(x, y); loss.backward(); opt.step();
    opt.zero_grad(set_to_none=True). fxspeed: engine.train_step(x, y). After warmup, steps
    are interleaved (eager, fxspeed, then fxspeed, eager, ...) so machine noise hits both
    alike; reported: median step time of each and their ratio (target <= 1.05), plus the
    median of the per-pair ratios (more robust when the machine is shared).
(b) Compile time. fxspeed.plan() on transformers' GPT2LMHeadModel(GPT2Config()) (124M,
    random init): capture (AOT export on fake tensors), passes and planning, target <= 15 s.
    Measured first in the process (cold: includes torch's one-time tracing setup), then again.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

import fxspeed
from fxspeed.models.gpt import GPT, GPTConfig

RATIO_TARGET = 1.05
COMPILE_TARGET_S = 15.0


def bench_compile(tiny: bool, batch: int, seq: int, repeats: int = 2) -> dict:
    from transformers import GPT2Config, GPT2LMHeadModel

    hf_cfg = GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=1000, n_positions=128,
                                                  bos_token_id=0, eos_token_id=0) if tiny else GPT2Config()
    torch.manual_seed(0)
    model = GPT2LMHeadModel(hf_cfg)
    n_params = sum(p.numel() for p in model.parameters())
    ids = torch.randint(0, hf_cfg.vocab_size, (batch, seq))
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        p = fxspeed.plan(model, 1, fxspeed.Config(), example_inputs={"input_ids": ids, "labels": ids})
        times.append(time.perf_counter() - t)
    return {"model": "GPT2LMHeadModel" + ("(tiny)" if tiny else "(GPT2Config())"), "params": n_params,
            "input_shape": [batch, seq], "plan_seconds_cold": times[0], "plan_seconds_warm": min(times[1:] or times),
            "target_seconds": COMPILE_TARGET_S, "meets_target": times[0] <= COMPILE_TARGET_S,
            "passes": {q["name"]: q["seconds"] for q in p.passes}, "graph_nodes": p.passes[-1]["nodes_after"] if p.passes else None}


def bench_step(cfg: GPTConfig, batch: int, seq: int, warmup: int, steps: int, lr: float = 1e-4) -> dict:
    torch.manual_seed(0)
    eager = GPT(cfg)
    compiled_model = copy.deepcopy(eager)  # same weights, tie preserved by deepcopy
    n_params = sum(p.numel() for p in eager.parameters())
    gen = torch.Generator().manual_seed(0)
    batches = [(torch.randint(0, cfg.vocab_size, (batch, seq), generator=gen),
                torch.randint(0, cfg.vocab_size, (batch, seq), generator=gen)) for _ in range(4)]

    opt = torch.optim.AdamW(eager.parameters(), lr=lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, fused=True)
    t = time.perf_counter()
    engine = fxspeed.compile(compiled_model, 1, fxspeed.Config(optimizer="adamw", lr=lr, betas=(0.9, 0.999), eps=1e-8,
                                                               weight_decay=0.0), example_inputs=batches[0])
    compile_s = time.perf_counter() - t

    def eager_step(x, y) -> float:
        loss = eager(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.item()

    def fx_step(x, y) -> float:
        return engine.train_step(x, y)

    def timed(fn, x, y) -> tuple[float, float]:
        t0 = time.perf_counter()
        loss = fn(x, y)
        return time.perf_counter() - t0, loss

    for i in range(warmup):
        x, y = batches[i % len(batches)]
        eager_step(x, y)
        fx_step(x, y)
    te, tf, le, lf = [], [], [], []
    for i in range(steps):
        x, y = batches[i % len(batches)]
        order = (("e", eager_step), ("f", fx_step)) if i % 2 == 0 else (("f", fx_step), ("e", eager_step))
        for tag, fn in order:
            dt, loss = timed(fn, x, y)
            (te if tag == "e" else tf).append(dt)
            (le if tag == "e" else lf).append(loss)
    med_e, med_f = statistics.median(te), statistics.median(tf)
    pair = statistics.median(f / e for e, f in zip(te, tf))
    return {"model": f"fxspeed.models.GPT(n_layer={cfg.n_layer}, n_embd={cfg.n_embd}, n_head={cfg.n_head}, "
                     f"vocab={cfg.vocab_size})", "params": n_params, "batch": [batch, seq], "warmup": warmup,
            "steps": steps, "eager_median_s": med_e, "fxspeed_median_s": med_f, "ratio": med_f / med_e,
            "ratio_pairwise_median": pair, "target_ratio": RATIO_TARGET, "meets_target": med_f / med_e <= RATIO_TARGET,
            "eager_times_s": te, "fxspeed_times_s": tf, "fxspeed_compile_s": compile_s,
            "max_loss_diff": max(abs(a - b) for a, b in zip(le, lf))}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=None, help="write results as JSON here")
    ap.add_argument("--tiny", action="store_true", help="tiny models and few steps (a smoke test, seconds)")
    ap.add_argument("--preset", default="124m", help="GPTConfig preset for the step benchmark (default 124m: "
                    "the '100m' preset has 91.5M params, under the 100M this benchmark is meant for)")
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--steps", type=int, default=10, help="timed steps of each (interleaved)")
    ap.add_argument("--threads", type=int, default=None,
                    help="torch CPU threads (default: torch's). 1 is far less sensitive to a shared, busy machine")
    ap.add_argument("--skip-compile", action="store_true", help="skip (b), the GPT-2 compile-time benchmark")
    ap.add_argument("--skip-step", action="store_true", help="skip (a), the step-time benchmark")
    a = ap.parse_args(argv)
    if a.tiny:
        a.preset, a.warmup, a.steps = "tiny", 1, 3
    if a.threads:
        torch.set_num_threads(a.threads)

    result: dict = {"fxspeed": fxspeed.__version__, "torch": torch.__version__, "python": platform.python_version(),
                    "machine": platform.machine(), "cpus": os.cpu_count(), "threads": torch.get_num_threads(),
                    "tiny": a.tiny}
    if not a.skip_compile:  # first, so its cold number includes torch's one-time setup as a user sees it
        result["compile"] = c = bench_compile(a.tiny, a.batch, a.seq)
        print(f"(b) fxspeed.plan {c['model']} {c['params'] / 1e6:.1f}M params, input {a.batch}x{a.seq}: "
              f"{c['plan_seconds_cold']:.2f} s cold, {c['plan_seconds_warm']:.2f} s warm (target <= {COMPILE_TARGET_S:.0f} s)",
              flush=True)
    if not a.skip_step:
        cfg = GPTConfig.preset(a.preset)
        cfg.block_size = max(cfg.block_size, a.seq)
        result["step"] = s = bench_step(cfg, a.batch, a.seq, a.warmup, a.steps)
        if not a.tiny and s["params"] < 100e6:
            print(f"warning: the step benchmark model has {s['params'] / 1e6:.1f}M params (< 100M)", file=sys.stderr)

    rows = []
    if "step" in result:
        s = result["step"]
        rows += [("step model", f"{s['model']}, {s['params'] / 1e6:.1f}M params, batch {s['batch'][0]}x{s['batch'][1]}"),
                 ("eager step (median)", f"{s['eager_median_s'] * 1e3:,.1f} ms"),
                 ("fxspeed step (median)", f"{s['fxspeed_median_s'] * 1e3:,.1f} ms"),
                 ("ratio fxspeed/eager", f"{s['ratio']:.3f}  (pairwise median {s['ratio_pairwise_median']:.3f}; "
                                         f"target <= {RATIO_TARGET}: {'ok' if s['meets_target'] else 'MISSED'})"),
                 ("loss |eager - fxspeed| max", f"{s['max_loss_diff']:.2e}"),
                 ("fxspeed.compile (this model)", f"{s['fxspeed_compile_s']:.2f} s")]
    if "compile" in result:
        c = result["compile"]
        rows += [("plan model", f"{c['model']}, {c['params'] / 1e6:.1f}M params"),
                 ("capture+passes+plan (cold)", f"{c['plan_seconds_cold']:.2f} s  (target <= {COMPILE_TARGET_S:.0f} s: "
                                                f"{'ok' if c['meets_target'] else 'MISSED'})"),
                 ("capture+passes+plan (warm)", f"{c['plan_seconds_warm']:.2f} s")]
    w = max(len(k) for k, _ in rows)
    print("\n".join(f"{k:<{w}}  {v}" for k, v in rows))
    if a.out is not None:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps(result, indent=1))
        print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
