"""Inference: fxspeed.serve against Hugging Face `generate` (eager), side by side in one run.

    python benchmarks/bench_inference.py --out inference.json                 # GPT-2 124M, fp32
    python benchmarks/bench_inference.py --layers 4 --out /tmp/i.json          # smaller, faster
    python benchmarks/bench_inference.py --workload 64 --out w.json            # + the mixed workload
    python -m fxspeed run -n 2 benchmarks/bench_inference.py --tensor 2 --threads 1 --out t.json
                                                    # tensor-parallel serving (fxspeed only)
    python benchmarks/bench_inference.py --device cuda --model llama-0.94b --precision bf16 \
        --batches 1 16 --prompt 32 --new 128 --workload 64 --prompt-range 32 512 --new-range 32 256
                                                    # the GPU tier (issue 16): + a row without CUDA graphs

HF GPT2LMHeadModel (or `--model llama-0.94b`: HF Llama, 16 x 2048, 0.94B) from its config
(random init), fp32 (`--precision bf16`: the model converted, as serving in bf16 is meant to
be), on `--device` (cpu, `--threads` CPU threads; or cuda), prompts of
`--prompt` random tokens, `--new` new tokens, greedy, at batch 8 and 1. Both generate exactly
`--new` tokens per request (no eos). Tokens/s = batch x new tokens / wall seconds of the whole
call (prefill included), and per CPU second of this process (fairer on a shared machine with
one thread), medians of `--repeats` runs after one warm-up run (fxspeed compiles its
token buckets in the warm-up; its compile seconds are reported separately). The tokens of both
are compared: greedy fp32 must agree. On CUDA each batch also runs fxspeed with
`cuda_graphs=False` (steps launched op by op), and the rows give the memory-bandwidth limit of
one decode step (weight bytes / the device preset's bandwidth) as tokens/s x batch.

`--unpacked-row`: also fxspeed with `pack_linear_weights` disabled (the CPU decode buckets through
MKL's GEMM instead of oneDNN's packed weights), to measure that pass side by side.
`--packed-row`: also fxspeed with `pack_linear="always"` (every small CPU bucket packed, as before
the probe chose per bucket), to measure the probe's choice side by side.

`--compile`: also HF `generate` with a static KV cache and its forward through `torch.compile`
(the gpt-fast recipe; compiled in an untimed warm-up run per batch, whose seconds are reported).

`--tensor T` (under `fxspeed run -n T`): fxspeed serves with Config(tensor=T) and HF is not run
(`--no-hf` skips it at T=1 too, the anchor for a TP run); the RSS of every rank is
reported (peak and at the end), measured from outside fxspeed's own counters.

`--workload N`: N requests, prompts uniform in --prompt-range, outputs uniform in --new-range
(seeded), all submitted at once. Useful tokens/s counts requested tokens only; fxspeed streams
them (p50/p95 seconds between a request's consecutive tokens), HF `generate` runs padded
batches of 16 (left padding, each batch to its longest requested output), HF `generate_batch`
(its continuous batching) runs all N with the longest requested output (one generation config).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch


def timed(fn, repeats: int) -> tuple[float, float, object]:  # noqa: ANN001
    """Median wall seconds and median CPU seconds of this process (the fairer figure on a shared
    machine: with one thread it excludes time the scheduler gave to other processes)."""
    out = fn()  # warm-up
    ts, cs = [], []
    for _ in range(repeats):
        t, c = time.perf_counter(), time.process_time()
        out = fn()
        ts.append(time.perf_counter() - t)
        cs.append(time.process_time() - c)
    return statistics.median(ts), statistics.median(cs), out


def build(name: str, layers: int | None):  # noqa: ANN201
    import transformers

    torch.manual_seed(0)
    if name == "gpt2":
        cfg = transformers.GPT2Config(n_layer=layers or 12, attn_implementation="sdpa")
        return transformers.GPT2LMHeadModel(cfg), cfg.vocab_size
    # issue 16's GPU model: 0.94B parameters, 1.88 GB of bf16 weights
    cfg = transformers.LlamaConfig(vocab_size=32000, hidden_size=2048, intermediate_size=5504,
                                   num_hidden_layers=layers or 16, num_attention_heads=16, num_key_value_heads=16,
                                   max_position_embeddings=2048, attn_implementation="sdpa")
    return transformers.LlamaForCausalLM(cfg), cfg.vocab_size


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=("gpt2", "llama-0.94b"), default="gpt2")
    ap.add_argument("--layers", type=int, default=None, help="default: the model's (12 / 16)")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--precision", choices=("fp32", "bf16"), default="fp32")
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--batches", type=int, nargs="+", default=[8, 1])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--token-budget", type=int, default=256)
    ap.add_argument("--workload", type=int, default=0)
    ap.add_argument("--prompt-range", type=int, nargs=2, default=[32, 128])
    ap.add_argument("--new-range", type=int, nargs=2, default=[32, 64])
    ap.add_argument("--tensor", type=int, default=1)
    ap.add_argument("--no-hf", action="store_true")
    ap.add_argument("--unpacked-row", action="store_true",
                    help="also fxspeed with pack_linear_weights disabled (MKL's GEMM on the CPU), side by side")
    ap.add_argument("--packed-row", action="store_true",
                    help="also fxspeed with pack_linear='always' (every small CPU bucket packed, no probe), side by side")
    ap.add_argument("--compile", action="store_true",
                    help="also HF generate with a static cache and torch.compile'd forward (minutes to compile)")
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    run_hf = not args.no_hf and args.tensor == 1
    if args.tensor > 1 and args.workload:
        ap.error("--workload compares with HF, which runs on one process: use it with --tensor 1")
    torch.set_num_threads(args.threads)
    if args.tensor > 1:  # joined here (serve would), so the baseline below includes gloo's buffers
        import torch.distributed as dist

        dist.init_process_group("gloo")
    import transformers

    import fxspeed

    transformers.logging.set_verbosity_error()
    baseline_mb = rss_mb()["end_mb"]  # torch, transformers, the process group: before the model
    device = torch.device(args.device)
    model, vocab = build(args.model, args.layers)
    model = model.to(device, torch.bfloat16 if args.precision == "bf16" else torch.float32).eval()
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    bandwidth = fxspeed.devices("auto")[0].mem_bandwidth if device.type == "cuda" else None
    t = time.perf_counter()
    max_batch = max(*args.batches, 16 if args.workload else 1)
    context = max(args.prompt + args.new, sum(args.prompt_range[1:]) + args.new_range[1] if args.workload else 0)
    # one CPU process: the plan's roofline at this machine's measured rates (the preset's are an
    # order of magnitude); tp ranks keep the preset, as they must agree on it
    devices = fxspeed.measured_cpu() if device.type == "cpu" and args.tensor == 1 else args.tensor
    # no prefix caching: the timed repeats send the same prompts, which a cached engine would read
    # rather than compute (HF computes them every time)
    options = dict(devices=devices, config=fxspeed.Config(tensor=args.tensor), token_budget=args.token_budget,
                   max_batch=max_batch, block_size=16, cache_tokens=max_batch * context, prefix_caching=False)
    engine = fxspeed.serve(model, **options)
    launched = fxspeed.serve(model, **options, cuda_graphs=False) if device.type == "cuda" else None
    unpacked = fxspeed.serve(model, **{**options, "config": fxspeed.Config(
        tensor=args.tensor, disable_passes=("pack_linear_weights",))}) if args.unpacked_row else None
    always = fxspeed.serve(model, **options, pack_linear="always") if args.packed_row else None
    rank0 = int(os.environ.get("RANK", "0")) == 0
    serve_s = time.perf_counter() - t
    rows = []
    g = torch.Generator().manual_seed(1)
    for b in args.batches:
        prompts = torch.randint(0, vocab, (b, args.prompt), generator=g).to(device)

        def hf() -> list[list[int]]:
            with torch.no_grad():
                out = model.generate(prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=args.new,
                                     min_new_tokens=args.new, do_sample=False, pad_token_id=0)
            return out[:, args.prompt:].tolist()

        def fx() -> list[list[int]]:
            return engine.generate(prompts.tolist(), max_new_tokens=args.new)

        c0 = engine._serving.stats["compile_s"]
        fx_s, fx_c, fx_out = timed(fx, args.repeats)
        tokens = b * args.new
        row = {"batch": b, "fxspeed_tok_s": tokens / fx_s, "fxspeed_tok_per_cpu_s": tokens / fx_c,
               "fxspeed_compile_s_this_batch": engine._serving.stats["compile_s"] - c0}
        if bandwidth:  # every decode step reads every weight once
            row["bandwidth_limit_tok_s"] = b * bandwidth / weight_bytes
            row["share_of_bandwidth_limit"] = row["fxspeed_tok_s"] / row["bandwidth_limit_tok_s"]
        if unpacked is not None:
            u_s, _, u_out = timed(lambda: unpacked.generate(prompts.tolist(), max_new_tokens=args.new), args.repeats)
            row.update({"fxspeed_unpacked_tok_s": tokens / u_s, "packing_speedup": u_s / fx_s,
                        "same_tokens_unpacked": u_out == fx_out})
        if always is not None:
            a_s, _, a_out = timed(lambda: always.generate(prompts.tolist(), max_new_tokens=args.new), args.repeats)
            row.update({"fxspeed_always_packed_tok_s": tokens / a_s, "probe_speedup": a_s / fx_s,
                        "same_tokens_always_packed": a_out == fx_out})
        row["pack_probe_ms"] = {T: {k: round(s * 1e3, 2) for k, s in v.items()}
                                for T, v in engine._serving.pack_probe.items()}
        if launched is not None:
            l_s, _, l_out = timed(lambda: launched.generate(prompts.tolist(), max_new_tokens=args.new), args.repeats)
            row.update({"fxspeed_no_cuda_graphs_tok_s": tokens / l_s, "cuda_graphs_speedup": l_s / fx_s,
                        "same_tokens_without_graphs": l_out == fx_out})
        if run_hf:
            hf_s, hf_c, hf_out = timed(hf, args.repeats)
            row.update({"hf_eager_tok_s": tokens / hf_s, "speedup": hf_s / fx_s, "hf_eager_tok_per_cpu_s": tokens / hf_c,
                        "speedup_cpu": hf_c / fx_c, "same_tokens": hf_out == fx_out})
        if args.compile and run_hf:
            row.update(hf_compiled(model, prompts, args, fx_s, fx_out))
        rows.append(row)
        if rank0:
            print(json.dumps(rows[-1]), flush=True)
    workload = run_workload(args, model, engine, vocab) if args.workload else None
    result = {"model": f"{type(model).__name__} {args.model} layers={args.layers or 'default'} {args.precision}",
              "device": args.device, "weight_bytes": weight_bytes, "threads": args.threads, "workload": workload,
              "tensor": args.tensor, "prompt": args.prompt, "new": args.new, "serve_s": serve_s,
              "compile_s_total": engine._serving.stats["compile_s"], "rows": rows,
              "plan": engine.plan.to_dict(), "rss_per_rank": rss_per_rank(baseline_mb)}
    if not rank0:
        return
    print(engine.plan.summary())
    print(json.dumps({"rss_per_rank": result["rss_per_rank"]}))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)


def hf_compiled(model: torch.nn.Module, prompts: torch.Tensor, args: argparse.Namespace, fx_s: float,
                fx_out: list[list[int]]) -> dict:
    """HF generate with a static KV cache and its forward through torch.compile (the compile
    happens in the warm-up run, timed apart), greedy as the other rows; a fresh compile per batch."""
    torch._dynamo.reset()
    compiled = torch.compile(model.forward, dynamic=False)

    def run() -> list[list[int]]:
        with torch.no_grad():
            out = _static_generate(model, compiled, prompts, args)
        return out[:, args.prompt:].tolist()

    t = time.perf_counter()
    run()
    compile_s = time.perf_counter() - t
    c_s, _, c_out = timed(run, args.repeats)
    tokens = prompts.shape[0] * args.new
    return {"hf_compile_tok_s": tokens / c_s, "hf_compile_s": compile_s, "speedup_vs_compile": c_s / fx_s,
            "same_tokens_compile": c_out == fx_out}


def _static_generate(model: torch.nn.Module, forward: object, prompts: torch.Tensor,
                     args: argparse.Namespace) -> torch.Tensor:
    """HF generate with cache_implementation="static", its forward swapped for `forward`."""
    plain = model.forward
    model.forward = forward
    try:
        return model.generate(prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=args.new,
                              min_new_tokens=args.new, do_sample=False, pad_token_id=0, cache_implementation="static")
    finally:
        model.forward = plain


def rss_mb() -> dict[str, float]:
    """This process's peak (VmHWM) and resident (VmRSS) memory in MB, as the kernel counts them."""
    with open("/proc/self/status") as f:
        got = {k: int(v.split()[0]) / 1024 for k, v in (line.split(":", 1) for line in f)
               if k in ("VmHWM", "VmRSS")}
    return {"peak_mb": got["VmHWM"], "end_mb": got["VmRSS"]}


