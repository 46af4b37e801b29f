"""Activation offload on CPU (Config(offload="activations", nvme_path=...): forward's saved
activations in a swap file between forward and backward) against the same run without it: peak
RSS growth of a training step and step time, side by side.

    python benchmarks/bench_activation_offload.py                     # GPT 6 x 768, seq 256, batches 4 and 8
    python benchmarks/bench_activation_offload.py --batches 4 --rounds 1   # quicker

Each (batch, variant) runs in its own process (a clean peak): the model is built, the kernel's
peak counter reset (/proc/self/clear_refs), the engine compiled and --steps steps run; growth =
VmHWM - VmRSS at the reset (parameters, gradients, Adam and activations all count), with
MALLOC_MMAP_THRESHOLD_=65536 as in the other benchmarks (large frees go back to the OS, so RSS
follows live tensors; without it glibc keeps the heap's high-water mark of any earlier phase). Rounds
alternate the order; step time is the median over rounds and timed steps (the first is
dropped); losses are printed to show the runs compute the same thing. The plan's offloaded
bytes are reported beside the RSS saving. The swap directory is --swap (default: a temporary
directory on the disk /tmp is on).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

CHILD = r"""
import json, sys, time, torch
import fxspeed
from fxspeed.models import GPT, GPTConfig
variant, swap = sys.argv[1], sys.argv[2]
batch, seq, vocab, layers, width, steps, threads = map(int, sys.argv[3:10])
torch.set_num_threads(threads)
torch.manual_seed(0)
model = GPT(GPTConfig(vocab_size=vocab, block_size=seq, n_layer=layers, n_head=max(1, width // 64), n_embd=width))
x = torch.randint(0, vocab, (batch, seq)); y = torch.roll(x, 1, 1)
def kb(field):
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1])
open("/proc/self/clear_refs", "w").write("5")
base = kb("VmRSS")
extra = dict(offload="activations", nvme_path=swap) if variant == "offload" else {}
engine = fxspeed.compile(model, 1, fxspeed.Config(lr=1e-4, **extra), example_inputs=(x, y))
times, losses = [], []
for _ in range(steps):
    t = time.perf_counter(); losses.append(engine.train_step(x, y)); times.append(time.perf_counter() - t)
moved = sum(b for k, b in engine.plan.offloaded.items() if k.startswith("activations"))
print(json.dumps({"growth_MB": (kb("VmHWM") - base) / 1024, "times": times[1:], "losses": losses,
                  "offloaded_MB": moved / 2**20, "planned_MB": engine.plan.memory(0)["total"] / 2**20}))
"""


def run(variant: str, batch: int, a: argparse.Namespace, swap: str) -> dict:
    cmd = [sys.executable, "-c", CHILD, variant, swap, str(batch), str(a.seq), str(a.vocab), str(a.layers),
           str(a.width), str(a.steps), str(a.threads)]
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=3600, env=env)
    if proc.returncode:
        raise RuntimeError(proc.stderr[-4000:])
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", default="4,8")
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--width", type=int, default=768)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--swap", default=None, help="directory for the swap files (default: a temporary one)")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    results = {}
    with tempfile.TemporaryDirectory(prefix="fxspeed-bench-act-") as tmp:
        swap = a.swap or tmp
        for batch in map(int, a.batches.split(",")):
            rows: dict[str, list[dict]] = {"offload": [], "plain": []}
            for r in range(a.rounds):
                for variant in (("offload", "plain") if r % 2 == 0 else ("plain", "offload")):
                    t = time.perf_counter()
                    rows[variant].append(run(variant, batch, a, swap))
                    print(f"batch {batch} round {r} {variant}: {time.perf_counter() - t:.0f} s", flush=True)
            res = {v: {"growth_MB": max(x["growth_MB"] for x in rs),
                       "step_s": statistics.median(t for x in rs for t in x["times"]),
                       "losses": rs[0]["losses"], "offloaded_MB": rs[0]["offloaded_MB"],
                       "planned_MB": rs[0]["planned_MB"]} for v, rs in rows.items()}
            off, plain = res["offload"], res["plain"]
            saved = plain["growth_MB"] - off["growth_MB"]
            res["step_ratio"] = off["step_s"] / plain["step_s"]
            res["rss_saved_MB"] = saved
            res["losses_equal"] = off["losses"] == plain["losses"]
            print(f"batch {batch}x{a.seq} GPT {a.layers}x{a.width}: peak growth offload {off['growth_MB']:.0f} MB "
                  f"(plan {off['planned_MB']:.0f}) vs plain {plain['growth_MB']:.0f} MB (plan {plain['planned_MB']:.0f}): "
                  f"saved {saved:.0f} MB of {off['offloaded_MB']:.0f} MB offloaded; step {off['step_s']:.3f} s vs "
                  f"{plain['step_s']:.3f} s ({res['step_ratio']:.3f}x); losses equal: {res['losses_equal']}", flush=True)
            results[batch] = res
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"args": vars(a), "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
