"""Event-time simulation of a pipeline `Schedule` under per-stage costs.

Model (the same p2p semantics `fxspeed.ir.schedule.validate` assumes):
  * each rank runs its actions in order, one at a time;
  * F, I, W take the stage's `forward`, `backward_input`, `backward_weight` seconds and B
    takes I + W; REDUCE and STEP take `reduce` / `step` seconds;
  * a send costs the sender nothing (it is posted and the rank moves on); its message arrives
    `p2p_latency + bytes / p2p_bandwidth` after the send is posted;
  * a recv finishes when both the rank reaches it and the message has arrived;
  * STEP waits until every send of the rank has been received (the runtime awaits its isends
    there, and a send completes only once its receiver took it), so a rank's own action list
    ends no earlier than its last message is consumed.

Activation memory, in units of one stage's activations for one micro-batch (`activation[s]`,
default 1.0): F(s,m) adds a unit; B(s,m) frees it; I(s,m) frees all but `weight_grad_fraction`
of it (W still needs the layer inputs and output gradients), and W(s,m) frees the rest. The
peak over each rank's action sequence is `peak_activations`; with the default fraction 1.0 it
counts micro-batches whose F is done and whose backward (B or W) is not.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

from fxspeed.ir.schedule import (ACTIVATION_KINDS, GATHER, OFFLOAD, PARAMETER_KINDS, B, COMPUTE_KINDS, F, I, RECV_KINDS, REDUCE, SEND_KINDS, STEP, W, Schedule,
                              ScheduleError)

from fxspeed.errors import ConfigError


@dataclass
class StageCosts:
    """Seconds per micro-batch for one stage; the full backward is backward_input + backward_weight."""

    forward: float = 1.0
    backward_input: float = 1.0
    backward_weight: float = 1.0
    activation: float = 1.0  # memory units held per in-flight micro-batch
    send_bytes: float = 0.0  # bytes of the stage's output activation (its input gradient is the same size)


@dataclass
class Costs:
    """Costs of every stage plus the communication and step model."""

    stages: list[StageCosts]
    p2p_latency: float = 0.0
    p2p_bandwidth: float = float("inf")  # bytes per second
    reduce: float = 0.0
    step: float = 0.0
    gather: float = 0.0  # GATHER(s): making one stage's weights whole (ZeRO-3); RELEASE takes no time
    weight_grad_fraction: float = 0.5  # share of an activation still held between I and W (a guess)

    @classmethod
    def uniform(cls, n_stages: int, forward: float = 1.0, backward_input: float = 1.0,
                backward_weight: float = 1.0, **kw) -> "Costs":
        """Every stage costs the same."""
        return cls([StageCosts(forward, backward_input, backward_weight) for _ in range(n_stages)], **kw)

    def p2p(self, stage: int) -> float:
        return self.p2p_latency + self.stages[stage].send_bytes / self.p2p_bandwidth


@dataclass
class SimResult:
    """What one simulated step looks like. Times in seconds."""

    step_time: float
    busy: list[float]  # per rank: seconds spent computing (F/B/I/W/REDUCE/STEP)
    idle: list[float]  # per rank: step_time - busy
    bubble: float  # sum(idle) / (n_ranks * step_time)
    peak_activations: list[float]  # per rank, see the module docstring
    # per rank: (action text, start, end) for drawing timelines
    timeline: list[list[tuple[str, float, float]]] = field(default_factory=list)
    finish: list[float] = field(default_factory=list)  # per rank: when its last action ends

    def own_idle_fraction(self, rank: int) -> float:
        """Share of the rank's own action list (start to its last action) spent waiting: what a
        rank measures around its run of the schedule, which ends before the step's slowest rank."""
        f = self.finish[rank] if self.finish else self.step_time
        return (f - self.busy[rank]) / f if f > 0 else 0.0


