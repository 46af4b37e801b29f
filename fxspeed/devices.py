"""Device descriptions for the cost model: memory, peak FLOP/s, memory and link bandwidth.

Presets are datasheet numbers (dense, no sparsity). They are inputs of a roofline model, not
promises: `DeviceSpec` can be built by hand for any other accelerator.
"""

from __future__ import annotations

import dataclasses
import functools
import platform
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from fxspeed.errors import ConfigError

GB = 1e9
GiB = 2**30


@dataclass(frozen=True)
class DeviceSpec:
    """One device. `flops` maps a dtype name ("fp32", "bf16", "fp16") to peak FLOP/s."""

    name: str
    memory: float  # bytes
    flops: dict[str, float] = field(default_factory=dict)
    mem_bandwidth: float = 0.0  # bytes/s
    link_bandwidth: float = 0.0  # bytes/s per direction between devices
    kind: str = "cuda"  # torch device type this runs on
    # bytes/s of the local disk Config.nvme_path is on (reads and writes together); 0 = unknown,
    # and the plan's step time then has no disk term
    disk_bandwidth: float = 0.0

    def peak_flops(self, dtype: str = "fp32") -> float:
        """FLOP/s at `dtype` ("fp32", "tf32", "bf16", "fp16"); the fp32 rate where the device lists none for it."""
        return self.flops.get(dtype, self.flops.get("fp32", 1.0))

    def to_dict(self) -> dict[str, Any]:
        """The fields as plain values (`DeviceSpec.from_dict` reads it back)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "DeviceSpec":
        """A DeviceSpec from `to_dict()`'s fields."""
        return cls(**d)


PRESETS: dict[str, DeviceSpec] = {
    # A 2-core CPU box with ~24 GB; FLOP/s and bandwidth measured order-of-magnitude on such
    # machines (fp32 GEMM ~ 1e11, STREAM-like copy ~ 1e10 B/s, loopback gloo ~ 2e9 B/s).
    # disk: dd with O_DIRECT 16 MiB blocks 1.7 GB/s write, 1.9 GB/s read here; the offload files see
    # less (64 MiB chunks beside compute): 1.0e9 reads + writes together
    "cpu": DeviceSpec("cpu", 24 * GB, {"fp32": 1.0e11, "bf16": 0.5e11, "fp16": 0.25e11}, 1.0e10, 2.0e9, "cpu",
                      1.0e9),
    "A100-80GB": DeviceSpec("A100-80GB", 80 * GB, {"fp32": 19.5e12, "tf32": 156e12, "bf16": 312e12, "fp16": 312e12},
                            2.039e12, 300e9, "cuda"),
    "H100-80GB": DeviceSpec("H100-80GB", 80 * GB, {"fp32": 67e12, "tf32": 494e12, "bf16": 989e12, "fp16": 989e12},
                            3.35e12, 450e9, "cuda"),
    "H200": DeviceSpec("H200", 141 * GB, {"fp32": 67e12, "tf32": 494e12, "bf16": 989e12, "fp16": 989e12},
                       4.8e12, 450e9, "cuda"),
}


def devices(spec: str | DeviceSpec = "auto", n: int = 1) -> list[DeviceSpec]:
    """`n` identical devices: `fxspeed.devices("H100-80GB", 64)`.

    "auto" describes the local machine: CUDA GPUs when present (as the closest preset by
    name), else the "cpu" preset with this machine's RAM.
    """
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ConfigError(f"devices: n={n!r} is invalid; it must be an integer >= 1")
    if isinstance(spec, DeviceSpec):
        return [spec] * n
    if isinstance(spec, str) and spec.lower() == "auto":
        return [_local_device()] * n
    # any case, and H100 for H100-80GB: the name as people write it
    named = {k.lower(): v for k, v in PRESETS.items()} | {k.split("-")[0].lower(): v for k, v in PRESETS.items()}
    if not isinstance(spec, str) or spec.lower() not in named:
        raise ConfigError(f"devices: unknown device preset {spec!r}; accepted: 'auto', {', '.join(map(repr, PRESETS))}")
    return [named[spec.lower()]] * n


def _local_device() -> DeviceSpec:
    if torch.cuda.is_available():
        name = torch.cuda.get_device_name(0)
        mem = float(torch.cuda.get_device_properties(0).total_memory)
        for key, preset in PRESETS.items():
            if key.split("-")[0] in name:
                return dataclasses.replace(preset, memory=mem)
        return dataclasses.replace(PRESETS["A100-80GB"], name=name, memory=mem)
    import psutil

    return dataclasses.replace(PRESETS["cpu"], memory=float(psutil.virtual_memory().total))


