"""offload_stage_activations: under a pipeline, the activations a micro-batch's forward saved
for its backward leave the device while other micro-batches compute. The schedule gets an
OFFLOAD(s,m) right after F(s,m) and a RELOAD(s,m) before the compute action that precedes the
backward of (s,m), so the copy back runs while that action computes:

    before:  rank 0: 0F0 SEND_F(0,0->r1) 0F1 SEND_F(0,1->r1) 0F2 ... RECV_B(0,0<-r1) 0B0 ...
    after:   rank 0: 0F0 OFFLOAD(0,0) SEND_F(0,0->r1) 0F1 SEND_F(0,1->r1) RELOAD(0,0) 0F2 ...
                     RECV_B(0,0<-r1) 0B0 ...

Only where it pays: a (stage, micro-batch) whose forward and backward have at least two other
compute actions between them on the rank (with one, the activations would come back as soon as
they left); and of its saved values only dense ones of at least activation_offload_min_bytes
that own their memory alone (`StageProgram.offload_saved`; see `movable`). The last stage under 1F1B runs
each backward right after its forward: nothing moves there. The runtime (runtime/runner.py)
moves them through the engine's activation store (runtime/offloaded_activations.py).
Options read: activation_store (empty: the pass does nothing), activation_offload_min_bytes.
why: docs/decisions/activation-offload.md
"""

from __future__ import annotations

import dataclasses
from collections import Counter

import torch
import torch.fx as fx

from fxspeed.compiler.pass_manager import DistributedProgram, PassContext, ProgramResult, program_pass
from fxspeed.ir import StageProgram, is_dense, tensor_bytes
from fxspeed.ir.schedule import COMPUTE_KINDS, OFFLOAD, RELOAD, Action, B, F, I, Schedule
from fxspeed.passes.memory.offload_activations import read_at_absolute_offset, storage_root

# the compute actions a (stage, micro-batch) needs between its forward and backward to move
MIN_ACTIONS_BETWEEN = 2


@program_pass("offload_stage_activations", requires=("stages", "schedule"))
def offload_stage_activations(program: DistributedProgram, ctx: PassContext) -> ProgramResult:
    o = ctx.options
    if not o.activation_store or program.schedule is None or not program.stages:
        return ProgramResult(program, modified=False)
    stages = [dataclasses.replace(p, offload_saved=movable(p, o.activation_offload_min_bytes))
              for p in program.stages]
    moving = {p.stage for p in stages if p.offload_saved}
    if not moving:
        return ProgramResult(program, modified=False)
    sch = bracket_activations(program.schedule, moving)
    return ProgramResult(dataclasses.replace(program, stages=stages, schedule=sch), modified=True)


def movable(p: StageProgram, min_bytes: int) -> list[int]:
    """Indices of the stage's saved outputs worth moving: dense tensors of at least `min_bytes`
    that own their memory alone (not a view of a parameter or input, nor sharing storage with
    another output of F: moving one copy would free nothing) and that no backward program views
    at an absolute storage offset (a reloaded tensor starts elsewhere in its storage)."""
    out = next(n for n in reversed(p.forward.graph.nodes) if n.op == "output")
    outs = list(out.args[0])
    roots = [storage_root(v) if isinstance(v, fx.Node) else None for v in outs]
    shared = Counter(r for r in roots if r is not None)
    k = len(p.send_f)
    chosen = []
    for i, val in enumerate(p.saved_meta()):
        root = roots[k + i]
        if not (isinstance(val, torch.Tensor) and val.numel() and is_dense(val) and tensor_bytes(val) >= min_bytes):
            continue
        whole = root is not None and root.op == "call_function" and shared[root] == 1 and \
            isinstance(root.meta.get("val"), torch.Tensor) and root.meta["val"].numel() == val.numel()
        if whole and not any(_viewed_absolutely(gm, len(p.state) + p.n_batch + i)
                             for gm in (p.backward, p.backward_input, p.backward_weight) if gm is not None):
            chosen.append(i)
    return chosen


def _viewed_absolutely(gm: fx.GraphModule, position: int) -> bool:
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    return position < len(placeholders) and read_at_absolute_offset(placeholders[position])


def bracket_activations(sch: Schedule, stages: set[int]) -> Schedule:
    """`sch` with OFFLOAD(s,m) after F(s,m) and RELOAD(s,m) before the last compute action ahead
    of its backward, for each (s,m) of `stages` with room between them."""
    actions = []
    for acts in sch.actions:
        where = {(a.kind, a.stage, a.microbatch): i for i, a in enumerate(acts) if a.kind in COMPUTE_KINDS}
        after: dict[int, list[Action]] = {}
        before: dict[int, list[Action]] = {}
        for (kind, s, m), f in where.items():
            if kind != F or s not in stages:
                continue
            b = where.get((B, s, m), where.get((I, s, m)))
            if b is None:
                continue
            between = [i for i in range(f + 1, b) if acts[i].kind in COMPUTE_KINDS]
            if len(between) < MIN_ACTIONS_BETWEEN:
                continue
            after.setdefault(f, []).append(Action(OFFLOAD, s, m))
            before.setdefault(between[-1], []).append(Action(RELOAD, s, m))
        out: list[Action] = []
        for i, a in enumerate(acts):
            out += before.get(i, [])
            out.append(a)
            out += after.get(i, [])
        actions.append(out)
    return dataclasses.replace(sch, actions=actions)
