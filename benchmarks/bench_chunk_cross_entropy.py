"""The vocabulary projection + cross-entropy in chunks (passes/memory/chunk_cross_entropy.py)
against the unfused program: peak RSS growth of a training step and step time, side by side.

    python benchmarks/bench_chunk_cross_entropy.py                  # GPT 2 x 256 wide, vocab 50257, seq 256
    python benchmarks/bench_chunk_cross_entropy.py --batches 2      # one operating point, quicker

Each (batch, variant) runs in its own process (a clean peak): the model is built, the kernel's
peak counter reset (/proc/self/clear_refs), the engine compiled and --steps steps run; growth =
VmHWM - VmRSS at the reset. Variants: "chunked" (the default rule; the pass runs where the fp32
logits take >= 64 MiB) and "unfused" (Config(disable_passes=("chunk_cross_entropy",))). Rounds
alternate the order; step time is the median over rounds and steps; losses are printed too.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

CHILD = r"""
import json, sys, time, torch
import fxspeed
from fxspeed.models import GPT, GPTConfig
variant, batch, seq, vocab, layers, width, steps = sys.argv[1], *map(int, sys.argv[2:8])
torch.set_num_threads(2)
torch.manual_seed(0)
model = GPT(GPTConfig(vocab_size=vocab, block_size=seq, n_layer=layers, n_head=max(1, width // 64), n_embd=width))
x = torch.randint(0, vocab, (batch, seq)); y = torch.roll(x, 1, 1)
def kb(field):
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1])
open("/proc/self/clear_refs", "w").write("5")
base = kb("VmRSS")
cfg = fxspeed.Config(lr=1e-4, disable_passes=("chunk_cross_entropy",) if variant == "unfused" else ())
engine = fxspeed.compile(model, 1, cfg, example_inputs=(x, y))
times, losses = [], []
for _ in range(steps):
    t = time.perf_counter(); losses.append(engine.train_step(x, y)); times.append(time.perf_counter() - t)
chunked = any(p["name"] == "chunk_cross_entropy" and p["modified"] for p in engine.plan.passes)
print(json.dumps({"growth_MB": (kb("VmHWM") - base) / 1024, "times": times[1:], "losses": losses, "chunked": chunked}))
"""


def run(variant: str, batch: int, a: argparse.Namespace) -> dict:
    cmd = [sys.executable, "-c", CHILD, variant, str(batch), str(a.seq), str(a.vocab), str(a.layers), str(a.width),
           str(a.steps)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    if proc.returncode:
        raise RuntimeError(proc.stderr[-4000:])
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", default="4,8")
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--vocab", type=int, default=50257)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    results = {}
    for batch in map(int, a.batches.split(",")):
        rows: dict[str, list[dict]] = {"chunked": [], "unfused": []}
        for r in range(a.rounds):
            for variant in (("chunked", "unfused") if r % 2 == 0 else ("unfused", "chunked")):
                t = time.perf_counter()
                rows[variant].append(run(variant, batch, a))
                print(f"batch {batch} round {r} {variant}: {time.perf_counter() - t:.0f} s", flush=True)
        res = {v: {"growth_MB": max(x["growth_MB"] for x in rs), "step_s": statistics.median(t for x in rs for t in x["times"]),
                   "losses": rs[0]["losses"], "chunked": rs[0]["chunked"]} for v, rs in rows.items()}
        logits_MB = batch * a.seq * a.vocab * 4 / 2**20
        print(f"batch {batch}x{a.seq}, vocab {a.vocab} ({logits_MB:.0f} MiB of fp32 logits): peak growth chunked "
              f"{res['chunked']['growth_MB']:.0f} MB vs unfused {res['unfused']['growth_MB']:.0f} MB; step time "
              f"{res['chunked']['step_s'] / res['unfused']['step_s']:.3f}x; losses {res['chunked']['losses']} vs "
              f"{res['unfused']['losses']}", flush=True)
        results[batch] = res
    if a.out:
        with open(a.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
