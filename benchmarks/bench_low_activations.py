"""bf16 training with the activations after each matmul kept in bf16 (passes/graph/keep_activations_low.py,
Config.low_activations=True) against fp32 activations (insert_casts alone, low_activations=False):
peak RSS growth of a training run and step time, side by side.

    python benchmarks/bench_low_activations.py                    # GPT 7 x 512, vocab 256, seq 256, batches 4 and 16
    python benchmarks/bench_low_activations.py --batches 16 --rounds 1

Each (batch, variant) runs in its own process (benchmarks/one_process_pairs.py): the model is
built, the kernel's peak counter reset, the engine compiled and --steps AdamW steps run;
growth = VmHWM - VmRSS at the reset (compile included). Rounds alternate the order; step time is
the median over rounds and steps; the losses of both variants are printed (they differ in the
last digits: backward's elementwise ops round to bf16 as under autocast). The default
(low_activations=True) is "low" on every device.
"""

from __future__ import annotations

import argparse

from one_process_pairs import add_model_args, child_script, compare_batches, run_child, write_json

CHILD = child_script('cfg = fxspeed.Config(precision="bf16", optimizer="adamw", lr=1e-4, low_activations=variant == "low")',
                     'report["low_nodes"] = sum(1 for n in engine.graph().graph.nodes if n.op == "call_function" '
                     'and getattr(n.meta.get("val"), "dtype", None) == torch.bfloat16)')


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(ap, vocab=256, layers=7, width=512, steps=4)
    ap.set_defaults(batches="4,16")
    a = ap.parse_args()

    def describe(batch: int, res: dict) -> str:
        lo, hi = res["low"], res["fp32"]
        return (f"batch {batch}x{a.seq}: peak growth low {lo['growth_MB']:.0f} MB vs fp32 {hi['growth_MB']:.0f} MB "
                f"({lo['growth_MB'] / hi['growth_MB']:.3f}x); step time {lo['step_s'] / hi['step_s']:.3f}x "
                f"({lo['step_s']:.3f} vs {hi['step_s']:.3f} s); bf16 nodes {lo['low_nodes']} vs {hi['low_nodes']}; "
                f"losses {[round(x, 5) for x in lo['losses']]} vs {[round(x, 5) for x in hi['losses']]}")

    write_json(a.out, compare_batches(a, ("low", "fp32"), lambda v, batch: run_child(CHILD, v, "", batch, a),
                                      describe))


if __name__ == "__main__":
    main()
