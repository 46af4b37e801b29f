"""`Config`: the flat, serializable description of how to train.

Every field is validated when the object is built, so a bad value fails at `Config(...)`
with the key name and the accepted values, not deep inside a pass.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fxspeed.errors import ConfigError

OPTIMIZERS = ("adamw", "adam", "sgd")
PRECISIONS = ("fp32", "bf16", "fp16")
LR_SCHEDULES = ("constant", "linear", "cosine")
SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb")
OFFLOADS = ("none", "optimizer", "parameters", "activations", "all")

# Fields whose meaning later capabilities provide. Until then a non-default value is refused
# with a clear message rather than silently ignored.
_NOT_YET = {
    "tensor": (1, "tensor parallelism is not implemented yet"),
    "offload": ("none", "offload is not implemented yet"),
}


@dataclass
class Config:
    """How fxspeed trains a model. Flat on purpose: it maps 1:1 to a JSON file.

    >>> Config(optimizer="adamw", lr=3e-4, grad_clip=1.0)
    """

    optimizer: str = "adamw"
    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0
    momentum: float = 0.0
    grad_clip: float | None = None
    lr_schedule: str = "constant"
    warmup_steps: int = 0
    total_steps: int | None = None
    zero: int = 0
    precision: str = "fp32"
    pipeline: int = 1
    schedule: str = "1f1b"
    tensor: int = 1
    microbatches: int = 1
    grad_accum: int = 1
    offload: str = "none"
    fp32_modules: tuple[str, ...] = ()  # module paths (prefixes) kept in fp32 under bf16/fp16
    reduce_dtype: str = "fp32"  # dtype gradients are reduced in across ranks
    loss_scale: float | None = None  # fp16: initial dynamic loss scale (default 2**16)
    loss_scale_window: int = 1000  # fp16: grow the scale after this many steps without overflow
    loss_scale_backoff: float = 0.5  # fp16: multiply the scale by this on overflow
    loss_scale_growth: float = 2.0
    bucket_mb: float = 25.0  # gradient / parameter bucket size for collectives
    dist_timeout_s: float = 300.0  # a collective waiting longer than this fails (names the group)
    disable_passes: tuple[str, ...] = ()
    seed: int | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.betas = tuple(float(b) for b in self.betas)  # type: ignore[assignment]
        self.disable_passes = tuple(self.disable_passes)
        self.fp32_modules = tuple(self.fp32_modules)
        _choice("optimizer", self.optimizer, OPTIMIZERS)
        _choice("precision", self.precision, PRECISIONS)
        _choice("lr_schedule", self.lr_schedule, LR_SCHEDULES)
        _choice("schedule", self.schedule, SCHEDULES)
        _choice("offload", self.offload, OFFLOADS)
        _choice("zero", self.zero, (0, 1, 2, 3))
        _positive("lr", self.lr, allow_zero=True)
        _positive("eps", self.eps)
        _positive("weight_decay", self.weight_decay, allow_zero=True)
        _positive("momentum", self.momentum, allow_zero=True)
        _positive("bucket_mb", self.bucket_mb)
        _choice("reduce_dtype", self.reduce_dtype, ("fp32", "bf16", "fp16"))
        if self.loss_scale is not None:
            _positive("loss_scale", self.loss_scale)
        _positive_int("loss_scale_window", self.loss_scale_window)
        if not 0 < self.loss_scale_backoff < 1:
            raise ConfigError(f"Config.loss_scale_backoff={self.loss_scale_backoff!r} is invalid; it must be in (0, 1)")
        if not self.loss_scale_growth > 1:
            raise ConfigError(f"Config.loss_scale_growth={self.loss_scale_growth!r} is invalid; it must be > 1")
        _positive("dist_timeout_s", self.dist_timeout_s)
        if len(self.betas) != 2 or not all(0.0 <= b < 1.0 for b in self.betas):
            raise ConfigError(f"Config.betas={self.betas!r} is invalid: give two numbers in [0, 1), e.g. (0.9, 0.999)")
        if self.grad_clip is not None:
            _positive("grad_clip", self.grad_clip)
        for key in ("pipeline", "tensor", "microbatches", "grad_accum"):
            _positive_int(key, getattr(self, key))
        if self.pipeline > 1 and self.schedule == "interleaved" and self.microbatches % self.pipeline:
            lo = (self.microbatches // self.pipeline) * self.pipeline
            hi = lo + self.pipeline
            works = f"{lo} or {hi}" if lo else f"{hi}"
            raise ConfigError(f"Config.microbatches={self.microbatches!r} is not a multiple of Config.pipeline="
                              f"{self.pipeline}, which schedule='interleaved' needs; use microbatches={works}, or "
                              "schedule='gpipe', '1f1b' or 'zb' (any number of micro-batches)")
        _positive_int("warmup_steps", self.warmup_steps, allow_zero=True)
        if self.total_steps is not None:
            _positive_int("total_steps", self.total_steps)
        if self.lr_schedule != "constant" and self.total_steps is None:
            raise ConfigError(
                f"Config.lr_schedule={self.lr_schedule!r} needs Config.total_steps (the step at which "
                "the learning rate reaches 0); set total_steps or use lr_schedule='constant'"
            )

    def check_supported(self) -> None:
        """Refuse settings whose capability is not built yet, naming the key."""
        if self.microbatches != 1 and self.pipeline == 1:
            raise ConfigError(f"Config.microbatches={self.microbatches!r} needs pipeline > 1 (micro-batches feed a "
                              "pipeline); on one stage use grad_accum to split the batch, or set pipeline")
        for key, (default, why) in _NOT_YET.items():
            value = getattr(self, key)
            if value != default:
                raise ConfigError(f"Config.{key}={value!r}: {why} in this version of fxspeed; use {key}={default!r}")

    # --- serialization -------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["betas"] = list(self.betas)
        d["disable_passes"] = list(self.disable_passes)
        d["fp32_modules"] = list(self.fp32_modules)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Config":
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise ConfigError(f"unknown Config key(s) {unknown}; valid keys are {sorted(names)}")
        return cls(**d)

    @classmethod
    def from_json(cls, path: str | Path) -> "Config":
        with open(path) as f:
            return cls.from_dict(json.load(f))

    def to_json(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2))

    @classmethod
    def coerce(cls, config: "Config | dict[str, Any] | str | Path | None") -> "Config":
        """Accept a Config, a dict, a JSON path or None (defaults)."""
        if config is None:
            return cls()
        if isinstance(config, Config):
            return config
        if isinstance(config, dict):
            return cls.from_dict(config)
        if isinstance(config, (str, Path)):
            return cls.from_json(config)
        raise ConfigError(f"config={config!r}: pass a fxspeed.Config, a dict, a JSON file path or None")


def _choice(key: str, value: Any, accepted: tuple[Any, ...]) -> None:
    if value not in accepted:
        raise ConfigError(f"Config.{key}={value!r} is invalid; accepted values: {', '.join(map(repr, accepted))}")


def _positive(key: str, value: Any, allow_zero: bool = False) -> None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and (value >= 0 if allow_zero else value > 0)
    if not ok:
        bound = ">= 0" if allow_zero else "> 0"
        raise ConfigError(f"Config.{key}={value!r} is invalid; it must be a number {bound}")


def _positive_int(key: str, value: Any, allow_zero: bool = False) -> None:
    ok = isinstance(value, int) and not isinstance(value, bool) and (value >= 0 if allow_zero else value >= 1)
    if not ok:
        bound = ">= 0" if allow_zero else ">= 1"
        raise ConfigError(f"Config.{key}={value!r} is invalid; it must be an integer {bound}")
