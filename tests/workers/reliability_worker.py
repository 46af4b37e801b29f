"""Run under `fxspeed run -n 2 -m tests.workers.reliability_worker --case CASE`: failure modes.

    raise      rank 1 raises after compile and one step; rank 0 keeps training (its next
               collective can never complete): the launcher must stop it and name rank 1
    exit       as raise, but rank 1 dies abruptly with os._exit(13)
    sys_exit   as raise, but rank 1 calls sys.exit(7) (no exception for sys.excepthook to see)
    midstep    rank 1's forward raises mid-step and it catches it: both ranks get an FxspeedError, rank 0's
               naming rank 1's failure (from the store)
    midserve   the same for tensor-parallel serving: rank 1's generate fails inside a step (injected)
               while rank 0 is in the step's collectives
    longer     rank 0 runs one step more than rank 1, whose script ends: rank 0's FxspeedError says so
    longer_tp  the same under tensor=2 (the step's first collective is the tp ranks' batch check)
    model      rank 1 builds a different model      -> ConfigError at compile on every rank
    config     rank 1 passes a different Config      -> ConfigError at compile on every rank
    devices    the ranks pass DeviceSpecs of different bandwidth (a rate measured per rank) -> ConfigError
    indivisible  a global batch of 5 rows on 2 ranks -> ConfigError from local_batch
    shapes     rank 1's local batch has another shape -> ConfigError at compile on every rank
    attribute  a plain Python attribute of the model differs on rank 1 -> ConfigError naming it
    branch     after a step, forward skips a layer on every rank (a flag) -> FxspeedError naming the
               layer's parameters (the gradient buckets were laid out for the first step's)

Expected errors are written to --out/{case}_rank{r}.txt as "ConfigError: message" and the worker
exits 0. The ConfigError cases may be joined by commas (`--case model,config,shapes,indivisible`):
they run in turn in one launch, each error agreed on every rank before the next case starts.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time

import torch
import torch.distributed as dist

import fxspeed
from fxspeed.data import local_batch
from fxspeed.errors import ConfigError, FxspeedError
from fxspeed.models import GPT, GPTConfig
from tests.workers.common import build_model, global_batches


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--case", required=True,
                    help="raise, exit, or some of model, config, indivisible, shapes joined by commas")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    os.environ.setdefault("FXSPEED_BACKEND", "gloo")
    torch.set_num_threads(1)
    cases = a.case.split(",")
    if not (cases in (["raise"], ["exit"], ["sys_exit"], ["midstep"], ["midserve"], ["longer"], ["longer_tp"]) or set(cases) <= {"model", "config", "devices", "indivisible", "shapes",
                                                                                       "buffer", "frozen", "attribute",
                                                                                       "branch"}):
        ap.error(f"--case {a.case}: raise, exit, sys_exit, midstep, midserve, longer, longer_tp, or some of model, config, devices, indivisible, shapes, buffer, "
                 "frozen, attribute, branch")
    for case in cases:
        run(case, a.out)
    if dist.is_initialized():
        dist.destroy_process_group()


def write_errors(out: str, case: str, rank: int, calls: list) -> None:
    """Each call's error, or "no error", one line each in --out/{case}_rank{rank}.txt."""
    msgs = []
    for call in calls:
        try:
            call()
            msgs.append("no error")
        except Exception as e:  # noqa: BLE001 - the test checks which error it was
            msgs.append(f"{type(e).__name__}: {e}")
    with open(os.path.join(out, f"{case}_rank{rank}.txt"), "w") as f:
        f.write("\n".join(msgs))


