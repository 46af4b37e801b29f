"""`Config`: the flat, serializable description of how to train.

Every field is validated when the object is built, so a bad value fails at `Config(...)`
with the key name and the accepted values, not deep inside a pass.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import warnings
from dataclasses import InitVar, dataclass
from pathlib import Path
from typing import Any

from fxspeed.errors import ConfigError

OPTIMIZERS = ("adamw", "adam", "sgd")
PRECISIONS = ("fp32", "bf16", "fp16")
LR_SCHEDULES = ("constant", "linear", "cosine")
SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb")
OFFLOADS = ("none", "optimizer", "parameters", "activations", "all")
LAYER_EXTRAPOLATION = (True, False, "auto")
DEFAULT_BUCKET_MB = 25.0  # the one definition of the default collective bucket size

# Settings that used to travel in the free-form `Config.extra` dict, now typed fields. An
# `extra=` given to Config (or an "extra" key in a JSON file) is still accepted for one release:
# these keys move to their fields with a FutureWarning; any other key is refused.
_EXTRA_FIELDS = ("pipeline_chunks", "split_points", "layer_extrapolation")

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
    bucket_mb: float = DEFAULT_BUCKET_MB  # gradient / parameter bucket size for collectives, in MiB
    dist_timeout_s: float = 300.0  # a collective waiting longer than this fails (names the group)
    disable_passes: tuple[str, ...] = ()  # pass names (graph or program passes) not to run
    seed: int | None = None
    # schedule="interleaved": stages per pipeline position (virtual stages; Config.pipeline x
    # pipeline_chunks stages in all, stage s on position s % pipeline). Ignored by other schedules.
    pipeline_chunks: int = 2
    # Pipeline: the modules stages 1, 2, ... start at (one per cut, in forward order, e.g.
    # ("blocks.6", "ln_f") for 3 stages). Empty: the cuts balancing predicted stage time.
    split_points: tuple[str, ...] = ()
    # Planner: trace 1, 2 and 3 repeated blocks and extrapolate to all of them (True), trace the
    # whole model (False), or extrapolate from 16 identical blocks up ("auto").
    layer_extrapolation: bool | str = "auto"
    # Deprecated: accepted for one release and moved to the fields above (see _EXTRA_FIELDS).
    # Not a field: `config.extra` reads back a mirror of those fields for code not yet switched.
    extra: InitVar[dict[str, Any] | None] = None

    def __post_init__(self, extra: dict[str, Any] | None = None) -> None:
        if extra and not isinstance(extra, _ExtraView):  # dataclasses.replace passes the read-back
            self._take_extra(extra)
        self.betas = tuple(float(b) for b in self.betas)  # type: ignore[assignment]
        self.disable_passes = tuple(self.disable_passes)
        self.fp32_modules = tuple(self.fp32_modules)
        if isinstance(self.split_points, str):
            raise ConfigError(f"Config.split_points={self.split_points!r} is invalid; give a list of module names, "
                              f"e.g. [{self.split_points!r}]")
        self.split_points = tuple(self.split_points or ())
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
        _positive_int("pipeline_chunks", self.pipeline_chunks)
        if not all(isinstance(p, str) and p for p in self.split_points):
            raise ConfigError(f"Config.split_points={list(self.split_points)!r} is invalid; give module names "
                              "(non-empty strings), e.g. ['blocks.6']")
        if not any(self.layer_extrapolation is v for v in (True, False)) and self.layer_extrapolation != "auto":
            raise ConfigError(f"Config.layer_extrapolation={self.layer_extrapolation!r} is invalid; accepted values: "
                              "True, False, 'auto'")
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
        if self.pipeline > 1 and self.split_points and len(self.split_points) != self.n_stages - 1:
            raise ConfigError(f"Config.split_points={list(self.split_points)!r} gives {len(self.split_points) + 1} "
                              f"stages, but the pipeline has {self.n_stages} (pipeline={self.pipeline}"
                              + (f" x pipeline_chunks={self.pipeline_chunks}" if self.schedule == "interleaved" else "")
                              + f"); give exactly {self.n_stages - 1} module names")
        _positive_int("warmup_steps", self.warmup_steps, allow_zero=True)
        if self.total_steps is not None:
            _positive_int("total_steps", self.total_steps)
        if self.lr_schedule != "constant" and self.total_steps is None:
            raise ConfigError(
                f"Config.lr_schedule={self.lr_schedule!r} needs Config.total_steps (the step at which "
                "the learning rate reaches 0); set total_steps or use lr_schedule='constant'"
            )

    @property
    def n_stages(self) -> int:
        """Pipeline stages in all: pipeline x pipeline_chunks under the interleaved schedule."""
        return self.pipeline * (self.pipeline_chunks if self.schedule == "interleaved" else 1)

    def _take_extra(self, extra: dict[str, Any]) -> None:
        if not isinstance(extra, dict):
            raise ConfigError(f"Config.extra={extra!r} is invalid; it is deprecated: set the typed fields "
                              f"{', '.join(_EXTRA_FIELDS)} instead")
        unknown = sorted(set(extra) - set(_EXTRA_FIELDS))
        if unknown:
            raise ConfigError(f"Config.extra keys {unknown} are not settings; Config.extra is deprecated and only "
                              f"accepts {list(_EXTRA_FIELDS)} (each now a Config field of that name)")
        defaults = {f.name: f.default for f in dataclasses.fields(self)}
        for key, value in extra.items():
            current = getattr(self, key)
            if key == "split_points":
                value = tuple(value or ())
                current = tuple(current or ())
            if current != defaults[key] and current != value:
                raise ConfigError(f"Config.{key}={current!r} and Config.extra[{key!r}]={value!r} disagree; "
                                  f"set only Config.{key} (extra is deprecated)")
            setattr(self, key, value)
        warnings.warn(f"Config(extra={extra!r}) is deprecated: use "
                      + ", ".join(f"Config({k}={extra[k]!r})" for k in extra), FutureWarning, stacklevel=4)

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
        d["split_points"] = list(self.split_points)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Config":
        """Build from a dict of field values ("extra", deprecated, is accepted as by Config())."""
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - names - {"extra"})
        if unknown:
            hints = []
            for key in unknown:
                close = difflib.get_close_matches(key, sorted(names), n=1)
                if close:
                    hints.append(f"{key!r} -> {close[0]!r}?")
            hint = f" (did you mean {', '.join(hints)})" if hints else ""
            raise ConfigError(f"unknown Config key(s) {unknown}{hint}; valid keys are {sorted(names)}")
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


class _ExtraView(dict):
    """What `Config.extra` returns: a copy of the typed fields, not settings of its own."""


def _extra(self: Config) -> dict[str, Any]:
    """Deprecated read-back of the settings that used to live in `extra` (the typed fields'
    values), for readers not switched to the fields yet. Read the fields instead."""
    return _ExtraView({"pipeline_chunks": self.pipeline_chunks, "split_points": list(self.split_points) or None,
            "layer_extrapolation": self.layer_extrapolation})


# Set after the dataclass is made: in the class body it would become the InitVar's default.
Config.extra = property(_extra)  # type: ignore[assignment,method-assign]


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
