"""Pipeline schedules as data: actions per rank, a text form, and a validator.

A `Schedule` says, for every rank, the ordered list of `Action`s the runtime executes in one
training step. The runtime interprets it without deciding anything; generators live in
`passes/program/lower_schedule.py`, a cost simulator in `fxspeed/planner/simulator.py`.

Action kinds (`stage` is always the stage local to the rank executing the action):

    F       forward of (stage, microbatch)
    B       full backward of (stage, microbatch)            = I + W
    I       backward w.r.t. the stage's inputs (the part the upstream stage waits for)
    W       backward w.r.t. the stage's weights (deferrable)
    SEND_F  send the output activation of (stage, mb) to `peer`, the rank of stage + 1
    RECV_F  receive the input activation of (stage, mb) from `peer`, the rank of stage - 1
    SEND_B  send the input gradient of (stage, mb) to `peer`, the rank of stage - 1
    RECV_B  receive the output gradient of (stage, mb) from `peer`, the rank of stage + 1
    REDUCE  reduce the stage's gradients over its data-parallel/shared-parameter group
    GATHER  make the stage's weights whole (ZeRO-3: all-gather this rank's shards over the
            data-parallel group); every compute action of the stage comes after it
    RELEASE drop the stage's gathered weights (only the shards stay); no compute action of the
            stage comes after it. A rank has both for each of its stages or neither.
    OFFLOAD move the activations F(stage, mb) saved for its backward off the device (those the
            stage program lists in `offload_saved`); after F(stage, mb)
    RELOAD  start bringing them back; after OFFLOAD(stage, mb), before the backward of
            (stage, mb), which waits for them. A (stage, mb) has both or neither.
    STEP    optimizer step of everything the rank owns (no stage)

Text form, one line per rank after a header (compute actions use torch's compact "0F1"):

    schedule 1f1b stages=2 ranks=2 microbatches=2 placement=0,1
    rank 0: 0F0 SEND_F(0,0->r1) 0F1 SEND_F(0,1->r1) RECV_B(0,0<-r1) 0B0 ... REDUCE(0) STEP
    rank 1: RECV_F(1,0<-r0) 1F0 1B0 SEND_B(1,0->r0) ... REDUCE(1) STEP

Point-to-point semantics the validator assumes (and the runtime must provide): a send is
posted without waiting for the receiver (an `isend` whose completion is awaited only at the
end of the step; the buffer between two ranks is unbounded unless `send_buffer` says
otherwise); a recv blocks until its message has arrived. Messages between one ordered pair
of ranks are matched in posting order (NCCL's rule: it has no tags), so the k-th send from
rank a to rank b must be the message the k-th recv on b from a expects.
"""

from __future__ import annotations

import re
from collections import deque
from dataclasses import dataclass, field
from typing import Iterable

from fxspeed.errors import FxspeedError

F, B, I, W = "F", "B", "I", "W"
SEND_F, RECV_F, SEND_B, RECV_B = "SEND_F", "RECV_F", "SEND_B", "RECV_B"
REDUCE, STEP = "REDUCE", "STEP"
GATHER, RELEASE = "GATHER", "RELEASE"
PARAMETER_KINDS = (GATHER, RELEASE)
OFFLOAD, RELOAD = "OFFLOAD", "RELOAD"
ACTIVATION_KINDS = (OFFLOAD, RELOAD)
COMPUTE_KINDS = (F, B, I, W)
SEND_KINDS = (SEND_F, SEND_B)
RECV_KINDS = (RECV_F, RECV_B)
COMM_KINDS = SEND_KINDS + RECV_KINDS
KINDS = COMPUTE_KINDS + COMM_KINDS + (REDUCE, STEP) + PARAMETER_KINDS + ACTIVATION_KINDS


class ScheduleError(FxspeedError, ValueError):
    """A schedule is malformed or would deadlock. Names the rank, action index and rule."""

    def __init__(self, message: str, *, rank: int | None = None, index: int | None = None,
                 rule: str | None = None):
        super().__init__(message)
        self.rank = rank
        self.index = index
        self.rule = rule


