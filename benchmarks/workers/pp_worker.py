"""Run under torch.distributed.run (gloo, CPU, 2 ranks): train the same GPT as a 2-rank pipeline
with fxspeed and with torch.distributed.pipelining, and in one process on the global batch;
record step times and losses.

Rows (--rows, comma separated):

    fx:S      fxspeed.compile(..., Config(pipeline=P, microbatches=M, schedule=S, optimizer="adamw"))
    torch:S   torch.distributed.pipelining: PipelineStage per stage, built by hand from the GPT's
              submodules with fxspeed's split of the fx:S row (which must come first), and the
              torch schedule of the same name (gpipe -> ScheduleGPipe, 1f1b -> Schedule1F1B,
              interleaved -> ScheduleInterleaved1F1B, zb -> ScheduleInterleavedZeroBubble)
    single    plain eager torch on rank 0 on the global batch (the other ranks wait)

Every row: the same GPT (seed 0), torch AdamW with its fused kernel (fxspeed's runtime uses it
too, so optimizer speed is not what the rows compare; same lr, weight_decay 0, no clipping), the same
global batch per step on every rank, one intra-op thread per process. A step is forward +
backward over M micro-batches + the tied weight's gradient summed over the ranks holding it +
optimizer step + zero grad + the mean loss on every rank (broadcast from the last stage, as
fxspeed's train_step returns it), so every pipeline row does the same work.

Timing: all rows are built first; then, step by step, every row runs one step, in an order
that rotates from step to step, so load changes of a shared machine hit every row alike. Each
step starts after a barrier (ranks aligned), and each rank times its own step: wall time, and
the process's CPU time (all its threads, gloo's included), which other load on the machine
barely changes.

Writes rows_rank{r}.json into --out.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import time
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

StepFn = Callable[[torch.Tensor, torch.Tensor], float]
STAT_KEYS = ("idle_fraction", "step_s", "compute_s")  # PipelineEngine.stats, per rank, last step


def build(a: argparse.Namespace) -> nn.Module:
    from fxspeed.models import GPT, GPTConfig

    torch.manual_seed(0)
    cfg = GPTConfig.preset(a.preset)
    for field in ("n_layer", "n_embd", "n_head", "vocab_size"):
        if getattr(a, field) is not None:
            setattr(cfg, field, getattr(a, field))
    cfg.block_size = max(cfg.block_size, a.seq)
    return GPT(cfg)


def batches(a: argparse.Namespace, vocab: int, n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The global batch of each step; seeded by step only, so every rank draws the same."""
    out = []
    for s in range(n):
        g = torch.Generator().manual_seed(1000 + s)
        out.append((torch.randint(0, vocab, (a.batch, a.seq), generator=g),
                    torch.randint(0, vocab, (a.batch, a.seq), generator=g)))
    return out


def adamw(params: list[nn.Parameter], lr: float) -> torch.optim.Optimizer:
    # fxspeed's Config defaults: betas (0.9, 0.999), eps 1e-8, weight_decay 0 (torch's AdamW default is 0.01).
    return torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, fused=True)


# --- fxspeed -----------------------------------------------------------------------------------
def setup_fx(schedule: str, a: argparse.Namespace, example: tuple, world: int) -> tuple[StepFn, object]:
    import fxspeed

    cfg = fxspeed.Config(pipeline=world, microbatches=a.microbatches, schedule=schedule, optimizer="adamw",
                         lr=a.lr, pipeline_chunks=a.chunks)
    engine = fxspeed.compile(build(a), world, cfg, example_inputs=example)
    return engine.train_step, engine


def block_ranges(stages: list[dict], n_layer: int) -> list[tuple[int, int]]:
    """[lo, hi) block indices of each stage, read off the parameter names fxspeed put on it."""
    ranges = []
    for st in stages:
        idx = sorted({int(m.group(1)) for n in st["params"] if (m := re.match(r"blocks\.(\d+)\.", n))})
        if idx and idx != list(range(idx[0], idx[-1] + 1)):
            raise RuntimeError(f"stage {st['stage']} holds non-contiguous blocks {idx}")
        ranges.append((idx[0], idx[-1] + 1) if idx else None)
    # A stage without blocks (embedding-only or head-only) sits between its neighbours.
    lo = 0
    out = []
    for r in ranges:
        out.append(r if r is not None else (lo, lo))
        lo = out[-1][1]
    if lo != n_layer or any(x[0] != y[1] for x, y in zip(out[1:], out)):
        raise RuntimeError(f"fxspeed's stages do not cover the {n_layer} blocks in order: {out}")
    # The hand-built torch stages put the embeddings first and the final norm last: check that
    # this is fxspeed's split too, or the comparison would not be of the same split.
    # (The tied weight may be listed as wte.weight or head.weight: one Parameter, two names.)
    first, last = set(stages[0]["params"]), set(stages[-1]["params"])
    if "wpe.weight" not in first or not {"ln_f.weight", "ln_f.bias"} <= last:
        raise RuntimeError("fxspeed's first stage lacks the embeddings or its last stage the final norm")
    return out


