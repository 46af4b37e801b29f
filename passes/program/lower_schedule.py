"""Pipeline schedule generators: GPipe, 1F1B, interleaved 1F1B and zero-bubble ZB-H1.

Each generator decides only the order of compute actions (F, B or I/W) per rank;
`from_compute_order` then inserts the point-to-point actions (a recv right before the action
that needs the data, a send right after the action that produced it), a REDUCE of each stage
right after its last backward piece (so gradient reduction overlaps the rest of the
backward), and a final STEP. The results validate under `fxspeed.ir.schedule.validate`.

`lower_schedule_pass` is the program pass: it adds the schedule that ctx.options names
(schedule, pipeline, microbatches, pipeline_chunks) to the program.
"""

from __future__ import annotations

import dataclasses

from fxspeed.compiler.pass_manager import DistributedProgram, PassContext, ProgramResult, program_pass
from fxspeed.errors import ConfigError
from fxspeed.ir.schedule import (B, F, I, RECV_B, RECV_F, REDUCE, SEND_B, SEND_F, STEP, W, Action, Schedule,
                                 validate)

__all__ = ["CONFIG_SCHEDULES", "SCHEDULES", "from_compute_order", "gpipe", "interleaved_1f1b", "lower_schedule_pass",
           "make", "one_f_one_b", "zero_bubble_h1"]


def _check_positive(fn: str, **values: int) -> None:
    for name, v in values.items():
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ConfigError(f"{fn}: {name}={v!r} is invalid; it must be an int >= 1")


def from_compute_order(name: str, n_microbatches: int, placement: list[int] | tuple[int, ...],
                       compute: list[list[tuple[str, int, int]]], *, check: bool = True) -> Schedule:
    """Build a full schedule from per-rank (kind, stage, mb) compute lists by adding p2p, REDUCE and STEP."""
    placement = tuple(placement)
    n_stages = len(placement)
    last_bwd: dict[tuple[int, int], int] = {}  # (rank, stage) -> index of its last B/W in `compute`
    for r, ops in enumerate(compute):
        for j, (kind, s, _) in enumerate(ops):
            if kind in (B, W):
                last_bwd[(r, s)] = j
    actions: list[list[Action]] = []
    for r, ops in enumerate(compute):
        acts: list[Action] = []
        for j, (kind, s, m) in enumerate(ops):
            if kind == F and s > 0 and placement[s - 1] != r:
                acts.append(Action(RECV_F, s, m, placement[s - 1]))
            if kind in (B, I) and s < n_stages - 1 and placement[s + 1] != r:
                acts.append(Action(RECV_B, s, m, placement[s + 1]))
            acts.append(Action(kind, s, m))
            if kind == F and s < n_stages - 1 and placement[s + 1] != r:
                acts.append(Action(SEND_F, s, m, placement[s + 1]))
            if kind in (B, I) and s > 0 and placement[s - 1] != r:
                acts.append(Action(SEND_B, s, m, placement[s - 1]))
            if kind in (B, W) and last_bwd.get((r, s)) == j:
                acts.append(Action(REDUCE, s))
        acts.append(Action(STEP))
        actions.append(acts)
    sch = Schedule(name, n_stages, n_microbatches, placement, actions)
    if check:
        validate(sch)
    return sch


def gpipe(P: int, M: int) -> Schedule:
    """GPipe: all M forwards, then all M backwards. Holds M micro-batches' activations per rank."""
    _check_positive("gpipe", P=P, M=M)
    compute = [[(F, r, m) for m in range(M)] + [(B, r, m) for m in range(M)] for r in range(P)]
    return from_compute_order("gpipe", M, list(range(P)), compute)


def _one_f_one_b_order(P: int, M: int, r: int, split: bool) -> list[tuple[str, int, int]]:
    """1F1B on rank r: P-1-r warm-up forwards, then alternate F/backward, then drain backwards.

    With `split` (ZB-H1) the backward is I, and W(k) is deferred by r steps: the last rank,
    whose input gradients head the critical path, pushes them upstream first; the deferred W
    fill the waits of the drain. In-flight micro-batches (F done, W not) stay <= P as in 1F1B.
    """
    warmup = min(P - 1 - r, M)
    bwd = I if split else B
    delay = r if split else 0
    ops: list[tuple[str, int, int]] = [(F, r, m) for m in range(warmup)]
    next_w = 0

    def after_backward(k: int) -> None:
        nonlocal next_w
        if split and next_w <= k - delay:
            ops.append((W, r, next_w))
            next_w += 1

    for k in range(M - warmup):
        ops.append((F, r, warmup + k))
        ops.append((bwd, r, k))
        after_backward(k)
    for k in range(M - warmup, M):
        ops.append((bwd, r, k))
        if split and next_w <= k:
            # The drain waits for gradients from downstream anyway: do one deferred W per I.
            ops.append((W, r, next_w))
            next_w += 1
    if split:
        ops.extend((W, r, m) for m in range(next_w, M))
    return ops


