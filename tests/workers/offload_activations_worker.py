"""Run under `fxspeed run -n 2 -m tests.workers.offload_activations_worker --swap DIR --out FILE`.

On 2 gloo ranks, for each case (ZeRO-2 and ZeRO-3 data parallelism; tensor parallelism over both
ranks, where the pass sees each rank's slices; a 2-stage 1F1B pipeline, where OFFLOAD/RELOAD
actions move micro-batches' saved activations between their F and B; ZeRO-3 bf16 with
offload="all", every tier in files): 3 steps with forward's saved activations in swap files equal
3 steps of the same Config with the activation passes disabled, bit for bit (losses, parameters),
and every offloaded activation came back. Rank 0 writes "ok" or the mismatches to FILE.
"""

from __future__ import annotations

import torch

import fxspeed
from fxspeed.data import local_batch
from fxspeed.models import GPT, GPTConfig
from tests.workers.common import write_mismatches

OFF = ("offload_activations", "offload_stage_activations")
# Each with offload="activations" (or "all": optimizer states, parameters and activations in files)
# against the same Config with the activation passes disabled by name.
CASES = [dict(zero=2), dict(zero=3), dict(tensor=2), dict(pipeline=2, microbatches=4),
         dict(zero=3, precision="bf16", offload="all")]


def _gpt() -> GPT:
    # wide enough that activations reach the pass's 1 MiB floor
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=256, block_size=64, n_layer=2, n_head=4, n_embd=128))


def run(case: dict, swap: str) -> list[str]:
    g = torch.Generator().manual_seed(1)
    batches = [tuple(torch.randint(0, 256, (32, 64), generator=g) for _ in range(2)) for _ in range(3)]
    # tensor parallelism and the pipeline: every rank takes the whole batch; data parallelism: its share
    mine = local_batch if case.get("zero") else (lambda b: b)
    cfg = {"lr": 1e-3, "offload": "activations", "nvme_path": swap, **case}
    a = fxspeed.compile(_gpt(), 2, fxspeed.Config(**cfg, disable_passes=OFF), example_inputs=mine(batches[0]))
    b = fxspeed.compile(_gpt(), 2, fxspeed.Config(**cfg), example_inputs=mine(batches[0]))
    tag = str(case)
    bad = [f"{tag}: step {i} loss {la} != {lb}" for i, (la, lb) in
           enumerate((a.train_step(*mine(x)), b.train_step(*mine(x))) for x in batches) if la != lb]
    if a._activations is not None and a._activations.stats["offloads"]:
        bad.append(f"{tag}: the passes disabled by name still moved activations")
    sa, sb = a.state_dict(), b.state_dict()
    bad += [f"{tag}: parameter {k} differs" for k in sa if not torch.equal(sa[k], sb[k])]
    if case.get("pipeline"):  # the first stage's rank moves micro-batches 1 and 2 (1F1B, M=4)
        moved = [str(x) for x in b.schedule.actions[0] if x.kind == "OFFLOAD"]
        if moved != ["OFFLOAD(0,1)", "OFFLOAD(0,2)"]:
            bad.append(f"{tag}: OFFLOAD actions {moved}")
        if b.position == 1:
            return bad
    stats = b._activations.stats
    if not stats["offloads"] or stats["offloads"] != stats["reloads"]:
        bad.append(f"{tag}: offloads/reloads {stats}")
    return bad


def main() -> None:
    write_mismatches(run, CASES)


if __name__ == "__main__":
    main()
