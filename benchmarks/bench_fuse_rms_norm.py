"""Hugging Face Llama trained with its written-out RMSNorms fused (fuse_kernels with the matcher of
passes/graph/rms_norm_pattern.py) against the same program without fuse_kernels: the planner's
predicted peak and activation bytes, the measured peak RSS growth, step time and losses.

    python benchmarks/bench_fuse_rms_norm.py                  # Llama 4 x 512, vocab 256, seq 256, batches 4 and 16
    python benchmarks/bench_fuse_rms_norm.py --batches 4 --rounds 1

On a CPU the pass runs only with FXSPEED_FUSE_ON_CPU=1 (set here for both variants; "unfused"
disables fuse_kernels by name), and the fused ops run their torch fallback (aten._fused_rms_norm,
a composite on CPU, and the backward formula in runtime/kernels/norms.py), not Triton: step
time says what the fallback costs, not what the kernels would gain on a GPU. Each (batch,
variant) runs in its own process (benchmarks/one_process_pairs.py: growth = VmHWM - VmRSS
after writing 5 to /proc/self/clear_refs, compile included; rounds alternate the order).
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
CHILD = child_script(
    'cfg = fxspeed.Config(optimizer="adamw", lr=1e-4, disable_passes=("fuse_kernels",) if variant == "unfused" else ())',
    'nodes = [str(n.target) for n in engine.graph().graph.nodes if n.op == "call_function"]\n'
    'report.update(plan_peak_MB=engine.plan.peak_memory(0) / 2**20, '
    'plan_activations_MB=engine.plan.memory(0)["activations"] / 2**20, '
    'fused_pairs=nodes.count("fxspeed.rms_norm_bwd.default"), rsqrt=nodes.count("aten.rsqrt.default"))',
    model=LLAMA, inputs='{"input_ids": x, "labels": x}', call="input_ids=x, labels=x")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(ap, vocab=256, layers=4, width=512, steps=4)
    ap.set_defaults(batches="4,16")
    a = ap.parse_args()

    def describe(batch: int, res: dict) -> str:
        f, u = res["fused"], res["unfused"]
        return (f"batch {batch}x{a.seq}: planned peak fused {f['plan_peak_MB']:.1f} MB vs unfused "
                f"{u['plan_peak_MB']:.1f} MB (activations {f['plan_activations_MB']:.1f} vs "
                f"{u['plan_activations_MB']:.1f}); measured peak growth {f['growth_MB']:.0f} MB vs {u['growth_MB']:.0f} MB "
                f"({f['growth_MB'] / u['growth_MB']:.3f}x); step time {f['step_s'] / u['step_s']:.3f}x "
                f"({f['step_s']:.3f} vs {u['step_s']:.3f} s); fused norm pairs {f['fused_pairs']} (rsqrt left "
                f"{f['rsqrt']}) vs {u['fused_pairs']} ({u['rsqrt']}); losses {[round(v, 5) for v in f['losses']]} vs "
                f"{[round(v, 5) for v in u['losses']]}")

    env = {"FXSPEED_FUSE_ON_CPU": "1"}
    write_json(a.out, compare_batches(a, ("fused", "unfused"),
                                      lambda v, batch: run_child(CHILD, v, "", batch, a, env), describe))


if __name__ == "__main__":
    main()
