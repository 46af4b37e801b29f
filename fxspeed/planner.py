"""Planner v0: predicted per-rank memory and step time for a strategy, from an annotated graph.

Memory has two phases: the graph (forward + backward, liveness over the nodes) with the
optimizer states resident, and the optimizer step (parameters + gradients + states + the
optimizer's own temporaries). ZeRO stages divide model states across the data-parallel
ranks as in the ZeRO paper; the paper's formula is kept beside our estimate.
"""

from __future__ import annotations

from typing import Sequence

import torch.fx as fx

from .config import Config
from .cost_model import estimate_times, optimizer_time
from .devices import DeviceSpec
from .ir import (ACTIVATIONS, BUFFERS, COMM_BUFFERS, GRADIENTS, INPUTS, META_KEY, OPTIMIZER_STATES, PARAMETERS,
                 TEMPORARIES, StepSignature, tensor_bytes)
from .memory import memory_timeline
from .plan import Plan

# Bytes of optimizer state per byte of (fp32) parameter, and of temporaries during the step:
# torch's foreach Adam allocates one sqrt(v) buffer per parameter; Adam with L2 weight decay
# also builds grad + wd*param.
OPT_STATE_FACTOR = {"adamw": 2, "adam": 2, "sgd": 0}
DDP_BUCKET_BYTES = 25 * 2**20


def opt_factors(config: Config) -> tuple[float, float]:
    state = OPT_STATE_FACTOR[config.optimizer]
    if config.optimizer == "sgd" and config.momentum:
        state = 1
    temp = {"adamw": 1, "adam": 2 if config.weight_decay else 1, "sgd": 1 if config.weight_decay else 0}[config.optimizer]
    return state, temp


def build_plan(gm: fx.GraphModule, signature: StepSignature, *, model_name: str, config: Config,
               devices: Sequence[DeviceSpec], passes: list[dict], notes: list[str] | None = None) -> Plan:
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    # Count each tensor once: a tied weight appears under several names.
    owned = [(s, ph) for s, ph in zip(signature.inputs, placeholders) if s.kind == "param" and not signature.is_alias(s.target)]
    params = {s.target: tensor_bytes(ph.meta.get("val")) for s, ph in owned}
    numel = {s.target: ph.meta["val"].numel() for s, ph in owned}
    trainable = {s.target for s in signature.outputs if s.kind == "grad" and s.target in params}
    p_bytes = sum(params.values())
    t_bytes = sum(params[n] for n in trainable)
    n = len(devices)
    dp = n  # pipeline/tensor degrees arrive with their issues
    z = config.zero
    state_f, temp_f = opt_factors(config)

    tl = memory_timeline(gm)
    step = dict(tl.peak)
    # The graph's own params/grads are full-size; ZeRO shards what the rank keeps.
    shard = lambda b, stage: b / dp if z >= stage else b  # noqa: E731
    step[PARAMETERS] = shard(p_bytes, 3)
    step[GRADIENTS] = shard(step.get(GRADIENTS, 0), 2)
    step[OPTIMIZER_STATES] = shard(state_f * t_bytes, 1)
    comm = 0.0
    if dp > 1:
        largest = max(params.values(), default=0)
        comm = 2 * DDP_BUCKET_BYTES if z < 3 else 2 * largest  # double-buffered buckets / prefetch
    step[COMM_BUFFERS] = comm
    opt_phase = {PARAMETERS: shard(p_bytes, 3), GRADIENTS: shard(t_bytes, 2), OPTIMIZER_STATES: shard(state_f * t_bytes, 1),
                 TEMPORARIES: shard(temp_f * t_bytes, 1), BUFFERS: step.get(BUFFERS, 0), INPUTS: step.get(INPUTS, 0)}
    peak, phase = (step, "step") if sum(step.values()) >= sum(opt_phase.values()) else (opt_phase, "optimizer")
    peak = {k: int(v) for k, v in peak.items()}

    dev = devices[0]
    by_role = estimate_times(gm, dev)
    t_opt = optimizer_time(shard(t_bytes, 1), config.optimizer, dev)
    comm_bytes = 0.0 if dp == 1 else (2 * (dp - 1) / dp * t_bytes if z < 3 else 3 * (dp - 1) / dp * t_bytes)
    t_comm = comm_bytes / dev.link_bandwidth if dp > 1 and dev.link_bandwidth else 0.0
    fwd, bwd = by_role.get("forward", 0.0), by_role.get("backward", 0.0)
    flops = {"forward": 0, "backward": 0}
    for node in gm.graph.nodes:
        inf = node.meta.get(META_KEY)
        if inf is not None and inf.role in flops:
            flops[inf.role] += inf.flops
    flops["total"] = flops["forward"] + flops["backward"]

    n_params = sum(numel.values())
    # ZeRO paper, fp32 training with Adam: 4 (params) + 4 (grads) + 8 (states) bytes/param.
    k_state = 4 * state_f
    formula = {0: (4 + 4 + k_state) * n_params, 1: (4 + 4) * n_params + k_state * n_params / dp,
               2: 4 * n_params + (4 + k_state) * n_params / dp, 3: (4 + 4 + k_state) * n_params / dp}[z]
    return Plan(
        model=model_name, n_params=n_params, n_trainable=sum(numel[n] for n in trainable),
        config=config.to_dict(), devices=[d.to_dict() for d in devices],
        strategy={"dp": dp, "zero": z, "pp": 1, "tp": 1, "precision": config.precision, "optimizer": config.optimizer},
        rank_memory=[dict(peak) for _ in range(n)], peak_phase=[phase] * n,
        time={"forward": fwd, "backward": bwd, "optimizer": t_opt, "communication": t_comm,
              "total": fwd + bwd + t_opt + t_comm},
        flops=flops, passes=passes,
        timeline={"names": tl.names, "roles": tl.roles, "bytes": tl.totals,
                  "resident": [int(step[OPTIMIZER_STATES] + comm)] * 1},
        notes=list(notes or []), zero_formula=[int(formula)] * n,
    )

