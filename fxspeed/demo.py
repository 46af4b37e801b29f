"""`fxspeed demo`: compile a byte-level GPT and train it on text every machine has offline.

The corpus is the source of Python's standard library (the ``.py`` files next to ``os.py``,
read in sorted order and capped at ~2 MB), so the demo needs no download and gives the same
data everywhere. Batches are random windows drawn with a seeded generator.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

CORPUS_CAP = 2_000_000  # bytes
MODELS = ("tiny", "small")


def load_corpus(cap: int = CORPUS_CAP) -> torch.Tensor:
    """Bytes of the standard library's top-level .py files, sorted by name, at most `cap`."""
    root = Path(os.__file__).resolve().parent
    chunks: list[bytes] = []
    size = 0
    for path in sorted(root.glob("*.py")):
        try:
            data = path.read_bytes()
        except OSError:
            continue
        chunks.append(data[: cap - size])
        size += len(chunks[-1])
        if size >= cap:
            break
    if size < 10_000:
        raise RuntimeError(f"fxspeed demo: found only {size} bytes of Python source under {root}; "
                           "the standard library's .py files are needed as the training corpus")
    return torch.frombuffer(bytearray(b"".join(chunks)), dtype=torch.uint8).long()


def get_batch(data: torch.Tensor, batch_size: int, seq_len: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    ix = torch.randint(0, data.numel() - seq_len - 1, (batch_size,), generator=gen)
    offsets = torch.arange(seq_len)
    x = data[ix[:, None] + offsets]
    y = data[ix[:, None] + offsets + 1]
    return x, y


def run(args: Any) -> int:
    """Run the demo from parsed CLI arguments; returns the process exit code."""
    from tqdm import tqdm

    import fxspeed
    from fxspeed.models.gpt import GPT, GPTConfig

    if getattr(args, "devices", 1) > 1 or getattr(args, "zero", 0) > 0:
        print(f"fxspeed demo: --devices {args.devices} --zero {args.zero}: multi-device training and ZeRO sharding "
              "are not implemented yet in this version of fxspeed; run the demo without --devices/--zero "
              "(or with --devices 1 --zero 0). fxspeed.plan() can already plan for many devices.", file=sys.stderr)
        return 2
    if args.steps < 1 or args.batch_size < 1 or args.seq_len < 2:
        print("fxspeed demo: --steps and --batch-size must be >= 1 and --seq-len >= 2", file=sys.stderr)
        return 2

    threads = getattr(args, "threads", None) or (1 if args.model == "tiny" else None)
    if threads:
        torch.set_num_threads(threads)
    t0 = time.perf_counter()
    torch.manual_seed(args.seed)
    gen = torch.Generator().manual_seed(args.seed)
    data = load_corpus()
    cfg = GPTConfig.preset(args.model)
    cfg.block_size = max(cfg.block_size, args.seq_len)
    model = GPT(cfg)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"fxspeed demo: byte-level GPT '{args.model}' ({n_params / 1e6:.2f}M params) on {data.numel() / 1e6:.2f} MB "
          f"of Python standard library source ({Path(os.__file__).resolve().parent})")
    print(f"batch {args.batch_size} x {args.seq_len} tokens, {args.steps} steps, AdamW lr {args.lr}, "
          f"{torch.get_num_threads()} CPU threads")

    x, y = get_batch(data, args.batch_size, args.seq_len, gen)
    tc = time.perf_counter()
    engine = fxspeed.compile(model, 1, fxspeed.Config(optimizer="adamw", lr=args.lr, grad_clip=1.0),
                             example_inputs=(x, y))
    print(f"compiled in {time.perf_counter() - tc:.1f} s\n")
    print(engine.plan.summary())
    print(flush=True)

    tokens = args.batch_size * args.seq_len
    losses: list[float] = []
    bar = tqdm(range(args.steps), desc="train", unit="step", dynamic_ncols=False, ncols=90, mininterval=0.5)
    tt = time.perf_counter()
    for step in bar:
        if step:
            x, y = get_batch(data, args.batch_size, args.seq_len, gen)
        losses.append(engine.train_step(x, y))
        elapsed = time.perf_counter() - tt
        bar.set_postfix(loss=f"{losses[-1]:.3f}", tok_s=f"{tokens * (step + 1) / elapsed:,.0f}", refresh=False)
    bar.close()
    train_s = time.perf_counter() - tt

    k = max(1, min(10, len(losses) // 4))
    first, last = sum(losses[:k]) / k, sum(losses[-k:]) / k
    print(f"\nloss: first {k} steps {first:.3f} -> last {k} steps {last:.3f} (mean over each; step 1 {losses[0]:.3f}, "
          f"uniform over 256 bytes = {torch.log(torch.tensor(256.0)).item():.3f})")
    print(f"trained {args.steps} steps in {train_s:.1f} s ({tokens * args.steps / train_s:,.0f} tokens/s); "
          f"total {time.perf_counter() - t0:.1f} s")
    if args.sample > 0:
        print("\nsample:", repr(sample(model, data, args.sample, gen)))
    return 0


@torch.no_grad()
def sample(model: torch.nn.Module, data: torch.Tensor, n: int, gen: torch.Generator) -> str:
    """Greedy-ish continuation of a prompt from the corpus, with the trained eager weights."""
    model.eval()
    block = model.config.block_size
    idx = data[:32].clone()[None]
    for _ in range(n):
        logits = model(idx[:, -block:])[:, -1]
        probs = torch.softmax(logits / 0.8, dim=-1)
        idx = torch.cat([idx, torch.multinomial(probs, 1, generator=gen)], dim=1)
    model.train()
    return bytes(idx[0, 32:].tolist()).decode("utf-8", errors="replace")
