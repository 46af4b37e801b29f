"""Prefix caching: requests that share a system prompt, served with and without it, side by side
in one run.

    python benchmarks/bench_prefix_cache.py --out prefix.json
    python benchmarks/bench_prefix_cache.py --shared 1024 --requests 16 --out prefix.json

A Hugging Face GPT-2 from its config (random init, fp32, `--layers`), two engines over the same
model: `prefix_caching=True` and `False` (the anchor). `--requests` prompts of `--shared` tokens in
common and `--own` tokens of their own (new ones at every call), `--new` new tokens each, greedy; the
calls alternate between the engines `--repeats` times (the first call of each is a warm-up that
compiles its buckets and, for the cached engine, computes the shared blocks once: a server that
has seen its system prompt). Reported: useful tokens/s
(the new tokens over the call's seconds, the best call), the time to the first token of the
call's last request, the prompt tokens each call did not compute, and whether both engines
return the same tokens.
"""

from __future__ import annotations

import argparse
import json
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--shared", type=int, default=512)
    ap.add_argument("--own", type=int, default=32)
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--new", type=int, default=16)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--out", default="")
    args = ap.parse_args()

    import torch
    import transformers

    import fxspeed

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=args.layers, attn_implementation="sdpa"))
    model.eval()
    g = torch.Generator().manual_seed(1)
    shared = torch.randint(0, 50257, (args.shared,), generator=g).tolist()
    engines = {mode: fxspeed.serve(model, prefix_caching=mode == "cached") for mode in ("cached", "anchor")}

    def call(engine: fxspeed.Engine, prompts: list[list[int]]) -> tuple[float, float, int, list[list[int]]]:
        serving = engine._serving
        hits = serving.stats["prefix_hit_tokens"]
        outs: list[list[int]] = [[] for _ in prompts]
        first: dict[int, float] = {}
        t = time.perf_counter()
        for rid, tok in engine.stream(prompts, max_new_tokens=args.new):
            first.setdefault(rid, time.perf_counter() - t)
            outs[rid].append(tok)
        return time.perf_counter() - t, max(first.values()), serving.stats["prefix_hit_tokens"] - hits, outs

    rows: dict[str, list] = {m: [] for m in engines}
    for _ in range(args.repeats + 1):
        # each call's own parts are new: only the shared prompt can be read from an earlier call
        prompts = [shared + torch.randint(0, 50257, (args.own,), generator=g).tolist() for _ in range(args.requests)]
        for mode, engine in engines.items():
            rows[mode].append(call(engine, prompts))
    result = {}
    for mode, calls in rows.items():
        best = min(calls[1:], key=lambda c: c[0])
        result[mode] = {"useful_tokens_per_s": args.requests * args.new / best[0], "call_s": best[0],
                        "last_first_token_s": best[1], "prompt_tokens_read_not_computed": best[2]}
    same = rows["cached"][-1][3] == rows["anchor"][-1][3]
    c, a = result["cached"], result["anchor"]
    print(json.dumps({"args": vars(args), **result, "same_tokens": same}))
    print(f"{args.requests} requests sharing {args.shared} of {args.shared + args.own} prompt tokens: prefix caching "
          f"{c['useful_tokens_per_s']:.1f} useful tok/s against {a['useful_tokens_per_s']:.1f} without "
          f"({c['useful_tokens_per_s'] / a['useful_tokens_per_s']:.2f}x); last first token {c['last_first_token_s']:.2f} "
          f"s against {a['last_first_token_s']:.2f} s; {c['prompt_tokens_read_not_computed']} prompt tokens read, not "
          f"computed; same tokens: {same}")
    if args.out:
        with open(args.out, "w") as fh:
            json.dump({"args": vars(args), **result, "same_tokens": same}, fh, indent=2)


if __name__ == "__main__":
    main()