def one_f_one_b(P: int, M: int) -> Schedule:
    """1F1B (PipeDream-flush): same bubble as GPipe, but at most P-r micro-batches in flight on rank r."""
    _check_positive("one_f_one_b", P=P, M=M)
    return from_compute_order("1f1b", M, list(range(P)), [_one_f_one_b_order(P, M, r, False) for r in range(P)])


def zero_bubble_h1(P: int, M: int) -> Schedule:
    """ZB-H1 (Qi et al. 2023): 1F1B with backward split into I and W, W deferred into the bubbles."""
    _check_positive("zero_bubble_h1", P=P, M=M)
    return from_compute_order("zb-h1", M, list(range(P)), [_one_f_one_b_order(P, M, r, True) for r in range(P)])


def interleaved_1f1b(P: int, v: int, M: int) -> Schedule:
    """Interleaved 1F1B (Megatron): v chunks per rank, stage s on rank s % P; bubble ~1/v of 1F1B's.

    Needs M a multiple of P: micro-batches go through each chunk in groups of P so that a
    rank's chunk-c output arrives just as the next rank wants it.
    """
    _check_positive("interleaved_1f1b", P=P, v=v, M=M)
    if M % P:
        lo, hi = (M // P) * P, (M // P + 1) * P
        works = f"{lo} or {hi}" if lo else f"{hi}"
        raise ConfigError(f"interleaved_1f1b: M={M} micro-batches is not a multiple of P={P} ranks; "
                          f"use M={works} (or v=1, which is plain 1F1B and takes any M)")
    if v == 1:
        sch = one_f_one_b(P, M)
        sch.name = "interleaved-1f1b"
        return sch
    S = P * v
    units = M * v  # (chunk, micro-batch) pairs per rank

    def unit(k: int, forward: bool) -> tuple[int, int]:
        group, pos = divmod(k, P * v)
        chunk = pos // P
        if not forward:
            chunk = v - 1 - chunk
        return chunk, group * P + pos % P

    compute = []
    for r in range(P):
        # Warm-up: enough forwards that the last chunk's first micro-batch can start its
        # backward; two more per hop from the last rank since each hop costs an F and a B.
        warmup = min((v - 1) * P + 2 * (P - 1 - r), units)
        ops: list[tuple[str, int, int]] = []
        for k in range(warmup):
            c, m = unit(k, True)
            ops.append((F, c * P + r, m))
        for k in range(units - warmup):
            c, m = unit(warmup + k, True)
            ops.append((F, c * P + r, m))
            c, m = unit(k, False)
            ops.append((B, c * P + r, m))
        for k in range(units - warmup, units):
            c, m = unit(k, False)
            ops.append((B, c * P + r, m))
        compute.append(ops)
    return from_compute_order("interleaved-1f1b", M, [s % P for s in range(S)], compute)


SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b", "zb-h1")


def make(name: str, P: int, M: int, v: int = 1) -> Schedule:
    """Generator by name (one of SCHEDULES); `v` is used only by interleaved-1f1b."""
    if name == "gpipe":
        return gpipe(P, M)
    if name == "1f1b":
        return one_f_one_b(P, M)
    if name == "interleaved-1f1b":
        return interleaved_1f1b(P, v, M)
    if name == "zb-h1":
        return zero_bubble_h1(P, M)
    raise ConfigError(f"unknown pipeline schedule {name!r}; choose one of {', '.join(SCHEDULES)}")


# Config.schedule -> generator name
CONFIG_SCHEDULES = {"gpipe": "gpipe", "1f1b": "1f1b", "interleaved": "interleaved-1f1b", "zb": "zb-h1"}


@program_pass("lower_schedule", produces=("schedule",))
def lower_schedule_pass(program: DistributedProgram, ctx: PassContext) -> ProgramResult:
    """The schedule of actions per pipeline position for options.schedule over
    options.pipeline x options.pipeline_chunks stages and options.microbatches micro-batches."""
    o = ctx.options
    schedule = make(CONFIG_SCHEDULES[o.schedule], o.pipeline, o.microbatches, o.pipeline_chunks)
    return ProgramResult(dataclasses.replace(program, schedule=schedule), modified=True)