# --- torch.distributed.pipelining --------------------------------------------------------------
class Stage(nn.Module):
    """One pipeline stage of the GPT, made of the model's own submodules: the embeddings on the
    first stage, blocks [lo, hi), and the final norm + head on the last (which returns logits;
    the loss is the schedule's loss_fn)."""

    def __init__(self, gpt: nn.Module, lo: int, hi: int, first: bool, last: bool):
        super().__init__()
        self.first, self.last = first, last
        if first:
            self.wte, self.wpe, self.drop = gpt.wte, gpt.wpe, gpt.drop
        self.blocks = nn.ModuleList(gpt.blocks[lo:hi])
        if last:
            self.ln_f, self.head = gpt.ln_f, gpt.head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.first:
            x = self.drop(self.wte(x) + self.wpe(torch.arange(x.shape[1], device=x.device)))
        for b in self.blocks:
            x = b(x)
        return self.head(self.ln_f(x)) if self.last else x


def lm_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), target.reshape(-1))


def setup_torch(schedule: str, a: argparse.Namespace, ranges: list[tuple[int, int]], rank: int,
                world: int) -> tuple[StepFn, object]:
    from torch.distributed import pipelining as pp

    # This process builds the whole GPT (seed 0, the same weights as fxspeed's) and keeps the
    # submodules of its own stages. The tied wte/head weight thus exists once on the first
    # stage's rank (as wte) and once on the last stage's rank (as head): two copies, whose
    # gradients are summed before the step (Megatron's embedding group).
    gpt = build(a)
    n_stages = len(ranges)
    mine = [s for s in range(n_stages) if s % world == rank]  # loop placement, as fxspeed's schedules
    mb, T, C, V = a.batch // a.microbatches, a.seq, gpt.config.n_embd, gpt.config.vocab_size
    modules, stages = [], []
    for s in mine:
        m = Stage(gpt, *ranges[s], first=s == 0, last=s == n_stages - 1)
        # Static metadata. Float examples must require grad: (torch 2.13) the stage takes
        # requires_grad from them, and would neither receive nor send gradients otherwise.
        x_in = torch.zeros(mb, T, dtype=torch.long) if s == 0 else torch.empty(mb, T, C, requires_grad=True)
        x_out = torch.empty(mb, T, V if s == n_stages - 1 else C, requires_grad=True)
        modules.append(m)
        stages.append(pp.PipelineStage(m, s, n_stages, torch.device("cpu"), input_args=(x_in,),
                                       output_args=(x_out,)))
    del gpt
    kind = {"gpipe": pp.ScheduleGPipe, "1f1b": pp.Schedule1F1B, "interleaved": pp.ScheduleInterleaved1F1B,
            "zb": pp.ScheduleInterleavedZeroBubble}[schedule]
    # scale_grads: gradients divided by M, matching a mean loss over equal micro-batches.
    # gpipe / 1f1b take one stage per rank; interleaved / zb a list of this rank's stages.
    first_arg = stages[0] if schedule in ("gpipe", "1f1b") else stages
    sched = kind(first_arg, a.microbatches, loss_fn=lm_loss, scale_grads=True)
    params = list({id(p): p for m in modules for p in m.parameters()}.values())
    opt = adamw(params, a.lr)
    first_rank, last_rank = 0, (n_stages - 1) % world
    tied_group = dist.new_group(sorted({first_rank, last_rank}))  # every rank creates it, in the same order
    tied = [m.wte.weight for m in modules if m.first] + [m.head.weight for m in modules if m.last]
    has_first, has_last = 0 in mine, n_stages - 1 in mine

    def step(x: torch.Tensor, y: torch.Tensor) -> float:
        losses: list[torch.Tensor] = []
        # The first stage feeds the inputs, the last the targets; outputs are not merged
        # (fxspeed returns none either).
        args = (x,) if has_first else ()
        kw = {"target": y, "losses": losses} if has_last else {}
        sched.step(*args, return_outputs=False, **kw)
        if first_rank != last_rank and rank in (first_rank, last_rank):
            g = tied[0].grad
            if g is None:
                g = tied[0].grad = torch.zeros_like(tied[0])
            dist.all_reduce(g, group=tied_group)
        opt.step()
        opt.zero_grad(set_to_none=True)
        out = torch.stack(losses).mean().detach() if has_last else torch.zeros(())
        dist.broadcast(out, src=last_rank)
        return float(out)

    return step, (sched, stages, modules, opt)


