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
        return self.flops.get(dtype, self.flops.get("fp32", 1.0))

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "DeviceSpec":
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
    if spec == "auto":
        return [_local_device()] * n
    if spec not in PRESETS:
        raise ConfigError(f"devices: unknown device preset {spec!r}; accepted: 'auto', {', '.join(map(repr, PRESETS))}")
    return [PRESETS[spec]] * n


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
