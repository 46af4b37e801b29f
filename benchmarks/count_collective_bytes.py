"""Bytes each rank sends per training step, counted at the collectives: DDP and fxspeed ZeRO-0..3.

    python benchmarks/count_collective_bytes.py --preset small --world 2

fxspeed: the compiled step's collective nodes (for `--world` ranks, rank 0, compiled in this one
process: the graph is what each rank runs) plus the runtime's post-step parameter gathers
(ZeRO-1/2, one per bucket), under the gloo options of before this change (all-reduce, then
keep the slice; ZeRO-3 gathers as all-reduces of zero-padded shards) and of now (point-to-point
exchanges, runtime/kernels/collectives.py). DDP: the buckets its comm hook is handed in one
step (a one-process gloo group; the buckets do not depend on the world size).

Bytes sent by one rank per call, N ranks, a buffer of n bytes: ring all-reduce 2(N-1)/N n;
reduce-scatter of an n-byte input and exchange_scatter (N-1)/N n; all-gather and
exchange_gather of an n-byte shard (N-1) n.
"""

from __future__ import annotations

import argparse
import json
import os

import torch
import torch.distributed as dist

import fxspeed
from fxspeed.compiler import PassOptions, compile_step
from fxspeed.models import GPT, GPTConfig
from fxspeed.runtime.kernels.collectives import exchange_gather, exchange_gather_out, exchange_scatter

c10d = torch.ops._c10d_functional
VARIANTS = {"before": dict(scatter_via_all_reduce=True, gather_via_all_reduce=True),
            "now": dict(scatter_via_exchange=True, gather_via_exchange=True)}


def node_bytes(n: torch.fx.Node, world: int) -> int:
    val = n.args[0].meta.get("val") if n.args and isinstance(n.args[0], torch.fx.Node) else None
    if not isinstance(val, torch.Tensor):
        return 0
    size = val.numel() * val.element_size()
    if n.target in (c10d.all_reduce.default, c10d.all_reduce_.default):
        return 2 * (world - 1) * size // world
    if n.target in (c10d.reduce_scatter_tensor.default, exchange_scatter):
        return (world - 1) * size // world
    if n.target in (c10d.all_gather_into_tensor.default, c10d.all_gather_into_tensor_out.default,
                    exchange_gather, exchange_gather_out):
        return (world - 1) * size
    if getattr(n.target, "namespace", None) == "_c10d_functional" and n.target is not c10d.wait_tensor.default:
        raise NotImplementedError(f"no byte count for {n.target}")
    return 0


def fxspeed_bytes(model: torch.nn.Module, batch: tuple, world: int, zero: int, variant: str) -> dict[str, int]:
    config = fxspeed.Config(zero=zero)
    opts = PassOptions.single_device(config, world_size=world, rank=0, zero=zero, group_name="count",
                                     reuse_grad_buckets=True, **VARIANTS[variant])
    c = compile_step(model, batch, {}, config=config, loss_fn=None, options=opts)
    graph = sum(node_bytes(n, world) for n in c.captured.gm.graph.nodes if n.op == "call_function")
    post = 0
    if zero in (1, 2):  # FlatParameters.after_step: one gather of this rank's shard per bucket
        for b in c.captured.signature.buckets:
            post += (world - 1) * b.shard_size(world) * torch.empty(0, dtype=getattr(torch, b.dtype)).element_size()
    return {"graph": graph, "post_step": post, "total": graph + post}


def ddp_bytes(model: torch.nn.Module, batch: tuple, world: int) -> int:
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    dist.init_process_group("gloo", rank=0, world_size=1)
    sizes: list[int] = []

    def hook(state, bucket):  # noqa: ANN001, ANN202
        buf = bucket.buffer()
        sizes.append(buf.numel() * buf.element_size())
        fut = torch.futures.Future()
        fut.set_result(buf)
        return fut

    ddp = torch.nn.parallel.DistributedDataParallel(model)
    ddp.register_comm_hook(None, hook)
    for step in range(2):  # the second step runs DDP's rebuilt buckets
        sizes.clear()
        ddp(*batch).backward()
    dist.destroy_process_group()
    return sum(2 * (world - 1) * s // world for s in sizes)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="small")
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--seq", type=int, default=64)
    a = ap.parse_args()
    torch.manual_seed(0)
    model = GPT(GPTConfig.preset(a.preset))
    x = torch.randint(0, model.config.vocab_size, (2, a.seq))
    batch = (x, x)
    out = {"params": sum(p.numel() for p in model.parameters()), "world": a.world,
           "ddp": ddp_bytes(model, batch, a.world)}
    for variant in VARIANTS:
        for zero in range(4):
            out[f"{variant}_zero{zero}"] = fxspeed_bytes(model, batch, a.world, zero, variant)
    for k, v in out.items():
        if isinstance(v, dict):
            print(f"{k:14s} {v['total']:>13,} B/rank/step  ({v['total'] / out['ddp']:.2f}x DDP; graph {v['graph']:,}, "
                  f"post-step {v['post_step']:,})")
        else:
            print(f"{k:14s} {v:>13,}" + (" B/rank/step" if k == "ddp" else ""))
    print(json.dumps(out))


if __name__ == "__main__":
    main()
