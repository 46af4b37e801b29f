"""Training with elementwise values recomputed in backward (passes/memory/recompute_pointwise.py)
against the same program keeping them from forward (the pass disabled by name): peak RSS growth
of a training run, the planner's activation bytes, step time and losses, side by side.

    python benchmarks/bench_recompute_pointwise.py                       # fxspeed GPT 7 x 512, batches 4 and 16
    python benchmarks/bench_recompute_pointwise.py --model llama --batches 4,16

Each (batch, variant) runs in its own process (benchmarks/one_process_pairs.py): growth = VmHWM -
VmRSS at the reset (compile included), rounds alternating the order. The losses must be equal:
recomputing a deterministic elementwise op gives the same bits.
"""

from __future__ import annotations

import argparse

from one_process_pairs import add_model_args, child_script, compare_batches, run_child, write_json

LLAMA = r"""
from transformers import LlamaConfig, LlamaForCausalLM
model = LlamaForCausalLM(LlamaConfig(vocab_size=vocab, hidden_size=width, intermediate_size=width * 8 // 3,
                                     num_hidden_layers=layers, num_attention_heads=max(1, width // 64),
                                     num_key_value_heads=max(1, width // 128), max_position_embeddings=seq))
x = torch.randint(0, vocab, (batch, seq))
"""
CONFIG = ('cfg = fxspeed.Config(precision=arg, optimizer="adamw", lr=1e-4, '
          'disable_passes=("recompute_pointwise",) if variant == "kept" else ())')
REPORT = ('report.update(plan_activations_MB=engine.plan.memory(0)["activations"] / 2**20, '
          'recomputed=sum(1 for n in engine.graph().graph.nodes if "recomputed_pointwise" in n.meta))')


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(ap, vocab=256, layers=7, width=512, steps=4)
    ap.add_argument("--model", choices=("gpt", "llama"), default="gpt")
    ap.add_argument("--precision", default="fp32")
    ap.set_defaults(batches="4,16")
    a = ap.parse_args()
    child = (child_script(CONFIG, REPORT, model=LLAMA, inputs='{"input_ids": x, "labels": x}',
                          call="input_ids=x, labels=x") if a.model == "llama" else child_script(CONFIG, REPORT))

    def describe(batch: int, res: dict) -> str:
        r, k = res["recomputed"], res["kept"]
        return (f"{a.model} {a.precision} batch {batch}x{a.seq}: peak growth recomputed {r['growth_MB']:.0f} MB vs kept "
                f"{k['growth_MB']:.0f} MB ({r['growth_MB'] / k['growth_MB']:.3f}x); planned activations "
                f"{r['plan_activations_MB']:.1f} vs {k['plan_activations_MB']:.1f} MB; step time "
                f"{r['step_s'] / k['step_s']:.3f}x ({r['step_s']:.3f} vs {k['step_s']:.3f} s); nodes recomputed "
                f"{r['recomputed']}; losses equal: {r['losses'] == k['losses']}")

    write_json(a.out, compare_batches(a, ("recomputed", "kept"),
                                      lambda v, batch: run_child(child, v, a.precision, batch, a), describe))


if __name__ == "__main__":
    main()
