"""What each fusion pass changes in the plan: HF GPT-2 and HF Llama (random init, from configs)
planned for one H200 with the fusion passes on one by one (norms -> + rotary -> + activations ->
+ residual add + norm), at two batch sizes and two model sizes. Per row: planned peak and
activation bytes, bytes read + written by all nodes (the annotate analysis: what the planner's
memory-bound time is made of), kernel launches (call_function nodes that run something) and the
predicted step time.

    python benchmarks/bench_fusion_plan.py                       # small and larger model, batch 2 and 8, seq 256
    python benchmarks/bench_fusion_plan.py --precision bf16 --out fusion_plan.json
    python benchmarks/bench_fusion_plan.py --tensor 2           # tp rank 0's program of 2 tensor ranks

Planning only: nothing runs. The plan of a CPU model traces the CPU program, where the fusion
passes run only with FXSPEED_FUSE_ON_CPU=1 (set here); on a GPU the same passes run by default.
"""

from __future__ import annotations

import argparse
import json
import operator
import os
import time

os.environ.setdefault("FXSPEED_FUSE_ON_CPU", "1")

import torch  # noqa: E402

import fxspeed  # noqa: E402
from fxspeed.ir import META_KEY  # noqa: E402

# each step turns on one more fusion pass; "unfused" disables all of them
STEPS = {"unfused": ("fuse_kernels", "fuse_rotary", "fuse_activations", "fuse_residual_norms"),
         "norms": ("fuse_rotary", "fuse_activations", "fuse_residual_norms"),
         "+rotary": ("fuse_activations", "fuse_residual_norms"),
         "+activations": ("fuse_residual_norms",),
         "+residual": ()}
SIZES = {"small": dict(layers=2, width=256), "larger": dict(layers=4, width=768)}


def build(kind: str, layers: int, width: int, seq: int, dropout: bool = True) -> torch.nn.Module:
    """`dropout=False`: GPT-2 without dropout (tensor parallelism refuses random ops)."""
    import transformers

    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    if kind == "gpt2":
        off = {} if dropout else dict(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
        return transformers.GPT2LMHeadModel(transformers.GPT2Config(
            n_layer=layers, n_embd=width, n_head=width // 64, n_positions=seq, vocab_size=8192,
            attn_implementation="sdpa", **off))
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        num_hidden_layers=layers, hidden_size=width, intermediate_size=width * 8 // 3, num_attention_heads=width // 64,
        num_key_value_heads=max(1, width // 128), vocab_size=8192, max_position_embeddings=seq,
        attn_implementation="sdpa"))


def graph_bytes_and_launches(model: torch.nn.Module, batch: dict, config: fxspeed.Config) -> tuple[int, int]:
    """Of the program tp rank 0 runs (the whole program without tensor parallelism)."""
    from fxspeed.compiler.options import PassOptions
    from fxspeed.compiler.pipelines import compile_step
    from fxspeed.planner.placement import PlacementAnalysis

    T = config.tensor
    opts = PassOptions.single_device(config, tp_size=T, tp_rank=0, tp_group_name="tp")
    analyses = [PlacementAnalysis(fxspeed.devices("H200", T)).graph_pass] if T > 1 else []
    gm = compile_step(model, (), batch, config=config, loss_fn=None, options=opts, analyses=analyses).captured.gm
    infos = [n.meta[META_KEY] for n in gm.graph.nodes if n.op == "call_function" and n.target is not operator.getitem
             and META_KEY in n.meta]
    launches = sum(1 for n in gm.graph.nodes if n.op == "call_function" and n.target is not operator.getitem)
    return sum(i.bytes_read + i.bytes_written for i in infos), launches


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["gpt2", "llama"])
    ap.add_argument("--sizes", nargs="+", default=list(SIZES))
    ap.add_argument("--batches", nargs="+", type=int, default=[2, 8])
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--precision", default="fp32")
    ap.add_argument("--tensor", type=int, default=1, help="tensor-parallel ranks (H200s); rank 0's program")
    ap.add_argument("--out", default="")
    a = ap.parse_args()
    rows = []
    for kind in a.models:
        for size in a.sizes:
            model = build(kind, seq=a.seq, dropout=a.tensor == 1, **SIZES[size])
            for batch_size in a.batches:
                ids = torch.randint(0, 8192, (batch_size, a.seq))
                batch = {"input_ids": ids, "labels": ids}
                base = None
                for step, disabled in STEPS.items():
                    t0 = time.perf_counter()
                    config = fxspeed.Config(precision=a.precision, tensor=a.tensor, disable_passes=disabled)
                    p = fxspeed.plan(model, fxspeed.devices("H200", a.tensor), config, example_inputs=batch)
                    moved, launches = graph_bytes_and_launches(model, batch, config)
                    row = dict(model=kind, size=size, batch=batch_size, step=step, peak_MB=p.peak_memory(0) / 2**20,
                               activations_MB=p.memory(0)["activations"] / 2**20, bytes_MB=moved / 2**20,
                               launches=launches, time_ms=p.time["total"] * 1e3)
                    base = base or row
                    rows.append(row)
                    print(f"{kind:6s} {size:6s} b={batch_size:<2d} {step:13s} peak {row['peak_MB']:8.1f} MB "
                          f"({row['peak_MB'] / base['peak_MB']:.3f}x)  activations {row['activations_MB']:8.1f} MB "
                          f"({row['activations_MB'] / base['activations_MB']:.3f}x)  bytes {row['bytes_MB']:9.1f} MB "
                          f"({row['bytes_MB'] / base['bytes_MB']:.3f}x)  launches {launches:5d}  predicted "
                          f"{row['time_ms']:.2f} ms ({row['time_ms'] / base['time_ms']:.3f}x)  [{time.perf_counter() - t0:.0f} s]",
                          flush=True)
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"precision": a.precision, "seq": a.seq, "tensor": a.tensor, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
