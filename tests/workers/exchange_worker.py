"""Run under torch.distributed.run: fxspeed::exchange_scatter / exchange_gather(_out)
(runtime/kernels/collectives.py) against gloo's reduce_scatter_tensor / all_gather_into_tensor
on the same inputs. Each rank writes --out/exchange_rank{r}.pt: per case, both results."""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist

from fxspeed.runtime.kernels.collectives import exchange_gather, exchange_gather_out, exchange_scatter

c10d = torch.ops._c10d_functional


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    group = dist.group.WORLD.group_name
    torch.manual_seed(1234 + rank)
    rec: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    # Shard sizes: one element, odd, and a bucket padded to a multiple of the world size.
    for s in (1, 7, 1001):
        for dtype in (torch.float32, torch.bfloat16):
            x = torch.randn(world * s).to(dtype)
            if s == 1001:
                x[-3:] = 0  # the zero padding reduce_gradients appends
            want = torch.empty(s, dtype=dtype)
            dist.reduce_scatter_tensor(want, x.clone())
            got = x[rank * s:(rank + 1) * s] + c10d.wait_tensor(exchange_scatter(x, world, group)).view(world - 1, s).sum(0)
            rec[f"scatter_{s}_{dtype}"] = (got, want)
            shard = torch.randn(s).to(dtype)
            want = torch.empty(world * s, dtype=dtype)
            dist.all_gather_into_tensor(want, shard)
            rec[f"gather_{s}_{dtype}"] = (c10d.wait_tensor(exchange_gather(shard, world, group)).clone(), want)
            # In place, as FlatParameters gathers: the shard is this rank's slot of `out`.
            out = torch.full((world * s,), float("nan"), dtype=dtype)
            out[rank * s:(rank + 1) * s] = shard
            back = exchange_gather_out(out[rank * s:(rank + 1) * s], world, group, out=out)
            rec[f"gather_out_{s}_{dtype}"] = (c10d.wait_tensor(back).clone(), want)
    # Many in flight at once, waited for in reverse order: each receive matches its own call.
    xs = [torch.randn(world * 64) for _ in range(6)]
    recvs = [exchange_scatter(x, world, group) for x in xs]
    for k in reversed(range(len(xs))):
        want = torch.empty(64)
        dist.reduce_scatter_tensor(want, xs[k].clone())
        got = xs[k][rank * 64:(rank + 1) * 64] + c10d.wait_tensor(recvs[k]).view(world - 1, 64).sum(0)
        rec[f"in_flight_{k}"] = (got, want)
    try:
        exchange_scatter(torch.zeros(world * 3 + 1), world, group)
        rec["uneven_error"] = ""
    except ValueError as e:
        rec["uneven_error"] = str(e)
    torch.save(rec, os.path.join(a.out, f"exchange_rank{rank}.pt"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
