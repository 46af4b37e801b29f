"""gloo collectives on one bucket, 2 CPU ranks: what ZeRO's reduce-scatter and all-gather cost.

    python -m torch.distributed.run --standalone --nproc-per-node=2 benchmarks/bench_gloo_collectives.py --mb 25

Rows (each on a --mb fp32 bucket; "shard" = 1/N of it), alternating order every round, a
barrier before and after each call, medians over --rounds:

    all_reduce          dist.all_reduce(bucket)                         what DDP / ZeRO-0 run
    reduce_scatter      dist.reduce_scatter_tensor(shard, bucket)       gloo's own
    all_gather          dist.all_gather_into_tensor(bucket, shard)      gloo's own, preallocated output
    all_reduce_padded   zeros + copy shard + all_reduce                 ZeRO-3's gather before the exchanges
    exchange_scatter    fxspeed::exchange_scatter + wait + add          what ZeRO-1/2/3 run on gloo now
    exchange_gather     fxspeed::exchange_gather_out + wait, in place   ZeRO-1/2 post-step, ZeRO-3 gathers
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist

from fxspeed.runtime.kernels.collectives import exchange_gather_out, exchange_scatter

c10d = torch.ops._c10d_functional


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mb", type=float, default=25.0)
    ap.add_argument("--rounds", type=int, default=20)
    a = ap.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    r, n_ranks = dist.get_rank(), dist.get_world_size()
    g = dist.group.WORLD.group_name
    n = int(a.mb * 2**20 / 4) // n_ranks * n_ranks
    s = n // n_ranks
    bucket, shard_out, full = torch.randn(n), torch.empty(s), torch.empty(n)
    shard = torch.randn(s)

    def padded() -> None:
        buf = torch.zeros(n)
        buf[r * s:(r + 1) * s].copy_(shard)
        dist.all_reduce(buf)

    def ex_scatter() -> None:
        w = c10d.wait_tensor(exchange_scatter(bucket, n_ranks, g))
        torch.add(bucket[r * s:(r + 1) * s], w.view(n_ranks - 1, s).sum(0) if n_ranks > 2 else w, out=shard_out)

    def ex_gather() -> None:
        c10d.wait_tensor(exchange_gather_out(full[r * s:(r + 1) * s], n_ranks, g, out=full))

    rows = {"all_reduce": lambda: dist.all_reduce(bucket), "reduce_scatter": lambda: dist.reduce_scatter_tensor(shard_out, bucket),
            "all_gather": lambda: dist.all_gather_into_tensor(full, shard), "all_reduce_padded": padded,
            "exchange_scatter": ex_scatter, "exchange_gather": ex_gather}
    times: dict[str, list[float]] = {k: [] for k in rows}
    for f in rows.values():  # warm up: connections, first-touch pages
        f()
    for i in range(a.rounds):
        for k in (list(rows) if i % 2 == 0 else list(rows)[::-1]):
            dist.barrier()
            t = time.perf_counter()
            rows[k]()
            dist.barrier()
            times[k].append(time.perf_counter() - t)
    if r == 0:
        ar = statistics.median(times["all_reduce"])
        print(f"torch {torch.__version__}, {n_ranks} gloo ranks, {n * 4 / 2**20:.1f} MiB bucket, {a.rounds} rounds")
        for k, ts in times.items():
            med = statistics.median(ts)
            print(f"{k:18s} median {med * 1e3:7.1f} ms  min {min(ts) * 1e3:7.1f} ms  {med / ar:5.2f}x all_reduce")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
