"""Run under `fxspeed run -n 2 -m tests.workers.offload_host_worker --swap DIR --out FILE`.

The host tier of optimizer and parameter offload (runtime/host_tier.py), run on the CPU as a
device apart from the host (FXSPEED_HOST_TIER_ON_CPU=1, set here): on 2 gloo ranks, 3 steps with
the states in (what would be pinned) host memory, or in files under DIR through the tier's
staging, equal 3 steps without offload bit for bit (parameters and optimizer states): fp32
ZeRO-1/2/3, fp16 ZeRO-3 with clipping (fp32 masters on the host, the loss scale and clip
coefficient applied there), bf16 ZeRO-3 with every tier in files ("all": the working shards
fetched through the tier). Rank 0 writes "ok" or the mismatches to FILE.
"""

from __future__ import annotations

import copy
import os

import torch

import fxspeed
from fxspeed.data import local_batch
from fxspeed.runtime.host_tier import ENV_ON_CPU
from tests.workers.common import build_model, global_batches, write_mismatches

# fp32 steps each reduced bucket inside backward, on the host; fp16 with clipping steps at the end
# with the factors; one process covers the working shards on the host (tests/test_offload_host.py).
CASES = [dict(zero=1), dict(zero=2, offload_device="nvme"), dict(zero=3),
         dict(zero=3, precision="fp16", grad_clip=0.5),
         dict(zero=3, precision="bf16", offload="all", offload_device="nvme")]


def run(case: dict, swap: str) -> list[str]:
    case = dict(case)
    kind = case.pop("offload", "optimizer")
    where = case.pop("offload_device", "cpu")
    model = build_model("gpt")
    twin = copy.deepcopy(model)
    batches = global_batches("gpt", 3)
    plain = dict(lr=1e-2, weight_decay=0.1, bucket_mb=0.01, **case)
    a = fxspeed.compile(model, 2, fxspeed.Config(**plain), example_inputs=local_batch(batches[0]))
    b = fxspeed.compile(twin, 2, fxspeed.Config(**plain, offload=kind, offload_device=where,
                                                nvme_path=swap if where == "nvme" else None),
                        example_inputs=local_batch(batches[0]))
    name = f"{case} {kind} on {where}"
    losses = [(a.train_step(*local_batch(x)), b.train_step(*local_batch(x))) for x in batches]
    bad = [f"{name}: losses {la} != {lb}" for la, lb in losses if la != lb]
    sa, sb = a.state_dict(), b.state_dict()
    bad += [f"{name}: parameter {k} differs" for k in sa if not torch.equal(sa[k], sb[k])]
    oa, ob = a._canonical_optimizer_state(), b._canonical_optimizer_state()
    bad += [f"{name}: optimizer state {k}/{s} differs" for k in oa for s in oa[k]
            if not torch.equal(oa[k][s], ob[k][s])]
    if b._link is None or b._link.stats["to_device_bytes"] == 0:
        bad.append(f"{name}: nothing went through the host tier ({b._link and b._link.stats})")
    if "grad_clip" not in case and kind == "optimizer" and not b._in_backward.calls:
        bad.append(f"{name}: no bucket was stepped inside backward")
    if kind != "parameters" and not b.optimizer.stats["host_tier"]:
        bad.append(f"{name}: the optimizer does not step through the host tier ({b.optimizer.stats})")
    if kind != "optimizer":
        files = b._flat.files
        if any(t.untyped_storage().nbytes() for t in b._flat.work_shards) or files.stats["fetches"] < 6:
            bad.append(f"{name}: working shards on the device between steps, or not fetched ({files.stats})")
        if (files.host is None) != (where == "nvme"):
            bad.append(f"{name}: the working shards are {'not ' if files.host is None else ''}in host memory")
    return bad


def main() -> None:
    os.environ[ENV_ON_CPU] = "1"
    write_mismatches(run, CASES)


if __name__ == "__main__":
    main()
