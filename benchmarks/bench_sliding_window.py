"""Serving a sliding-window model: the cache a request holds and the decode speed, against the same
model with full attention, side by side in one run.

    python benchmarks/bench_sliding_window.py --out sw.json
    python benchmarks/bench_sliding_window.py --prompts 512 3072 --window 128 --out sw.json

A HF Mistral from its config (random init, fp32, `--layers` x `--hidden`, `--kv-heads` key/value
heads), served by fxspeed with `sliding_window=--window` ("window") and with no window ("full",
the anchor: same weights and sizes). `--global-every K`: a Qwen2 whose every K-th layer is global
and the others slide (Gemma3's pattern at K=6), against the same Qwen2 with no window. Per prompt length: `--batch` requests of that many random
tokens and `--new` new tokens, greedy. Each row runs in its own process, so its peak RSS is read
from outside (the child's own rusage, `os.wait4`); the cache is serve's default
(max_batch x what a request of the whole context holds). Reported: tokens/s of decode (batch x
(new - 1) tokens over the seconds a call with `--new` tokens takes beyond one with a single new
token, the fastest of `--repeats` each), the prefill seconds (that single-token call), the cache's
tokens and bytes, and peak RSS. The window row's first request is checked
against HF `generate` (its own sliding-window cache) for equal tokens.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time


def child(args: argparse.Namespace) -> dict:
    import torch
    import transformers

    import fxspeed

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    sizes = dict(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=2 * args.hidden,
                 num_hidden_layers=args.layers, num_attention_heads=args.hidden // 64,
                 num_key_value_heads=args.kv_heads, max_position_embeddings=args.context, attn_implementation="sdpa")
    if args.global_every:  # Qwen2 with layer kinds: every global_every-th layer global, the others sliding
        kinds = ["full_attention" if (i + 1) % args.global_every == 0 else "sliding_attention" for i in range(args.layers)]
        windowed = args.mode == "window"
        cfg = transformers.Qwen2Config(**sizes, use_sliding_window=windowed, sliding_window=args.window,
                                       layer_types=kinds if windowed else ["full_attention"] * args.layers)
        model = transformers.Qwen2ForCausalLM(cfg).eval()
    else:
        cfg = transformers.MistralConfig(**sizes, sliding_window=args.window if args.mode == "window" else None)
        model = transformers.MistralForCausalLM(cfg).eval()
    engine = fxspeed.serve(model, token_budget=args.budget, max_batch=args.batch, block_size=16)
    g = torch.Generator().manual_seed(1)
    prompts = torch.randint(0, args.vocab, (args.batch, args.prompt), generator=g).tolist()
    def seconds(new: int) -> float:
        t = time.perf_counter()
        engine.generate(prompts, max_new_tokens=new)
        return time.perf_counter() - t

    seconds(args.new), seconds(1)  # compiles the buckets of both calls' steps (the schedule is the same each time)

    # decode: what new - 1 more tokens per request add to a call that prefills and samples one
    prefill = min(seconds(1) for _ in range(args.repeats))
    total = min(seconds(args.new) for _ in range(args.repeats))
    out = engine.generate(prompts[:1], max_new_tokens=args.new)
    row = {"mode": args.mode, "prompt": args.prompt, "batch": args.batch, "new": args.new,
           "decode_tokens_per_s": args.batch * (args.new - 1) / max(total - prefill, 1e-9),
           "generate_s": total, "prefill_s": prefill,
           "cache_tokens": engine.plan.cache_tokens, "cache_mib": engine.plan.cache_bytes / 2**20,
           "held_at_context": engine.plan.held_at_context, "ring_blocks": engine._serving.ring}
    if args.mode == "window" and args.check:
        with torch.no_grad():
            ref = model.generate(torch.tensor(prompts[:1]), attention_mask=torch.ones(1, args.prompt, dtype=torch.long),
                                 max_new_tokens=args.new, do_sample=False, eos_token_id=None, pad_token_id=0)
        row["tokens_equal_hf"] = out[0] == ref[0, args.prompt:].tolist()
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=1024)
    ap.add_argument("--window", type=int, default=256)
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--prompts", type=int, nargs="+", default=[512, 3072])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--global-every", type=int, default=0,
                    help="every K-th layer global, the others sliding (a Qwen2 with layer kinds); 0: all slide")
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--budget", type=int, default=256)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--no-check", dest="check", action="store_false", help="skip the HF token check")
    ap.add_argument("--out", default="")
    ap.add_argument("--mode", default="", help=argparse.SUPPRESS)  # the child's row
    ap.add_argument("--prompt", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.mode:
        print(json.dumps(child(args)))
        return
    child_argv = list(sys.argv[1:])  # the child writes no file: --out and its value (or --out=X) left out
    for i, a in enumerate(child_argv):
        if a == "--out":
            del child_argv[i:i + 2]
            break
    child_argv = [a for a in child_argv if not a.startswith("--out=")]
    rows = []
    for prompt in args.prompts:
        for mode in ("window", "full"):
            cmd = [sys.executable, __file__, "--mode", mode, "--prompt", str(prompt)] + child_argv
            with tempfile.TemporaryFile("w+") as err:
                proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, text=True)
                out = proc.stdout.read()
                _, status, usage = os.wait4(proc.pid, 0)  # this child's own rusage: its peak RSS, from outside
                proc.returncode = os.waitstatus_to_exitcode(status)
                if proc.returncode:
                    err.seek(0)
                    sys.exit(f"{mode} at prompt {prompt} failed:\n{err.read()[-3000:]}")
            row = json.loads(out.strip().splitlines()[-1])
            row["peak_rss_mib"] = usage.ru_maxrss / 1024
            rows.append(row)
            print(json.dumps(row), flush=True)
    for prompt in args.prompts:
        w, f = (next(r for r in rows if r["prompt"] == prompt and r["mode"] == m) for m in ("window", "full"))
        print(f"prompt {prompt}: window {args.window} decodes {w['decode_tokens_per_s']:.1f} tok/s against full "
              f"attention's {f['decode_tokens_per_s']:.1f} ({w['decode_tokens_per_s'] / f['decode_tokens_per_s']:.2f}x); "
              f"cache {w['cache_mib']:.0f} MiB against {f['cache_mib']:.0f} MiB")
    if args.out:
        with open(args.out, "w") as fh:
            json.dump({"args": vars(args), "rows": rows}, fh, indent=2)


if __name__ == "__main__":
    main()
