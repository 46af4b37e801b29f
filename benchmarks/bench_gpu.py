"""GPU benchmark (issue 13's table in one command): fxspeed vs eager PyTorch on one CUDA device.

    python benchmarks/bench_gpu.py                    # GPT 124M and HF GPT-2 124M at 8x1024 and 4x512
    python benchmarks/bench_gpu.py --quick            # about 2 minutes: 8x1024 only, fewer steps
    python benchmarks/bench_gpu.py --torch-compile    # adds torch.compile of the eager step (slow to compile)

Models: fxspeed.models.GPT with the '124m' preset (GPT-2 small's shape, 50257 vocabulary, tied
head) and transformers' GPT2LMHeadModel(GPT2Config()) (124M, SDPA attention, random init).

Each (model, batch) is run in these modes, each on a fresh model built with the same seed:

    eager-fp32        loss = model(batch); loss.backward(); opt.step(); opt.zero_grad()
    fxspeed-fp32      engine.train_step(batch)
    eager-amp-bf16    the eager step under torch.autocast("cuda", torch.bfloat16)
    fxspeed-bf16      fxspeed.Config(precision="bf16")
    compile-*         (--torch-compile) torch.compile(model) in fp32 and under autocast

Every mode uses AdamW with torch's fused CUDA kernel (lr 1e-4) on fp32 parameters. Step time:
median of --steps timed steps after --warmup steps, each step ending in a host sync (the loss
as a float, as train_step returns it). MFU: (6 x parameters x tokens + attention FLOPs
12 x layers x width x seq x tokens) per step / step time / PEAK_FLOPS (989e12, H100/H200 dense
bf16; fp32 rows are reported against the same number). Peak memory:
torch.cuda.max_memory_allocated from before the model is built to the end of the run (reset
between runs); for fxspeed also the plan's predicted peak and predicted / measured. Results go
to --out as JSON after every run (a crash or timeout keeps what finished), and a table is
printed at the end.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import platform
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable

import torch

PEAK_FLOPS = 989e12
LR = 1e-4
DEVICE = "cuda"  # the CLI needs CUDA; tests/test_benchmark_gpu_smoke.py sets "cpu" to run the logic
MODELS = ("gpt", "hf-gpt2")
POINTS = ("8x1024", "4x512")
MODES = ("eager-fp32", "fxspeed-fp32", "eager-amp-bf16", "fxspeed-bf16")
COMPILE_MODES = ("compile-fp32", "compile-amp-bf16")


def require_cuda() -> None:
    if not torch.cuda.is_available():
        sys.exit(f"bench_gpu.py needs a CUDA device: torch.cuda.is_available() is False (torch {torch.__version__}, "
                 f"CUDA build {torch.version.cuda or 'none'}). Run it on a GPU machine, e.g. via benchmarks/gpu_check.sh.")


# --------------------------------------------------------------------------------------------
# Models
# --------------------------------------------------------------------------------------------

def build(name: str, batch: int, seq: int, hf_mask: bool, tiny: bool = False
          ) -> tuple[torch.nn.Module, tuple, dict, dict]:
    """(model on DEVICE, args, kwargs, shape facts) with a seeded random init and batch; `tiny`:
    2-layer, 64-wide models with a 256-token vocabulary (a smoke test of this script)."""
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    dev = torch.device(DEVICE)
    if name == "gpt":
        from fxspeed.models.gpt import GPT, GPTConfig

        cfg = GPTConfig.preset("124m") if not tiny else GPTConfig(vocab_size=256, block_size=seq, n_layer=2,
                                                                   n_head=2, n_embd=64)
        with dev:
            model = GPT(cfg)
        x = torch.randint(0, cfg.vocab_size, (batch, seq), generator=g).to(dev)
        y = torch.randint(0, cfg.vocab_size, (batch, seq), generator=g).to(dev)
        return model, (x, y), {}, {"layers": cfg.n_layer, "width": cfg.n_embd, "vocab": cfg.vocab_size,
                                   "desc": "fxspeed.models.GPT(GPTConfig.preset('124m'))" if not tiny else "tiny GPT"}
    if name == "hf-gpt2":
        import transformers

        cfg = transformers.GPT2Config() if not tiny else transformers.GPT2Config(
            n_layer=2, n_embd=64, n_head=2, vocab_size=256, n_positions=seq, bos_token_id=0, eos_token_id=0)
        cfg._attn_implementation = "sdpa"
        with dev:
            model = transformers.GPT2LMHeadModel(cfg)
        ids = torch.randint(0, cfg.vocab_size, (batch, seq), generator=g).to(dev)
        kw = {"input_ids": ids, "labels": ids}
        if hf_mask:
            kw["attention_mask"] = torch.ones_like(ids)
        return model, (), kw, {"layers": cfg.n_layer, "width": cfg.n_embd, "vocab": cfg.vocab_size,
                               "desc": f"transformers.GPT2LMHeadModel({'GPT2Config()' if not tiny else 'tiny'}), sdpa, "
                                       f"dropout {cfg.resid_pdrop}"
                                       + (", all-ones attention_mask" if hf_mask else "")}
    raise SystemExit(f"unknown model {name!r}; choose from {', '.join(MODELS)}")


def n_params(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())  # tied weights once


def step_flops(params: int, tokens: int, layers: int, width: int, seq: int) -> float:
    return 6.0 * params * tokens + 12.0 * layers * width * seq * tokens


# --------------------------------------------------------------------------------------------
# One run
# --------------------------------------------------------------------------------------------

def _loss(out: Any) -> torch.Tensor:
    if isinstance(out, torch.Tensor):
        return out
    return out["loss"] if isinstance(out, dict) else out.loss


def make_step(mode: str, model: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[Callable[[], float], dict]:
    """The step function of `mode` and what setting it up measured (fxspeed: compile time, plan)."""
    import fxspeed

    info: dict[str, Any] = {}
    if mode.startswith("fxspeed"):
        precision = mode.split("-")[1]
        cfg = fxspeed.Config(optimizer="adamw", lr=LR, precision=precision)
        t = time.perf_counter()
        engine = fxspeed.compile(model, devices=1, config=cfg, example_inputs=kwargs if kwargs else args)
        info["fxspeed_compile_s"] = time.perf_counter() - t
        plan = getattr(engine, "plan", None)
        if plan is not None:
            info["plan_peak_bytes"] = int(plan.peak_memory(0))
            info["plan_step_s"] = float(plan.time.get("total", float("nan")))
        return (lambda: engine.train_step(*args, **kwargs)), info
    amp = "amp-bf16" in mode
    fwd = torch.compile(model) if mode.startswith("compile") else model
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0, fused=True)  # as fxspeed.Config()

    def step() -> float:
        with torch.autocast(DEVICE, dtype=torch.bfloat16, enabled=amp):
            loss = _loss(fwd(*args, **kwargs))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.item()

    return step, info


def _on_cuda() -> bool:
    return DEVICE == "cuda"


def _sync() -> None:
    if _on_cuda():
        torch.cuda.synchronize()


def _free() -> None:
    gc.collect()
    if _on_cuda():
        torch.cuda.empty_cache()


def run(name: str, batch: int, seq: int, mode: str, warmup: int, steps: int, hf_mask: bool,
        tiny: bool = False) -> dict[str, Any]:
    _free()
    if _on_cuda():
        torch.cuda.reset_peak_memory_stats()
    model, args, kwargs, facts = build(name, batch, seq, hf_mask, tiny)
    params = n_params(model)
    step, info = make_step(mode, model, args, kwargs)
    t = time.perf_counter()
    losses = [step() for _ in range(warmup)]
    first_s = time.perf_counter() - t
    times = []
    for _ in range(steps):
        _sync()
        t = time.perf_counter()
        losses.append(step())
        _sync()
        times.append(time.perf_counter() - t)
    peak = torch.cuda.max_memory_allocated() if _on_cuda() else 0
    med = statistics.median(times)
    tokens = batch * seq
    flops = step_flops(params, tokens, facts["layers"], facts["width"], seq)
    out = {"model": name, "model_desc": facts["desc"], "params": params, "batch": [batch, seq], "mode": mode,
           "median_step_s": med, "step_times_s": times, "warmup_s": first_s, "tokens_per_s": tokens / med,
           "flops_per_step": flops, "mfu": flops / med / PEAK_FLOPS, "peak_bytes": int(peak),
           "losses": losses, "finite": all(math.isfinite(x) for x in losses), **info}
    if "plan_peak_bytes" in out and peak:
        out["plan_over_measured_peak"] = out["plan_peak_bytes"] / peak
    del model, step, args, kwargs
    if mode.startswith("compile"):
        torch._dynamo.reset()  # drop the compiled graphs (and the weights their guards hold)
    return out


# --------------------------------------------------------------------------------------------
# Driver
# --------------------------------------------------------------------------------------------

def compare(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (model, batch): fxspeed / eager ratios (fp32 vs eager fp32, bf16 vs eager autocast)."""
    by = {(r["model"], tuple(r["batch"]), r["mode"]): r for r in results if "error" not in r}
    rows = []
    for (m, b, mode), r in by.items():
        base = {"fxspeed-fp32": "eager-fp32", "fxspeed-bf16": "eager-amp-bf16",
                "compile-fp32": "eager-fp32", "compile-amp-bf16": "eager-amp-bf16"}.get(mode)
        e = by.get((m, b, base)) if base else None
        if e is None:
            continue
        rows.append({"model": m, "batch": list(b), "mode": mode, "vs": base,
                     "step_time_ratio": r["median_step_s"] / e["median_step_s"],
                     "peak_memory_ratio": r["peak_bytes"] / e["peak_bytes"] if e["peak_bytes"] else None,
                     "mfu": r["mfu"], "mfu_baseline": e["mfu"],
                     "loss_rel_diff_last": abs(r["losses"][-1] - e["losses"][-1]) / abs(e["losses"][-1])})
    return rows