@dataclass(frozen=True)
class Action:
    """One step of one rank. `stage`/`microbatch` are None where the kind has none."""

    kind: str
    stage: int | None = None
    microbatch: int | None = None
    peer: int | None = None

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ScheduleError(f"unknown action kind {self.kind!r}; expected one of {', '.join(KINDS)}")
        needs_mb = self.kind in COMPUTE_KINDS or self.kind in COMM_KINDS or self.kind in ACTIVATION_KINDS
        if self.kind != STEP and self.stage is None:
            raise ScheduleError(f"{self.kind} needs a stage")
        if needs_mb and self.microbatch is None:
            raise ScheduleError(f"{self.kind} needs a micro-batch")
        if self.kind == STEP and self.stage is not None or not needs_mb and self.microbatch is not None:
            raise ScheduleError(f"{self.kind} takes {'no stage or' if self.kind == STEP else 'no'} micro-batch; "
                                f"got stage={self.stage!r}, microbatch={self.microbatch!r}")
        if (self.kind in COMM_KINDS) != (self.peer is not None):
            raise ScheduleError(f"{self.kind}: peer is {self.peer!r}; only send/recv actions have a peer")

    def __str__(self) -> str:
        if self.kind in COMPUTE_KINDS:
            return f"{self.stage}{self.kind}{self.microbatch}"
        if self.kind in SEND_KINDS:
            return f"{self.kind}({self.stage},{self.microbatch}->r{self.peer})"
        if self.kind in RECV_KINDS:
            return f"{self.kind}({self.stage},{self.microbatch}<-r{self.peer})"
        if self.kind in (REDUCE, *PARAMETER_KINDS):
            return f"{self.kind}({self.stage})"
        if self.kind in ACTIVATION_KINDS:
            return f"{self.kind}({self.stage},{self.microbatch})"
        return "STEP"


_COMPUTE_RE = re.compile(r"^(\d+)([FBIW])(\d+)$")
_COMM_RE = re.compile(r"^(SEND_F|SEND_B|RECV_F|RECV_B)\((\d+),(\d+)(->|<-)r(\d+)\)$")
_STAGE_RE = re.compile(r"^(REDUCE|GATHER|RELEASE)\((\d+)\)$")
_ACTIVATION_RE = re.compile(r"^(OFFLOAD|RELOAD)\((\d+),(\d+)\)$")


def parse_action(token: str) -> Action:
    """Parse one token of the text form ("0F1", "SEND_F(0,1->r1)", "REDUCE(0)", "STEP")."""
    if m := _COMPUTE_RE.match(token):
        return Action(m[2], int(m[1]), int(m[3]))
    if m := _COMM_RE.match(token):
        arrow = "->" if m[1] in SEND_KINDS else "<-"
        if m[4] != arrow:
            raise ScheduleError(f"action {token!r}: {m[1]} is written with '{arrow}', e.g. {m[1]}(0,1{arrow}r1)")
        return Action(m[1], int(m[2]), int(m[3]), int(m[5]))
    if m := _STAGE_RE.match(token):
        return Action(m[1], int(m[2]))
    if m := _ACTIVATION_RE.match(token):
        return Action(m[1], int(m[2]), int(m[3]))
    if token == STEP:
        return Action(STEP)
    raise ScheduleError(f"cannot parse action {token!r}; expected e.g. 0F1, 1I0, 2W3, SEND_F(0,1->r1), "
                        f"RECV_B(0,1<-r1), REDUCE(0), GATHER(0), RELEASE(0), OFFLOAD(0,1), RELOAD(0,1) or STEP")