def rss_per_rank(baseline_mb: float) -> list[dict[str, float]]:
    """Every rank's peak (the whole model is built in each process before serve slices it) and
    resident memory at the end, and the end above the baseline taken before the model was built
    (the weights the rank kept, the cache, the programs)."""
    mine = rss_mb()
    mine["end_above_baseline_mb"] = mine["end_mb"] - baseline_mb
    import torch.distributed as dist

    if not dist.is_initialized():
        return [mine]
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    return every


def run_workload(args: argparse.Namespace, model: torch.nn.Module, engine: object, vocab: int) -> dict:
    g = torch.Generator().manual_seed(2)
    n = args.workload
    plens = torch.randint(args.prompt_range[0], args.prompt_range[1] + 1, (n,), generator=g).tolist()
    news = torch.randint(args.new_range[0], args.new_range[1] + 1, (n,), generator=g).tolist()
    prompts = [torch.randint(0, vocab, (p,), generator=g).tolist() for p in plens]
    useful = sum(news)
    out: dict = {"requests": n, "prompt_range": args.prompt_range, "new_range": args.new_range,
                 "useful_tokens": useful}

    t0 = time.perf_counter()
    for b in engine._serving.buckets:  # compile every bucket first: the workload may need any
        engine._serving.program(b)
    out["fxspeed_compile_all_buckets_s"] = time.perf_counter() - t0
    t0, c0 = time.perf_counter(), time.process_time()
    last: dict[int, float] = {}
    gaps: list[float] = []
    for rid, _ in engine.stream(prompts, max_new_tokens=news):
        now = time.perf_counter()
        if rid in last:
            gaps.append(now - last[rid])
        last[rid] = now
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    gaps.sort()
    out["fxspeed"] = {"useful_tok_s": useful / wall, "wall_s": wall, "useful_tok_per_cpu_s": useful / cpu,
                      "p50_between_tokens_s": gaps[len(gaps) // 2] if gaps else None,
                      "p95_between_tokens_s": gaps[int(len(gaps) * 0.95)] if gaps else None}
    print(json.dumps({"workload_fxspeed": out["fxspeed"]}), flush=True)

    t0, c0 = time.perf_counter(), time.process_time()
    for i in range(0, n, 16):
        ps, ns = prompts[i:i + 16], news[i:i + 16]
        width = max(len(p) for p in ps)
        ids = torch.tensor([[0] * (width - len(p)) + p for p in ps], device=model.device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in ps], device=model.device)
        with torch.no_grad():
            model.generate(ids, attention_mask=mask, max_new_tokens=max(ns), min_new_tokens=max(ns), do_sample=False,
                           pad_token_id=0)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    out["hf_generate_padded_16"] = {"useful_tok_s": useful / wall, "wall_s": wall, "useful_tok_per_cpu_s": useful / cpu}
    print(json.dumps({"workload_hf_padded": out["hf_generate_padded_16"]}), flush=True)

    try:
        import transformers

        gc = transformers.GenerationConfig(max_new_tokens=max(news), do_sample=False, eos_token_id=None,
                                           pad_token_id=0)
        t0, c0 = time.perf_counter(), time.process_time()
        model.generate_batch(prompts, generation_config=gc)
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        out["hf_generate_batch"] = {"useful_tok_s": useful / wall, "wall_s": wall,
                                    "useful_tok_per_cpu_s": useful / cpu}  # it may run threads of its own
    except Exception as e:  # noqa: BLE001 - reported, not fatal: the other rows stand
        out["hf_generate_batch"] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
    print(json.dumps({"workload_hf_generate_batch": out["hf_generate_batch"]}), flush=True)
    return out


if __name__ == "__main__":
    main()
