"""Is the memory plan a promise? Each rank's measured peak RSS against `plan.peak_memory(rank)`,
for compile and for the training steps apart.

    MALLOC_MMAP_THRESHOLD_=65536 MALLOC_TRIM_THRESHOLD_=65536 OMP_NUM_THREADS=1 \\
        python -m fxspeed run -n 2 benchmarks/bench_plan_memory.py --mode z1+bf16+opt --nvme /tmp/swap
    ... --model llama --layers 6 --width 512 --batch 4 --seq 128 --mode z2+fp32

`--mode`: "+"-joined parts: z0..z3 (ZeRO stage), fp32 / bf16 (precision), opt (offload="optimizer"),
all (offload="all"), gaK (grad_accum=K; --batch is then the whole step's). Models: fxspeed's GPT
(`--model gpt`) or HF Llama with grouped-query attention (`--model llama`), random init, from
`--layers`, `--width`, `--vocab`. `--meta`: the model is built under `fxspeed.parameters_on_meta()`
and compile gives it its values one bucket at a time (deferred init); `--tensor T` / `--pipeline P`
(micro-batches: `--batch`) lay it out over tensor-parallel ranks / pipeline stages, where from meta
each rank makes one init group whole at a time and keeps its slice / makes its stages' weights only:

    MALLOC_MMAP_THRESHOLD_=65536 MALLOC_TRIM_THRESHOLD_=65536 OMP_NUM_THREADS=1 \\
        python -m fxspeed run -n 2 benchmarks/bench_plan_memory.py --mode z0+fp32 --tensor 2 --meta

Measured from outside fxspeed's counters: the kernel's peak RSS (VmHWM) of this process, reset by
writing "5" to /proc/self/clear_refs once the model is built and again after compile; growth over
the RSS before compile, plus the model's fp32 parameter bytes (the model sits in that baseline),
as the suite's memory tests count it (with `--meta` the baseline holds no parameters: growth alone). `steady` is the RSS between steps after the last one. The
plan counts tensors only: on small models the process's own memory shows as a plan below the
measured step. Measured (HF Llama 18M 6x512, 2 ranks bf16 ZeRO-1 + optimizer offload, rank 0): the
live tensors match the plan (137.0 MB at the peak against 137.8; between steps exactly its
parameters + optimizer states) and memory outside tensors grows 38 MB over compile and the first
step, none of it returned when the engine is dropped: glibc's heap +12 MB (5 of it freed but held),
oneDNN's primitive cache for the step's matmul shapes ~8 MB (ONEDNN_PRIMITIVE_CACHE_CAPACITY=0
removes it), the rest Python objects (the compiled program's graph and fake tensors) and new
threads' stacks and arenas. It grows with the program's node count (12 layers: 64 MB) and not with
the model's size (width 256: 42 MB). Set the MALLOC_ variables, or freed
tensors stay in glibc's heap and every peak reads high. One JSON line per rank on stdout.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

import fxspeed
from fxspeed.models import GPT, GPTConfig

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
from benchmarks.workers.dp_worker import reset_peak, status_kb  # noqa: E402 (after the path)


def rss_bytes(field: str) -> int:
    return status_kb(field) * 1024


def config_of(mode: str, nvme: str | None) -> fxspeed.Config:
    kw: dict = {"zero": 1, "precision": "bf16", "optimizer": "adam"}
    for part in mode.split("+"):
        if part[0] == "z" and part[1:].isdigit():
            kw["zero"] = int(part[1:])
        elif part in ("fp32", "bf16", "fp16"):
            kw["precision"] = part
        elif part in ("opt", "all"):
            if nvme is None:
                raise SystemExit(f"--mode {mode}: offload needs --nvme DIR (the same path on every rank)")
            kw.update(offload="optimizer" if part == "opt" else "all", nvme_path=nvme)
        elif part.startswith("ga") and part[2:].isdigit():
            kw["grad_accum"] = int(part[2:])
        else:
            raise SystemExit(f"--mode: unknown part {part!r} (z0..z3, fp32, bf16, fp16, opt, all, gaK)")
    return fxspeed.Config(**kw)


def build(a: argparse.Namespace) -> tuple[torch.nn.Module, bool]:
    """The model and whether it takes HF keyword batches."""
    torch.manual_seed(0)
    if a.model == "llama":
        import transformers

        transformers.logging.set_verbosity_error()
        cfg = transformers.LlamaConfig(vocab_size=a.vocab, hidden_size=a.width,
                                       intermediate_size=a.width * 8 // 3 // 64 * 64, num_hidden_layers=a.layers,
                                       num_attention_heads=8, num_key_value_heads=4,
                                       max_position_embeddings=max(a.seq, 64), attn_implementation="sdpa")
        return transformers.LlamaForCausalLM(cfg), True
    cfg = dataclasses.replace(GPTConfig.preset("100m"), n_layer=a.layers, n_embd=a.width, n_head=8,
                              vocab_size=a.vocab, block_size=max(a.seq, 64))
    return GPT(cfg), False


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mode", default="z1+bf16")
    ap.add_argument("--model", choices=("gpt", "llama"), default="gpt")
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--width", type=int, default=512)
    ap.add_argument("--vocab", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=8)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--nvme", default=None, help="offload directory (exists, same on every rank)")
    ap.add_argument("--meta", action="store_true", help="build on the meta device; compile materializes it")
    ap.add_argument("--tensor", type=int, default=1, help="Config.tensor (tensor-parallel ranks)")
    ap.add_argument("--pipeline", type=int, default=1, help="Config.pipeline (stages; micro-batches: --batch)")
    a = ap.parse_args()
    torch.set_num_threads(1)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    config = config_of(a.mode, a.nvme)
    if a.tensor > 1 or a.pipeline > 1:
        config = dataclasses.replace(config, tensor=a.tensor, pipeline=a.pipeline,
                                     microbatches=a.batch if a.pipeline > 1 else config.microbatches)
    # Code loaded on first use (tracing, collectives, the first bf16 matmul) is not the plan's.
    torch.manual_seed(0)
    tiny = GPT(GPTConfig.preset("tiny"))
    x = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    fxspeed.compile(tiny, world, fxspeed.Config(zero=3, optimizer="adam", precision=config.precision),
                    example_inputs=(x, x)).train_step(x, x)
    del tiny
    gc.collect()

    with fxspeed.parameters_on_meta() if a.meta else contextlib.nullcontext():
        model, hf = build(a)
    ids = torch.randint(0, a.vocab, (a.batch, a.seq), generator=torch.Generator().manual_seed(0))
    batch: dict = {"input_ids": ids, "labels": ids} if hf else {}
    args = () if hf else (ids, ids)
    # (the fp32 model sits in the baseline; under pipeline / tensor parallelism too: every rank built it whole)
    model_bytes = sum(4 * p.numel() for p in model.parameters() if not p.is_meta)
    if dist.is_initialized():
        dist.barrier()
    base = rss_bytes("VmRSS")
    reset_peak()
    engine = fxspeed.compile(model, world, config, example_inputs=batch if hf else args)
    compiled = rss_bytes("VmHWM")
    reset_peak()
    for _ in range(a.steps):
        engine.train_step(*args, **batch)
    stepped = rss_bytes("VmHWM")
    engine.synchronize()
    gc.collect()
    steady = rss_bytes("VmRSS")
    rank = dist.get_rank() if dist.is_initialized() else 0
    plan = engine.plan.peak_memory(rank)
    mb = lambda b: round(b / 1e6, 1)  # noqa: E731
    layout = "".join(f"+{k}{n}" for k, n in (("tp", a.tensor), ("pp", a.pipeline)) if n > 1)
    print(json.dumps({"rank": rank, "world": world, "mode": a.mode + layout + ("+meta" if a.meta else ""),
                      "model": a.model,
                      "plan_mb": mb(plan), "compile_mb": mb(compiled - base + model_bytes),
                      "step_mb": mb(stepped - base + model_bytes), "steady_mb": mb(steady - base + model_bytes),
                      "plan_over_step": round(plan / (stepped - base + model_bytes), 3),
                      "plan_categories_mb": {k: mb(v) for k, v in engine.plan.memory(rank).items()}}), flush=True)


if __name__ == "__main__":
    main()