@dataclass
class Schedule:
    """Per-rank action lists plus what they are for. `placement[s]` is the rank of stage s."""

    name: str
    n_stages: int
    n_microbatches: int
    placement: tuple[int, ...]
    actions: list[list[Action]] = field(default_factory=list)

    @property
    def n_ranks(self) -> int:
        return len(self.actions)

    def stages_of(self, rank: int) -> list[int]:
        return [s for s, r in enumerate(self.placement) if r == rank]

    def format(self) -> str:
        """The text form; `Schedule.parse(s.format()) == s` and `parse(t).format() == t`."""
        head = (f"schedule {self.name} stages={self.n_stages} ranks={self.n_ranks} "
                f"microbatches={self.n_microbatches} placement={','.join(map(str, self.placement))}")
        lines = [head] + [f"rank {r}: " + " ".join(map(str, acts)) for r, acts in enumerate(self.actions)]
        return "\n".join(lines) + "\n"

    __str__ = format

    @classmethod
    def parse(cls, text: str) -> "Schedule":
        """Read the text form written by `format` (blank lines and '#' comments are ignored)."""
        lines = [ln.strip() for ln in text.splitlines()]
        lines = [ln for ln in lines if ln and not ln.startswith("#")]
        if not lines:
            raise ScheduleError("empty schedule text; expected a 'schedule NAME stages=...' header line")
        m = re.match(r"^schedule (\S+) stages=(\d+) ranks=(\d+) microbatches=(\d+) placement=([\d,]+)$", lines[0])
        if not m:
            raise ScheduleError(f"bad header {lines[0]!r}; expected e.g. "
                                f"'schedule 1f1b stages=4 ranks=4 microbatches=8 placement=0,1,2,3'")
        name, n_stages, n_ranks, n_mb = m[1], int(m[2]), int(m[3]), int(m[4])
        placement = tuple(int(x) for x in m[5].split(","))
        actions: list[list[Action]] = []
        for ln in lines[1:]:
            rm = re.match(r"^rank (\d+):(.*)$", ln)
            if not rm or int(rm[1]) != len(actions):
                raise ScheduleError(f"line {ln!r}: expected 'rank {len(actions)}: ACTION ACTION ...'")
            actions.append([parse_action(tok) for tok in rm[2].split()])
        if len(actions) != n_ranks:
            raise ScheduleError(f"header says ranks={n_ranks} but {len(actions)} rank lines follow")
        return cls(name, n_stages, n_mb, placement, actions)


def _err(rank: int, index: int, action: Action | None, rule: str, detail: str) -> ScheduleError:
    where = f"rank {rank}, action {index}" + (f" ({action})" if action is not None else "")
    return ScheduleError(f"{where}: {detail} [rule: {rule}]", rank=rank, index=index, rule=rule)


def _message(a: Action) -> tuple[str, int, int]:
    """What a send carries, keyed as the receiver names it: (recv kind, receiving stage, mb)."""
    if a.kind == SEND_F:
        return (RECV_F, a.stage + 1, a.microbatch)
    if a.kind == SEND_B:
        return (RECV_B, a.stage - 1, a.microbatch)
    return (a.kind, a.stage, a.microbatch)