# --- one process -------------------------------------------------------------------------------
def setup_single(a: argparse.Namespace, rank: int) -> tuple[StepFn, object]:
    model = build(a)
    opt = adamw(list(model.parameters()), a.lr)

    def step(x: torch.Tensor, y: torch.Tensor) -> float:
        if rank != 0:
            return float("nan")  # only rank 0 runs the one-process baseline; the others wait
        loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return float(loss)

    return step, (model, opt)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", required=True)
    ap.add_argument("--preset", default="small")
    ap.add_argument("--n-layer", dest="n_layer", type=int, default=None)
    ap.add_argument("--n-embd", dest="n_embd", type=int, default=None)
    ap.add_argument("--n-head", dest="n_head", type=int, default=None)
    ap.add_argument("--vocab", dest="vocab_size", type=int, default=None)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--microbatches", type=int, default=4)
    ap.add_argument("--chunks", type=int, default=2)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    os.environ.setdefault("FXSPEED_BACKEND", "gloo")
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    rows = a.rows.split(",")
    n = a.warmup + a.steps
    ref = build(a)
    model_cfg = dict(vars(ref.config))
    n_params = sum(p.numel() for p in ref.parameters())  # the tied weight once
    del ref
    data = batches(a, model_cfg["vocab_size"], n)

    steps: dict[str, StepFn] = {}
    keep: dict[str, object] = {}
    recs: dict[str, dict] = {}
    splits: dict[str, list[tuple[int, int]]] = {}
    for row in rows:
        t0 = time.perf_counter()
        kind, _, sched = row.partition(":")
        rec: dict = {"row": row, "rank": rank, "world": world}
        if kind == "fx":
            steps[row], keep[row] = setup_fx(sched, a, data[0], world)
            rec["stages"] = keep[row].describe()["stages"]
            splits[sched] = block_ranges(rec["stages"], model_cfg["n_layer"])
            rec["split_blocks"] = splits[sched]
        elif kind == "torch":
            if sched not in splits:
                raise SystemExit(f"row {row} needs fx:{sched} before it (it copies fxspeed's split)")
            steps[row], keep[row] = setup_torch(sched, a, splits[sched], rank, world)
            rec["split_blocks"] = splits[sched]
        elif kind == "single":
            steps[row], keep[row] = setup_single(a, rank)
        else:
            raise SystemExit(f"unknown row {row!r}")
        rec.update(setup_s=time.perf_counter() - t0, step_times_s=[], warmup_times_s=[], cpu_times_s=[], losses=[])
        recs[row] = rec

    for s, (x, y) in enumerate(data):
        k = s % len(rows)
        for row in rows[k:] + rows[:k]:  # rotate the order every step
            dist.barrier()
            c, t = time.process_time(), time.perf_counter()
            loss = steps[row](x, y)
            dt, dc = time.perf_counter() - t, time.process_time() - c
            rec = recs[row]
            (rec["step_times_s"] if s >= a.warmup else rec["warmup_times_s"]).append(dt)
            if s >= a.warmup:
                rec["cpu_times_s"].append(dc)
            rec["losses"].append(loss)
            # fxspeed's own account of the last step, where the engine provides it.
            stats = getattr(keep[row], "stats", None)
            if isinstance(stats, dict) and s >= a.warmup:
                for key in STAT_KEYS:
                    if stats.get(key) is not None:
                        rec.setdefault(key, []).append(float(stats[key]))
    dist.barrier()
    with open(os.path.join(a.out, f"rows_rank{rank}.json"), "w") as f:
        json.dump({"rows": recs, "threads": torch.get_num_threads(), "model": model_cfg, "params": n_params}, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
