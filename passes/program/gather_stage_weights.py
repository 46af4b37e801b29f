"""gather_stage_weights: ZeRO-3 under a pipeline keeps each stage's weights as shards except while
the stage computes. The schedule gets a GATHER(s) before the first action of stage s on its rank
(a receive of its input included, so the gather runs while upstream computes) and a RELEASE(s)
right after the stage's last compute action:

    before:  rank 0: 0F0 SEND_F(0,0->r1) 0F1 ... 0B1 REDUCE(0) STEP
    after:   rank 0: GATHER(0) 0F0 SEND_F(0,0->r1) 0F1 ... 0B1 RELEASE(0) REDUCE(0) STEP

The runtime (runtime/runner.py) hands both to the engine, which all-gathers the stage's flat
buckets over the data-parallel group and drops them again; with several stages per rank
(interleaved), a stage's weights are whole only from its first to its last action; a bucket
two stages of a rank read stays whole until both released it. Nothing after the schedule reads
the weights (the gradients are summed and bucketed by name), tied ones included. Options read: zero, world_size (nothing to do below ZeRO-3 or on one replica).
why: docs/decisions/zero-under-a-pipeline.md
"""

from __future__ import annotations

import dataclasses

from fxspeed.compiler.pass_manager import DistributedProgram, PassContext, ProgramResult, program_pass
from fxspeed.ir.schedule import COMPUTE_KINDS, GATHER, RELEASE, Action, Schedule


@program_pass("gather_stage_weights", requires=("schedule",))
def gather_stage_weights(program: DistributedProgram, ctx: PassContext) -> ProgramResult:
    o = ctx.options
    sch = program.schedule
    if o.zero < 3 or o.world_size == 1 or sch is None:
        return ProgramResult(program, modified=False)
    return ProgramResult(dataclasses.replace(program, schedule=bracket(sch)), modified=True)


def bracket(sch: Schedule) -> Schedule:
    """`sch` with GATHER(s) before the first action of each stage s and RELEASE(s) after its last
    compute action, on every rank."""
    actions = []
    for acts in sch.actions:
        first: dict[int, int] = {}
        last: dict[int, int] = {}
        for i, a in enumerate(acts):
            if a.stage is None:
                continue
            first.setdefault(a.stage, i)
            if a.kind in COMPUTE_KINDS:
                last[a.stage] = i
        out: list[Action] = []
        for i, a in enumerate(acts):
            out += [Action(GATHER, s) for s, j in first.items() if j == i]
            out.append(a)
            out += [Action(RELEASE, s) for s, j in last.items() if j == i]
        actions.append(out)
    return dataclasses.replace(sch, actions=actions)
