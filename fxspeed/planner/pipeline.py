"""The pipeline part of a plan: per stage and per rank, from the stage programs and the schedule.

    pipeline_report(stages, schedule, config, replicas)   -> dict (plan.pipeline)
    apply_pipeline(plan, report, world, pp)                -> the Plan made per rank
    plan_pipeline(model, args, kwargs, config, devices)    -> Plan (what fxspeed.plan runs for pipeline > 1)

Pure functions of compiled programs: no process group, no engine. The engine calls the first
two after it compiled its program; `fxspeed.plan` compiles the same program on fake tensors.

Time: each stage's predicted seconds per micro-batch (split_stages sums the roofline times of
its nodes) drive the event simulator (planner/simulator.py), which gives the bubble and the
step time.

Memory, per pipeline position, walks the position's action list the way the pipeline runtime
executes it and tracks every tensor that outlives a program:

    resident     the rank's weights (a tied weight once), the gradient buffers the stage
                 programs accumulate into (accumulate_gradients; kept across steps),
                 optimizer states (Adam: 2 x trainable bytes; / replicas under ZeRO), the batch
    saved        what F(s, m) returns for B(s, m): held until that backward (until W under the
                 zero-bubble split, with I's carry)
    messages     a receive buffer exists from when its irecv is posted (the first
                 RECV_PREFETCH of each stream at the start, then one more at each RECV) until
                 the program reading it frees it; a sent tensor is held until STEP (the
                 runtime awaits its isends there)
    gradients    a gradient a backward returns is allocated by the first micro-batch and kept
                 to the step; later micro-batches' copies are added in and freed
    temporaries  inside each program: its own liveness (planner/memory.program_liveness),
                 inputs it is handed freed at their last use (F, B and W take a list they
                 empty; I keeps its inputs for W)

The step phase's peak is the largest total at any action; the optimizer phase is weights +
every trainable gradient + states + the optimizer's temporaries. The rank's peak is the larger.
With replicas, two gradient buckets (Config.bucket_mb) are resident for the data-parallel
reduction; ZeRO-1 and up shard optimizer states over the replicas, ZeRO-2 and up also the
gradients of the optimizer phase.

Not counted: the host memory of the compiled programs themselves (graphs, generated code) and
of the communication library, which is no tensor of the step.
why (and how close it is): docs/decisions/pipeline-memory-model.md
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Sequence

from fxspeed.config import Config
from fxspeed.devices import DeviceSpec
from fxspeed.ir import (ACTIVATIONS, BUFFERS, CATEGORIES, COMM_BUFFERS, GRADIENTS, INPUTS, OPTIMIZER_STATES,
                        PARAMETERS, TEMPORARIES, StageProgram, tensor_bytes)
from fxspeed.ir.schedule import OFFLOAD, RELOAD, B, F, I, RECV_B, RECV_F, SEND_B, SEND_F, STEP, W, Schedule
from fxspeed.planner.estimate import (choose_offload, offload_tier, reduce_elem,
                                     resident_optimizer_states, staging_held, staging_on_device)
from fxspeed.planner.memory import ProgramLiveness, program_liveness
from fxspeed.planner.plan import Plan

# Receives the runtime posts ahead per (direction, stage) stream, the awaited one included
# (runtime/runner.py, PipelineRuntime(recv_prefetch=2)).
RECV_PREFETCH = 2


# --------------------------------------------------------------------------------------------
# Per stage: sizes and program liveness
# --------------------------------------------------------------------------------------------

def _meta_bytes(metas: Sequence[Any]) -> int:
    return sum(math.prod(m.shape) * m.dtype.itemsize for m in metas)


@dataclass
class _Stage:
    """What the memory walk needs of one StageProgram."""

    program: StageProgram
    weights: dict[str, int]  # canonical parameter name -> bytes (a tied weight under one name)
    trainable: dict[str, int]  # canonical names with a gradient (returned or accumulated into a buffer)
    into_bytes: int  # gradient buffers the programs accumulate into (resident across steps)
    buffer_bytes: int  # module buffers (read-only state)
    batch_bytes: int  # one micro-batch's tensors
    grad_bytes: dict[str, int]  # bytes of each gradient B/W returns, by its output name
    forward: ProgramLiveness
    backward: ProgramLiveness
    backward_input: ProgramLiveness | None
    backward_weight: ProgramLiveness | None


def _stage(p: StageProgram) -> _Stage:
    fph = [n for n in p.forward.graph.nodes if n.op == "placeholder"]
    state_bytes = [tensor_bytes(ph.meta.get("val")) for ph in fph[:len(p.state)]]
    weights: dict[str, int] = {}
    buffers = grad_buffers = 0
    by_name: dict[str, int] = {}
    for spec, b in zip(p.state, state_bytes):
        by_name[spec.target] = b
        if spec.kind in ("param", "param_shard", "param_tp"):
            weights[p.tied.get(spec.target, spec.target)] = b
        elif spec.kind == "buffer":
            buffers += b
        elif spec.kind == "grad_buffer":  # a bucket the program reduces gradients into
            grad_buffers += b
    into = {n: _meta_bytes([m]) for n, m in zip(p.grads_into, p.grads_into_meta)}
    grad_bytes = {n: by_name.get(n, 0) for n in p.grads}
    trainable = {}
    for n in [*p.grads, *p.grads_into]:
        c = p.tied.get(n, n)
        trainable[c] = weights.get(c, into.get(n, grad_bytes.get(n, 0)))
    batch = sum(tensor_bytes(ph.meta.get("val")) for ph in fph[len(p.state):len(p.state) + p.n_batch])
    return _Stage(p, weights, trainable, sum(into.values()) + grad_buffers, buffers, batch, grad_bytes,
                  program_liveness(p.forward), program_liveness(p.backward),
                  program_liveness(p.backward_input) if p.backward_input is not None else None,
                  program_liveness(p.backward_weight) if p.backward_weight is not None else None)


# --------------------------------------------------------------------------------------------
# Per rank: walk the action list
# --------------------------------------------------------------------------------------------

class _Walk:
    """Tensors alive on one rank while it runs its actions (see the module docstring)."""

    def __init__(self) -> None:
        self.size: dict[Any, int] = {}
        self.category: dict[Any, str] = {}
        self.holders: dict[Any, set[Any]] = {}
        self.total = 0
        self.peak = -1
        self.peak_at = ""
        self.peak_by: dict[str, int] = {}

    def add(self, key: Any, size: int, category: str, holder: Any) -> None:
        if key not in self.size:
            self.size[key], self.category[key], self.holders[key] = size, category, set()
            self.total += size
        self.holders[key].add(holder)

    def release(self, key: Any, holder: Any) -> None:
        if key is None or key not in self.holders:
            return
        self.holders[key].discard(holder)
        if not self.holders[key]:
            self.total -= self.size.pop(key)
            del self.holders[key], self.category[key]

    def release_all(self, holder: Any) -> None:
        for key in [k for k, hs in self.holders.items() if holder in hs]:
            self.release(key, holder)

    def by_category(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for key, size in self.size.items():
            out[self.category[key]] = out.get(self.category[key], 0) + size
        return out

    def observe(self, at: str, extra: int = 0) -> None:
        if self.total + extra > self.peak:
            self.peak, self.peak_at = self.total + extra, at
            self.peak_by = self.by_category()
            if extra:
                self.peak_by[TEMPORARIES] = self.peak_by.get(TEMPORARIES, 0) + extra

    def run(self, at: str, pl: ProgramLiveness, inputs: list[Any], consumed: set[Any], boxed: bool) -> None:
        """A program runs on `inputs` (storage keys, None for resident state); inputs held
        only by the `consumed` holders are freed at their last use when `boxed`."""
        freed: set[int] = set()
        if boxed:
            latest: dict[Any, int] = {}
            for j, key in enumerate(inputs):
                if key is None or key not in self.holders or not self.holders[key] <= consumed:
                    continue
                if key not in latest or pl.last_use[j] > pl.last_use[latest[key]]:
                    latest[key] = j
            freed = set(latest.values())
        self.observe(at, pl.peak(freed))


def _rank_memory(stages: dict[int, _Stage], actions: list[Any]) -> dict[str, Any]:
    """Peak bytes above the resident state while one rank runs `actions`, by category, and the
    action it happens at."""
    w = _Walk()
    grads_seen: set[str] = set()
    streams: dict[tuple[str, int], list[Any]] = {}
    for a in actions:
        if a.kind in (RECV_F, RECV_B):
            streams.setdefault((a.kind, a.stage), []).append(a)
    cursor = {k: 0 for k in streams}
    recv_keys: dict[tuple[str, int, int], list[Any]] = {}
    saved_keys: dict[tuple[int, int], list[Any]] = {}
    saved_sizes: dict[tuple[int, int], list[int]] = {}
    carry_keys: dict[tuple[int, int], list[Any]] = {}

    def post(stream: tuple[str, int]) -> None:
        i, queue = cursor[stream], streams[stream]
        if i >= len(queue):
            return
        r = queue[i]
        p = stages[r.stage].program
        metas = p.recv_f if r.kind == RECV_F else p.recv_b
        keys = []
        for k, m in enumerate(metas):
            key = ("recv", r.kind, r.stage, r.microbatch, k)
            w.add(key, _meta_bytes([m]), COMM_BUFFERS, "recv")
            keys.append(key)
        recv_keys[(r.kind, r.stage, r.microbatch)] = keys
        cursor[stream] = i + 1

    for stream in streams:
        for _ in range(RECV_PREFETCH):
            post(stream)
    w.observe("start")

    def outputs(pl: ProgramLiveness, inputs: list[Any], tag: tuple) -> list[Any]:
        keys = []
        for size, alias, sid in pl.outputs:
            keys.append(inputs[alias] if alias is not None else (tag, sid) if size else None)
        return keys

    def hold(keys: list[Any], sizes: list[int], category: str, holder: Any) -> None:
        for key, size in zip(keys, sizes):
            if key is not None:
                w.add(key, size, category, holder)

    def grads_out(st: _Stage, keys: list[Any], sizes: list[int], names: list[str]) -> None:
        for key, size, name in zip(keys, sizes, names):
            if key is None:
                continue
            if name not in grads_seen:  # the first micro-batch's gradient becomes the running sum
                grads_seen.add(name)
                w.add(key, size, GRADIENTS, ("grad", name))
            # later ones are added into it in place and dropped

    for a in actions:
        s, m = a.stage, a.microbatch
        at = str(a)
        if a.kind == F:
            st = stages[s]
            p = st.program
            pl = st.forward
            ins = [None] * (len(p.state) + p.n_batch) + (recv_keys.pop((RECV_F, s, m), []) if s > 0 else [])
            ins += [None] * (len(pl.inputs) - len(ins))
            w.run(at, pl, ins, {"recv"}, boxed=True)
            outs = outputs(pl, ins, ("F", s, m))
            sizes = [o[0] for o in pl.outputs]
            k = len(p.send_f) if s < p.n_stages - 1 else 0
            hold(outs[k:k + p.n_saved], sizes[k:k + p.n_saved], ACTIVATIONS, ("saved", s, m))
            hold(outs[:k], sizes[:k], COMM_BUFFERS, ("send", s, m))
            for key in ins:
                w.release(key, "recv")
            saved_keys[(s, m)] = outs[k:k + p.n_saved]
            saved_sizes[(s, m)] = sizes[k:k + p.n_saved]
            w.observe(at)
        elif a.kind in (OFFLOAD, RELOAD):  # the listed saved activations leave, and come back
            keys, sizes = saved_keys.get((s, m), []), saved_sizes.get((s, m), [])
            for i in stages[s].program.offload_saved:
                if i < len(keys) and keys[i] is not None:
                    if a.kind == OFFLOAD:
                        w.release(keys[i], ("saved", s, m))
                    else:
                        w.add(keys[i], sizes[i], ACTIVATIONS, ("saved", s, m))
            w.observe(at)
        elif a.kind in (B, I):
            st = stages[s]
            p = st.program
            split = a.kind == I and st.backward_input is not None
            pl = st.backward_input if split else st.backward
            recv = recv_keys.pop((RECV_B, s, m), []) if s < p.n_stages - 1 else []
            base_ins = [None] * (len(p.state) + p.n_batch) + saved_keys.pop((s, m), []) + recv
            ins = base_ins + [None] * (len(pl.inputs) - len(base_ins))  # B: beta and the gradient buffers
            consumed = {("saved", s, m), "recv"}
            w.run(at, pl, ins, consumed, boxed=not split)
            outs = outputs(pl, ins, (a.kind, s, m))
            sizes = [o[0] for o in pl.outputs]
            k = len(p.send_b) if s > 0 else 0
            hold(outs[:k], sizes[:k], COMM_BUFFERS, ("send", s, m))
            if split:  # W reads I's inputs and its carry: they stay until W
                carry = outs[k:]
                hold(carry, sizes[k:], ACTIVATIONS, ("ww", s, m))
                for key in ins:
                    if key is not None:
                        w.add(key, 0, ACTIVATIONS, ("ww", s, m))
                carry_keys[(s, m)] = base_ins + carry  # W's inputs: I's, then the carry
            else:
                grads_out(st, outs[k:], sizes[k:], p.grads)
            for key in ins:
                for h in consumed:
                    w.release(key, h)
            w.observe(at)
        elif a.kind == W:
            st = stages[s]
            p = st.program
            if st.backward_weight is None or (s, m) not in carry_keys:
                continue
            pl = st.backward_weight
            ins = carry_keys.pop((s, m))
            ins += [None] * (len(pl.inputs) - len(ins))
            w.run(at, pl, ins, {("ww", s, m)}, boxed=True)
            outs = outputs(pl, ins, (W, s, m))
            grads_out(st, outs, [o[0] for o in pl.outputs], p.grads)
            w.release_all(("ww", s, m))
            w.observe(at)
        elif a.kind in (RECV_F, RECV_B):
            if (a.kind, s) in streams:
                post((a.kind, s))
            w.observe(at)
        elif a.kind in (SEND_F, SEND_B):
            pass  # the tensor is held since the program made it, until STEP
        elif a.kind == STEP:  # every isend is awaited: the runtime drops the sent tensors
            for holder in {h for hs in w.holders.values() for h in hs if isinstance(h, tuple) and h[0] == "send"}:
                w.release_all(holder)
    by = {c: int(v) for c, v in w.peak_by.items() if v}
    return {"peak": int(max(w.peak, 0)), "at": w.peak_at, "by_category": by}


def _tp_bytes(programs: list[StageProgram], microbatches: int) -> dict[str, int]:
    """Bytes of the tp collectives (shard_tensors') one rank runs per step in these stages: each
    forward and backward once per micro-batch (the backward's I/W split runs the same ones)."""
    from fxspeed.planner.placement import tp_collectives

    out: dict[str, int] = {}
    for p in programs:
        for gm in (p.forward, p.backward):
            for kind, nbytes in tp_collectives(gm):
                out[f"tp_{kind}"] = out.get(f"tp_{kind}", 0) + nbytes * microbatches
    return out


# --------------------------------------------------------------------------------------------
# The report
# --------------------------------------------------------------------------------------------

def pipeline_report(stages: list[StageProgram], schedule: Schedule, config: Config, replicas: int,
                    costs: Any = None, staged_here: bool = True) -> dict[str, Any]:
    """Per stage: modules, parameters, predicted time and memory; per pipeline position: the
    memory at its peak by category (see the module docstring); the schedule's simulated bubble
    and step time. `costs` (a simulator.Costs) overrides the planner's stage times.
    `staged_here`: the offloaded optimizer's staging is the device's memory (estimate.staging_on_device)."""
    from fxspeed.planner.estimate import opt_factors
    from fxspeed.planner.simulator import Costs, StageCosts, simulate

    if costs is None:
        costs = Costs([StageCosts(p.predicted.get("forward", 1.0), p.predicted.get("backward_input", 1.0),
                                  p.predicted.get("backward_weight", 0.0),
                                  activation=p.predicted.get("saved_bytes", 1.0),
                                  send_bytes=p.predicted.get("send_bytes", 0.0)) for p in stages])
    sim = simulate(schedule, costs)
    M, D, z = config.microbatches, replicas, config.zero
    state_f, _ = opt_factors(config)
    info = [_stage(p) for p in stages]

    ranks = []
    for r in range(schedule.n_ranks):
        mine = {s: info[s] for s, pos in enumerate(schedule.placement) if pos == r}
        walk = _rank_memory(mine, schedule.actions[r])
        weights: dict[str, int] = {}
        trainable: dict[str, int] = {}
        for st in mine.values():
            weights.update(st.weights)
            trainable.update(st.trainable)
        w_bytes, t_bytes = sum(weights.values()), sum(trainable.values())
        states = state_f * t_bytes / (D if z >= 1 else 1)
        resident = {PARAMETERS: w_bytes, BUFFERS: sum(st.buffer_bytes for st in mine.values()),
                    INPUTS: max((st.batch_bytes for st in mine.values()), default=0) * M,
                    GRADIENTS: sum(st.into_bytes for st in mine.values()), OPTIMIZER_STATES: states,
                    COMM_BUFFERS: min(2 * config.bucket_mb * 2**20, t_bytes) if D > 1 else 0}
        step = dict(resident)
        for c, v in walk["by_category"].items():
            step[c] = step.get(c, 0) + v
        # Config.offload="optimizer": this position's states go to its files (all, or what its
        # memory budget needs), as they do without a pipeline; three staging chunks stay.
        moved, note = choose_offload(config, states, sum(step.values()), staged_here=staged_here)
        states_held = resident_optimizer_states(config, states, moved, staged_here=staged_here)
        step[OPTIMIZER_STATES] = resident[OPTIMIZER_STATES] = states_held
        # ZeRO-3: every stage's RELEASE ran before the step, so only the trainable weights' shards stay
        held = w_bytes - t_bytes + t_bytes / D if z >= 3 and D > 1 else w_bytes
        opt = {PARAMETERS: held, BUFFERS: resident[BUFFERS], INPUTS: resident[INPUTS],
               GRADIENTS: t_bytes / (D if z >= 2 else 1), OPTIMIZER_STATES: states_held,
               COMM_BUFFERS: resident[COMM_BUFFERS]}
        as_int = lambda d: {c: int(round(d.get(c, 0))) for c in CATEGORIES}  # noqa: E731
        ranks.append({"position": r, "stages": sorted(mine), "peak_at": walk["at"], "offloaded": int(moved),
                      "offload_note": note, "staging": staging_held(config, moved, states),
                      # the optimizer's own temporaries depend on the device: apply_pipeline adds them
                      "phase_memory": {"step": as_int(step), "optimizer": as_int(opt)},
                      "weights_bytes": int(w_bytes), "trainable_bytes": int(t_bytes),
                      "largest_trainable": int(max(trainable.values(), default=0)),
                      "n_params": int(sum(st.program.predicted.get("params", 0) for st in mine.values())),
                      "busy_s": sim.busy[r] if r < len(sim.busy) else 0.0,
                      "forward_s": M * sum(st.program.predicted.get("forward", 0.0) for st in mine.values()),
                      "send_bytes": int(M * sum(_meta_bytes(st.program.send_f) + _meta_bytes(st.program.send_b)
                                                for st in mine.values())),
                      "tp_communication": _tp_bytes([st.program for st in mine.values()], M)})

    out_stages = []
    for st in info:
        p = st.program
        rank = schedule.placement[p.stage]
        pb = float(sum(st.weights.values()))
        tb = float(sum(st.trainable.values()))
        peak = ranks[rank]["phase_memory"]["step"]
        pred = p.predicted
        # "rank" is the pipeline position (kept under that name for existing readers): the global
        # ranks running it are every (replica, tp rank) at that position, in plan.mesh's table.
        out_stages.append({"stage": p.stage, "rank": rank, "position": rank, "modules": p.modules, "params": int(pred.get("params", 0)),
                           "forward_s": pred.get("forward", 0.0),
                           "backward_s": pred.get("backward_input", 0.0) + pred.get("backward_weight", 0.0),
                           "memory_bytes": {"parameters": pb, "gradients": tb,
                                            "optimizer_states": state_f * tb / (D if z >= 1 else 1),
                                            "activations": float(peak.get(ACTIVATIONS, 0))}})
    return {"schedule": schedule.name, "stages_n": len(stages), "microbatches": M, "replicas": D, "zero": z,
            "config": config.to_dict(),  # apply_pipeline moves it to plan.config
            "stages": out_stages, "ranks": ranks, "bubble": sim.bubble, "step_s": sim.step_time,
            "idle_fraction": [i / sim.step_time if sim.step_time else 0.0 for i in sim.idle],
            "own_idle_fraction": [sim.own_idle_fraction(r) for r in range(len(sim.idle))]}


# --------------------------------------------------------------------------------------------
# The Plan, per rank
# --------------------------------------------------------------------------------------------

def apply_pipeline(plan: Plan, report: dict[str, Any], world: int, pp: int) -> None:
    """Make `plan` (finish_plan's, from one micro-batch's costs) the pipeline's: plan.pipeline
    is `report`; each of the `world` ranks gets its pipeline position's memory (the larger of
    its step and optimizer phases), peak phase and device; strategy, mesh layout, step time
    (the simulated schedule + the optimizer), FLOPs per step and communication follow."""
    from fxspeed.planner.cost_model import optimizer_time
    from fxspeed.planner.estimate import optimizer_temporaries, zero_paper_bytes
    from fxspeed.planner.plan import layout_text

    first = not plan.pipeline
    tp = int(plan.strategy.get("tp", 1) or 1)
    dp = max(1, world // (pp * tp))
    z, M = int(report.get("zero", plan.strategy.get("zero", 0))), int(report["microbatches"])
    device = DeviceSpec.from_dict(plan.devices[0])
    # The engine's finish_plan had the micro-batch config (pipeline=1): the plan gets the real one.
    config = Config.from_dict(report.pop("config", None) or plan.config)
    per_position = []
    for rk in report["ranks"]:
        step = dict(rk["phase_memory"]["step"])
        opt = dict(rk["phase_memory"]["optimizer"])
        shard = rk["trainable_bytes"] / (dp if z >= 1 else 1)
        opt[TEMPORARIES] = int(round(optimizer_temporaries(config, device, shard, rk["largest_trainable"])))
        phase = "step" if sum(step.values()) >= sum(opt.values()) else "optimizer"
        rk["phase_memory"]["optimizer"] = opt
        rk["peak_phase"] = phase
        per_position.append((step if phase == "step" else opt, phase))

    def position(g: int) -> int:
        return (g // tp) % pp

    plan.pipeline = report
    plan.rank_memory = [dict(per_position[position(g)][0]) for g in range(world)]
    plan.peak_phase = [per_position[position(g)][1] for g in range(world)]
    plan.devices = [plan.devices[0]] * world
    plan.strategy = {**plan.strategy, "dp": dp, "pp": pp, "tp": tp, "zero": z}
    plan.config = config.to_dict()
    plan.mesh = layout_text(dp, pp, tp)
    plan.phase_memory = {k: dict(v) for k, v in report["ranks"][0]["phase_memory"].items()}
    # Rank 0's resident model states (finish_plan's were the whole micro-batch program's).
    plan.model_states = {c: int(max(v.get(c, 0) for v in plan.phase_memory.values()))
                         for c in (PARAMETERS, GRADIENTS, OPTIMIZER_STATES)}
    moved = report["ranks"][0].get("offloaded", 0)  # rank 0's, as every plan field without a rank is
    plan.offloaded = {offload_tier(device, config): int(moved)} if moved else {}
    if moved and not staging_on_device(device):  # the chunks' staging slots: pinned host memory beside the device
        plan.offloaded["host"] = plan.offloaded.get("host", 0) + int(report["ranks"][0]["staging"])
    # the micro-batch plan's budget note is not the pipeline's: each position's is
    plan.notes = [n for n in plan.notes if n not in plan.over_budget]
    plan.over_budget = sorted({rk["offload_note"] for rk in report["ranks"] if rk.get("offload_note")})
    plan.notes += plan.over_budget

    # Time: the busiest position's compute, its wait (the bubble as it lives it), its optimizer step.
    ranks = report["ranks"]
    r = max(range(len(ranks)), key=lambda i: ranks[i]["busy_s"])
    busy, fwd = ranks[r]["busy_s"], min(ranks[r]["forward_s"], ranks[r]["busy_s"])
    t_opt = optimizer_time(ranks[r]["trainable_bytes"] / (dp if z >= 1 else 1), config.optimizer, device)
    ring = (dp - 1) / dp
    communication = {"pipeline_p2p": int(ranks[0]["send_bytes"])}
    if dp > 1:
        communication["gradient_reduction"] = int((2 if z < 2 else 1) * ring * ranks[0]["trainable_bytes"] / 4
                                                  * reduce_elem(config))
    plan.communication = communication
    grads_r = ranks[r]["trainable_bytes"] / 4 * reduce_elem(config) * (2 if z < 2 else 1) * ring
    t_comm = grads_r / device.link_bandwidth if dp > 1 and device.link_bandwidth else 0.0
    plan.time = {"forward": fwd, "backward": busy - fwd, "bubble": max(0.0, report["step_s"] - busy),
                 "optimizer": t_opt, "communication": t_comm, "total": report["step_s"] + t_opt + t_comm}
    if first:  # finish_plan counted one micro-batch
        plan.flops = {k: int(v) * M for k, v in plan.flops.items()}
    if config.precision == "fp32":
        state_f = 2 if config.optimizer in ("adam", "adamw") else (1 if config.momentum else 0)
        zf = [zero_paper_bytes(rk["n_params"], z, dp, k=4 * state_f, bytes_per_param=4) for rk in ranks]
    else:
        zf = [zero_paper_bytes(rk["n_params"], z, dp, k=12, bytes_per_param=2) for rk in ranks]
    plan.zero_formula = [int(zf[position(g)]) for g in range(world)]
    peaks = ", ".join(f"position {rk['position']} at "
                      + (rk["peak_at"] if rk["peak_phase"] == "step" else "the optimizer step") for rk in ranks)
    plan.notes.append(f"pipeline: per-rank memory = the rank's stages' weights, gradient buffers, optimizer states "
                      f"and what its action list keeps alive (saved activations, messages in flight, each "
                      f"program's temporaries), walked action by action; peaks: {peaks}. Time per step = the "
                      f"simulated {report['schedule']} schedule (bubble {report['bubble']:.3f}) + optimizer")


def plan_pipeline(model: Any, args: tuple, kwargs: dict, *, config: Config, devices: Sequence[DeviceSpec],
                  loss_fn: Any = None) -> Plan:
    """Plan `model` under Config.pipeline > 1 without running it: one micro-batch (the batch
    split into Config.microbatches along dim 0) is traced on fake tensors (a meta model works),
    cut into stages and scheduled as the engine would, then reported per stage and per rank.

    A deep stack of identical blocks (Config.layer_extrapolation, as without a pipeline) is traced
    with 1, 2 and 3 blocks per stage instead of whole, and every per-stage and per-rank figure is
    extrapolated linearly to the blocks each stage gets (see `_plan_extrapolated`)."""
    from fxspeed.compiler.capture import trial_compiles
    from fxspeed.errors import ConfigError

    P, tp, world = config.pipeline, config.tensor, len(devices)
    if world % (P * tp):
        raise ConfigError(f"devices={world} is not a multiple of Config.pipeline x Config.tensor = {P} x {tp}; use "
                          f"devices = {P * tp} x (data-parallel replicas), e.g. {max(P * tp, world - world % (P * tp))}"
                          f" or {(world // (P * tp) + 1) * P * tp}")
    with trial_compiles():  # the stage programs (and presolve's) are read for the plan and dropped
        return _plan_pipeline(model, args, kwargs, config=config, devices=devices, loss_fn=loss_fn)


def _plan_pipeline(model: Any, args: tuple, kwargs: dict, *, config: Config, devices: Sequence[DeviceSpec],
                   loss_fn: Any) -> Plan:
    from fxspeed.compiler.pipelines import compile_program, micro_config
    from fxspeed.ir.batch import split_batch
    from fxspeed.planner.estimate import _extrapolation_wanted, costs_reader, finish_plan, for_target, repeated_blocks

    P, tp, world = config.pipeline, config.tensor, len(devices)
    D = world // (P * tp)
    margs, mkw = split_batch(args, kwargs, config.microbatches)[0]
    options, analyses = None, ()
    if tp > 1:  # tp rank 0's stages, with the layout the engine would choose
        from fxspeed.compiler.options import PassOptions
        from fxspeed.planner.estimate import presolve_placements

        options = PassOptions.single_device(config, tp_size=tp, tp_group_name="tp (planned)")
        analyses = (presolve_placements(model, margs, mkw, config=config, devices=devices, loss_fn=loss_fn,
                                        options=options).graph_pass,)

    if config.offloads_activations:  # the schedule's OFFLOAD/RELOAD actions, as the engine's
        from fxspeed.compiler.options import PassOptions

        options = dataclasses.replace(options or PassOptions.single_device(config), activation_store="(planned)")

    options = for_target(options, devices[0])

    def program(split_points: Sequence[str] | None) -> Any:
        # Every position's stages as that position compiles them (gradient accumulation included).
        return compile_program(model, margs, mkw, config=config, replicas=D, positions=tuple(range(P)),
                               loss_fn=loss_fn, train=True, split_points=split_points,
                               analyze=costs_reader(micro_config(config), devices[:1]), options=options,
                               analyses=analyses)

    n_stages = P * (config.pipeline_chunks if config.schedule == "interleaved" else 1)
    found = repeated_blocks(model)
    notes: list[str] = []
    staged_here = staging_on_device(devices[0])
    if (found is not None and not config.split_points and len(found[2]) >= 3 * n_stages
            and _extrapolation_wanted(config, len(found[2]))):
        cp, costs, report, notes = _plan_extrapolated(model, found, n_stages, program, config, D, staged_here)
    else:
        cp = program(tuple(config.split_points) or None)
        costs, report = cp.costs, pipeline_report(cp.stages, cp.schedule, config, D, staged_here=staged_here)
    plan = finish_plan(costs, model_name=type(model).__name__, config=config, devices=devices,
                       passes=[r.to_dict() for r in cp.records], pp=P, tp=tp)
    apply_pipeline(plan, report, world, P)
    plan.notes += notes
    if tp > 1:
        from fxspeed.planner.placement import TP_PLAN_NOTE, collapse_blocks

        plan.tp_placements = collapse_blocks(costs.tp_placements)
        plan.tp_communication = {k: int(v) for k, v in report["ranks"][0]["tp_communication"].items()}
        plan.notes.append(TP_PLAN_NOTE)
    return plan


def _plan_extrapolated(model: Any, found: tuple, n_stages: int, program: Any, config: Config,
                       replicas: int, staged_here: bool = True) -> tuple[Any, Any, dict[str, Any], list[str]]:
    """The pipeline of a deep block stack from three small traces: the model cut to 1, 2 and 3
    blocks per stage (split at those blocks). Each stage's forward time is a + b x blocks (the
    first stage's a holds the embedding, the last's the head), so the whole model's cut is the
    one a balanced split would make: blocks handed one at a time to the stage whose forward
    stays shortest. Every per-stage and per-rank figure (memory by category and phase, bytes,
    parameters, stage times) is then extrapolated linearly from the 1- and 2-block traces to the
    stage's blocks, the schedule simulated with those stage times, and the extrapolation checked
    against the 3-block trace. Returns the 2-block program (pass records), the extrapolated
    GraphCosts, the report and the notes."""
    import time

    from fxspeed.planner.estimate import _rel, block_prefix, truncated

    parent, attr, blocks = found
    L = len(blocks)
    prefix = block_prefix(model, blocks)
    t0 = time.perf_counter()
    traced = []
    for k in (1, 2, 3):
        with truncated(parent, attr, k * n_stages):
            traced.append(program([f"{prefix}{k * s}" for s in range(1, n_stages)]))
    one, two, three = traced
    fwd = [(p1.predicted.get("forward", 0.0), p2.predicted.get("forward", 0.0)) for p1, p2 in zip(one.stages, two.stages)]
    # Blocks per stage: the next block to the stage whose forward stays shortest. From none: a
    # stage may get no block (a large head alone on the last one), as the whole trace's cut allows
    n = [0] * n_stages
    for _ in range(L):
        s = min(range(n_stages), key=lambda i: (fwd[i][0] + (fwd[i][1] - fwd[i][0]) * n[i], i))
        n[s] += 1

    def report_for(counts: list[int]) -> dict[str, Any]:
        return _extrapolated_report(one, two, counts, config, replicas, prefix, staged_here)

    check = report_for([3] * n_stages)
    want = pipeline_report(three.stages, three.schedule, config, replicas, staged_here=staged_here)
    errs = {"step time": _rel(check["step_s"], want["step_s"]),
            "peak memory": max(_rel(sum(a["phase_memory"]["step"].values()), sum(b["phase_memory"]["step"].values()))
                               for a, b in zip(check["ranks"], want["ranks"]))}
    note = (f"repeated-layer extrapolation (pipeline): {type(model).__name__}.{attr} has {L} identical blocks; traced "
            f"with 1, 2 and 3 blocks per stage in {time.perf_counter() - t0:.1f}s and extrapolated linearly to "
            f"{'/'.join(map(str, n))} blocks per stage (check at 3 per stage: "
            + ", ".join(f"{k} error {v:.2%}" for k, v in errs.items()) + ")")
    notes = [note]
    if max(errs.values()) > 0.01:
        notes.append(f"warning: the 3-blocks-per-stage check misses by {max(errs.values()):.1%}; set "
                     "Config(layer_extrapolation=False) to trace the whole model")
    costs = one.costs.extrapolate(two.costs, L / n_stages)  # a trace's unit: one block per stage
    return two, costs, report_for(n), notes


def _extrapolated_report(one: Any, two: Any, counts: list[int], config: Config, replicas: int,
                         prefix: str, staged_here: bool = True) -> dict[str, Any]:
    """pipeline_report of the program whose stage s has counts[s] blocks, from the programs
    `one` and `two` with 1 and 2 blocks per stage (linear in the blocks; maxima and the peak's
    action from `two`)."""
    from fxspeed.planner.simulator import Costs, StageCosts, simulate

    r1 = pipeline_report(one.stages, one.schedule, config, replicas, staged_here=staged_here)
    r2 = pipeline_report(two.stages, two.schedule, config, replicas, staged_here=staged_here)

    def lin(a: Any, b: Any, k: float) -> Any:
        if isinstance(a, dict):
            return {c: lin(a.get(c, 0), b.get(c, 0), k) for c in {*a, *b}}
        return type(b)(a + (b - a) * (k - 1)) if isinstance(b, (int, float)) and not isinstance(b, bool) else b

    sched = two.schedule
    stage_costs = []
    for s, (p1, p2) in enumerate(zip(one.stages, two.stages)):
        k = counts[s]
        f = lambda key, d=0.0: lin(p1.predicted.get(key, d), p2.predicted.get(key, d), k)  # noqa: E731
        stage_costs.append(StageCosts(f("forward", 1.0), f("backward_input", 1.0), f("backward_weight"),
                                      activation=f("saved_bytes", 1.0), send_bytes=f("send_bytes")))
    sim = simulate(sched, Costs(stage_costs))
    out = dict(r2)
    out["bubble"], out["step_s"] = sim.bubble, sim.step_time
    out["idle_fraction"] = [i / sim.step_time if sim.step_time else 0.0 for i in sim.idle]
    out["own_idle_fraction"] = [sim.own_idle_fraction(r) for r in range(len(sim.idle))]
    starts = [sum(counts[:s]) for s in range(len(counts))]
    out["stages"] = []
    for s, (a, b) in enumerate(zip(r1["stages"], r2["stages"])):
        st = {key: lin(a[key], b[key], counts[s]) for key in b}
        st["modules"] = _with_blocks(a["modules"], prefix, starts[s], counts[s])
        out["stages"].append(st)
    out["ranks"] = []
    for r, (a, b) in enumerate(zip(r1["ranks"], r2["ranks"])):
        mine = [s for s, pos in enumerate(sched.placement) if pos == r]
        k = sum(counts[s] for s in mine) / len(mine)  # a rank's stages: their mean block count
        rk = {key: (b[key] if key in ("position", "stages", "peak_at", "offload_note", "largest_trainable")
                    else lin(a[key], b[key], k)) for key in b}
        rk["busy_s"] = sim.busy[r] if r < len(sim.busy) else 0.0
        out["ranks"].append(rk)
    return out


def _with_blocks(modules: list[str], prefix: str, start: int, count: int) -> list[str]:
    """A 1-block stage's modules with its block replaced by blocks start .. start + count - 1."""
    before, after, seen = [], [], False
    for m in modules:
        if m.startswith(prefix):
            seen = True
        elif seen:
            after.append(m)
        else:
            before.append(m)
    return before + [f"{prefix}{i}" for i in range(start, start + count)] + after


__all__ = ["apply_pipeline", "pipeline_report", "plan_pipeline"]