@functools.cache
def measured_cpu() -> DeviceSpec:
    """This machine's CPU with its memory bandwidth and matmul FLOP/s measured at the torch thread
    count in effect (half a second to a few seconds, once per process):

        engine = fxspeed.serve(model, devices=fxspeed.measured_cpu())   # the plan's roofline at these rates

    The "cpu" preset's 10 GB/s and 100 GFLOP/s are an order of magnitude; a box with 28 GB/s
    decoded GPT-2 at batch 1 at twice the tokens/s the preset's roofline promised. It is not the
    default: plans that choose (stage splits, placements, recompute) must be the same on every
    rank and on every run, and a shared machine's rates move with its load. For a multi-rank
    compile, measure on one rank and give every rank the same DeviceSpec.

    Bandwidth: the best of three `sum`s over a buffer of twice the last-level cache (at least
    512 MiB, at most an eighth of free memory), so it is read from DRAM, not cache. FLOP/s: the
    best of three 1024^3 matmuls per dtype; a low-precision dtype this CPU has no fast kernels for
    (`cpu_computes_natively`) keeps the preset's ratio to fp32."""
    import psutil

    base = dataclasses.replace(PRESETS["cpu"], memory=float(psutil.virtual_memory().total))
    cache = _last_level_cache_bytes()
    size = min(max(512 * 2**20, 2 * cache), int(psutil.virtual_memory().available) // 8)
    if size < 2 * cache:
        import logging

        logging.getLogger("fxspeed").warning(
            "fxspeed.measured_cpu: only %d MiB free for the bandwidth probe, under twice the %d MiB last-level "
            "cache, so part of it is read from cache and the bandwidth reads high", size >> 20, cache >> 20)
    bandwidth = _read_bandwidth(max(size // 4, 1 << 20))
    flops = {}
    for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16), ("fp16", torch.float16)):
        if dtype != torch.float32 and not cpu_computes_natively(dtype):
            flops[name] = flops["fp32"] * base.flops[name] / base.flops["fp32"]
            continue
        a = torch.ones(1024, 1024, dtype=dtype)
        flops[name] = 2 * 1024**3 / _best_seconds(lambda: torch.mm(a, a))  # noqa: B023 - called right away
    return dataclasses.replace(base, name=f"cpu (measured: {bandwidth / GB:.1f} GB/s, {flops['fp32'] / 1e9:.0f} "
                               "GFLOP/s fp32)", mem_bandwidth=bandwidth, flops=flops)


def _read_bandwidth(numel: int) -> float:
    buf = torch.ones(numel, dtype=torch.float32)  # freed on return: it is larger than the caches
    return numel * 4 / _best_seconds(buf.sum)


def _best_seconds(fn: Any, repeats: int = 3) -> float:
    import time

    fn()  # warm-up (first touch, kernel choice)
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return max(best, 1e-9)


def _last_level_cache_bytes() -> int:
    """The largest CPU cache's size from sysfs (Linux); 64 MiB when it cannot be read."""
    import glob

    sizes = []
    for path in glob.glob("/sys/devices/system/cpu/cpu0/cache/index*/size"):
        try:
            text = open(path).read().strip().upper()
        except OSError:
            continue
        scale = {"K": 2**10, "M": 2**20, "G": 2**30}.get(text[-1:], 1)
        digits = text.rstrip("KMG")
        if digits.isdigit():
            sizes.append(int(digits) * scale)
    return max(sizes, default=64 * 2**20)


def normalize_devices(value: int | str | DeviceSpec | Sequence[DeviceSpec]) -> list[DeviceSpec]:
    """Turn the `devices` argument of compile()/plan() into a list of DeviceSpec."""
    if isinstance(value, bool):
        raise ConfigError(f"devices={value!r} is invalid; {_ACCEPTED}")
    if isinstance(value, int):
        if value < 1:
            raise ConfigError(f"devices={value!r} is invalid; it must be >= 1 ({_ACCEPTED})")
        return devices("auto", value)
    if isinstance(value, (str, DeviceSpec)):
        return devices(value, 1)
    if isinstance(value, Sequence) and value and all(isinstance(d, DeviceSpec) for d in value):
        return list(value)
    raise ConfigError(f"devices={value!r} is invalid; {_ACCEPTED}")


_ACCEPTED = ("accepted: a positive int (local devices), a preset name "
             f"({', '.join(map(repr, PRESETS))}), a DeviceSpec, or a non-empty list of DeviceSpec")


@functools.cache
def cpu_computes_natively(dtype: torch.dtype) -> bool:
    """Whether this host's CPU runs `dtype` matmuls, convolutions and attention at a useful
    speed in PyTorch. On x86, bf16 needs AVX-512 (oneDNN's bf16 kernels start at avx512_core,
    native or emulated) or AMX; fp16 needs AVX512-FP16 or AMX-FP16. Without them PyTorch falls
    back to reference loops 5-100x slower than fp32 (passes/graph/upcast_cpu_compute.py has the
    numbers). Other architectures are assumed native: only x86 was measured."""
    if dtype not in (torch.bfloat16, torch.float16):
        return True
    if platform.machine().lower() not in ("x86_64", "amd64", "i386", "i686"):
        return True
    has = lambda name: bool(getattr(torch.cpu, name, lambda: False)())  # noqa: E731 - older torch lacks some
    if dtype == torch.bfloat16:
        return has("_is_avx512_supported") or has("_is_amx_tile_supported")
    return has("_is_amx_fp16_supported") or "avx512_fp16" in _cpu_flags()


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            return next((set(line.split(":", 1)[1].split()) for line in f if line.startswith("flags")), set())
    except OSError:
        return set()