def table(results: list[dict[str, Any]]) -> str:
    head = f"{'model':<8} {'batch':<8} {'mode':<17} {'step ms':>9} {'tok/s':>9} {'MFU':>6} {'peak GB':>8} " \
           f"{'plan/meas':>9} {'compile s':>9} {'last loss':>9}"
    lines = [head, "-" * len(head)]
    for r in results:
        b = f"{r['batch'][0]}x{r['batch'][1]}"
        if "error" in r:
            lines.append(f"{r['model']:<8} {b:<8} {r['mode']:<17} ERROR: {r['error'][:80]}")
            continue
        pm = f"{r['plan_over_measured_peak']:.3f}" if "plan_over_measured_peak" in r else "-"
        cs = f"{r['fxspeed_compile_s']:.1f}" if "fxspeed_compile_s" in r else "-"
        lines.append(f"{r['model']:<8} {b:<8} {r['mode']:<17} {r['median_step_s'] * 1e3:>9.1f} "
                     f"{r['tokens_per_s']:>9.0f} {r['mfu'] * 100:>5.1f}% {r['peak_bytes'] / 1e9:>8.2f} {pm:>9} {cs:>9} "
                     f"{r['losses'][-1]:>9.4f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=Path("bench_gpu.json"))
    ap.add_argument("--quick", action="store_true", help="about 2 minutes: 8x1024 only, 2 warm-up + 5 timed steps")
    ap.add_argument("--models", default=",".join(MODELS), help=f"comma-separated, from {', '.join(MODELS)}")
    ap.add_argument("--points", default=",".join(POINTS), help="comma-separated BATCHxSEQ operating points")
    ap.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, from {', '.join(MODES + COMPILE_MODES)}")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--torch-compile", action="store_true", help="also time torch.compile of the eager step")
    ap.add_argument("--hf-mask", action="store_true", help="pass HF models an all-ones attention_mask")
    ap.add_argument("--tiny", action="store_true", help="2-layer 64-wide models (a smoke test of this script)")
    a = ap.parse_args(argv)
    if DEVICE == "cuda":
        require_cuda()
    if a.quick:
        a.points, a.warmup, a.steps = "8x1024", 2, 5
    modes = [m for m in a.modes.split(",") if m] + (list(COMPILE_MODES) if a.torch_compile else [])
    unknown = set(modes) - set(MODES + COMPILE_MODES)
    if unknown:
        ap.error(f"unknown mode(s) {sorted(unknown)}")
    points = [tuple(int(v) for v in p.lower().split("x")) for p in a.points.split(",") if p]

    import fxspeed  # noqa: F401 - after the CUDA check: fail fast without importing the compiler

    meta = {"torch": torch.__version__, "cuda": torch.version.cuda,
            "device": torch.cuda.get_device_name(0) if _on_cuda() else DEVICE,
            "python": platform.python_version(), "peak_flops": PEAK_FLOPS, "lr": LR,
            "tf32_matmul": torch.backends.cuda.matmul.allow_tf32, "tf32_cudnn": torch.backends.cudnn.allow_tf32,
            "warmup": a.warmup, "steps": a.steps, "quick": a.quick, "tiny": a.tiny}
    try:
        import transformers

        meta["transformers"] = transformers.__version__
    except ImportError:
        pass
    results: list[dict[str, Any]] = []

    def save() -> None:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps({"meta": meta, "results": results, "comparisons": compare(results)}, indent=1))

    print(json.dumps(meta), flush=True)
    for name in a.models.split(","):
        for batch, seq in points:
            for mode in modes:
                t = time.perf_counter()
                try:
                    r = run(name, batch, seq, mode, a.warmup, a.steps, a.hf_mask, a.tiny)
                except Exception as e:  # noqa: BLE001 - record it and go on with the other runs
                    r = {"model": name, "batch": [batch, seq], "mode": mode,
                         "error": f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}",
                         "traceback": traceback.format_exc()[-4000:]}
                    print(r["traceback"], file=sys.stderr, flush=True)
                r["wall_s"] = time.perf_counter() - t
                results.append(r)
                save()
                done = r.get("median_step_s")
                print(f"{name} {batch}x{seq} {mode}: " + (f"{done * 1e3:.1f} ms/step, peak "
                      f"{r['peak_bytes'] / 1e9:.2f} GB ({r['wall_s']:.0f} s)" if done else r["error"]), flush=True)
                _free()
    print(table(results))
    for c in compare(results):
        mem = f"{c['peak_memory_ratio']:.3f}" if c["peak_memory_ratio"] is not None else "-"
        print(f"{c['model']} {c['batch'][0]}x{c['batch'][1]} {c['mode']} / {c['vs']}: step time "
              f"{c['step_time_ratio']:.3f}, peak memory {mem}, MFU {c['mfu'] * 100:.1f}% vs "
              f"{c['mfu_baseline'] * 100:.1f}%, last loss rel diff {c['loss_rel_diff_last']:.2e}")
    print(f"wrote {a.out}")
    return 1 if any("error" in r for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