def simulate(schedule: Schedule, costs: Costs | Sequence[StageCosts]) -> SimResult:
    """Run the schedule in simulated time; raise ScheduleError if it deadlocks."""
    if not isinstance(costs, Costs):
        costs = Costs(list(costs))
    if len(costs.stages) != schedule.n_stages:
        raise ConfigError(f"simulate: got costs for {len(costs.stages)} stages but schedule "
                          f"{schedule.name!r} has {schedule.n_stages}; give one StageCosts per stage")
    if not 0.0 <= costs.weight_grad_fraction <= 1.0:
        raise ConfigError(f"Costs.weight_grad_fraction={costs.weight_grad_fraction!r}; it must be in [0, 1]")
    n = schedule.n_ranks
    pc = [0] * n
    clock = [0.0] * n
    busy = [0.0] * n
    held = [0.0] * n
    peak = [0.0] * n
    arrivals: dict[tuple[int, int], list[float]] = {}  # (src, dst) -> arrival times, FIFO
    received = {}  # (src, dst) -> how many consumed
    consumed_at: dict[int, float] = {}  # src rank -> latest time one of its messages was taken
    timeline: list[list[tuple[str, float, float]]] = [[] for _ in range(n)]

    def duration(a) -> float:
        if a.kind == REDUCE:
            return costs.reduce
        if a.kind == STEP:
            return costs.step
        if a.kind in PARAMETER_KINDS:
            return costs.gather if a.kind == GATHER else 0.0
        if a.kind in ACTIVATION_KINDS:  # asynchronous copies: the backward waits, if anything
            return 0.0
        c = costs.stages[a.stage]
        return {F: c.forward, I: c.backward_input, W: c.backward_weight,
                B: c.backward_input + c.backward_weight}[a.kind]

    def account_memory(r: int, a) -> None:
        if a.kind in ACTIVATION_KINDS:  # the micro-batch's saved activations leave and come back
            held[r] += costs.stages[a.stage].activation * (-1 if a.kind == OFFLOAD else 1)
            peak[r] = max(peak[r], held[r])
            return
        if a.kind not in COMPUTE_KINDS:
            return
        unit = costs.stages[a.stage].activation
        keep = costs.weight_grad_fraction * unit
        held[r] += {F: unit, B: -unit, I: keep - unit, W: -keep}[a.kind]
        peak[r] = max(peak[r], held[r])

    progressed = True
    while progressed:
        progressed = False
        for r in range(n):
            acts = schedule.actions[r]
            while pc[r] < len(acts):
                a = acts[pc[r]]
                if a.kind in SEND_KINDS:
                    arrivals.setdefault((r, a.peer), []).append(clock[r] + costs.p2p(a.stage))
                    timeline[r].append((str(a), clock[r], clock[r]))
                elif a.kind in RECV_KINDS:
                    key = (a.peer, r)
                    k = received.get(key, 0)
                    q = arrivals.get(key, [])
                    if k >= len(q):
                        break  # its send is not posted yet; another rank must run first
                    start = clock[r]
                    clock[r] = max(clock[r], q[k])
                    received[key] = k + 1
                    consumed_at[a.peer] = max(consumed_at.get(a.peer, 0.0), clock[r])
                    timeline[r].append((str(a), start, clock[r]))
                elif a.kind == STEP and any(received.get(key, 0) < len(q) for key, q in arrivals.items()
                                            if key[0] == r):
                    break  # a send of this rank is not taken yet; its receiver must run first
                else:
                    if a.kind == STEP:
                        clock[r] = max(clock[r], consumed_at.get(r, 0.0))
                    d = duration(a)
                    timeline[r].append((str(a), clock[r], clock[r] + d))
                    clock[r] += d
                    busy[r] += d
                    account_memory(r, a)
                pc[r] += 1
                progressed = True
    stuck = [r for r in range(n) if pc[r] < len(schedule.actions[r])]
    if stuck:
        r = stuck[0]
        raise ScheduleError(f"rank {r}, action {pc[r]} ({schedule.actions[r][pc[r]]}): simulation deadlocked; "
                            f"run fxspeed.ir.schedule.validate for the full diagnosis", rank=r, index=pc[r],
                            rule="deadlock")
    step_time = max(clock) if n else 0.0
    idle = [step_time - b for b in busy]
    bubble = sum(idle) / (n * step_time) if step_time > 0 else 0.0
    return SimResult(step_time, busy, idle, bubble, peak, timeline, list(clock))


def analytic_bubble(P: int, M: int, v: int = 1) -> float:
    """Bubble fraction of GPipe/1F1B (v=1) and interleaved 1F1B with equal stage costs and free p2p."""
    b = (P - 1) / v
    return b / (M + b)