class Skippable(torch.nn.Module):
    """Uses layer b while `use_b` (a Python flag: a branch the trace bakes in)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)
        self.use_b = True

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        if self.use_b:
            h = self.b(h)
        return ((h - y) ** 2).mean()


def run(case: str, out: str | None) -> None:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    batches = global_batches("gpt", 50)
    model = build_model("gpt")
    cfg = fxspeed.Config(zero=3, lr=1e-2, bucket_mb=0.05)
    example = local_batch(batches[0])

    if case in ("raise", "exit", "sys_exit"):
        engine = fxspeed.compile(model, world, cfg, example_inputs=example)
        engine.train_step(*example)
        if rank == 1:
            if case == "exit":
                os._exit(13)
            if case == "sys_exit":
                sys.exit(7)
            raise RuntimeError("rank 1 fails on purpose after compile")
        t0 = time.time()
        for b in batches[1:]:  # blocks in the step's first collective: rank 1 is gone
            engine.train_step(*local_batch(b))
        print(f"rank {rank}: trained {len(batches) - 1} steps without rank 1 in {time.time() - t0:.1f} s", flush=True)
        raise SystemExit(0)

    if case in ("longer", "longer_tp"):  # rank 0's loader holds one batch more: it starts a step rank 1 never joins
        if case == "longer_tp":  # the step's first collective is the tp ranks' batch check
            cfg, mine = fxspeed.Config(tensor=world, lr=1e-2), (lambda b: b)
        else:
            mine = local_batch
        engine = fxspeed.compile(model, world, cfg, example_inputs=mine(batches[0]))
        try:
            for b in batches[:3 if rank == 0 else 2]:
                engine.train_step(*mine(b))
            msg = "no error"
        except FxspeedError as e:
            msg = f"FxspeedError: {e}"
        with open(os.path.join(out, f"{case}_rank{rank}.txt"), "w") as f:
            f.write(msg)
        if rank == 1:
            sys.exit(0)  # as a script ends (main's destroy_process_group would close the group first)
        return

    if case == "midstep":
        # rank 1's batch holds a token id outside the vocabulary: its forward raises while rank 0
        # runs the step's gradient all-reduce; rank 1 catches it and tries the next batch
        engine = fxspeed.compile(model, world, fxspeed.Config(lr=1e-2, dist_timeout_s=20.0), example_inputs=example)
        engine.train_step(*example)
        bad = local_batch(batches[1])
        if rank == 1:
            bad = (bad[0].clone().fill_(10_000), bad[1])
        write_errors(out, case, rank, [lambda b=b: engine.train_step(*b) for b in (bad, local_batch(batches[2]))])
        return

    if case == "midserve":
        # a device slow enough that the weights are split (the step all-reduces activations)
        slow = dataclasses.replace(fxspeed.devices("cpu")[0], flops={"fp32": 1e8}, mem_bandwidth=1e7)
        engine = fxspeed.serve(model, devices=[slow] * world, config=fxspeed.Config(tensor=world, dist_timeout_s=20.0),
                               token_budget=8, max_batch=2, block_size=4, cache_tokens=64)
        prompts = [[1, 2, 3], [4, 5]]
        engine.generate(prompts, max_new_tokens=3)
        if rank == 1:
            def fails(chunks: object) -> None:
                raise RuntimeError("injected step failure")

            engine._serving._step = fails
        write_errors(out, case, rank, [lambda: engine.generate(prompts, max_new_tokens=3)] * 2)
        return

    if case == "branch":
        skippable = Skippable()
        x, y = torch.randn(4, 8), torch.randn(4, 8)
        engine = fxspeed.compile(skippable, world, fxspeed.Config(zero=1, lr=1e-2), example_inputs=(x, y))
        engine.train_step(x, y)
        skippable.use_b = False
        try:
            engine.train_step(x, y)
            msg = "no error"
        except FxspeedError as e:
            msg = f"FxspeedError: {e}"
        with open(os.path.join(out, f"{case}_rank{rank}.txt"), "w") as f:
            f.write(msg)
        return

    try:
        if case == "model" and rank == 1:
            model = GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=3, n_head=2, n_embd=32))
        if case == "buffer" and rank == 1:  # one rank's extra buffer shifted the others' values
            model.register_buffer("extra", torch.zeros(3))
        if case == "frozen" and rank == 1:  # a weight frozen on one rank aborted gloo at the first step
            next(model.parameters()).requires_grad_(False)
        if case == "config" and rank == 1:
            cfg = fxspeed.Config(zero=3, lr=3e-2, bucket_mb=0.05)
        if case == "devices":  # a rate measured on each rank: the planner's choices would differ
            # (hosts with other RAM are fine: the memory of "auto" devices is each host's own)
            world = [dataclasses.replace(fxspeed.devices("cpu")[0], mem_bandwidth=(1 + rank) * 1e10,
                                         memory=(1 + rank) * 1e10)] * world
        if case == "indivisible":
            x = torch.randint(0, 64, (5, 16))
            example = local_batch((x, x))
        if case == "attribute":  # baked into the trace like a shape: the ranks' programs would differ
            model.loss_scale_hint = 2.0 if rank == 1 else 1.0
        if case == "shapes" and rank == 1:
            example = tuple(t[:, :8] for t in example)  # a shorter sequence on rank 1 only
        engine = fxspeed.compile(model, world, cfg, example_inputs=example)
        engine.train_step(*example)
        msg = "no error"
    except ConfigError as e:
        msg = f"ConfigError: {e}"
    with open(os.path.join(out, f"{case}_rank{rank}.txt"), "w") as f:
        f.write(msg)


if __name__ == "__main__":
    main()
