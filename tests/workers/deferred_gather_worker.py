"""Run under torch.distributed.run: watches a ZeRO-1/2 engine's post-step parameter all-gathers
(and ZeRO-0's persistent gradient buckets).

For each stage in --zero, on the GPT with small buckets: one step, then records
  * how many collectives are still registered (in flight or finished but not waited for) and
    whether the engine says its gathers are in flight: the step returned before waiting;
  * the same after running the compiled program once more by itself (forward + backward, no
    optimizer step): the program's own waits consumed every gather;
  * whether every bucket Parameter's first reader in the program is a wait_tensor;
  * the state_dict after one step, and the weights of a ZeRO-0 engine after the same step;
  * how many persistent gradient buffers there are and whether a second step reused them.
Rank 0 writes them to --out/zero{k}.pt.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import _get_work_registry_size

import fxspeed
from fxspeed.data import local_batch
from tests.workers.common import build_model, global_batches


def first_readers_are_waits(engine: fxspeed.Engine) -> bool:
    gm = engine.graph()
    sig = next(iter(engine._executors.values())).program.signature
    names = {n for b in sig.buckets for n in b.names}
    wait = torch.ops._c10d_functional.wait_tensor.default
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    checked = 0
    for spec, ph in zip(sig.inputs, placeholders):
        if spec.kind == "param" and spec.target in names:
            checked += 1
            if [u.target for u in ph.users] != [wait]:
                return False
    return checked == len(names)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--zero", default="1,2")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    torch.set_num_threads(1)
    world = int(os.environ["WORLD_SIZE"])
    batches = global_batches("gpt", 1)
    first = local_batch(batches[0])
    reference = fxspeed.compile(build_model("gpt"), world, fxspeed.Config(zero=0, lr=1e-2, bucket_mb=0.01),
                                example_inputs=first)
    reference.train_step(*first)
    want = {k: v.clone() for k, v in reference.state_dict().items()}
    for zero in map(int, a.zero.split(",")):
        # The optimizer steps after the program here: the program is run alone below (forward and
        # backward only), which a program stepping its buckets inside backward is not.
        engine = fxspeed.compile(build_model("gpt"), world,
                                 fxspeed.Config(zero=zero, lr=1e-2, bucket_mb=0.01,
                                                disable_passes=("step_buckets_in_backward",)),
                                 example_inputs=first)
        initial = {k: v.clone() for k, v in engine.state_dict().items()}
        engine.train_step(*first)
        rec = {"buckets": len(engine._flat.buckets), "registered_after_step": _get_work_registry_size(),
               "in_flight_after_step": engine._flat.in_flight, "first_readers_are_waits": first_readers_are_waits(engine)}
        # Run the program alone: only its own waits can consume the gathers.
        ex = next(iter(engine._executors.values()))
        ex.run(list(first))
        rec["registered_after_program"] = _get_work_registry_size()
        rec["state"] = {k: v.clone() for k, v in engine.state_dict().items()}
        # ZeRO-0 reduces into persistent buckets: the same memory on every step.
        before = [t.data_ptr() for _, t in sorted(engine._flat.grad_buffers.items())]
        engine.train_step(*first)
        rec["grad_buffers"] = len(engine._flat.grad_buffers)
        rec["grad_buffers_kept"] = before == [t.data_ptr() for _, t in sorted(engine._flat.grad_buffers.items())]
        rec["initial"], rec["want"] = initial, want
        if dist.get_rank() == 0:
            torch.save(rec, os.path.join(a.out, f"zero{zero}.pt"))
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
