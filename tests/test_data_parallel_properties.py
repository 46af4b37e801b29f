"""Property tests for data parallelism over random small models, on 2 and 3 gloo processes.

Starting processes for every hypothesis example would take minutes, so hypothesis draws the
cases up front and one torch.distributed.run launch per world size trains them all:
`drawn_cases()` runs a @given-decorated collector with derandomize=True (the same cases on
every run, for a given hypothesis version and strategy source) over `case_strategy`, plus the
explicit @example edge cases. A case is a random MLP (depth, odd or even width, activation,
residual, LayerNorm, tied weights, a parameter that gets no gradient) with a ZeRO stage, a
tiny bucket size (often several buckets, padded where the world size does not divide them),
AdamW or SGD (weight decay on every parameter or, `no_decay`, not on the 1-D ones:
Config.no_weight_decay), gradient accumulation over 1 or 2 slices (under ZeRO-0/1 the slices
sum locally and the last one reduces), and a batch of rows_per_rank * world * grad_accum rows.
The worker (tests/workers/property_worker.py) trains 3 steps.

Properties, for every case and world size:
  (a) parity with one eager process on the global batch using the torch.optim twin: every
      loss and every state_dict tensor within relative error 1e-5 (per tensor norm);
      every rank reports the same losses and the same state;
  (b) bucket layout: every parameter that gets a gradient is in exactly one bucket (tied
      weights once), none that gets none; offsets are contiguous; and the ranks' shards,
      concatenated in rank order and unpadded, equal the flat concatenation of the bucket's
      parameters in the final state, bit for bit;
  (c) padding entries (between numel and padded) are exactly zero after training, in the
      shards and, for ZeRO-0..2, in the full flat buffers every rank keeps.

No shrinking happens across a launch. A failure lists every failing case as JSON; to replay
(or shrink by hand) set FXSPEED_DP_CASES to a JSON list of cases (or a path to one).
"""

from __future__ import annotations

import functools
import json
import os
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, Phase, example, given, settings
from hypothesis import strategies as st

from tests.workers.property_worker import LR, MOMENTUM, build, exempt, global_batches
from tests.multiprocess import rank_env, run_ranks

ROOT = Path(__file__).resolve().parents[1]
TOL = 1e-5
N_CASES = 8  # generated; plus the explicit examples below


@st.composite
def case_strategy(draw: st.DrawFn) -> dict[str, Any]:
    depth = draw(st.integers(1, 4))
    return {
        "depth": depth,
        "width": draw(st.integers(3, 33)),
        "activation": draw(st.sampled_from(["relu", "gelu", "tanh"])),
        "residual": draw(st.booleans()),
        "layernorm": draw(st.booleans()),
        "tied": draw(st.booleans()) if depth >= 2 else False,
        "no_grad": draw(st.sampled_from(["none", "unused", "frozen", "detached"])),
        "zero": draw(st.integers(0, 3)),
        # 52 bytes .. 10 KiB: from one parameter per bucket to a few buckets per model.
        "bucket_mb": draw(st.sampled_from([0.00005, 0.0001, 0.0005, 0.001, 0.002, 0.005, 0.01])),
        "optimizer": draw(st.sampled_from(["adamw", "sgd"])),
        "weight_decay": draw(st.sampled_from([0.0, 0.1])),
        "grad_clip": draw(st.sampled_from([None, 0.05])),
        "rows_per_rank": draw(st.integers(1, 3)),
        "seed": draw(st.integers(0, 2**16)),
        "grad_accum": draw(st.sampled_from([1, 2])),
        "no_decay": draw(st.booleans()),
    }


