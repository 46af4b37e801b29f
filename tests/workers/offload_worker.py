"""Run under `fxspeed run -n 2 -m tests.workers.offload_worker --swap DIR --out FILE`.

On 2 gloo ranks, for ZeRO-1, ZeRO-3, a 2-stage pipeline and fp16 ZeRO-3 with clipping (fp32 masters
in the file too): 3 steps with Adam's moments offloaded to files under DIR equal 3 steps without
offload bit for bit (parameters and optimizer states); the same for bf16 ZeRO-3 with the working
parameter shards in files (offload="parameters") and fp16 ZeRO-3 with both (offload="all"),
with a different bucket size so a rank's states span several chunks; a pipeline under a
memory budget its plan meets without offload keeps every state in memory. Rank 0 writes "ok" or
the mismatches to FILE.
"""

from __future__ import annotations

import copy

import torch

import fxspeed
from fxspeed.data import local_batch
from tests.workers.common import build_model, global_batches, write_mismatches

# ZeRO-1 and ZeRO-2 step the same flat shards (and ZeRO-0 the Parameters, as one process does):
# one of each kind of tensor the optimizer is handed, to keep the launch short. Under fp16 the
# masters go to the file too (against the in-memory masters of runtime/flat_parameters.py), and
# the loss scale and clipping become 1/scale and the clip coefficient handed to the optimizer
# instead of scaling the fp16 gradients in place (bf16 without them: tests/test_offload.py).
# Parameter offload (ZeRO-Infinity): bf16 working shards in files, fetched ahead of each gather,
# with the fp32 masters and torch's Adam in memory ("parameters"), and with both tiers ("all").
CASES = [dict(zero=1), dict(zero=3), dict(pipeline=2, microbatches=2), dict(zero=3, precision="fp16", grad_clip=0.5),
         # a budget larger than the model: each position's plan offloads nothing, and so does its
         # optimizer (it was built before the pipeline's plan and offloaded every state)
         dict(pipeline=2, microbatches=2, memory_budget_gb=100.0),
         dict(zero=3, precision="bf16", offload="parameters"),
         # a loss scale that is not a power of 2: the clip norm of scaled fp16 gradients times 1/scale
         # differs in the last bits from the norm of unscaled fp32 ones (the masters-in-file path
         # now takes the latter, as the in-memory path does)
         dict(zero=3, precision="fp16", grad_clip=0.5, loss_scale=1000.0, offload="all")]


def run(case: dict, swap: str) -> list[str]:
    case = dict(case)
    kind = case.pop("offload", "optimizer")
    model = build_model("gpt")
    twin = copy.deepcopy(model)
    batches = global_batches("gpt", 3)
    plain = dict(lr=1e-2, weight_decay=0.1, bucket_mb=0.01, **case)
    example = local_batch(batches[0]) if "pipeline" not in case else batches[0]
    pick = (lambda b: local_batch(b)) if "pipeline" not in case else (lambda b: b)
    a = fxspeed.compile(model, 2, fxspeed.Config(**plain), example_inputs=example)
    b = fxspeed.compile(twin, 2, fxspeed.Config(**plain, offload=kind, nvme_path=swap), example_inputs=example)
    losses = [(a.train_step(*pick(x)), b.train_step(*pick(x))) for x in batches]
    bad = [f"{case}: losses {la} != {lb}" for la, lb in losses if la != lb]
    sa, sb = a.state_dict(), b.state_dict()
    bad += [f"{case}: parameter {k} differs" for k in sa if not torch.equal(sa[k], sb[k])]
    oa, ob = a._canonical_optimizer_state(), b._canonical_optimizer_state()
    bad += [f"{case}: optimizer state {k}/{s} differs" for k in oa for s in oa[k] if not torch.equal(oa[k][s], ob[k][s])]
    if kind != "optimizer":
        files = b._flat.files
        if any(t.untyped_storage().nbytes() for t in b._flat.work_shards) or files.stats["fetches"] < 6:
            bad.append(f"{case} {kind}: working shards in memory, or not fetched ({files.stats})")
        if files.stats["waited_reads"] > 1:  # the first step's first fetch has nothing ahead of it
            bad.append(f"{case} {kind}: {files.stats['waited_reads']} fetches were not prefetched")
    if kind == "parameters":
        return bad
    if b.optimizer.stats["masters"] != ("precision" in case):
        bad.append(f"{case}: masters in the file: {b.optimizer.stats['masters']}")
    if "memory_budget_gb" in case:
        planned = b.plan.pipeline["ranks"][b.position]["offloaded"]
        if planned or b.optimizer.stats["chunks"]:
            bad.append(f"{case}: the plan offloads {planned} bytes, the optimizer {b.optimizer.stats['chunks']} chunks")
        return bad
    if b.optimizer.stats["chunks"] < 2 and "pipeline" not in case:
        bad.append(f"{case}: one chunk only ({b.optimizer.stats}); the test means to step several")
    return bad


def main() -> None:
    write_mismatches(run, CASES)


if __name__ == "__main__":
    main()
