"""Run under `fxspeed run -n 2 -m tests.workers.expect_all_ranks_worker --out DIR [--engine]`:
fxspeed.mesh.expect_all_ranks over 2 gloo ranks.

Default: both ranks call it 50 times (passes; the store holds no more keys afterwards), then
rank 0 alone calls it with a 2 s timeout (FxspeedError within it) while rank 1 waits at a
barrier, then both call it again under the same name (the caught error left the ranks in step) and under
another name (the store still works). out/rank{r}.json.

--engine: a ZeRO-3 engine; rank 0 alone calls engine.state_dict() (the user pattern
`if rank == 0: torch.save(engine.state_dict(), ...)`), rank 1 waits at a barrier. The
engine calls expect_all_ranks first thing in state_dict(). Then both call state_dict(), rank 0
alone calls load_state_dict() (the same error), then enters `with engine.gathered():` alone
(the same error), both call save() with a directory per rank and
load_state_dict() with states that differ (refused on both), both load and take a step (the
engine still works). out/engine_rank{r}.json.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d

from fxspeed.errors import FxspeedError
from fxspeed.mesh import expect_all_ranks


def plain(rank: int) -> dict:
    dist.init_process_group("gloo")
    store = distributed_c10d._get_default_store()
    record: dict = {}
    dist.barrier()
    before = store.num_keys()
    t0 = time.monotonic()
    for _ in range(50):
        expect_all_ranks("engine.state_dict()")
    record["both_50_calls_s"] = time.monotonic() - t0
    dist.barrier()
    record["keys_added"] = store.num_keys() - before  # <= 0: other keys may come and go
    keys = [f"fxspeed/expect_all_ranks/world/engine.state_dict()/{n}{end}"
            for n in range(1, 51) for end in ("", "/all")]
    record["keys_left"] = [k for k in keys if store.check([k])]
    if rank == 0:
        t0 = time.monotonic()
        try:
            expect_all_ranks("engine.state_dict()", timeout_s=2.0)
            record["alone"] = "no error"
        except FxspeedError as e:
            record["alone"] = f"FxspeedError: {e}"
        record["alone_s"] = time.monotonic() - t0
    dist.barrier()
    # The caught error left the ranks in step: both calling the same method now pass together.
    expect_all_ranks("engine.state_dict()", timeout_s=30.0)
    record["again"] = "ok"
    expect_all_ranks("engine.save()", timeout_s=30.0)
    record["after"] = "ok"
    return record


def engine(rank: int) -> dict:
    import fxspeed
    from fxspeed.data import local_batch
    from tests.workers.common import build_model, global_batches

    batches = global_batches("gpt", 1)
    world = int(os.environ["WORLD_SIZE"])
    eng = fxspeed.compile(build_model("gpt"), world, fxspeed.Config(zero=3, lr=1e-2, dist_timeout_s=16.0),
                          example_inputs=local_batch(batches[0]))
    eng.train_step(*local_batch(batches[0]))
    record: dict = {}
    if rank == 0:
        t0 = time.monotonic()
        try:
            eng.state_dict()
            record["alone"] = "no error"
        except Exception as e:  # noqa: BLE001 - the test checks which error it was
            record["alone"] = f"{type(e).__name__}: {e}"
        record["alone_s"] = time.monotonic() - t0
    dist.barrier()
    # The user caught it and calls it on every rank: the full state, and training goes on.
    state = eng.state_dict()
    record["again"] = sorted(state) == sorted(build_model("gpt").state_dict())
    # load_state_dict on one rank only: under ZeRO-0 it left the replicas apart with no error
    if rank == 0:
        try:
            eng.load_state_dict(state)
            record["load_alone"] = "no error"
        except Exception as e:  # noqa: BLE001 - the test checks which error it was
            record["load_alone"] = f"{type(e).__name__}: {e}"
    dist.barrier()
    # `with engine.gathered():` entered on one rank only (to print a sample on rank 0): its
    # all-gathers hung both ranks until dist_timeout_s, then a raw gloo timeout
    if rank == 0:
        t0 = time.monotonic()
        try:
            with eng.gathered():
                pass
            record["gathered_alone"] = "no error"
        except Exception as e:  # noqa: BLE001 - the test checks which error it was
            record["gathered_alone"] = f"{type(e).__name__}: {e}"
        record["gathered_alone_s"] = time.monotonic() - t0
    dist.barrier()
    # Both ranks call, with different arguments: a directory per rank (a timestamp taken on each),
    # a state that differs on rank 1. Each is refused on every rank before anything is written.
    out = os.environ["FXSPEED_TEST_OUT"]
    for what, call in (("save_apart", lambda: eng.save(os.path.join(out, f"ck_rank{rank}"))),
                       ("load_state_apart", lambda: eng.load_state_dict(
                           {k: v + rank for k, v in state.items()}))):
        try:
            call()
            record[what] = "no error"
        except Exception as e:  # noqa: BLE001 - the test checks which error it was
            record[what] = f"{type(e).__name__}: {e}"
    record["nothing_written"] = sorted(os.listdir(out))
    eng.load_state_dict(state)
    eng.train_step(*local_batch(batches[0]))
    record["after"] = "ok"
    return record


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--engine", action="store_true")
    a = ap.parse_args()
    os.environ["FXSPEED_TEST_OUT"] = a.out
    os.environ.setdefault("FXSPEED_BACKEND", "gloo")
    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    record = engine(rank) if a.engine else plain(rank)
    with open(os.path.join(a.out, f"{'engine_' if a.engine else ''}rank{rank}.json"), "w") as f:
        json.dump(record, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