# Hand-picked corners, always included (with hypothesis's first, simplest draw, which is
# ZeRO-0, every stage is covered whatever else it draws): everything at once on an odd width;
# one small bucket per parameter under ZeRO-2 with SGD; the widest layer under ZeRO-1.
EXPLICIT = [
    {"depth": 3, "width": 5, "activation": "gelu", "residual": True, "layernorm": True, "tied": True,
     "no_grad": "unused", "zero": 3, "bucket_mb": 0.00005, "optimizer": "adamw", "weight_decay": 0.1,
     "grad_clip": 0.05, "rows_per_rank": 1, "seed": 7, "grad_accum": 2, "no_decay": True},
    {"depth": 2, "width": 3, "activation": "tanh", "residual": False, "layernorm": False, "tied": False,
     "no_grad": "frozen", "zero": 2, "bucket_mb": 0.00005, "optimizer": "sgd", "weight_decay": 0.1,
     "grad_clip": None, "rows_per_rank": 2, "seed": 11, "grad_accum": 1, "no_decay": True},
    {"depth": 2, "width": 33, "activation": "relu", "residual": True, "layernorm": True, "tied": False,
     "no_grad": "detached", "zero": 1, "bucket_mb": 0.001, "optimizer": "adamw", "weight_decay": 0.1,
     "grad_clip": None, "rows_per_rank": 3, "seed": 3, "grad_accum": 2, "no_decay": False},
]


@functools.cache
def drawn_cases() -> tuple[str, ...]:
    """The cases, as JSON strings: FXSPEED_DP_CASES when set, else hypothesis's draw."""
    override = os.environ.get("FXSPEED_DP_CASES")
    if override:
        text = Path(override).read_text() if not override.lstrip().startswith("[") else override
        return tuple(json.dumps(c, sort_keys=True) for c in json.loads(text))
    drawn: list[str] = []

    @settings(max_examples=N_CASES, derandomize=True, database=None, deadline=None,
              phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))
    @given(case_strategy())
    def collect(case: dict[str, Any]) -> None:
        s = json.dumps(case, sort_keys=True)
        if s not in drawn:
            drawn.append(s)

    for e in EXPLICIT:
        collect = example(e)(collect)
    collect()
    return tuple(drawn)


def launch(world: int, cases_path: Path, out: Path) -> None:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}",
           "-m", "tests.workers.property_worker", "--cases", str(cases_path), "--out", str(out)]
    env = rank_env()
    proc = run_ranks(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]


def eager_reference(case: dict[str, Any], world: int) -> tuple[list[float], dict[str, torch.Tensor], set[int], dict[str, int]]:
    """One process on the global batches with the torch.optim optimizer. Also returns the ids
    of the parameters that received a gradient."""
    torch.set_num_threads(1)
    model = build(case)
    params = [p for p in model.parameters() if p.requires_grad]
    skip = bool(exempt(case))  # Config.no_weight_decay=("1d",): the 1-D parameters in a group without decay
    groups = [{"params": [p for p in params if not (skip and p.dim() < 2)]},
              {"params": [p for p in params if skip and p.dim() < 2], "weight_decay": 0.0}]
    groups = [g for g in groups if g["params"]]
    if case["optimizer"] == "sgd":
        opt = torch.optim.SGD(groups, lr=LR, momentum=MOMENTUM, weight_decay=case["weight_decay"], fused=True)
    else:
        opt = torch.optim.AdamW(groups, lr=LR, weight_decay=case["weight_decay"], fused=True)
    losses, with_grad = [], set()
    for x, y in global_batches(case, world):
        opt.zero_grad(set_to_none=True)
        loss = model(x, y)
        loss.backward()
        if case["grad_clip"] is not None:
            torch.nn.utils.clip_grad_norm_([p for p in params if p.grad is not None], case["grad_clip"])
        with_grad |= {id(p) for p in params if p.grad is not None}
        opt.step()
        losses.append(loss.item())
    ids = {n: id(p) for n, p in model.named_parameters(remove_duplicate=False)}
    return losses, model.state_dict(), {i for i in ids.values() if i in with_grad}, ids


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    ref = b.norm().item()
    return (a - b).norm().item() / ref if ref > 0 else (a - b).norm().item()


