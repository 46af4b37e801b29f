"""The vocabulary projection + cross-entropy in chunks (passes/memory/chunk_cross_entropy.py)
against the unfused program: peak RSS growth of a training step and step time, side by side.

    python benchmarks/bench_chunk_cross_entropy.py                  # GPT 2 x 256 wide, vocab 50257, seq 256
    python benchmarks/bench_chunk_cross_entropy.py --batches 2      # one operating point, quicker

Each (batch, variant) runs in its own process (a clean peak; benchmarks/one_process_pairs.py):
the model is built, the kernel's peak counter reset (/proc/self/clear_refs), the engine compiled
and --steps steps run; growth = VmHWM - VmRSS at the reset. Variants: "chunked" (the default rule; the pass runs where the fp32
logits take >= 64 MiB) and "unfused" (Config(disable_passes=("chunk_cross_entropy",))). Rounds
alternate the order; step time is the median over rounds and steps; losses are printed too.
"""

from __future__ import annotations

import argparse

from one_process_pairs import add_model_args, child_script, compare_batches, run_child, write_json

CHILD = child_script(
    'cfg = fxspeed.Config(lr=1e-4, disable_passes=("chunk_cross_entropy",) if variant == "unfused" else ())',
    'report["chunked"] = any(p["name"] == "chunk_cross_entropy" and p["modified"] for p in engine.plan.passes)')


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(ap, vocab=50257, layers=2, width=256, steps=3)
    a = ap.parse_args()

    def describe(batch: int, res: dict) -> str:
        logits_MB = batch * a.seq * a.vocab * 4 / 2**20
        return (f"batch {batch}x{a.seq}, vocab {a.vocab} ({logits_MB:.0f} MiB of fp32 logits): peak growth chunked "
                f"{res['chunked']['growth_MB']:.0f} MB vs unfused {res['unfused']['growth_MB']:.0f} MB; step time "
                f"{res['chunked']['step_s'] / res['unfused']['step_s']:.3f}x; losses {res['chunked']['losses']} vs "
                f"{res['unfused']['losses']}")

    write_json(a.out, compare_batches(a, ("chunked", "unfused"), lambda v, batch: run_child(CHILD, v, "", batch, a),
                                      describe))


if __name__ == "__main__":
    main()
