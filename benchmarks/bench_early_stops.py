"""Requests that stop early at eos on a cache too small for their whole max_new_tokens: useful
tokens/s, steps and preemptions.

    python benchmarks/bench_early_stops.py --cache-tokens 2048
    python benchmarks/bench_early_stops.py --cache-tokens 1024 --out stops.json

A Hugging Face GPT-2 from its config (random init, fp32, `--layers`), `--requests` prompts of
32..128 random tokens (seeded), max_new_tokens `--max-new`, and for each request an eos id taken
from its own greedy output at a position uniform in 8..96 (a reference run on a roomy cache,
kept in `--ref`), so requests stop where a chat model's answers would, long before max_new_tokens.
Served at `--cache-tokens` with max_batch 16; the best of `--repeats` calls after a warm-up.
The tokens are checked against the reference's, cut at each eos. Run it on two checkouts of
fxspeed to compare scheduling policies (a request that reserves its whole length at admission,
before 5b1d3b4, against one that grows).
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import random
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--max-new", type=int, default=128)
    ap.add_argument("--cache-tokens", type=int, default=2048)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--ref", default="early_stops_ref.json", help="the reference outputs (made if missing)")
    ap.add_argument("--out", default="")
    args = ap.parse_args()

    import torch
    import transformers

    import fxspeed

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(attn_implementation="sdpa", n_layer=args.layers))
    model.eval()
    rng = random.Random(0)
    prompts = [[rng.randrange(50257) for _ in range(rng.randint(32, 128))] for _ in range(args.requests)]
    stops = [rng.randint(8, 96) for _ in range(args.requests)]
    if not os.path.exists(args.ref):
        full = fxspeed.serve(model, max_batch=16).generate(prompts, max_new_tokens=args.max_new)
        with open(args.ref, "w") as fh:
            json.dump(full, fh)
    with open(args.ref) as fh:
        full = json.load(fh)
    eos = [[f[k - 1]] for f, k in zip(full, stops)]
    want = [f[:f.index(e[0]) + 1] for f, e in zip(full, eos)]
    # without prefix caching (where the checkout has it): the repeated calls send the same prompts,
    # whose blocks a cached engine would read rather than compute, which is not what this measures
    off = {"prefix_caching": False} if "prefix_caching" in inspect.signature(fxspeed.serve).parameters else {}
    engine = fxspeed.serve(model, max_batch=16, cache_tokens=args.cache_tokens, **off)
    engine.generate(prompts[:16], max_new_tokens=8)
    best, out = float("inf"), []
    for _ in range(args.repeats):
        steps = engine._serving.stats["steps"]
        t = time.perf_counter()
        out = engine.generate(prompts, max_new_tokens=args.max_new, eos_token_ids=eos)
        best = min(best, time.perf_counter() - t)
        steps = engine._serving.stats["steps"] - steps
    row = {"useful_tokens_per_s": sum(len(o) for o in out) / best, "call_s": best, "steps": steps,
           "preempted": engine._serving.stats.get("preempted"), "tokens_equal": out == want,
           "fxspeed": os.path.dirname(fxspeed.__file__)}
    print(json.dumps({"args": vars(args), **row}))
    if args.out:
        with open(args.out, "w") as fh:
            json.dump({"args": vars(args), **row}, fh, indent=2)


if __name__ == "__main__":
    main()
