"""The inference plan: KV-cache bytes per token, what fits, and the decode roofline.

Decode is memory-bound: every step reads all the weights once plus each request's cached keys
and values, and does about 2 x parameters FLOPs per token, so

    step seconds(B, L) = max(2 * P * B / peak_flops, (weight_bytes + B * read(L)) / bandwidth)
    tokens/s(B, L)     = B / step seconds

where read(L) = L * kv_bytes_per_token, less in the layers with a sliding window W (they read
min(L, W) tokens). The largest batch x context that fits: (device memory - weights - packed weight
copies - workspace) / kv_bytes_per_token tokens of cache, shared by the batch; a request keeps
fewer than its context's tokens where layers slide (the serving loop reuses their blocks behind
the window: `ServingLoop.bytes_held`).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any

import torch.nn as nn

from fxspeed.config import Config
from fxspeed.devices import DeviceSpec
from fxspeed.ir.program import WINDOW_GROUP
from fxspeed.planner.placement import P, R, S, CostModel, tp_collectives

# Activations of one step (one row of `token_budget` tokens) are small next to weights and cache;
# they are kept aside as a fixed share of device memory rather than modelled.
WORKSPACE_FRACTION = 0.05


@dataclass
class InferencePlan:
    model: str
    device: str
    parameters: int
    weight_bytes: int
    kv_bytes_per_token: int
    layers: int
    context: int
    cache_tokens: int  # what serve allocated
    cache_bytes: int
    max_cache_tokens: int  # what would fit on the device
    max_batch_at_context: int  # requests of the full context length that fit at once
    token_budget: int
    block_size: int
    predicted_tokens_per_s: dict[str, float] = field(default_factory=dict)  # "batch=B,context=L" -> tokens/s
    tensor: int = 1  # tp ranks; weights, cache and "fits" are per rank
    tp_collectives_per_step: int = 0
    # copies of the linear weights pre-packed for oneDNN (CPU decode buckets;
    # passes/inference/pack_linear_weights.py), held beside the model's own
    packed_weight_bytes: int = 0
    # with serve(pack_linear="auto"): the [in, out] copies of the [out, in] linear weights that
    # small buckets the probe runs through ATen's GEMM read, held beside the packed ones (an upper
    # bound: a machine where every small bucket packs holds none)
    gemm_copy_bytes: int = 0
    # with serve(pack_linear="auto") on more than one CPU thread: the copies of the linear weights
    # split over the threads that buckets the probe splits read (an upper bound too)
    split_copy_bytes: int = 0
    # the cache a request of the full context holds, in tokens of every layer's keys and values:
    # the context, or less where layers have a sliding window (the serving loop reuses their blocks
    # behind it; where only some layers slide, this is their bytes and the global layers' together)
    held_at_context: int = 0
    # where only some layers slide: the tokens the sliding layers' own pool holds (max_batch rings);
    # `cache_tokens` is then the global layers'
    window_pool_tokens: int = 0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    def summary(self) -> str:
        mb = 1 << 20
        per = f", per rank of tensor={self.tensor} ({self.tp_collectives_per_step} tp collectives/step)" \
            if self.tensor > 1 else ""
        lines = [
            f"inference plan: {self.model} on {self.device}{per}",
            f"  weights            {self.parameters / 1e6:.2f}M parameters, {self.weight_bytes / mb:.1f} MiB"
            + (f" + {self.packed_weight_bytes / mb:.1f} MiB packed for the decode buckets"
               if self.packed_weight_bytes else "")
            + (f" + up to {self.gemm_copy_bytes / mb:.1f} MiB of [in, out] copies (buckets the probe runs "
               "through ATen's GEMM)" if self.gemm_copy_bytes else "")
            + (f" + up to {self.split_copy_bytes / mb:.1f} MiB of copies split over the threads (buckets the "
               "probe splits)" if self.split_copy_bytes else ""),
            f"  KV cache           {self.kv_bytes_per_token} bytes/token ({self.layers} layers, keys + values)",
            f"  cache allocated    {self.cache_tokens} tokens ({self.cache_bytes / mb:.1f} MiB) in blocks of "
            f"{self.block_size}"
            + (f" (the sliding layers' pool: {self.window_pool_tokens} tokens)" if self.window_pool_tokens else ""),
            f"  fits on device     {self.max_cache_tokens} tokens of cache = {self.max_batch_at_context} requests "
            f"x {self.context} context"
            + (f" (each holds {self.held_at_context} tokens: its sliding windows')"
               if 0 < self.held_at_context < self.context else ""),
            f"  token budget/step  {self.token_budget}",
            "  predicted decode (roofline):",
        ]
        lines += [f"    {k:<24} {v:10.1f} tokens/s" for k, v in self.predicted_tokens_per_s.items()]
        return "\n".join(lines)


def decode_tokens_per_s(parameters: int, weight_bytes: int, kv_bytes_read: int, batch: int, device: DeviceSpec,
                        dtype: str = "fp32", comm_s: float = 0.0) -> float:
    """The roofline of one decode step at `batch` requests that each read `kv_bytes_read` bytes of
    cache (InferenceProgram.kv_bytes_read at their context), plus `comm_s` seconds of
    tensor-parallel collectives (not overlapped: each waits for its layer)."""
    flops_s = 2.0 * parameters * batch / device.peak_flops(dtype)
    bytes_s = (weight_bytes + batch * kv_bytes_read) / max(device.mem_bandwidth, 1.0)
    return batch / (max(flops_s, bytes_s) + comm_s)


def plan_inference(model: nn.Module, program: Any, serving: Any, device: DeviceSpec, config: Config,
                   tensor: int = 1) -> InferencePlan:
    """`program`: an InferenceProgram (its kv_layout); `serving`: the ServingLoop (cache, budget).
    Under tensor parallelism (`tensor` > 1) the model's Parameters hold this rank's slices and the
    program's cache layout this rank's heads, so every figure is per tp rank; the decode roofline
    adds the program's tp collectives (the placement cost model's all-reduce / all-gather time)."""
    unique = {id(p): p for p in model.parameters()}
    params = sum(p.numel() for p in unique.values())
    wbytes = sum(p.numel() * p.element_size() for p in unique.values())
    kvb = program.kv_bytes_per_token()
    packed = int(program.gm.meta.get("packed_weight_bytes", 0))
    # (a bucket packs or reads these; "auto" may do both in different buckets: both held)
    auto = packed and serving.pack_linear == "auto"
    gemm = int(program.gm.meta.get("transposed_copy_bytes", 0)) if auto else 0
    split = int(program.gm.meta.get("split_copy_bytes", 0)) if auto and serving.packed.ways > 1 else 0
    free = device.memory * (1 - WORKSPACE_FRACTION) - wbytes - packed - gemm - split
    max_tokens = max(int(free // kvb), 0) if kvb else 0
    ctx = serving.max_context
    dtype = {"bf16": "bf16", "fp16": "fp16"}.get(config.precision, "fp32")
    collectives = _tp_collectives(program.gm, program.tokens) if tensor > 1 else []
    cm = CostModel(device, tensor)
    pred = {}
    for b in sorted({1, serving.max_batch}):
        for length in sorted({min(128, ctx), ctx}):
            comm = sum(cm.move(P if reduce else S(0), R, int(b * per_token)) for reduce, per_token in collectives)
            pred[f"batch={b},context={length}"] = decode_tokens_per_s(params, wbytes, program.kv_bytes_read(length),
                                                                     b, device, dtype, comm_s=comm)
    # a request of the whole context, in tokens of every layer's cache: fewer than the context where
    # layers slide (their blocks behind the window are reused; Gemma3's global layers keep them all)
    held = -(-serving.bytes_held(ctx) // kvb) if ctx and kvb else 0
    return InferencePlan(model=type(model).__name__, device=device.name, parameters=params, weight_bytes=wbytes,
                         kv_bytes_per_token=kvb, layers=len(program.kv_layout), context=ctx,
                         cache_tokens=serving.cache.usable_blocks * serving.block_size,
                         window_pool_tokens=(serving.cache.usable(WINDOW_GROUP) * serving.block_size
                                             if WINDOW_GROUP in serving.cache.sizes else 0),
                         cache_bytes=serving.cache.nbytes(), max_cache_tokens=max_tokens,
                         max_batch_at_context=max_tokens // held if held else 0, held_at_context=min(held, ctx),
                         token_budget=serving.token_budget,
                         block_size=serving.block_size, predicted_tokens_per_s=pred, tensor=tensor,
                         tp_collectives_per_step=len(collectives), packed_weight_bytes=packed,
                         gemm_copy_bytes=gemm, split_copy_bytes=split)


def _tp_collectives(gm: Any, tokens: int) -> list[tuple[bool, float]]:
    """The tp collectives of a serving program, as (is an all-reduce, bytes per token of the
    row of `tokens`)."""
    return [(kind == "all_reduce", nbytes / tokens) for kind, nbytes in tp_collectives(gm)]
