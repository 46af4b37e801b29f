"""What the one-process A/B benchmarks share (bench_chunk_cross_entropy.py,
bench_activation_offload.py, bench_low_activations.py, bench_fuse_rms_norm.py): each (batch,
variant) runs in its own process, which builds a model (fxspeed's GPT unless told otherwise),
resets the kernel's peak counter (/proc/self/clear_refs), compiles and trains --steps steps and
prints one JSON line (peak RSS growth = VmHWM - VmRSS at the reset, step times without the
first, losses, plus what the benchmark's own code adds); rounds alternate the variants' order so
drift hits both; a variant's figures are the worst growth and the median step over its rounds.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any

_PRELUDE = r"""
import json, sys, time, torch
import fxspeed
variant, arg = sys.argv[1], sys.argv[2]
batch, seq, vocab, layers, width, steps, threads = map(int, sys.argv[3:10])
torch.set_num_threads(threads)
torch.manual_seed(0)
"""
# The default model: fxspeed's GPT on next-token batches, trained as engine.train_step(x, y).
GPT_MODEL = r"""
from fxspeed.models import GPT, GPTConfig
model = GPT(GPTConfig(vocab_size=vocab, block_size=seq, n_layer=layers, n_head=max(1, width // 64), n_embd=width))
x = torch.randint(0, vocab, (batch, seq)); y = torch.roll(x, 1, 1)
"""
_RESET = r"""
def kb(field):
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1])
open("/proc/self/clear_refs", "w").write("5")
base = kb("VmRSS")
"""
_STEPS = r"""
engine = fxspeed.compile(model, 1, cfg, example_inputs=INPUTS)
times, losses = [], []
for _ in range(steps):
    t = time.perf_counter(); losses.append(engine.train_step(CALL)); times.append(time.perf_counter() - t)
report = {"growth_MB": (kb("VmHWM") - base) / 1024, "times": times[1:], "losses": losses}
"""


def child_script(config: str, report: str = "", model: str = GPT_MODEL, inputs: str = "(x, y)",
                 call: str = "x, y") -> str:
    """The child's code: `model` builds `model` and its batch (default GPT_MODEL: x, y) from the
    argv sizes; `config` sets `cfg` (a fxspeed.Config) from `variant` and `arg`; the engine is
    compiled with example_inputs=`inputs` and trained with train_step(`call`); `report` adds keys
    to the dict `report` after training (`engine` is there)."""
    steps = _STEPS.replace("INPUTS", inputs).replace("CALL", call)
    return _PRELUDE + model + _RESET + config + "\n" + steps + report + "\nprint(json.dumps(report))\n"


def add_model_args(ap: argparse.ArgumentParser, *, vocab: int, layers: int, width: int, steps: int) -> None:
    ap.add_argument("--batches", default="4,8")
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--vocab", type=int, default=vocab)
    ap.add_argument("--layers", type=int, default=layers)
    ap.add_argument("--width", type=int, default=width)
    ap.add_argument("--steps", type=int, default=steps)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=None)


def run_child(script: str, variant: str, arg: str, batch: int, a: argparse.Namespace,
              env: dict[str, str] | None = None) -> dict[str, Any]:
    cmd = [sys.executable, "-c", script, variant, arg, str(batch), str(a.seq), str(a.vocab), str(a.layers),
           str(a.width), str(a.steps), str(a.threads)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=3600, env={**os.environ, **(env or {})})
    if proc.returncode:
        raise RuntimeError(proc.stderr[-4000:])
    return json.loads(proc.stdout.strip().splitlines()[-1])


def alternate(variants: tuple[str, str], batch: int, rounds: int, run: Any) -> dict[str, dict[str, Any]]:
    """Each variant `rounds` times, the order swapped every round; per variant: the worst growth,
    the median step, and the first run's other keys."""
    rows: dict[str, list[dict]] = {v: [] for v in variants}
    for r in range(rounds):
        for variant in (variants if r % 2 == 0 else variants[::-1]):
            t = time.perf_counter()
            rows[variant].append(run(variant))
            print(f"batch {batch} round {r} {variant}: {time.perf_counter() - t:.0f} s", flush=True)
    return {v: {**rs[0], "growth_MB": max(x["growth_MB"] for x in rs),
                "step_s": statistics.median(t for x in rs for t in x["times"])} for v, rs in rows.items()}


def compare_batches(a: argparse.Namespace, variants: tuple[str, str], run: Any, describe: Any) -> dict[int, dict]:
    """For each batch of --batches: `alternate` the variants (`run(variant, batch)` gives one
    child's report), print `describe(batch, res)` (which may add keys to `res`) and keep `res`."""
    results = {}
    for batch in map(int, a.batches.split(",")):
        res = alternate(variants, batch, a.rounds, lambda v: run(v, batch))  # noqa: B023 - called before the next batch
        print(describe(batch, res), flush=True)
        results[batch] = res
    return results


def write_json(path: str | None, obj: Any) -> None:
    """--out: `obj` as indented JSON (nothing when no path was given)."""
    if path:
        with open(path, "w") as f:
            json.dump(obj, f, indent=1)
