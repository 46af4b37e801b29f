"""Planner: predicted per-rank memory and step time for a strategy, from an annotated graph.

Memory has two phases, and the plan's peak is the larger:

    step       the graph (forward + backward; liveness over its nodes) with the parameters and
               the optimizer states resident (steady state: states exist from the first step on)
    optimizer  parameters + gradients + optimizer states + the optimizer's own temporaries

ZeRO stages divide model states across the data-parallel ranks as in the ZeRO paper; the
paper's formula is kept beside our estimate (`zero_paper_bytes`).

Two steps make a plan: `graph_costs` reads one traced graph into plain numbers (`GraphCosts`),
and `finish_plan` applies the strategy to them. Between the two, costs of several traces can be
combined: `plan_model` traces a model whose blocks repeat (an nn.ModuleList of identical
layers) with 2, 3 and 4 blocks and extrapolates to all of them: linearly for FLOPs, parameters
and time, over the timeline's points for the peak memory (planner/extrapolate.py), checked on
the third trace.
why: docs/decisions/repeated-block-extrapolation.md,
     docs/decisions/plan-from-the-single-device-program.md
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from dataclasses import dataclass, field
from typing import Any, Iterator, Mapping, Sequence

import torch
import torch.fx as fx
import torch.nn as nn

from fxspeed.config import Config, ConfigWarning
from fxspeed.planner.cost_model import estimate_times, optimizer_time
from fxspeed.devices import DeviceSpec
from fxspeed.errors import warn_user
from fxspeed.ir import (BACKWARD, BUFFERS, CATEGORIES, COMM_BUFFERS, FORWARD, GRADIENTS, INPUTS, META_KEY,
                        OPTIMIZER_STATES, PARAMETERS, TEMPORARIES, StepSignature, step_calls, tensor_bytes)
from fxspeed.planner.extrapolate import ALL, FRONT, extrapolate_peak, extrapolate_peaks
from fxspeed.planner.memory import memory_timeline, phase_of
from fxspeed.planner.placement import PlacementAnalysis, collapse_blocks, describe_placements
from fxspeed.planner.plan import Plan, layout_text

# Optimizer states per (fp32) parameter: Adam keeps exp_avg and exp_avg_sq; SGD with momentum
# keeps one buffer. States are created on the first step (torch.optim allocates them lazily).
OPT_STATE_FACTOR = {"adamw": 2, "adam": 2, "sgd": 0}
# Repeated blocks are extrapolated from 2-, 3- and 4-block traces when a model has at least this
# many (Config.layer_extrapolation: True / False / "auto").
EXTRAPOLATE_MIN_LAYERS = 16


def opt_factors(config: Config) -> tuple[float, float]:
    """(state, temporary) bytes per trainable parameter byte for `config.optimizer` when torch
    runs its foreach implementation (the default on GPUs); see `optimizer_temporaries`."""
    state = OPT_STATE_FACTOR[config.optimizer]
    if config.optimizer == "sgd" and config.momentum:
        state = 1
    temp = {"adamw": 1, "adam": 1, "sgd": 1 if config.weight_decay else 0}[config.optimizer]
    return state, temp


# Device kinds where torch.optim has fused Adam/AdamW/SGD kernels, which runtime/optimizer.py uses.
FUSED_OPTIMIZER_DEVICES = ("cpu", "cuda")


def uses_foreach(device: DeviceSpec) -> bool:
    """Without fused kernels, torch.optim picks its foreach implementation by default only when
    every parameter is on a device with foreach kernels (CUDA and the like); on the CPU it loops
    over tensors."""
    return device.kind != "cpu"


def optimizer_temporaries(config: Config, device: DeviceSpec, trainable_bytes: float, largest: float) -> float:
    """Bytes the optimizer step allocates beyond parameters, gradients and states, read off
    torch.optim (torch/optim/adam.py, sgd.py) for the rank's `trainable_bytes`:

    fused (CPU, CUDA: what fxspeed's runtime runs there): none, the kernel updates each tensor in
        place (why: docs/decisions/fused-optimizers.md).
    foreach (other accelerators): Adam/AdamW build `exp_avg_sq_sqrt = _foreach_sqrt(exp_avg_sqs)`,
        one tensor per parameter (Adam's L2 decay builds `grads + wd*params` too, but frees it
        first); SGD builds `grads + wd*params` only with weight decay.
    single-tensor (a CPU without fused kernels): the same work one parameter at a time, so only
        the largest parameter matters: `denom = (exp_avg_sq.sqrt() / c).add_(eps)` holds two of
        its size at once, plus `grad.add(param, alpha=wd)` for Adam with L2 decay; SGD one with
        weight decay.
    """
    if device.kind in FUSED_OPTIMIZER_DEVICES:
        return 0.0
    if uses_foreach(device):
        return opt_factors(config)[1] * trainable_bytes
    largest = min(largest, trainable_bytes)
    wd = 1 if config.weight_decay else 0
    per = {"adamw": 2, "adam": 2 + wd, "sgd": wd}[config.optimizer]
    return per * largest


def zero_paper_bytes(n_params: float, stage: int, dp: int, k: float = 12, bytes_per_param: float = 2,
                     grad_bytes: float | None = None) -> float:
    """Model-state bytes per rank from the ZeRO paper (Rajbhandari et al. 2020, Figure 1):
    parameters (`bytes_per_param`), gradients (`grad_bytes`, default the same) and `k` bytes of
    optimizer state per parameter, with stage 1/2/3 dividing states / +gradients / +parameters
    by the data-parallel degree `dp`. Mixed-precision Adam: k=12, 2-byte params and grads
    (the paper's 7.5B on 64 GPUs: 120, 31.4, 16.6, 1.88 GB). fp32 Adam: k=8, 4 and 4."""
    g = bytes_per_param if grad_bytes is None else grad_bytes
    p, s = bytes_per_param * n_params, k * n_params
    gr = g * n_params
    return {0: p + gr + s, 1: p + gr + s / dp, 2: p + (gr + s) / dp, 3: (p + gr + s) / dp}[stage]


# --------------------------------------------------------------------------------------------
# One traced graph -> plain numbers
# --------------------------------------------------------------------------------------------

@dataclass
class GraphCosts:
    """What the planner reads off one traced step, before any strategy is applied."""

    step: dict[str, float]  # liveness peak by category (the graph's own full-size params and grads)
    param_bytes: float  # unique parameters (a tied weight counted once)
    trainable_bytes: float
    largest_param: float
    largest_trainable: float
    n_params: float
    n_trainable: float
    flops: dict[str, float]  # forward, backward
    times: dict[str, float]  # forward, backward (seconds on the plan's device)
    timeline: dict[str, list[Any]] = field(default_factory=dict)
    # Master weights (the program reads low-precision working copies, keep_weights_low): bytes of
    # the fp32 masters of the trainable parameters, which the optimizer steps (0 otherwise)
    master_bytes: float = 0.0
    grad_bytes: float = 0.0  # the trainable parameters' gradients, as the program leaves them
    # step_in_backward: gradients the program hands to the optimizer inside backward (freed there;
    # not held during the optimizer phase after the program)
    stepped_grad_bytes: float = 0.0
    # Tensor parallelism: every parameter's placement and the tp collectives' bytes per step
    # (placement.describe_placements of the tp rank's program)
    tp_placements: dict[str, str] = field(default_factory=dict)
    tp_communication: dict[str, float] = field(default_factory=dict)
    # offload_activations: bytes of the saved activations the program moves off the device in
    # forward (the timeline already counts them gone between their offload and their reload)
    offloaded_activation_bytes: float = 0.0
    # (bytes, dtype) of each trainable parameter's gradient in the order backward completes them:
    # the order reduce_gradients fills its buckets in (gradient_buckets)
    gradient_order: list[tuple[int, str]] = field(default_factory=list)
    # The traced step's liveness (memory.Timeline): repeated-layer extrapolation extrapolates its
    # points (planner/extrapolate.py). None on extrapolated costs
    liveness: Any = field(default=None, repr=False, compare=False)
    # The peak's breakdown within forward and within backward (memory.Timeline.phase_peaks): the
    # gradient buckets a replica holds in flight are added to backward's only (step_peak). Empty:
    # `step` stands for both
    phase_steps: dict[str, dict[str, float]] = field(default_factory=dict)
    # Backward's candidate peaks as (gradient bytes made so far, breakdown) (memory.backward_front):
    # the gradient buckets in flight at a node are at most what backward has made by then, so the
    # replica's peak in backward is the largest of these with their buckets. Empty (a linear
    # extrapolation): backward's phase_steps peak with two whole buckets
    backward_front: list[tuple[float, dict[str, float]]] = field(default_factory=list, repr=False)

    @property
    def state_basis(self) -> float:
        """Bytes of the tensors the optimizer steps (its states are the same size per state)."""
        return self.master_bytes or self.trainable_bytes

    def extrapolate(self, two: "GraphCosts", layers: float, blocks: int = 1) -> "GraphCosts":
        """`self` traced with `blocks` blocks, `two` with one more: costs with `layers` blocks,
        linear in the count (a maximum, the largest parameter, is taken from `two`)."""
        k = layers - blocks

        def lin(a: float, b: float) -> float:
            return a + (b - a) * k

        def lin_d(a: dict[str, float], b: dict[str, float]) -> dict[str, float]:
            return {c: lin(a.get(c, 0), b.get(c, 0)) for c in {*a, *b}}

        return GraphCosts(step=lin_d(self.step, two.step), param_bytes=lin(self.param_bytes, two.param_bytes),
                          trainable_bytes=lin(self.trainable_bytes, two.trainable_bytes),
                          largest_param=two.largest_param, largest_trainable=two.largest_trainable,
                          n_params=lin(self.n_params, two.n_params),
                          n_trainable=lin(self.n_trainable, two.n_trainable), flops=lin_d(self.flops, two.flops),
                          times=lin_d(self.times, two.times), timeline=two.timeline,
                          master_bytes=lin(self.master_bytes, two.master_bytes),
                          grad_bytes=lin(self.grad_bytes, two.grad_bytes),
                          stepped_grad_bytes=lin(self.stepped_grad_bytes, two.stepped_grad_bytes),
                          tp_placements=collapse_blocks(two.tp_placements),
                          tp_communication=lin_d(self.tp_communication, two.tp_communication),
                          offloaded_activation_bytes=lin(self.offloaded_activation_bytes,
                                                         two.offloaded_activation_bytes),
                          gradient_order=_repeat_block(self.gradient_order, two.gradient_order, layers - blocks),
                          phase_steps={ph: lin_d(self.phase_steps[ph], two.phase_steps[ph])
                                       for ph in self.phase_steps.keys() & two.phase_steps.keys()})


def _repeat_block(one: list[tuple[int, str]], two: list[tuple[int, str]], more: float) -> list[tuple[int, str]]:
    """The gradient order with `more` blocks added to `one`'s, from the orders of `one` and of
    `two` (one block more): `two` is `one` with one block's gradients inserted somewhere; insert
    that run `more` times. A pair that does not read that way (blocks whose gradients
    interleave) keeps `two`'s order."""
    m = len(two) - len(one)
    if m <= 0:
        return list(two)
    for p in range(len(one) + 1):
        if two[:p] == one[:p] and two[p + m:] == one[p:]:
            return one[:p] + two[p:p + m] * max(1, round(more)) + one[p:]
    return list(two)


def gradient_buckets(costs: GraphCosts, limit: float) -> list[float]:
    """Bytes of each gradient bucket reduce_gradients makes with `limit` (Config.bucket_mb): it
    fills buckets in gradient order and closes one once it reaches the limit or the dtype changes,
    so a bucket holds up to the limit plus one gradient."""
    return [size for size, _ in typed_gradient_buckets(costs, limit)]


def typed_gradient_buckets(costs: GraphCosts, limit: float) -> list[tuple[float, str]]:
    """`gradient_buckets` with each bucket's gradient dtype ("torch.bfloat16")."""
    buckets: list[tuple[float, str]] = []
    size, kind = float(limit), None
    for nbytes, dtype in costs.gradient_order:
        if size >= limit or dtype != kind:
            buckets.append((0.0, dtype))
            size, kind = 0.0, dtype
        size += nbytes
        buckets[-1] = (size, dtype)
    return buckets


def accumulated_gradients(costs: GraphCosts, config: Config, dp: int) -> float:
    """Gradient bytes a step of `Config.grad_accum` slices keeps from its earlier slices while a
    later one runs, forward included (runtime/engine.py `_joint_step`): over several replicas
    ZeRO-0/1 the slices' unreduced flat buckets (reduced once, by the last slice), ZeRO-2/3 the
    reduced shards; one replica its gradients. The plan is of one slice's program and counted
    none: GPT 4 x 256 on 2 ranks planned the same at grad_accum=2 as at 1."""
    if config.grad_accum <= 1:
        return 0.0
    full = costs.grad_bytes or costs.trainable_bytes
    return full / dp if config.zero >= 2 and dp > 1 else full


def flattened_bucket(costs: GraphCosts, limit: float, made: float | None = None) -> float:
    """One replica with a flat layout (master weights there: its optimizer states offloaded)
    flattens each complete bucket of gradients (reduce_gradients' cat, no collective) and steps it
    inside backward: the flat bucket lives beside the gradients it was made from, which the planned
    program (before that pass) holds per parameter. The largest bucket complete once `made` bytes
    of gradients are (any, without `made`). 1 rank, GPT 19M bf16 with optimizer offload: the step
    peaked 54 MB above the plan's 133, a 27 MB bucket of it this."""
    done, largest = 0.0, 0.0
    for size in gradient_buckets(costs, limit) if costs.gradient_order else [min(limit, costs.trainable_bytes)]:
        done += size
        if made is not None and _whole(done) > made:
            break
        largest = max(largest, size)
    return largest


def flatten_transient(costs: GraphCosts, config: Config, dp: int, made: float) -> float:
    """Communication-buffer bytes while ZeRO-2's reduce_gradients flattens a complete bucket (its
    `cat`) over `dp` replicas, once backward has made `made` gradient bytes: the last bucket
    complete by then, whose gradients are still full-size, and reuse_buffers' workspace they are
    copied into (allocated at the first bucket's flatten with the size of the largest bucket it
    will hold) are live at once. The planned program's gradients count that bucket as the rank's
    1/dp shard, so the rest is counted here. `min(two buckets, made)` alone capped the first
    bucket's flatten at the bytes made, one copy: fp32 ZeRO-2 on 2 ranks (HF Llama 18M, buckets of
    27.7, 28.3 and 16.7 MB) peaked 11 MB over the plan at the workspace's allocation. Not ZeRO-1:
    its planned gradients hold the whole bucket and the cap's copy is its fresh flat buffer. Not
    ZeRO-3: the workspace is shared with the gathered parameter buckets, which step_phase counts
    (its plan was over the live tensors at the peak already)."""
    buckets = gradient_buckets(costs, config.bucket_mb * 2**20)
    if config.zero != 2 or not buckets:
        return 0.0
    last, complete = 0.0, 0.0
    for nbytes in buckets:
        complete += nbytes
        if made < _whole(complete):
            break
        last = nbytes
    return last + max(buckets) - last / dp if last else 0.0


def bucket_step_copy(costs: GraphCosts, config: Config, dp: int, made: float | None = None) -> float:
    """Bytes of the gradient a bucket stepped inside backward over `dp` replicas gets as its own
    tensor (FlatParameters.set_grads, in fxspeed::step_buckets): this rank's shard, in the dtype
    of what the optimizer steps, held through the update beside the reduced bucket the program
    hands over (which the program holds until the call returns) and the next bucket in flight.
    ZeRO-1 copies its shard out of the whole reduced bucket; under master weights held here the
    shard becomes the fp32 master's gradient (ZeRO-1/2/3: twice a working-precision shard);
    ZeRO-2/3 without them step the reduced shard as it is. Bucket k is stepped once bucket k+1 is
    complete (the last at backward's end), so with `made` (the gradient bytes backward has made)
    only the buckets stepped by then count; the largest of their copies is returned.
    (bf16 ZeRO-1 on 2 ranks, a 19M GPT, peaked 247 MB as measured against a plan of 209 without it:
    at the first bucket's step, its fp32 shard beside the whole reduced bf16 bucket and the next.)"""
    if dp < 2 or config.zero < 1 or not costs.stepped_grad_bytes:
        return 0.0
    buckets = typed_gradient_buckets(costs, config.bucket_mb * 2**20)
    master_here = costs.master_bytes > 0 and not masters_in_file(costs, config)
    largest = 0.0
    for k, (nbytes, dtype) in enumerate(buckets):
        complete = sum(b for b, _ in buckets[:k + 2])  # this bucket and the next, or every one
        if made is not None and made < _whole(complete):
            break
        own = getattr(torch, dtype.rpartition(".")[2]).itemsize
        target = 4 if master_here else own
        if config.zero == 1 or target != own:
            largest = max(largest, nbytes / own / dp * target)
    return largest


def two_buckets(costs: GraphCosts, limit: float) -> float:
    """Bytes of two buckets in flight (one being reduced or gathered while the next fills): the
    two largest, not the largest twice, which a model whose one parameter dominates (a tied
    embedding of a large vocabulary) counted as two copies of that parameter. Without an order (a
    plan built from costs that lack it): two of the limit, or of every trainable byte if fewer."""
    if not costs.gradient_order:
        return 2 * min(limit, costs.trainable_bytes)
    return sum(sorted(gradient_buckets(costs, limit))[-2:])


def _gradient_order(gm: fx.GraphModule, signature: StepSignature, trainable: set[str]) -> list[tuple[int, str]]:
    """(bytes, dtype) of the trainable gradients in the order the graph produces them: returned
    ones (by their producing node, as reduce_gradients sorts them) and those the program steps
    inside backward (the gradient argument of each optimizer call)."""
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    out_node = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    found = [g for g, s in zip(out_node.args[0], signature.outputs)
             if s.kind == "grad" and s.target in trainable and isinstance(g, fx.Node)]
    found += [g for n in step_calls(gm.graph) for g in n.args[3] if isinstance(g, fx.Node)]
    found.sort(key=order.__getitem__)
    return [(tensor_bytes(g.meta.get("val")), str(g.meta["val"].dtype)) for g in found
            if hasattr(g.meta.get("val"), "dtype")]


def graph_costs(gm: fx.GraphModule, signature: StepSignature, device: DeviceSpec,
                grad_scale: float = 1.0, tp: int = 1) -> GraphCosts:
    """`grad_scale`: the fraction of each gradient a rank keeps (1/dp under ZeRO-2 and 3). `tp`:
    the tensor-parallel degree when `gm` is one tp rank's program: bytes are the rank's (its
    slices), parameter counts the model's (a "param_tp" slice is 1/tp of its parameter)."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    # Count each tensor once: a tied weight appears under several names.
    owned = [(s, ph) for s, ph in zip(signature.inputs, placeholders)
             if s.kind in ("param", "param_tp") and not signature.is_alias(s.target)]
    params = {s.target: tensor_bytes(ph.meta.get("val")) for s, ph in owned}
    numel = {s.target: ph.meta["val"].numel() for s, ph in owned}
    full = {s.target: numel[s.target] * (tp if s.kind == "param_tp" else 1) for s, _ in owned}
    stepped = set(signature.stepped_in_backward) & set(params)
    trainable = {s.target for s in signature.outputs if s.kind == "grad" and s.target in params} | stepped
    out_node = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    grad_bytes = sum(tensor_bytes(o.meta.get("val")) for o, s in zip(out_node.args[0], signature.outputs)
                     if s.kind == "grad" and s.target in trainable and isinstance(o, fx.Node))
    stepped_bytes = stepped_gradient_bytes(gm)
    grad_bytes += stepped_bytes
    master = 4.0 * sum(numel[n] for n in trainable) if signature.working_dtype else 0.0

    tl = memory_timeline(gm, grad_scale)
    by_role = estimate_times(gm, device)
    flops = {"forward": 0, "backward": 0}
    for node in gm.graph.nodes:
        inf = node.meta.get(META_KEY)
        if inf is not None and inf.role in flops:
            flops[inf.role] += inf.flops
    placed: tuple[dict[str, str], dict[str, int]] = ({}, {})
    if tp > 1:
        placed = describe_placements(gm, signature)
    return GraphCosts(
        step={c: float(v) for c, v in tl.peak.items()}, param_bytes=float(sum(params.values())),
        trainable_bytes=float(sum(params[n] for n in trainable)), largest_param=float(max(params.values(), default=0)),
        largest_trainable=float(max((params[n] for n in trainable), default=0)),
        n_params=float(sum(full.values())), n_trainable=float(sum(full[n] for n in trainable)),
        flops={k: float(v) for k, v in flops.items()},
        times={"forward": by_role.get("forward", 0.0), "backward": by_role.get("backward", 0.0)},
        timeline={"names": tl.names, "roles": tl.roles, "bytes": tl.totals, "gradients": tl.gradients,
                  "produced": tl.produced},
        master_bytes=master, grad_bytes=float(grad_bytes), stepped_grad_bytes=float(stepped_bytes),
        tp_placements=placed[0], tp_communication={k: float(v) for k, v in placed[1].items()},
        offloaded_activation_bytes=float(sum(signature.offloaded_activations.values())),
        gradient_order=_gradient_order(gm, signature, trainable), liveness=tl,
        phase_steps={ph: {c: float(v) for c, v in peak.items()} for ph, peak in tl.phase_peaks.items()},
        backward_front=[(float(made), {c: float(v) for c, v in live.items()}) for made, live in tl.backward_front()],
    )


# --------------------------------------------------------------------------------------------
# Numbers + strategy -> Plan
# --------------------------------------------------------------------------------------------

def finish_plan(costs: GraphCosts, *, model_name: str, config: Config, devices: Sequence[DeviceSpec],
                passes: list[dict], notes: list[str] | None = None, pp: int = 1, tp: int = 1) -> Plan:
    """The plan of `costs` (one traced step) under `config` on `devices`, laid out as a
    dp x pp x tp mesh (dp = devices / (pp x tp)). Memory and time here are those of data
    parallelism over the graph as traced; under a pipeline, planner.pipeline.apply_pipeline
    then replaces them per rank from the stage programs."""
    n = len(devices)
    dp = max(1, n // (pp * tp))
    z = config.zero
    state_f, _ = opt_factors(config)
    t_bytes = costs.trainable_bytes

    shard = lambda b, stage: b / dp if z >= stage else b  # noqa: E731
    states, masters = partition_states(costs, config, dp)  # what offload may move; masters kept here
    peak_resident = max(sum(step_peak(costs, config, dp, 0).values()),  # nothing offloaded
                        sum(_optimizer_phase(costs, config, devices, dp, 0).values()))
    in_file = masters_in_file(costs, config)
    staged_here = staging_on_device(devices[0])
    moved, budget_note = choose_offload(config, states, peak_resident, in_file, staged_here)
    notes = [*(notes or []), *([budget_note] if budget_note else [])]
    if costs.stepped_grad_bytes:
        notes.append("the optimizer steps inside backward (step_in_backward): each bucket of gradients is freed "
                     "once its parameters are updated, so the gradients are never all held at once")
    on_disk = moved + (costs.param_bytes / dp if config.offloads_parameters else 0)
    tier = offload_tier(devices[0], config)
    host_tier = tier == "host"
    offloaded = {tier: int(round(on_disk))} if on_disk else {}
    if moved and not staged_here:  # the chunks' staging slots: pinned host memory beside the device
        offloaded["host"] = offloaded.get("host", 0) + staging_held(config, moved, states, in_file)
    if costs.offloaded_activation_bytes:
        where = "host" if devices[0].kind == "cuda" else "disk"
        offloaded[f"activations ({where})"] = int(round(costs.offloaded_activation_bytes))
        notes.append("saved activations leave the device in forward and come back ahead of backward "
                     "(offload_activations): the memory above counts them gone in between")
    step = step_peak(costs, config, dp, moved, staged_here)
    comm = step[COMM_BUFFERS]
    opt_phase = _optimizer_phase(costs, config, devices, dp, moved)
    as_int = lambda d: {c: int(round(d.get(c, 0))) for c in CATEGORIES}  # noqa: E731
    step_i, opt_i = as_int(step), as_int(opt_phase)
    peak, phase = (step_i, "step") if sum(step_i.values()) >= sum(opt_i.values()) else (opt_i, "optimizer")

    dev = devices[0]
    t_opt = optimizer_time(shard(costs.state_basis, 1), config.optimizer, dev)
    communication = communication_bytes(costs, config, dp)
    comm_bytes = sum(communication.values())
    t_comm = comm_bytes / dev.link_bandwidth if dp > 1 and dev.link_bandwidth else 0.0
    fwd, bwd = costs.times.get("forward", 0.0), costs.times.get("backward", 0.0)
    t_disk = 0.0 if host_tier else disk_time(dev, moved, costs.param_bytes / dp if config.offloads_parameters else 0.0,
                                             compute=fwd + bwd, t_opt=t_opt)
    flops = {"forward": int(round(costs.flops.get("forward", 0))), "backward": int(round(costs.flops.get("backward", 0)))}
    flops["total"] = flops["forward"] + flops["backward"]

    n_params = int(round(costs.n_params))
    share = n_params / tp  # the paper has no tensor parallelism: its formula over a tp rank's 1/tp
    if config.precision == "fp32":
        formula = zero_paper_bytes(share, z, dp, k=4 * state_f, bytes_per_param=4)
    else:  # the paper's mixed-precision accounting: 2-byte params and grads, K=12
        formula = zero_paper_bytes(share, z, dp, k=12, bytes_per_param=2)
    timeline = dict(costs.timeline)
    timeline["resident"] = [int(step[OPTIMIZER_STATES] + comm)]
    if costs.liveness is not None and pp == 1 and timeline.get("bytes"):
        # What the rank holds at each node under the strategy (its shards, optimizer states,
        # buffers), whose maximum is the step phase's peak: what viz.plot_timeline draws. Only for
        # a plan of the whole traced graph: an extrapolated plan's timeline is a shorter trace's
        timeline["rank_bytes"] = [int(round(v)) for v in step_phase_series(costs, config, dp, moved, staged_here)]
    model_states = {PARAMETERS: int(round(resident_parameters(costs, config, dp))),
                    GRADIENTS: int(round(shard(costs.grad_bytes or t_bytes, 2))),
                    OPTIMIZER_STATES: int(round(resident_optimizer_states(config, states, moved, in_file, staged_here)
                                                          + masters))}
    return Plan(
        model=model_name, n_params=n_params, n_trainable=int(round(costs.n_trainable)),
        config=config.to_dict(), devices=[d.to_dict() for d in devices],
        strategy={"dp": dp, "zero": z, "pp": pp, "tp": tp, "precision": config.precision, "optimizer": config.optimizer},
        rank_memory=[dict(peak) for _ in range(n)], peak_phase=[phase] * n,
        time={"forward": fwd, "backward": bwd, "optimizer": t_opt, "communication": t_comm,
              **({"disk": t_disk} if t_disk else {}), "total": fwd + bwd + t_opt + t_comm + t_disk},
        flops=flops, passes=passes, timeline=timeline,
        notes=list(notes or []), zero_formula=[int(formula)] * n,
        phase_memory={"step": step_i, "optimizer": opt_i}, model_states=model_states,
        dtypes=category_dtypes(config, master=costs.master_bytes > 0),
        communication={k: int(v) for k, v in communication.items()},
        mesh=layout_text(dp, pp, tp) if n > 1 else "", offloaded=offloaded, offloaded_optimizer=int(moved),
        over_budget=[budget_note] if budget_note else [],
        tp_placements=dict(costs.tp_placements), tp_communication={k: int(v) for k, v in costs.tp_communication.items()},
    )


def disk_time(device: DeviceSpec, states: float, shards: float, *, compute: float, t_opt: float) -> float:
    """Seconds of a step the offload files add (at device.disk_bandwidth; 0 when unknown).
    Optimizer states (`states` bytes, masters included) are read and written once a step while
    the optimizer steps the chunks before them; working parameter shards (`shards` bytes) are
    read twice (forward and backward, ahead of their gathers, so behind the compute) and written
    once (the step's new values). What does not fit behind the work it overlaps is added."""
    bw = device.disk_bandwidth
    if not bw or not (states or shards):
        return 0.0
    behind_compute = 2 * shards / bw
    behind_step = (2 * states + shards) / bw
    return max(0.0, behind_compute - compute) + max(0.0, behind_step - t_opt)


def stepped_gradient_bytes(gm: fx.GraphModule) -> int:
    """Bytes of the gradients the program's optimizer calls (fxspeed::step_parameters, put
    there by step_in_backward) take."""
    return sum(tensor_bytes(g.meta.get("val")) for n in step_calls(gm.graph) for g in n.args[3])


def _optimizer_phase(costs: GraphCosts, config: Config, devices: Sequence[DeviceSpec], dp: int,
                     offloaded: float | None = None) -> dict[str, float]:
    """Rank bytes by category during the optimizer step (parameters, gradients, states, the
    optimizer's temporaries), ZeRO-sharded over `dp`."""
    z = config.zero
    shard = lambda b, stage: b / dp if z >= stage else b  # noqa: E731
    t_bytes = costs.trainable_bytes
    states, masters = partition_states(costs, config, dp)
    # Master weights: the reduced low-precision shards became fp32 gradients of the masters (in
    # memory), or stay low-precision shards that the offloaded optimizer upcasts chunk by chunk.
    grads = (shard(costs.master_bytes, 1) if masters else shard(costs.grad_bytes or t_bytes, 1)) \
        if costs.master_bytes else shard(t_bytes, 2)
    if costs.stepped_grad_bytes:  # stepped (and freed) inside backward; one replica, fp32 working weights
        grads = max(0.0, grads - costs.stepped_grad_bytes)
    return {PARAMETERS: resident_parameters(costs, config, dp), GRADIENTS: grads,
            OPTIMIZER_STATES: resident_optimizer_states(config, states, offloaded, masters_in_file(costs, config),
                                                        staging_on_device(devices[0])) + masters,
            TEMPORARIES: optimizer_temporaries(config, devices[0], shard(t_bytes, 1), costs.largest_trainable),
            BUFFERS: costs.step.get(BUFFERS, 0), INPUTS: costs.step.get(INPUTS, 0)}


def communication_bytes(costs: GraphCosts, config: Config, dp: int) -> dict[str, float]:
    """Bytes each rank sends per step (ring collectives: (N-1)/N of the buffer per pass).

    gradient reduction: all-reduce = 2 passes (ZeRO-0/1), reduce-scatter = 1 pass (ZeRO-2/3);
    ZeRO-1/2 all-gather updated shards after the step (1 pass); ZeRO-3 all-gathers parameters
    twice (forward and backward), in the compute dtype under mixed precision."""
    if dp == 1:
        return {}
    ring = (dp - 1) / dp
    elem = {"fp32": 4, "bf16": 2, "fp16": 2}
    own = (costs.grad_bytes or costs.trainable_bytes) / max(costs.n_trainable, 1)  # bytes per gradient element
    grads = costs.n_trainable * reduce_elem(config, own)
    out = {"gradient_reduction": (2 if config.zero < 2 else 1) * ring * grads}
    if config.zero in (1, 2):
        out["parameter_all_gather"] = ring * costs.trainable_bytes  # working copies under master weights
    if config.zero >= 3:
        out["parameter_all_gather"] = 2 * ring * costs.n_params * elem[config.precision]
    return out


def reduce_elem(config: Config, own: float = 4) -> float:
    """Bytes per gradient element on the wire: Config.reduce_dtype, or the gradients' own
    (`own`) for "auto" and "fp32" (the program's gradients are fp32 unless master weights made
    them low-precision; see passes/parallel/reduce_gradients.py)."""
    return {"bf16": 2, "fp16": 2}.get(config.reduce_dtype, own)


def category_dtypes(config: Config, master: bool = False) -> dict[str, str]:
    """The dtype each tensor category is held in under `config` (what insert_casts and the
    runtime do). Without master weights: fp32 weights (the master), gradients and states, and
    low-precision compute copies made in the step; with them (`master`, keep_weights_low):
    low-precision working weights and gradients, fp32 master + states in the partition."""
    if config.precision == "fp32":
        return {c: "float32" for c in ("parameters", "gradients", "optimizer_states", "activations")}
    low = {"bf16": "bfloat16", "fp16": "float16"}[config.precision]
    names = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
    grads = names.get(config.reduce_dtype, low) if master else "float32"
    reduce = names.get(config.reduce_dtype, grads)
    d = {"parameters": f"float32 master + {low} compute copies", "gradients": grads,
         "optimizer_states": "float32", "activations": f"{low} (matmul/attention operands), float32 elsewhere",
         "gradient_reduction": reduce}
    if master:
        d["parameters"] = f"{low} working copies (float32 master with the optimizer, in this rank's partition)"
        d["optimizer_states"] = "float32 (master weights + the optimizer's states)"
    if config.zero >= 3:
        d["parameter_gathers"] = low
    if config.precision == "fp16":
        d["loss_scale"] = "float32 (dynamic)"
    return d


def grad_scale(config: Config, n_devices: int) -> float:
    return 1.0 / n_devices if config.zero >= 2 else 1.0


# The offloaded optimizer's chunk is at most this share of the rank's offloadable states, so that
# its three staging slots hold about a quarter of them: two buckets' worth (150 MiB at the
# default bucket_mb) held all the states of a small shard, and offloading them saved nothing.
CHUNK_SHARE = 12
# ... and at least this size, so that its file reads and writes stay large.
MIN_CHUNK = 2**20
# 64 elements of [exp_avg | exp_avg_sq] or [master | exp_avg | exp_avg_sq] in fp32: 512 and 768 bytes
RUN_BYTES = 1536


def offload_chunk_bytes(config: Config, bucket_mb: float | None = None, *, states: float | None = None) -> int:
    """Bytes of states per chunk of the offloaded optimizer (the engine asks for this): two
    gradient buckets' worth (a bucket's exp_avg and exp_avg_sq), and given the rank's `states`
    (the bytes it may offload: moments, and masters in the file) at most 1/CHUNK_SHARE of them
    but not under MIN_CHUNK; at least two pages. `bucket_mb`: instead of Config.bucket_mb.

        7.7M-parameter GPT, fp32, one rank: states 61.6 MB -> chunks of 5.1 MB, not 52.4 MB"""
    chunk = 2 * (config.bucket_mb if bucket_mb is None else bucket_mb) * 2**20
    if states and states / CHUNK_SHARE < chunk:
        # whole runs of 64 elements of 2 or 3 fp32 sections (the optimizer cuts runs at 64
        # elements): a chunk of another size is cut short, and reaching a memory budget's bytes
        # then took one chunk more than planned
        chunk = min(chunk, max(states / CHUNK_SHARE // RUN_BYTES * RUN_BYTES, MIN_CHUNK))
    return max(int(chunk), 2 * 4096)


def masters_in_file(costs: GraphCosts, config: Config) -> bool:
    """Optimizer offload under master weights: the fp32 masters go to the file with the moments."""
    return config.offloads_optimizer and costs.master_bytes > 0


def resident_parameters(costs: GraphCosts, config: Config, dp: int, made: float | None = None) -> float:
    """Parameter bytes a rank holds between uses: its ZeRO shard of every bucket, or with
    parameter offload (runtime/offloaded_parameters.py) the shards in flight: the one being
    gathered, the one read ahead, and two written back after the step (whose buffers the files
    keep until forward reads those buckets again).

    `made`: a node of backward that has made this many gradient bytes. Forward has read every
    bucket, so no write is left there; a fetch's buffer dies with its gather (which copies it
    into the gathered bucket) and the read ahead is the next bucket's: the shards of the buckets
    `gathered_at` that node. At the end of backward (nothing left to read ahead) the two written
    back had been counted on top of four buckets' worth: 30-50% over a measured step
    (docs/decisions/parameter-offload.md)."""
    mine = costs.param_bytes / dp if config.zero >= 3 else costs.param_bytes
    if not config.offloads_parameters:
        return mine
    if made is not None and costs.gradient_order:
        return min(mine, gathered_at(costs, config.bucket_mb * 2**20, made) / dp)
    bucket = max(costs.largest_param, min(config.bucket_mb * 2**20, costs.param_bytes))
    return min(mine, 4 * bucket / dp)


def persistent_buckets(config: Config, costs: GraphCosts) -> bool:
    """Whether ZeRO-0's reduced buckets are persistent buffers (passes/parallel/reduce_gradients.py:
    reuse_grad_buckets, where the gradients are reduced in their own dtype: reduce_dtype "auto" /
    "fp32", or the dtype the gradients have, as a model given in bf16 with reduce_dtype="bf16")."""
    if config.pipeline != 1:
        return False
    reduced = {"bf16": "torch.bfloat16", "fp16": "torch.float16"}.get(config.reduce_dtype)
    return reduced is None or bool(costs.gradient_order) and all(d == reduced for _, d in costs.gradient_order)


def buckets_not_made(costs: GraphCosts, limit: float, made: float) -> float:
    """ZeRO-0's persistent buckets beyond the planned program's gradients at a node that has made
    `made` gradient bytes: the program holds each gradient from when
    it is made, the rank every bucket throughout, and a bucket's gradients die once flattened into
    it. So the buckets not begun and the one being filled, whole (its gradients are the program's
    until the flatten): every bucket before backward, the last one at its end. Two buckets, as
    counted before, had been 77 MB short at backward's start and 40 MB over at its end (19M GPT,
    fp32, 2 ranks, offload="optimizer": plan 251.7 MB vs 214-216 measured)."""
    sizes = gradient_buckets(costs, limit)
    if not sizes:
        return max(0.0, (costs.grad_bytes or costs.trainable_bytes) - made)
    start = 0.0
    for size in sizes:
        if made <= start + size:
            break
        start += size
    else:
        start -= sizes[-1]
    return sum(sizes) - start


def gathered_at(costs: GraphCosts, limit: float, made: float) -> float:
    """Bytes of the (ZeRO-3) buckets whose parameters a node of backward that has made `made`
    gradient bytes works on: the bucket those gradients fill and the next one, fetched ahead.
    Where `made` ends a bucket, either bucket may be the one in use, so both pairs count."""
    sizes = gradient_buckets(costs, limit)
    best, start = 0.0, 0.0
    for k, size in enumerate(sizes):
        end = start + size
        if start <= made <= end or (k == len(sizes) - 1 and made > end):
            best = max(best, size + (sizes[k + 1] if k + 1 < len(sizes) else 0.0))
        start = end
    return best


def partition_states(costs: GraphCosts, config: Config, dp: int) -> tuple[float, float]:
    """(optimizer-state bytes the offloaded optimizer may move, fp32 master bytes held beside them)
    per rank. Under Config.offload="optimizer" the masters go to the file with the moments (a
    chunk is [master | exp_avg | exp_avg_sq]), so they are part of the first number."""
    shard = (lambda b: b / dp) if config.zero >= 1 else (lambda b: b)  # noqa: E731
    states, masters = shard(opt_factors(config)[0] * costs.state_basis), shard(costs.master_bytes)
    if masters_in_file(costs, config):
        return states + masters, 0.0
    return states, masters


def offload_staging(config: Config, masters: bool = False, bucket_mb: float | None = None, *,
                    states: float | None = None) -> int:
    """Host bytes the offloaded optimizer stages chunks through (runtime/offloaded_optimizer.py):
    three page-aligned slots of one chunk (`offload_chunk_bytes` of states in whole elements:
    [exp_avg | exp_avg_sq], or with the masters in the file [master | exp_avg | exp_avg_sq]; larger
    tensors are cut into chunk-sized runs) and, with the masters, one chunk of fp32 gradients.
    `bucket_mb`, `states`: as offload_chunk_bytes takes them."""
    sections = 3 if masters else 2
    cap = max(offload_chunk_bytes(config, bucket_mb, states=states) // (4 * sections), 1)  # elements per chunk
    slot = -(-(4 * sections * cap) // 4096) * 4096
    return 3 * slot + (4 * cap if masters else 0)


def staging_held(config: Config, moved: float, states: float, masters: bool = False,
                 bucket_mb: float | None = None) -> int:
    """Bytes of the offloaded optimizer's staging slots when `moved` of the rank's `states` bytes
    are offloaded: `offload_staging`, at most the moved states themselves (the optimizer sizes its
    slots to the largest chunk it has). `bucket_mb`: instead of Config.bucket_mb."""
    return int(min(moved, offload_staging(config, masters, bucket_mb, states=states)))


def offload_tier(device: DeviceSpec, config: Config) -> str:
    """Where optimizer and parameter offload put the states: "host" (a CUDA device keeps them in
    pinned host memory unless told Config.offload_device="nvme") or "disk" (files)."""
    return "host" if device.kind == "cuda" and config.offload_device != "nvme" else "disk"


def staging_on_device(device: DeviceSpec) -> bool:
    """Whether the offloaded optimizer's staging slots are this device's memory: on a CPU device
    (the files tier stages in the process's memory), not on a CUDA one (pinned host buffers)."""
    return device.kind != "cuda"


def resident_optimizer_states(config: Config, states: float, offloaded: float | None = None,
                              masters: bool = False, staged_here: bool = True) -> float:
    """Optimizer-state bytes held in the device's memory: all of them, or under
    Config.offload="optimizer" those not offloaded (`offloaded`, default all) plus, where the
    staging is device memory (`staged_here`, see staging_on_device), the staging the offloaded
    optimizer reads, steps and writes chunks through (`offload_staging`; `masters`: the fp32
    masters are in the file)."""
    if not config.offloads_optimizer:
        return states
    moved = states if offloaded is None else offloaded
    if not moved:
        return states
    return states - moved + (staging_held(config, moved, states, masters) if staged_here else 0)


def choose_offload(config: Config, states: float, peak_resident: float,
                   masters: bool = False, staged_here: bool = True) -> tuple[int, str | None]:
    """Bytes of optimizer states to offload under Config.offload="optimizer": all of them, or with
    Config.memory_budget_gb just enough (in whole chunks) that the rank's peak fits the budget.
    Also a note when even offloading everything does not fit."""
    if not config.offloads_optimizer:
        return 0, None
    if config.memory_budget_gb is None:
        return int(states), None
    budget = config.memory_budget_gb * 1e9
    chunk = offload_chunk_bytes(config, states=states)

    def peak(moved: float) -> float:
        return peak_resident - states + resident_optimizer_states(config, states, moved, masters, staged_here)

    moved = 0.0
    while moved < states and peak(moved) > budget:
        moved = min(states, moved + chunk)
    note = None
    if peak(moved) > budget:
        note = over_budget(config, peak(moved), states, masters, staged_here)
    return int(moved), note


def warn_over_budget(plan: Plan) -> None:
    """An engine whose plan cannot meet Config.memory_budget_gb runs anyway (the plan's figures
    are estimates), but says so: the note alone was seen only by a user who printed the plan."""
    for note in plan.over_budget:
        warn_user(note, ConfigWarning)


def over_budget(config: Config, peak: float, states: float, masters: bool, staged_here: bool) -> str:
    """What to say when the peak with every optimizer state (`states` bytes) offloaded is over
    Config.memory_budget_gb: the least the plan reaches, and the changes that lower it. The
    staging the offloaded states move through is three chunks (offload_chunk_bytes: at most 2 x
    bucket_mb, not under MIN_CHUNK), at most the states themselves: a smaller bucket_mb (three
    chunks about a quarter of the states) is named only where it at least halves that staging
    (small shards, where MIN_CHUNK holds it up). ZeRO-3 over more ranks shards what the rank holds
    (ZeRO-2 on a small model adds more gradient buckets than it shards)."""
    fixes = []
    held = staging_held(config, states, states, masters) if staged_here else 0
    smaller = states / (24 * 2**20)  # MiB: three chunks of 2 x bucket_mb, about a quarter of the states
    if held and smaller < config.bucket_mb and staging_held(config, states, states, masters, smaller) < 0.5 * held:
        fixes.append(f"Config.bucket_mb={smaller:.2g} (now {config.bucket_mb:g}: the staging of the offloaded "
                     f"states takes {held / 2**20:.3g} MiB of the peak)")
    fixes.append("zero=3 over more ranks" if config.zero < 3 else "more ranks")
    fixes.append("a smaller batch")
    return (f"Config.memory_budget_gb={config.memory_budget_gb:g} cannot be met: the planned peak is "
            f"{peak / 1e9:.3g} GB per rank even with every optimizer state offloaded; to lower it, try "
            + ", ".join(fixes[:-1]) + f" or {fixes[-1]}")


def step_peak(costs: GraphCosts, config: Config, n_devices: int, offloaded: float | None = None,
              staged_here: bool = True) -> dict[str, float]:
    """The rank's bytes by category at the peak of the step: the larger of forward's peak and
    backward's with the gradient buckets in flight (`step_phase` of each); of `costs.step` with
    them where the costs have no phase peaks."""
    phases = [(costs.phase_steps[ph], ph == BACKWARD, None) for ph in (FORWARD, BACKWARD)
              if ph in costs.phase_steps and not (ph == BACKWARD and costs.backward_front)]
    phases += [(live, True, made) for made, live in costs.backward_front]
    candidates = [step_phase(live, costs, config, n_devices, offloaded, staged_here, in_backward=b, made=made)
                  for live, b, made in phases or [(costs.step, True, None)]]
    return max(candidates, key=lambda d: sum(d.values()))


def step_phase(graph_live: dict[str, float], costs: GraphCosts, config: Config, n_devices: int,
               offloaded: float | None = None, staged_here: bool = True, in_backward: bool = True,
               made: float | None = None) -> dict[str, float]:
    """Rank bytes by category while the graph runs, from the graph's live bytes at one node
    (`in_backward`: a node of backward, where gradient buckets are in flight; `made`: the gradient
    bytes backward has made by then, which ZeRO-1/2/3's fresh buckets cannot exceed).

    The graph's own parameters and gradients are full-size; ZeRO shards what the rank keeps.
    Optimizer states are resident (steady state) and so are communication buffers."""
    dp, z = n_devices, config.zero
    shard = lambda b, stage: b / dp if z >= stage else b  # noqa: E731
    step = dict(graph_live)
    step[PARAMETERS] = resident_parameters(costs, config, dp, made if in_backward else None)
    step[GRADIENTS] = shard(step.get(GRADIENTS, 0), 2) + accumulated_gradients(costs, config, dp)
    states, masters = partition_states(costs, config, dp)
    step[OPTIMIZER_STATES] = resident_optimizer_states(config, states, offloaded, masters_in_file(costs, config),
                                                       staged_here) + masters
    comm = 0.0
    pair = two_buckets(costs, config.bucket_mb * 2**20)
    if dp > 1 and z == 0 and persistent_buckets(config, costs):
        # ZeRO-0 reduces into persistent buckets (persistent-gradient-buckets-for-zero0.md), there
        # in forward too: the planned program's gradients (per parameter, every one made so far:
        # ZeRO-0 keeps them) stand for the buckets already flattened, the rest are counted here
        comm = buckets_not_made(costs, config.bucket_mb * 2**20, graph_live.get(GRADIENTS, 0.0))
    elif dp > 1 and in_backward:
        # Double-buffered gradient buckets. The planned program holds gradients per parameter (it
        # is planned before the distributed passes); with several replicas a bucket's gradients
        # stay full-size until the bucket is complete, and its reduction stages the next one.
        # The others' hold what has been made.
        comm = pair if z == 0 or made is None else max(min(pair, made), flatten_transient(costs, config, dp, made))
        if z < 3:
            # The gradient a bucket stepped inside backward gets as its own tensor. Not under
            # ZeRO-3: a bucket is stepped after the last reader of its gathered weights, and its
            # shard's copy (4/dp bytes an element under master weights) takes the place of that
            # gathered bucket (2 or 4), which the two gathered buckets below hold in flight
            step[GRADIENTS] += bucket_step_copy(costs, config, dp, made)
    elif dp == 1 and in_backward and costs.master_bytes:
        comm = flattened_bucket(costs, config.bucket_mb * 2**20, made)
    if z >= 3 and (dp > 1 or config.offloads_parameters):  # (one rank with parameter offload "gathers" from files)
        # two gathered parameter buckets in flight (the gradient buckets' parameters, in the
        # working dtype the gradients have); without a gradient order, the largest parameter twice
        comm += pair if costs.gradient_order else 2 * max(costs.largest_param, pair / 2)
    step[COMM_BUFFERS] = comm
    return step


def _whole(nbytes: float) -> float:
    """`nbytes` less a rounding margin, for comparing amounts of gradient bytes made (an
    extrapolated plan's are affine in the block count, in floating point) with a sum of them."""
    return nbytes * (1 - 1e-9)


def step_phase_series(costs: GraphCosts, config: Config, dp: int, offloaded: float | None = None,
                      staged_here: bool = True) -> list[float]:
    """The rank's total bytes after each node of the graph (the step phase at every node, as
    `step_phase` makes the peak's: `dp` replicas, `offloaded` optimizer-state bytes)."""
    graph_params = costs.step.get(PARAMETERS, 0.0)
    out = []
    roles = costs.timeline.get("roles") or [BACKWARD] * len(costs.timeline["bytes"])
    made = costs.timeline.get("produced") or [None] * len(roles)
    for total, grads, role, m in zip(costs.timeline["bytes"], costs.timeline["gradients"], roles, made):
        live = {PARAMETERS: graph_params, GRADIENTS: grads, TEMPORARIES: total - graph_params - grads}
        out.append(sum(step_phase(live, costs, config, dp, offloaded, staged_here,
                                  in_backward=phase_of(role) == BACKWARD, made=m).values()))
    return out


# --------------------------------------------------------------------------------------------
# Model -> Plan: meta models, repeated blocks
# --------------------------------------------------------------------------------------------

def repeated_blocks(model: nn.Module) -> tuple[nn.Module, str, nn.ModuleList] | None:
    """The nn.ModuleList of structurally identical blocks holding the most parameters, as
    (parent module, attribute name, list); None if the model has none with 2+ blocks."""
    best, best_size = None, 0
    for name, mod in model.named_modules():
        if not isinstance(mod, nn.ModuleList) or len(mod) < 2:
            continue
        sigs = {_structure(b) for b in mod}
        if len(sigs) != 1:
            continue
        size = sum(p.numel() for p in mod.parameters())
        if size > best_size:
            parent_name, _, attr = name.rpartition(".")
            best, best_size = (model.get_submodule(parent_name), attr, mod), size
    return best


def block_prefix(model: nn.Module, blocks: nn.ModuleList) -> str:
    """The qualified-name prefix of the block stack `blocks` in `model` ("layers."): block k's
    parameters are named `<prefix>k.<rest>`."""
    return next(n for n, m in model.named_modules() if m is blocks) + "."


def _structure(block: nn.Module) -> tuple:
    return (type(block),
            tuple((n, type(m).__name__) for n, m in block.named_modules()),
            tuple((n, tuple(p.shape), p.dtype, p.requires_grad) for n, p in block.named_parameters()),
            tuple((n, tuple(b.shape), b.dtype) for n, b in block.named_buffers()))


@contextlib.contextmanager
def truncated(parent: nn.Module, attr: str, k: int) -> Iterator[None]:
    """Temporarily replace `parent.<attr>` (a ModuleList) by its first `k` blocks."""
    full = getattr(parent, attr)
    parent._modules[attr] = nn.ModuleList(list(full)[:k])
    try:
        yield
    finally:
        parent._modules[attr] = full


def _extrapolation_wanted(config: Config, layers: int) -> bool:
    flag = config.layer_extrapolation
    if flag == "auto":
        return layers >= EXTRAPOLATE_MIN_LAYERS
    return bool(flag)


def costs_reader(config: Config, devices: Sequence[DeviceSpec]) -> Any:
    """The `analyze` hook of compile_step: reads GraphCosts off the single-device program (under
    tensor parallelism, off one tp rank's program: its slices of the weights and activations)."""
    dp = max(1, len(devices) // (config.pipeline * config.tensor))
    return lambda gm, sig: graph_costs(gm, sig, devices[0], grad_scale(config, dp), tp=config.tensor)


def for_target(options: Any, device: DeviceSpec) -> Any:
    """Pass options (None, a mapping or a PassOptions) for a program planned for `device`: a CUDA
    target's program is traced on this host's CPU, where upcast_cpu_compute would otherwise lower
    its bf16/fp16 ops for this CPU (fp32 copies, fp32 FLOP/s) -- not what the GPU runs."""
    if device.kind == "cpu":
        return options
    if options is not None and not isinstance(options, Mapping):
        return dataclasses.replace(options, upcast_cpu_compute="off")
    return {**(options or {}), "upcast_cpu_compute": "off"}


def trace_costs(model: nn.Module, args: tuple, kwargs: dict, *, config: Config, devices: Sequence[DeviceSpec],
                loss_fn: Any = None) -> tuple[GraphCosts, list[dict], list[str]]:
    """Costs of `model`'s step on this batch: one trace, or 2/3/4-block traces extrapolated to
    all blocks for a deep stack of identical blocks. Returns (costs, pass records, notes)."""
    from fxspeed.compiler import compile_step
    from fxspeed.compiler.capture import trial_compiles
    from fxspeed.compiler.options import frees_gradients_in_backward, masters_kept, offload_flops_per_byte

    options: dict[str, Any] = {}  # overrides of the single-device options, as the engine's rank has them
    analyses: list = []
    if config.tensor > 1:  # plan tp rank 0's program, with the layout the engine would choose
        from fxspeed.planner.placement import make_placement_analysis

        options.update(tp_size=config.tensor, tp_group_name="tp (planned)")
    dp = len(devices) // (config.tensor * config.pipeline)
    if config.pipeline == 1 and not masters_kept(config, dp):  # (a pipeline's plan is built elsewhere)
        options["master_weights"] = False
    if frees_gradients_in_backward(config, dp):
        # What the engine's program does: the optimizer steps inside backward, by parameter on
        # one replica, by reduced bucket on several (read here as by parameter: the program is
        # planned before the distributed passes).
        options["optimizer_store"] = "(planned)"
    if config.offloads_activations and config.pipeline == 1:
        options.update(activation_store="(planned)",
                       activation_offload_flops_per_byte=offload_flops_per_byte(config, devices[0]))

    options = for_target(options, devices[0])

    def one() -> tuple[GraphCosts, list[dict]]:
        if config.tensor > 1:
            analyses[:] = [make_placement_analysis(devices)]
        with trial_compiles():  # the program is read here and dropped: no source of it stays
            compiled = compile_step(model, args, kwargs, config=config, loss_fn=loss_fn, train=True,
                                    analyze=costs_reader(config, devices), options=options, analyses=analyses)
        return compiled.costs, [r.to_dict() for r in compiled.records]

    # A CUDA program cannot be traced without CUDA: AOT export's functionalization of fake CUDA
    # tensors aborts a CPU-only torch build (c10 "not linked with support for cuda devices").
    off_device = devices[0].kind == "cuda" and not any(t.is_cuda for t in [*model.parameters(), *model.buffers()])
    first = ["traced on the model's device, not on CUDA: kernels chosen only for CUDA programs (flash attention "
             "under bf16/fp16, fuse_kernels' Triton norms) are not in this plan; plan with the model on a GPU for "
             "them"] if off_device else []
    found = repeated_blocks(model)
    if found is None or not _extrapolation_wanted(config, len(found[2])) or len(found[2]) <= 4:
        costs, passes = one()  # (4 blocks or fewer: the traces below would be the whole model)
        return costs, passes, first
    parent, attr, blocks = found
    layers = len(blocks)
    t0 = time.perf_counter()
    # 2, 3 and 4 blocks, not 1: the first and last blocks differ from the inner ones (the last
    # block's backward has no residual gradient to add), so a 1-block trace is not a stack's
    # start with its end; extrapolate from 2 and 3, check against 4
    traced = []
    for k in (2, 3, 4):
        with truncated(parent, attr, k):
            traced.append(one())
    (c2, _), (c3, _), (c4, passes) = traced
    # The peak from the timelines' points (extrapolate.py); a linear extrapolation of the peak's
    # breakdown only where the traces do not read as one block inserted
    check = c2.extrapolate(c3, 4, blocks=2)
    check_peak = extrapolate_peak(c2.liveness, c3.liveness, 3, 4)
    peaks = extrapolate_peaks(c3.liveness, c4.liveness, 4, layers)
    by_points = check_peak is not None and peaks is not None
    if by_points:
        check.step = check_peak
    errs = {"peak memory": _rel(sum(check.step.values()), sum(c4.step.values())),
            "time": _rel(sum(check.times.values()), sum(c4.times.values())),
            "FLOPs": _rel(sum(check.flops.values()), sum(c4.flops.values()))}
    worst = max(errs.values())
    how = ("its timeline's points" if by_points else
           "its breakdown, linearly (the traces do not read as one block's nodes inserted)")
    note = (f"repeated-layer extrapolation: {type(model).__name__}.{attr} has {layers} identical "
            f"{type(blocks[0]).__name__} blocks; traced with 2, 3 and 4 blocks in {time.perf_counter() - t0:.1f}s "
            f"and extrapolated linearly to {layers}, the peak memory from {how} (check at 4 blocks: "
            + ", ".join(f"{k} error {v:.2%}" for k, v in errs.items())
            + "); the timeline is the 4-block trace's")
    notes = [*first, note]
    if worst > 0.01:
        notes.append(f"warning: the 4-block check misses by {worst:.1%}; the blocks may not be independent "
                     "(set Config(layer_extrapolation=False) to trace the whole model)")
    costs = c2.extrapolate(c3, layers, blocks=2)
    costs.timeline = c4.timeline
    if by_points:
        costs.step = peaks.pop(ALL)
        costs.backward_front = peaks.pop(FRONT, [])  # type: ignore[assignment]
        costs.phase_steps = peaks
    negative = sorted(c for c, v in costs.step.items() if v < 0)
    if negative:
        # (Linear fallback) the peak is at another place in the 2- and 3-block traces (a tensor counted as one
        # category in one and another in the other): the breakdown, and likely the peak, are wrong
        notes.append(f"warning: the extrapolated peak has negative {', '.join(negative)}: the peak moves between "
                     "the traces, so the extrapolated peak memory is not reliable; set "
                     "Config(layer_extrapolation=False) to trace the whole model")
    return costs, passes, notes


# A stack of more blocks than this is solved for tp placements on two of them (see presolve_placements).
PRESOLVE_MIN_BLOCKS = 4


def presolve_placements(model: nn.Module, args: tuple, kwargs: dict, *, config: Config,
                        devices: Sequence[DeviceSpec], loss_fn: Any, options: Any) -> Any:
    """The "tp_placements" analysis for `model`, solved ahead on two of its repeated blocks when it
    has PRESOLVE_MIN_BLOCKS or more: the solver moves a weight of every block at once, so two
    blocks (one with a neighbour on each side that matters) decide the layout of all, and the
    whole program (Llama-70B's 80 layers: minutes of local search) is only propagated once with
    those placements fixed. Block k >= 1 takes block 1's placement, block 0 its own. Without such
    a stack the analysis is returned unsolved (it solves the first program it sees)."""
    from fxspeed.compiler import compile_step
    from fxspeed.compiler.pipelines import micro_config

    analysis = PlacementAnalysis(devices)
    found = repeated_blocks(model)
    if found is None or len(found[2]) < PRESOLVE_MIN_BLOCKS:
        return analysis
    parent, attr, blocks = found
    prefix = block_prefix(model, blocks)
    with truncated(parent, attr, 2):
        compile_step(model, args, kwargs, config=micro_config(config), loss_fn=loss_fn, train=True,
                     options=options.local(), analyses=[analysis.graph_pass])
    solved, out = analysis.params or {}, {}
    for name, _ in model.named_parameters(remove_duplicate=False):
        key = name
        if name.startswith(prefix):
            k, _, rest = name[len(prefix):].partition(".")
            key = f"{prefix}{min(int(k), 1)}.{rest}"
        if key in solved:
            out[name] = solved[key]
    analysis.params = out
    return analysis


def _rel(pred: float, true: float) -> float:
    return abs(pred - true) / abs(true) if true else abs(pred)


def plan_model(model: nn.Module, args: tuple, kwargs: dict, *, config: Config, devices: Sequence[DeviceSpec],
               loss_fn: Any = None) -> Plan:
    """Trace (on fake tensors) and plan `model`'s training step for `config` on `devices`."""
    costs, passes, notes = trace_costs(model, args, kwargs, config=config, devices=devices, loss_fn=loss_fn)
    return finish_plan(costs, model_name=type(model).__name__, config=config, devices=devices,
                       passes=passes, notes=notes, tp=config.tensor)


__all__ = ["GraphCosts", "PRESOLVE_MIN_BLOCKS", "bucket_step_copy", "costs_reader", "presolve_placements", "finish_plan", "optimizer_temporaries", "step_phase_series", "grad_scale", "graph_costs", "opt_factors", "plan_model",
           "repeated_blocks", "trace_costs", "zero_paper_bytes"]