def validate(schedule: Schedule, *, send_buffer: int | None = None) -> None:
    """Raise `ScheduleError` unless the schedule is complete, ordered, matched and deadlock-free.

    Rules, checked in this order (each error names rank, action index and rule):
      shape       placement has n_stages entries, each a rank in range; stages/micro-batches in range
      placement   every action's stage lives on the rank that runs it; peers are the neighbour's rank
      once        F of every (stage, mb) exactly once; its backward as one B, or one I and one W
      order       F(s,m) after its input (F(s-1,m) locally or RECV_F(s,m)); I/B(s,m) after F(s,m)
                  and after the output gradient (I/B(s+1,m) locally or RECV_B(s,m)); W after I;
                  a send after what it sends is computed; REDUCE(s) after all of s's backward;
                  one STEP, last, after every REDUCE of the rank
      weights     GATHER(s)/RELEASE(s): on every stage of the rank or none, once each; every
                  compute action of s after GATHER(s) and before RELEASE(s)
      activations OFFLOAD(s,m) after F(s,m), RELOAD(s,m) after it, both before the backward of
                  (s,m) (its B or I); a (stage, mb) has both or neither
      match       the k-th send a->b carries what the k-th recv on b from a expects
      deadlock    running all ranks with blocking recvs (and sends blocking once `send_buffer`
                  messages to a peer are unreceived; None = unbounded, 0 = rendezvous) finishes
    """
    sch = schedule
    P, S, M = sch.n_ranks, sch.n_stages, sch.n_microbatches
    if P < 1 or S < 1 or M < 1:
        raise ScheduleError(f"schedule {sch.name!r}: ranks={P}, stages={S}, microbatches={M}; all must be >= 1",
                            rule="shape")
    if len(sch.placement) != S or any(not 0 <= r < P for r in sch.placement):
        raise ScheduleError(f"schedule {sch.name!r}: placement {list(sch.placement)} must give a rank in "
                            f"0..{P - 1} for each of the {S} stages", rule="shape")
    has_reduce = {s: False for s in range(S)}
    # Backward pieces present anywhere: REDUCE waits only for those; absent ones are the "once" rule's.
    present = {(a.kind, a.stage, a.microbatch) for acts in sch.actions for a in acts if a.kind in (B, W)}

    # Per-rank structural and order checks; `done` holds what this rank has executed so far.
    seen: dict[tuple[str, int, int], tuple[int, int]] = {}
    for rank, acts in enumerate(sch.actions):
        done: set[tuple[str, int | None, int | None]] = set()
        gathers = any(a.kind in PARAMETER_KINDS for a in acts)
        if gathers:
            for st in sch.stages_of(rank):
                for kind in PARAMETER_KINDS:
                    if not any(a.kind == kind and a.stage == st for a in acts):
                        raise _err(rank, len(acts), None, "weights", f"{kind}({st}) is missing (a rank gathers and "
                                   "releases the weights of every stage it runs, or of none)")
        for i, a in enumerate(acts):
            if a.kind != STEP:
                if not 0 <= a.stage < S:
                    raise _err(rank, i, a, "shape", f"stage {a.stage} out of range 0..{S - 1}")
                if sch.placement[a.stage] != rank:
                    raise _err(rank, i, a, "placement", f"stage {a.stage} lives on rank "
                               f"{sch.placement[a.stage]}, not here")
            if a.microbatch is not None and not 0 <= a.microbatch < M:
                raise _err(rank, i, a, "shape", f"micro-batch {a.microbatch} out of range 0..{M - 1}")
            if a.kind in COMM_KINDS:
                nb = a.stage + (1 if a.kind in (SEND_F, RECV_B) else -1)
                if not 0 <= nb < S:
                    raise _err(rank, i, a, "placement", f"stage {a.stage} has no stage {nb} to talk to")
                if a.peer != sch.placement[nb] or a.peer == rank:
                    raise _err(rank, i, a, "placement", f"peer r{a.peer} should be r{sch.placement[nb]}, the rank of "
                               f"stage {nb}" + (" (same rank: no send/recv needed)"
                                                if sch.placement[nb] == rank else ""))
            key = (a.kind, a.stage, a.microbatch)
            if a.kind in COMPUTE_KINDS + COMM_KINDS + (REDUCE,) + PARAMETER_KINDS + ACTIVATION_KINDS:
                if key in seen:
                    r0, i0 = seen[key]
                    raise _err(rank, i, a, "once", f"already done at rank {r0}, action {i0}")
                seen[key] = (rank, i)
            s, m = a.stage, a.microbatch
            if a.kind == F and s > 0:
                src = (F, s - 1, m) if sch.placement[s - 1] == rank else (RECV_F, s, m)
                if src not in done:
                    raise _err(rank, i, a, "order", f"forward of stage {s} micro-batch {m} runs before its input "
                               f"({_name(src)}) on rank {rank}")
            if a.kind in (B, I):
                if (F, s, m) not in done:
                    raise _err(rank, i, a, "order", f"backward of stage {s} micro-batch {m} runs before its forward")
                if s < S - 1:
                    local = sch.placement[s + 1] == rank
                    ok = ((B, s + 1, m) in done or (I, s + 1, m) in done) if local else (RECV_B, s, m) in done
                    if not ok:
                        need = f"the backward of stage {s + 1}" if local else _name((RECV_B, s, m))
                        raise _err(rank, i, a, "order", f"backward of stage {s} micro-batch {m} runs before its "
                                   f"output gradient arrives ({need})")
            if a.kind == W and (I, s, m) not in done:
                raise _err(rank, i, a, "order", f"weight gradient of stage {s} micro-batch {m} runs before its "
                           f"input gradient ({s}I{m})")
            if a.kind == SEND_F and (F, s, m) not in done:
                raise _err(rank, i, a, "order", f"sends the output of {s}F{m} before computing it")
            if a.kind == SEND_B and (B, s, m) not in done and (I, s, m) not in done:
                raise _err(rank, i, a, "order", f"sends the input gradient of stage {s} micro-batch {m} before "
                           f"computing it ({s}I{m} or {s}B{m})")
            if a.kind == REDUCE:
                has_reduce[s] = True
                missing = [mb for mb in range(M) for k in (B, W) if (k, s, mb) in present and (k, s, mb) not in done]
                if missing:
                    raise _err(rank, i, a, "order", f"reduces stage {s}'s gradients before the backward of "
                               f"micro-batch {missing[0]} (B or W) has run")
            if a.kind in COMPUTE_KINDS and gathers:
                if (GATHER, s, None) not in done:
                    raise _err(rank, i, a, "weights", f"runs stage {s} before GATHER({s}) made its weights whole")
                if (RELEASE, s, None) in done:
                    raise _err(rank, i, a, "weights", f"runs stage {s} after RELEASE({s}) dropped its weights")
            if a.kind == OFFLOAD and (F, s, m) not in done:
                raise _err(rank, i, a, "activations", f"offloads what {s}F{m} saved before {s}F{m} ran")
            if a.kind == RELOAD and (OFFLOAD, s, m) not in done:
                raise _err(rank, i, a, "activations", f"reloads what {s}F{m} saved, which was not offloaded "
                           f"(OFFLOAD({s},{m}) comes first)")
            if a.kind in (OFFLOAD, RELOAD) and ((B, s, m) in done or (I, s, m) in done):
                raise _err(rank, i, a, "activations", f"comes after the backward of stage {s} micro-batch {m}, "
                           "which reads those activations")
            if a.kind in (B, I) and (OFFLOAD, s, m) in done and (RELOAD, s, m) not in done:
                raise _err(rank, i, a, "activations", f"backward of stage {s} micro-batch {m} runs while its "
                           f"activations are offloaded (RELOAD({s},{m}) must come before it)")
            if a.kind == RELEASE and (GATHER, s, None) not in done:
                raise _err(rank, i, a, "weights", f"releases stage {s}'s weights before GATHER({s})")
            if a.kind == STEP:
                if i != len(acts) - 1:
                    raise _err(rank, i, a, "order", "STEP must be the rank's last action")
                missing_r = [st for st in sch.stages_of(rank) if (REDUCE, st, None) not in done]
                if missing_r:
                    raise _err(rank, i, a, "order", f"optimizer step before REDUCE({missing_r[0]})")
            done.add(key)
        if not acts or acts[-1].kind != STEP:
            raise _err(rank, len(acts), None, "once", "the rank never runs STEP (it must be its last action)")

    # Completeness: each (stage, mb) has F and exactly one way of doing its backward.
    for s in range(S):
        r = sch.placement[s]
        n = len(sch.actions[r])
        for m in range(M):
            if (F, s, m) not in seen:
                raise _err(r, n, None, "once", f"forward {s}F{m} is missing")
            b, i_, w = ((k, s, m) in seen for k in (B, I, W))
            if b and (i_ or w):
                raise _err(r, seen[(B, s, m)][1], Action(B, s, m), "once",
                           f"micro-batch {m} of stage {s} has both B and I/W; use B, or I and W")
            if not b and not (i_ and w):
                what = f"{s}W{m}" if i_ else (f"{s}I{m}" if w else f"{s}B{m} (or {s}I{m} and {s}W{m})")
                raise _err(r, n, None, "once", f"backward {what} is missing")
        if not has_reduce[s]:
            raise _err(r, n, None, "once", f"REDUCE({s}) is missing")
    # Every cross-rank edge needs its send and its recv.
    for s in range(S - 1):
        if sch.placement[s] == sch.placement[s + 1]:
            continue
        for m in range(M):
            for kind, st, peer_stage in ((SEND_F, s, s + 1), (RECV_F, s + 1, s),
                                         (SEND_B, s + 1, s), (RECV_B, s, s + 1)):
                if (kind, st, m) not in seen:
                    r = sch.placement[st]
                    raise _err(r, len(sch.actions[r]), None, "once",
                               f"{Action(kind, st, m, sch.placement[peer_stage])} is missing")

    # Matching: per ordered pair, the send sequence equals the recv sequence.
    sends: dict[tuple[int, int], list[tuple[tuple, int]]] = {}
    recvs: dict[tuple[int, int], list[tuple[tuple, int]]] = {}
    for rank, acts in enumerate(sch.actions):
        for i, a in enumerate(acts):
            if a.kind in SEND_KINDS:
                sends.setdefault((rank, a.peer), []).append((_message(a), i))
            elif a.kind in RECV_KINDS:
                recvs.setdefault((a.peer, rank), []).append((_message(a), i))
    for (src, dst), rs in sorted(recvs.items()):
        ss = sends.get((src, dst), [])
        for k, (msg, i) in enumerate(rs):
            if k >= len(ss) or ss[k][0] != msg:
                got = f"{_name(ss[k][0])} (rank {src}, action {ss[k][1]})" if k < len(ss) else "nothing"
                raise _err(dst, i, sch.actions[dst][i], "match",
                           f"this is recv #{k} from rank {src}, but send #{k} from rank {src} to rank {dst} is {got}; "
                           f"messages between two ranks are matched in order")

    _check_deadlock(sch, send_buffer)


