"""Run under torch.distributed.run with N = pipeline x data-parallel ranks: trains a tiny model
(the GPT with tied wte/head, or GPT2LMHeadModel) with fxspeed pipeline parallelism for each
requested (schedule, micro-batches) and writes, per rank, the losses and the parameters the rank
holds to --out/{tag}{schedule}_m{M}_rank{r}.pt.

Several runs in one launch: each `--case "<these flags>"` is parsed as its own command line (with
the launch's --out) and run in turn, in one process group; the tests give each case a --tag. A
launch costs ~12 s (2 ranks) to ~25 s (4 ranks on 2 cores) of process start-up and imports, a
case a few seconds, so the suite runs its cases in few launches.

The ranks of one pipeline pass the same batch: their replica's slice of the global batch
(fxspeed.data.local_batch with the engine's dp_rank / dp_size). The test merges one
pipeline's parameters and compares with one process on the whole global batch.
"""

from __future__ import annotations

import argparse
import os
import shlex
import time

import torch
import torch.distributed as dist

import fxspeed
from fxspeed.data import local_batch
from tests.workers.common import build_model, global_batches

SAVE_AT = 2  # --checkpoint: the run saves after this many steps


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="gpt", choices=("gpt", "gpt2", "gpt6", "gpt2-6"))
    ap.add_argument("--schedules", default="gpipe,1f1b")
    ap.add_argument("--microbatches", default="")  # comma list; default P and 2P
    ap.add_argument("--pipeline", type=int, default=0, help="pipeline degree (default: every rank)")
    ap.add_argument("--zero", default="0", help="ZeRO stage, or a comma list (files then tagged _z<stage>)")
    ap.add_argument("--precision", default="fp32")
    ap.add_argument("--loss-scale", type=float, default=None)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--grad-clip", type=float, default=None)
    ap.add_argument("--checkpoint", action="store_true",
                    help=f"also: save after {SAVE_AT} steps of the run, resume a fresh engine from it, record the "
                         "run's later losses and the fresh engine's")
    ap.add_argument("--eval", action="store_true",
                    help="also run eval_step after training (compiles the forward-only programs) and record its loss")
    ap.add_argument("--other-batch", action="store_true",
                    help="also: after training, pass a batch of half the rows and record the error's message")
    ap.add_argument("--tag", default="", help="prefix of this run's file names")
    ap.add_argument("--case", action="append", default=[],
                    help="one run's flags, quoted; repeat for several runs in this launch")
    ap.add_argument("--out", required=True)
    return ap


def operand_dtype(a: torch.fx.Node) -> torch.dtype:
    """The dtype of the values a matmul multiplies: on a CPU without native bf16/fp16 arithmetic,
    upcast_cpu_compute feeds it fp32 copies of the low-precision values (so it reports theirs)."""
    src = a.args[0] if a.target is torch.ops.aten._to_copy.default and a.kwargs.get("dtype") == torch.float32 else None
    if isinstance(src, torch.fx.Node) and src.meta["val"].dtype in (torch.bfloat16, torch.float16):
        return src.meta["val"].dtype
    return a.meta["val"].dtype


def main() -> None:
    ap = parser()
    a = ap.parse_args()
    os.environ.setdefault("FXSPEED_BACKEND", "gloo")
    torch.set_num_threads(1)
    for case in [ap.parse_args([*shlex.split(c), "--out", a.out]) for c in a.case] or [a]:
        t0 = time.perf_counter()
        run(case)
        dist.barrier()
        if dist.get_rank() == 0:  # in the launch's output: where its time goes
            print(f"pipeline_worker: {case.tag or case.model}: {time.perf_counter() - t0:.1f} s", flush=True)
    dist.destroy_process_group()