def check_case(case: dict[str, Any], world: int, results: list[dict[str, Any]]) -> list[str]:
    """Every property violated by one case (empty when it holds)."""
    errors = [f"rank {r} raised:\n{res['error']}" for r, res in enumerate(results) if "error" in res]
    if errors:
        return errors
    bad: list[str] = []
    want_losses, want_state, with_grad, ids = eager_reference(case, world)
    r0 = results[0]

    # (a) parity with one process on the global batch; every rank agrees.
    for r, res in enumerate(results):
        if res["losses"] != r0["losses"]:
            bad.append(f"(a) rank {r} losses {res['losses']} != rank 0 {r0['losses']}")
        if res["state"].keys() != r0["state"].keys() or any(not torch.equal(res["state"][k], r0["state"][k])
                                                            for k in r0["state"]):
            bad.append(f"(a) rank {r} state_dict differs from rank 0's")
    for step, (a, b) in enumerate(zip(r0["losses"], want_losses)):
        if abs(a - b) > TOL * abs(b):
            bad.append(f"(a) loss at step {step}: {a!r} vs eager {b!r}")
    if r0["state"].keys() != want_state.keys():
        bad.append(f"(a) state_dict keys {sorted(r0['state'])} != eager {sorted(want_state)}")
    for k, want in want_state.items():
        have = r0["state"].get(k)
        if have is None or have.shape != want.shape:
            continue
        e = rel_err(have, want)
        if e > TOL:
            bad.append(f"(a) {k}: relative error {e:.3g} vs eager")

    # (b) bucket layout and shards.
    buckets, shards = r0["buckets"], [res["shards"] for res in results]
    if buckets is None:
        return bad + ["(b) engine._flat is None on several ranks"]
    for res in results[1:]:
        if res["buckets"] != buckets:
            bad.append("(b) ranks disagree on the bucket layout")
    names = [n for b in buckets for n in b["names"]]
    bucketed = [ids[n] for n in names]
    if len(set(bucketed)) != len(bucketed):
        bad.append(f"(b) a parameter is in more than one bucket: {names}")
    if set(bucketed) != with_grad:
        by_id = {i: n for n, i in reversed(ids.items())}
        bad.append(f"(b) bucketed parameters {sorted(by_id[i] for i in set(bucketed))} != those with a gradient "
                   f"{sorted(by_id[i] for i in with_grad)}")
    for k, b in enumerate(buckets):
        numels = [int(torch.Size(s).numel()) for s in b["shapes"]]
        if b["offsets"] != [sum(numels[:j]) for j in range(len(numels))] or b["numel"] != sum(numels):
            bad.append(f"(b) bucket {k}: offsets {b['offsets']} / numel {b['numel']} do not match shapes {b['shapes']}")
        if b["padded"] % world or not b["numel"] <= b["padded"] < b["numel"] + world:
            bad.append(f"(b) bucket {k}: padded {b['padded']} is not numel {b['numel']} rounded up to {world}")
        sizes = [s[k].numel() for s in shards]
        if sizes != [b["padded"] // world] * world:
            bad.append(f"(b) bucket {k}: shard sizes {sizes}, expected {world} x {b['padded'] // world}")
            continue
        whole = torch.cat([s[k] for s in shards])
        params = torch.cat([r0["state"][n].reshape(-1) for n in b["names"]])
        if not torch.equal(whole[:b["numel"]], params):
            bad.append(f"(b) bucket {k}: concatenated shards != its parameters in the final state "
                       f"(max abs diff {(whole[:b['numel']] - params).abs().max().item():.3g})")
        # (c) padding stays zero.
        if torch.count_nonzero(whole[b["numel"]:]).item():
            bad.append(f"(c) bucket {k}: padding in the shards is {whole[b['numel']:].tolist()}")
        for r, res in enumerate(results):
            full = res["full"][k]
            if full is None:
                continue
            if not torch.equal(full, whole):
                bad.append(f"(b) bucket {k}: rank {r}'s full flat buffer != the concatenated shards")
            if torch.count_nonzero(full[b["numel"]:]).item():
                bad.append(f"(c) bucket {k}: padding in rank {r}'s full buffer is {full[b['numel']:].tolist()}")
    return bad


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 3])
def test_random_data_parallel_cases_match_one_process_and_shards_tile_the_parameters(world: int, tmp_path: Path):
    cases = [json.loads(s) for s in drawn_cases()]
    path = tmp_path / "cases.json"
    path.write_text(json.dumps(cases, indent=1))
    launch(world, path, tmp_path)
    failures = []
    for i, case in enumerate(cases):
        results = [torch.load(tmp_path / f"case{i}_rank{r}.pt", weights_only=False) for r in range(world)]
        bad = check_case(case, world, results)
        if bad:
            failures.append(f"case {i} on {world} ranks: {json.dumps(case, sort_keys=True)}\n  " + "\n  ".join(bad[:8]))
    assert not failures, f"{len(failures)} of {len(cases)} cases fail:\n" + "\n".join(failures)
