"""Activation offload on CPU (Config(offload="activations", nvme_path=...): forward's saved
activations in a swap file between forward and backward) against the same run without it: peak
RSS growth of a training step and step time, side by side.

    python benchmarks/bench_activation_offload.py                     # GPT 6 x 768, seq 256, batches 4 and 8
    python benchmarks/bench_activation_offload.py --batches 4 --rounds 1   # quicker

Each (batch, variant) runs in its own process (a clean peak; benchmarks/one_process_pairs.py):
the model is built, the kernel's peak counter reset (/proc/self/clear_refs), the engine compiled and --steps steps run; growth =
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
import tempfile

from one_process_pairs import add_model_args, child_script, compare_batches, run_child, write_json

CHILD = child_script(
    'cfg = fxspeed.Config(lr=1e-4, **(dict(offload="activations", nvme_path=arg) if variant == "offload" else {}))',
    'report["offloaded_MB"] = sum(b for k, b in engine.plan.offloaded.items() if k.startswith("activations")) / 2**20\n'
    'report["planned_MB"] = engine.plan.memory(0)["total"] / 2**20')
# RSS follows live tensors (large frees go back to the OS), as in the other benchmarks
ENV = {"MALLOC_MMAP_THRESHOLD_": "65536"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(ap, vocab=8192, layers=6, width=768, steps=4)
    ap.add_argument("--swap", default=None, help="directory for the swap files (default: a temporary one)")
    a = ap.parse_args()

    def describe(batch: int, res: dict) -> str:
        off, plain = res["offload"], res["plain"]
        saved = plain["growth_MB"] - off["growth_MB"]
        res["step_ratio"] = off["step_s"] / plain["step_s"]
        res["rss_saved_MB"] = saved
        res["losses_equal"] = off["losses"] == plain["losses"]
        return (f"batch {batch}x{a.seq} GPT {a.layers}x{a.width}: peak growth offload {off['growth_MB']:.0f} MB "
                f"(plan {off['planned_MB']:.0f}) vs plain {plain['growth_MB']:.0f} MB (plan {plain['planned_MB']:.0f}): "
                f"saved {saved:.0f} MB of {off['offloaded_MB']:.0f} MB offloaded; step {off['step_s']:.3f} s vs "
                f"{plain['step_s']:.3f} s ({res['step_ratio']:.3f}x); losses equal: {res['losses_equal']}")

    with tempfile.TemporaryDirectory(prefix="fxspeed-bench-act-") as tmp:
        swap = a.swap or tmp
        results = compare_batches(a, ("offload", "plain"),
                                  lambda v, batch: run_child(CHILD, v, swap, batch, a, env=ENV), describe)
    write_json(a.out, {"args": vars(a), "results": results})


if __name__ == "__main__":
    main()