def run(a: argparse.Namespace) -> None:
    world = int(os.environ["WORLD_SIZE"])
    P = a.pipeline or world
    mbs = [int(m) for m in a.microbatches.split(",")] if a.microbatches else [P, 2 * P]
    batches = global_batches(a.model, a.steps)
    zeros = [int(z) for z in a.zero.split(",")]
    for sched, M, zero in ((s, m, z) for s in a.schedules.split(",") for m in mbs for z in zeros):
        model = build_model(a.model)
        cfg = fxspeed.Config(pipeline=P, microbatches=M, schedule=sched, lr=1e-2, optimizer="adamw",
                             grad_clip=a.grad_clip, zero=zero, precision=a.precision,
                             loss_scale=a.loss_scale)
        rank, dp_size = dist.get_rank() if dist.is_initialized() else int(os.environ["RANK"]), world // P
        mine = [local_batch(b, rank // P, dp_size) for b in batches]
        engine = fxspeed.compile(model, world, cfg, example_inputs=mine[0])
        assert (engine.dp_rank, engine.dp_size) == (rank // P, dp_size)
        tag = f"{a.tag}{sched}_m{M}"
        ckpt = os.path.join(a.out, f"ckpt_{tag}")
        losses = []
        for i, b in enumerate(mine):
            if a.checkpoint and i == SAVE_AT:
                engine.save(ckpt)  # mid-run: the losses and weights after it are the uninterrupted run's
            losses.append(step(engine, b))
        state = {k: v.clone() for k, v in engine.state_dict().items()}
        ev = mine[0]
        eval_loss = None
        if a.eval:
            eval_loss = engine.eval_step(*ev) if isinstance(ev, tuple) else engine.eval_step(**ev)
        other_batch = None
        if a.other_batch:  # refused on every rank before anything runs (the batch signature is local)
            try:
                step(engine, tuple(t[:t.shape[0] // 2] for t in ev))
            except fxspeed.ConfigError as e:
                other_batch = str(e)
        low = {operand_dtype(n.args[-1]) for p in engine.programs for n in p.forward.graph.nodes
               if n.op == "call_function" and n.target in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default)}
        torch.save({"losses": losses, "state": state, "stages": engine.stages, "stats": dict(engine.stats),
                    "matmul_dtypes": sorted(str(d) for d in low), "plan": engine.plan.pipeline,
                    "summary": engine.plan.summary(), "eval_loss": eval_loss, "other_batch": other_batch, "rank_memory": engine.plan.memory(dist.get_rank()),
                    "describe": engine.describe() if dist.get_rank() == 0 else None,
                    "actions": [str(x) for x in engine.schedule.actions[engine.position]]},
                   os.path.join(a.out, f"{a.tag}{sched}_m{M}{f'_z{zero}' if len(zeros) > 1 else ''}_rank{dist.get_rank()}.pt"))
        dist.barrier()
        if a.checkpoint:
            resume_check(a, model_name=a.model, world=world, cfg=cfg, batches=mine, tag=tag, ckpt=ckpt,
                         straight=losses[SAVE_AT:], straight_state=state)


def step(engine: fxspeed.Engine, b) -> float:  # noqa: ANN001
    return engine.train_step(*b) if isinstance(b, tuple) else engine.train_step(**b)


def resume_check(a: argparse.Namespace, *, model_name: str, world: int, cfg: fxspeed.Config, batches: list,
                 tag: str, ckpt: str, straight: list[float], straight_state: dict[str, torch.Tensor]) -> None:
    """The losses of steps SAVE_AT+1.. of the uninterrupted run (which saved `ckpt` after step SAVE_AT)
    and of a fresh engine loaded from that checkpoint; whether their final weights are equal."""
    fresh = fxspeed.compile(build_model(model_name), world, cfg, example_inputs=batches[0])
    fresh.load(ckpt)
    resumed = [step(fresh, b) for b in batches[SAVE_AT:]]
    state = {k: v.clone() for k, v in fresh.state_dict().items()}  # a collective under a pipeline: every rank
    same = state.keys() == straight_state.keys() and all(torch.equal(v, straight_state[k]) for k, v in state.items())
    torch.save({"straight": straight, "resumed": resumed, "same_params": same},
               os.path.join(a.out, f"resume_{tag}_rank{dist.get_rank()}.pt"))
    dist.barrier()


if __name__ == "__main__":
    main()
