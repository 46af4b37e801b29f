"""Roofline cost model: predicted seconds per node on a `DeviceSpec`.

    time(node) = max(flops / peak_flops(dtype), bytes_moved / memory_bandwidth) + launch

Views cost nothing. The launch term stands for per-op overhead (kernel launch on GPUs,
dispatcher on CPUs) and is what makes many tiny ops slow.
"""

from __future__ import annotations

import torch.fx as fx

from fxspeed.devices import DeviceSpec
from fxspeed.ir import META_KEY, NodeInfo

LAUNCH_SECONDS = {"cuda": 5e-6, "cpu": 3e-6}
_DTYPE_CLASS = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}


def node_time(inf: NodeInfo, device: DeviceSpec) -> float:
    if inf.is_view or (inf.flops == 0 and inf.bytes_read + inf.bytes_written == 0):
        return 0.0
    peak = device.peak_flops(_DTYPE_CLASS.get(inf.dtype or "float32", "fp32"))
    compute = inf.flops / peak if peak else 0.0
    memory = (inf.bytes_read + inf.bytes_written) / device.mem_bandwidth if device.mem_bandwidth else 0.0
    return max(compute, memory) + LAUNCH_SECONDS.get(device.kind, 5e-6)


def estimate_times(gm: fx.GraphModule, device: DeviceSpec) -> dict[str, float]:
    """Write `NodeInfo.time` for every node; return seconds summed by role."""
    by_role: dict[str, float] = {}
    for n in gm.graph.nodes:
        inf: NodeInfo | None = n.meta.get(META_KEY)
        if inf is None or n.op != "call_function":
            continue
        inf.time = node_time(inf, device)
        by_role[inf.role] = by_role.get(inf.role, 0.0) + inf.time
    return by_role


def optimizer_time(param_bytes: int, optimizer: str, device: DeviceSpec) -> float:
    """Optimizer step is memory-bound: Adam reads/writes params, grads and two states (~8 passes)."""
    passes = {"adam": 8, "adamw": 8, "sgd": 3}.get(optimizer, 8)
    return passes * param_bytes / device.mem_bandwidth if device.mem_bandwidth else 0.0
