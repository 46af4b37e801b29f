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


def _relaunch(args: Any) -> int:
    """`--devices N` from a plain shell: start N copies of this same demo via `fxspeed run -n N`."""
    from fxspeed.tools.launcher import launch

    argv = list(getattr(args, "argv", None) or sys.argv[1:])
    if "demo" not in argv:
        argv = ["demo", *argv]
    return launch(args.devices, "fxspeed", argv, module=True)


def _in_launched_group(devices: int) -> bool:
    return "LOCAL_RANK" in os.environ and os.environ.get("WORLD_SIZE") == str(devices)


def run(args: Any) -> int:
    """Run the demo from parsed CLI arguments; returns the process exit code.

    With --devices N > 1 outside a launched group the demo re-launches itself on N local
    processes (`fxspeed run -n N -m fxspeed demo ...`); each rank then draws the same global
    batch, trains on its slice (fxspeed.data.local_batch), and only rank 0 prints.
    """
    devices = getattr(args, "devices", 1)
    zero = getattr(args, "zero", 0)
    if devices < 1:
        print("fxspeed demo: --devices must be >= 1", file=sys.stderr)
        return 2
    if args.steps < 1 or args.batch_size < 1 or args.seq_len < 2:
        print("fxspeed demo: --steps and --batch-size must be >= 1 and --seq-len >= 2", file=sys.stderr)
        return 2
    pipeline = getattr(args, "pipeline", 1)
    if pipeline > 1 and devices % pipeline:
        print(f"fxspeed demo: --pipeline {pipeline} needs --devices a multiple of it (pipeline x data-parallel "
              f"replicas)", file=sys.stderr)
        return 2
    replicas = devices // pipeline
    if args.batch_size % replicas:
        by = f"--devices {devices}" if pipeline == 1 else \
            f"the {replicas} data-parallel replicas (--devices {devices} / --pipeline {pipeline})"
        print(f"fxspeed demo: --batch-size {args.batch_size} is the global batch and must be divisible by {by} "
              f"(each replica trains on batch_size / {replicas} sequences)", file=sys.stderr)
        return 2
    if devices > 1 and not _in_launched_group(devices):
        return _relaunch(args)
    try:
        return _train(args, devices, zero)
    finally:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()


def _train(args: Any, devices: int, zero: int) -> int:
    from tqdm import tqdm

    import fxspeed
    from fxspeed.data import local_batch
    from fxspeed.models.gpt import GPT, GPTConfig

    if devices > 1:
        os.environ.setdefault("FXSPEED_BACKEND", "gloo")  # the demo is a CPU demo
    rank = int(os.environ.get("RANK", 0)) if devices > 1 else 0
    lead = rank == 0

    def say(*a: Any, **k: Any) -> None:
        if lead:
            print(*a, **k)

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
    say(f"fxspeed demo: byte-level GPT '{args.model}' ({n_params / 1e6:.2f}M params) on {data.numel() / 1e6:.2f} MB "
        f"of Python standard library source ({Path(os.__file__).resolve().parent})")
    pp = getattr(args, "pipeline", 1)
    where = ""
    if devices > 1 and pp == 1:
        where = f"{devices} processes, ZeRO-{zero}, {args.batch_size // devices} sequences per rank, "
    elif devices > 1:
        where = (f"{devices} processes ({pp}-stage pipeline x {devices // pp} replicas), ZeRO-{zero}, "
                 f"{args.batch_size // (devices // pp)} sequences per replica, ")
    say(f"batch {args.batch_size} x {args.seq_len} tokens, {args.steps} steps, AdamW lr {args.lr}, "
        f"{where}{torch.get_num_threads()} CPU threads" + (" per process" if devices > 1 else ""))

    # Every rank draws the same global batch from the same seeded generator and keeps its
    # replica's slice; the ranks of one pipeline share a slice (the runtime splits it into
    # micro-batches).
    pipeline = getattr(args, "pipeline", 1)
    replicas = devices // pipeline
    part = (lambda b: local_batch(b, rank // pipeline, replicas)) if replicas > 1 else (lambda b: b)
    x, y = part(get_batch(data, args.batch_size, args.seq_len, gen))
    tc = time.perf_counter()
    config = fxspeed.Config(optimizer="adamw", lr=args.lr, grad_clip=1.0, zero=zero,
                            precision=getattr(args, "precision", "fp32"), pipeline=pipeline,
                            microbatches=2 * pipeline if pipeline > 1 else 1)
    engine = fxspeed.compile(model, devices, config, example_inputs=(x, y))
    say(f"compiled in {time.perf_counter() - tc:.1f} s\n")
    say(engine.plan.summary())
    say(flush=True)

    tokens = args.batch_size * args.seq_len
    losses: list[float] = []
    bar = tqdm(range(args.steps), desc="train", unit="step", dynamic_ncols=False, ncols=90, mininterval=0.5,
               disable=not lead)
    tt = time.perf_counter()
    for step in bar:
        if step:
            x, y = part(get_batch(data, args.batch_size, args.seq_len, gen))
        losses.append(engine.train_step(x, y))  # the mean over ranks: the global batch's loss
        elapsed = time.perf_counter() - tt
        bar.set_postfix(loss=f"{losses[-1]:.3f}", tok_s=f"{tokens * (step + 1) / elapsed:,.0f}", refresh=False)
    bar.close()
    train_s = time.perf_counter() - tt

    k = max(1, min(10, len(losses) // 4))
    first, last = sum(losses[:k]) / k, sum(losses[-k:]) / k
    say(f"\nloss: first {k} steps {first:.3f} -> last {k} steps {last:.3f} (mean over each; step 1 {losses[0]:.3f}, "
        f"uniform over 256 bytes = {torch.log(torch.tensor(256.0)).item():.3f})")
    say(f"trained {args.steps} steps in {train_s:.1f} s ({tokens * args.steps / train_s:,.0f} tokens/s"
        + (" over all ranks" if devices > 1 else "") + f"); total {time.perf_counter() - t0:.1f} s")
    if args.sample > 0:
        # The engine may keep the weights elsewhere than the module (a pipeline rank its stages', a
        # ZeRO-3 rank shards, ZeRO-1/2 bf16 fp32 masters): state_dict() gathers the full model on
        # every rank (a collective), whatever the config.
        state = engine.state_dict()
        if lead:
            model = GPT(cfg)
            model.load_state_dict(state)
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
