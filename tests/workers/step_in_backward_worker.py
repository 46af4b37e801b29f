"""Run under `fxspeed run -n 2 -m tests.workers.step_in_backward_worker --swap DIR --out FILE`.

On 2 gloo ranks, for each case: 3 steps with the optimizer stepping each reduced gradient bucket
inside backward (passes/memory/step_buckets_in_backward.py) equal 3 steps with the pass disabled
bit for bit (losses, parameters, optimizer states), the program returns no gradient bucket, and
the stepper was called once per bucket per step. Rank 0 writes "ok" or the mismatches to FILE.
"""

from __future__ import annotations

import copy

import torch

import fxspeed
from fxspeed.data import local_batch
from tests.workers.common import build_model, global_batches, write_mismatches

OFF = ("step_buckets_in_backward",)
# Each kind of tensor the optimizer is handed per bucket: ZeRO-0's Parameters (views of the
# persistent reduced buckets), ZeRO-1's shard of a full reduced bucket, ZeRO-2's reduce-scattered
# shard, ZeRO-3's shard (an input the program gathers), fp32 masters of bf16 working copies, and
# the offloaded optimizer's chunks (masters and moments in the file, several chunks per rank), and
# buckets reduced in bf16 and cast back.
CASES = [("gpt", dict(zero=0)), ("gpt2", dict(zero=1, optimizer="sgd", momentum=0.9)), ("gpt", dict(zero=2)),
         ("gpt", dict(zero=3)), ("gpt", dict(zero=1, precision="bf16")),
         ("gpt", dict(zero=2, precision="bf16", offload="optimizer")), ("gpt", dict(zero=2, reduce_dtype="bf16"))]


def run(name: str, case: dict, swap: str) -> list[str]:
    model = build_model(name)
    twin = copy.deepcopy(model)
    batches = global_batches(name, 3)
    cfg = dict(lr=1e-2, weight_decay=0.1, bucket_mb=0.01, **case)
    if "offload" in case:
        cfg["nvme_path"] = swap
    example = local_batch(batches[0])
    a = fxspeed.compile(model, 2, fxspeed.Config(**cfg), example_inputs=example)
    b = fxspeed.compile(twin, 2, fxspeed.Config(**cfg, disable_passes=OFF), example_inputs=example)
    tag = f"{name} {case}"
    step = lambda e, x: e.train_step(**x) if isinstance(x, dict) else e.train_step(*x)  # noqa: E731
    losses = [(step(a, local_batch(x)), step(b, local_batch(x))) for x in batches]
    bad = [f"{tag}: losses {la} != {lb}" for la, lb in losses if la != lb]
    sa, sb = a.state_dict(), b.state_dict()
    bad += [f"{tag}: parameter {k} differs" for k in sa if not torch.equal(sa[k], sb[k])]
    oa, ob = a._canonical_optimizer_state(), b._canonical_optimizer_state()
    bad += [f"{tag}: optimizer state {k}/{s} differs" for k in oa for s in oa[k] if not torch.equal(oa[k][s], ob[k][s])]
    sig = next(iter(a._executors.values())).program.signature
    buckets = len(a._flat.buckets)
    if any(s.kind == "grad_bucket" for s in sig.outputs) or a._in_backward is None:
        bad.append(f"{tag}: buckets left to the step after the program: {[s for s in sig.outputs]}")
    elif a._in_backward.calls != 3 * buckets or buckets < 2:
        bad.append(f"{tag}: {a._in_backward.calls} bucket steps in 3 steps of {buckets} buckets")
    if b._in_backward is not None and b._in_backward.calls:
        bad.append(f"{tag}: the pass disabled by name still stepped inside backward")
    if "offload" in case and a.optimizer.stats["chunks"] < 2:
        bad.append(f"{tag}: one chunk only ({a.optimizer.stats}); the case means to step several")
    return bad


def main() -> None:
    write_mismatches(lambda case, swap: run(*case, swap), CASES)


if __name__ == "__main__":
    main()