def _name(key: tuple) -> str:
    kind, s, m = key
    if kind in COMPUTE_KINDS:
        return f"{s}{kind}{m}"
    return f"{kind}({s},{m})"


def _check_deadlock(sch: Schedule, send_buffer: int | None) -> None:
    """Run every rank's list with blocking recvs; raise if some rank can never proceed."""
    if send_buffer is not None and send_buffer < 0:
        raise ScheduleError(f"send_buffer={send_buffer}; use None (unbounded), 0 (rendezvous) or a positive count")
    pc = [0] * sch.n_ranks
    queues: dict[tuple[int, int], deque] = {}
    cap = float("inf") if send_buffer is None else send_buffer

    def current(r: int) -> Action | None:
        return sch.actions[r][pc[r]] if pc[r] < len(sch.actions[r]) else None

    progressed = True
    while progressed:
        progressed = False
        for r in range(sch.n_ranks):
            while (a := current(r)) is not None:
                if a.kind in SEND_KINDS:
                    q = queues.setdefault((r, a.peer), deque())
                    if len(q) < cap:
                        q.append(a)
                    else:
                        peer_a = current(a.peer)
                        # Rendezvous: the receiver is waiting at this very message, so both proceed.
                        if not q and peer_a is not None and peer_a.kind in RECV_KINDS and peer_a.peer == r:
                            pc[a.peer] += 1
                        else:
                            break
                elif a.kind in RECV_KINDS:
                    q = queues.setdefault((a.peer, r), deque())
                    if not q:
                        break
                    q.popleft()  # order was checked by the match rule
                pc[r] += 1
                progressed = True
    stuck = [r for r in range(sch.n_ranks) if current(r) is not None]
    if stuck:
        desc = "; ".join(f"rank {r} waits at action {pc[r]} ({current(r)})" for r in stuck)
        r = stuck[0]
        raise _err(r, pc[r], current(r), "deadlock", f"no rank can proceed: {desc}")


def actions_of(schedule: Schedule, kinds: Iterable[str]) -> list[tuple[int, int, Action]]:
    """(rank, index, action) of every action whose kind is in `kinds`, rank-major."""
    ks = set(kinds)
    return [(r, i, a) for r, acts in enumerate(schedule.actions) for i, a in enumerate(acts) if a.kind in ks]
