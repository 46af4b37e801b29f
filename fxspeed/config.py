"""`Config`: the flat, serializable description of how to train.

Every field is validated when the object is built, so a bad value fails at `Config(...)`
with the key name and the accepted values, not deep inside a pass. Types are checked from the
field annotations (see `Config`'s docstring for the rules), and a setting that the other
settings make ineffective is refused or warned about (`ConfigWarning`), never silently ignored.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import json
import math
import numbers
import types
import typing
from dataclasses import InitVar, dataclass
from pathlib import Path
from typing import Any

from fxspeed.errors import ConfigError, warn_user

OPTIMIZERS = ("adamw", "adam", "sgd")
PRECISIONS = ("fp32", "bf16", "fp16")
# "auto": the gradients' own dtype (the working precision under master weights, else fp32)
REDUCE_DTYPES = ("auto", "fp32", "bf16", "fp16")
LR_SCHEDULES = ("constant", "linear", "cosine", "manual")  # manual: the user sets the lr
NAN_CHECKS = ("off", "skip", "raise")
SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb")
OFFLOADS = ("none", "optimizer", "parameters", "activations", "all")
OFFLOAD_DEVICES = ("auto", "cpu", "nvme")
LAYER_EXTRAPOLATION = (True, False, "auto")
DEFAULT_BUCKET_MB = 25.0  # the one definition of the default collective bucket size

# Settings that used to travel in the free-form `Config.extra` dict, now typed fields. An
# `extra=` given to Config (or an "extra" key in a JSON file) is still accepted for one release:
# these keys move to their fields with a FutureWarning; any other key is refused.
_EXTRA_FIELDS = ("pipeline_chunks", "split_points", "layer_extrapolation")

# Fields whose meaning later capabilities provide. Until then a non-default value is refused
# with a clear message rather than silently ignored.
_NOT_YET: dict[str, tuple[Any, str]] = {}

# The accepted values of the fields that take one of a few (named in type errors too).
_CHOICES: dict[str, tuple[Any, ...]] = {
    "optimizer": OPTIMIZERS, "precision": PRECISIONS, "lr_schedule": LR_SCHEDULES, "schedule": SCHEDULES,
    "offload": OFFLOADS, "offload_device": OFFLOAD_DEVICES, "zero": (0, 1, 2, 3), "reduce_dtype": REDUCE_DTYPES,
    "layer_extrapolation": LAYER_EXTRAPOLATION, "nan_check": NAN_CHECKS,
}
# Name-list fields where a single string is one name (a 1-tuple), never split into characters.
# split_points is not one of them: how many names it holds decides the number of stages.
_ONE_NAME_OK = ("fp32_modules", "disable_passes", "no_weight_decay")
# Optimizer hyperparameters and the optimizers that read them: a non-default value under any
# other optimizer would have no effect, so it is refused.
_OPTIMIZER_ONLY = {"momentum": ("sgd",), "betas": ("adamw", "adam"), "eps": ("adamw", "adam")}


class ConfigWarning(UserWarning):
    """A Config setting that has no effect under the other settings chosen (e.g. total_steps with
    lr_schedule='constant'). Filter it with `warnings.filterwarnings("ignore", category=ConfigWarning)`."""


@dataclass
class Config:
    """How fxspeed trains a model. Flat on purpose: it maps 1:1 to a JSON file.

    >>> Config(optimizer="adamw", lr=3e-4, grad_clip=1.0)

    Each field's type is checked against its annotation (ConfigError naming the key, the value
    and what is accepted): an `int` field takes an integer, not a bool nor a float even if
    integral (`zero=1.0` -> use `zero=1`); a `float` field takes an int or a float, not a bool,
    and must be finite (no nan/inf); `| None` fields also take None; tuple fields take a list or a
    tuple (JSON gives lists) of items of the annotated type; `betas` takes exactly two numbers in
    [0, 1). A single string for `fp32_modules`, `disable_passes` or `no_weight_decay` is one entry (`"head"` ->
    `("head",)`, never split into characters); for `split_points` it is refused (give a list).
    Values are stored normalized: tuples, Python ints and floats.

    A non-default setting the other settings make ineffective is refused when it names the
    wrong optimizer (`momentum` with adam/adamw; `betas` or `eps` with sgd), else warned about
    with a `ConfigWarning`: total_steps under lr_schedule='constant', loss-scale settings
    without precision='fp16', fp32_modules under precision='fp32', schedule or split_points
    without a pipeline, pipeline_chunks under a schedule other than 'interleaved'.
    """

    optimizer: str = "adamw"
    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0
    # Parameters weight decay leaves alone (torch.optim's param groups with weight_decay=0):
    # entries are substrings of a parameter's name ("bias", "LayerNorm.weight": the Hugging Face
    # recipe), globs when they hold * ? or [ ("*.ln_*"), or "1d": every parameter with fewer than
    # two dimensions (biases, norm scales: Megatron's and nanoGPT's rule). Empty: decay everything.
    no_weight_decay: tuple[str, ...] = ()
    momentum: float = 0.0
    grad_clip: float | None = None
    # "manual": the engine never changes the lr after Config.lr; set engine.optimizer's
    # param_groups or step a torch scheduler built on engine.optimizer. Any other schedule owns
    # the lr, and a change made behind its back is an error at the next step.
    lr_schedule: str = "constant"
    warmup_steps: int = 0
    total_steps: int | None = None
    zero: int = 0
    precision: str = "fp32"
    pipeline: int = 1
    schedule: str = "1f1b"
    tensor: int = 1
    # Megatron's sequence parallelism: the residual stream (norms, residual adds) is split over the
    # tp ranks by tokens; row-parallel outputs are reduce-scattered and gathered again before the
    # next column-parallel matmul, instead of all-reduced (same bytes, 1/T of the norm work and of
    # the residual activations per rank). Needs tensor > 1.
    sequence_parallel: bool = False
    microbatches: int = 1
    grad_accum: int = 1
    # "optimizer": Adam's moments live off the device and are stepped there (ZeRO-Offload /
    # ZeRO-Infinity); under bf16/fp16 with zero >= 1 the fp32 master weights go with them and the
    # device keeps the working copies and gradients. "parameters" (ZeRO-Infinity, zero=3 under
    # bf16/fp16): each rank's low-precision working shards live off the device and are read back
    # one bucket ahead of their gather; "activations": the activations forward saves for backward
    # leave the device after forward makes them and come back ahead of backward's readers
    # (pinned host memory on a CUDA device, files on a CPU one); "all": the three. Where:
    # offload_device "nvme" (files under nvme_path; any device, the CPU included; activations on
    # a CUDA device not yet), "cpu" (pinned host memory, the optimizer stepping on the host; only
    # meaningful for a CUDA device), "auto" (files on a CPU device, pinned host memory on a CUDA
    # one).
    offload: str = "none"
    offload_device: str = "auto"
    nvme_path: str | None = None  # a directory on a local disk for offload_device="nvme"
    # Bytes one rank may hold (GB). With offload="optimizer" the planner offloads only as much of
    # the optimizer states as it takes to fit (plan.offloaded); None offloads all of them.
    memory_budget_gb: float | None = None
    fp32_modules: tuple[str, ...] = ()  # module paths (prefixes) kept in fp32 under bf16/fp16
    # bf16/fp16: what a low-precision matmul makes stays low through the activations, dropout,
    # views and products that follow it, forward and backward, as under eager autocast (half the
    # bytes those ops move and backward keeps), on every device; False: every value outside
    # matmul/conv/attention in fp32 (passes/graph/keep_activations_low).
    low_activations: bool = True
    # dtype gradients are reduced (and, under master weights, held) in across ranks. "auto": their own
    # dtype, which is the working precision (bf16/fp16) where ZeRO-1/2/3 keep the fp32 master in
    # the partition (the ZeRO paper's layout), fp32 otherwise; "fp32" keeps fp32 gradients there too.
    reduce_dtype: str = "auto"
    loss_scale: float | None = None  # fp16: initial dynamic loss scale (default 2**16)
    loss_scale_window: int = 1000  # fp16: grow the scale after this many steps without overflow
    loss_scale_backoff: float = 0.5  # fp16: multiply the scale by this on overflow
    loss_scale_growth: float = 2.0
    bucket_mb: float = DEFAULT_BUCKET_MB  # gradient / parameter bucket size for collectives, in MiB
    # A collective waiting longer than this fails (names the group). The world group is shared by the
    # engines of a process: the latest compile's value governs it (docs/architecture.md, the mesh).
    dist_timeout_s: float = 300.0
    disable_passes: tuple[str, ...] = ()  # pass names (graph or program passes) not to run
    seed: int | None = None
    # Non-finite loss or gradients at a step: "off" (eager's behaviour, costs nothing), "skip"
    # the step (weights, optimizer states and lr schedule unchanged; engine.stats["skipped_steps"]),
    # or "raise" an error naming the step. All ranks agree (one small all-reduce per step).
    nan_check: str = "off"
    # schedule="interleaved": stages per pipeline position (virtual stages; Config.pipeline x
    # pipeline_chunks stages in all, stage s on position s % pipeline). Other schedules ignore it
    # (a non-default value under a pipeline then warns, see _warn_ineffective).
    pipeline_chunks: int = 2
    # Pipeline: the modules stages 1, 2, ... start at (one per cut, in forward order, e.g.
    # ("blocks.6", "ln_f") for 3 stages). Empty: the cuts balancing predicted stage time.
    split_points: tuple[str, ...] = ()
    # Planner: trace 2, 3 and 4 repeated blocks and extrapolate to all of them (True), trace the
    # whole model (False), or extrapolate from 16 identical blocks up ("auto").
    layer_extrapolation: bool | str = "auto"
    # Deprecated: accepted for one release and moved to the fields above (see _EXTRA_FIELDS).
    # Not a field: `config.extra` reads back a mirror of those fields for code not yet switched.
    extra: InitVar[dict[str, Any] | None] = None

    def __post_init__(self, extra: dict[str, Any] | None = None) -> None:
        if extra and not isinstance(extra, _ExtraView):  # dataclasses.replace passes the read-back
            self._take_extra(extra)
        self._validate()
        self._warn_ineffective()

    def _validate(self) -> None:
        """Check (and normalize) every field's type, then the values; raise ConfigError."""
        if self.split_points is None:  # what the deprecated `extra` read-back gives for "none"
            self.split_points = ()
        hints = _field_types()
        for f in dataclasses.fields(self):
            setattr(self, f.name, _typed(f.name, getattr(self, f.name), hints[f.name]))
        _choice("optimizer", self.optimizer, OPTIMIZERS)
        _choice("precision", self.precision, PRECISIONS)
        _choice("lr_schedule", self.lr_schedule, LR_SCHEDULES)
        _choice("nan_check", self.nan_check, NAN_CHECKS)
        _choice("schedule", self.schedule, SCHEDULES)
        _choice("offload", self.offload, OFFLOADS)
        _choice("offload_device", self.offload_device, OFFLOAD_DEVICES)
        if self.offloads_optimizer and self.optimizer == "sgd":
            raise ConfigError(f"Config.offload={self.offload!r} offloads Adam's moments and steps them with the CPU "
                              "Adam; optimizer='sgd' (its momentum buffer) has no offloaded form yet (use optimizer='adamw' or "
                              "'adam', or offload='none' / 'parameters' / 'activations')")
        if self.memory_budget_gb is not None:
            _positive("memory_budget_gb", self.memory_budget_gb)
        if self.nvme_path is not None and not self.nvme_path:
            raise ConfigError("Config.nvme_path='' is invalid: give a directory on a local disk, or None")
        _choice("zero", self.zero, (0, 1, 2, 3))
        _positive("lr", self.lr, allow_zero=True)
        _positive("eps", self.eps)
        _positive("weight_decay", self.weight_decay, allow_zero=True)
        if "" in self.no_weight_decay:
            raise ConfigError("Config.no_weight_decay holds an empty entry, which would match every parameter; give "
                              "name substrings ('bias'), globs ('*.ln_*') or '1d'")
        _positive("momentum", self.momentum, allow_zero=True)
        _positive("bucket_mb", self.bucket_mb)
        _choice("reduce_dtype", self.reduce_dtype, REDUCE_DTYPES)
        _choice("low_activations", self.low_activations, (True, False))
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
        if self.sequence_parallel and self.tensor == 1:
            raise ConfigError("Config.sequence_parallel=True splits the residual stream over the tensor-parallel "
                              "ranks, but Config.tensor=1; set tensor to 2 or more (e.g. Config(tensor=2, "
                              "sequence_parallel=True)) or leave sequence_parallel off")
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
        if self.lr_schedule in ("linear", "cosine") and self.total_steps is None:
            raise ConfigError(
                f"Config.lr_schedule={self.lr_schedule!r} needs Config.total_steps (the step at which "
                "the learning rate reaches 0); set total_steps or use lr_schedule='constant'"
            )
        defaults = _defaults()
        for key, users in _OPTIMIZER_ONLY.items():
            value = getattr(self, key)
            if self.optimizer not in users and value != defaults[key]:
                used_by = f"optimizer{'s' if len(users) > 1 else ''} {' and '.join(map(repr, users))}"
                raise ConfigError(f"Config.{key}={value!r} has no effect with optimizer={self.optimizer!r}; {key} is "
                                  f"used only by {used_by}: remove it (default {defaults[key]!r}) or use "
                                  f"optimizer={users[0]!r}")

    def _warn_ineffective(self) -> None:
        """Warn (ConfigWarning) about non-default settings that the other settings make ineffective."""
        defaults = _defaults()
        changed = {k for k, v in defaults.items() if getattr(self, k) != v}
        ignored: list[tuple[str, str]] = []
        if self.lr_schedule in ("constant", "manual") and "total_steps" in changed:
            ignored.append(("total_steps", f"lr_schedule={self.lr_schedule!r} does not decay (only 'linear' and "
                                           "'cosine' read total_steps)"))
        if self.lr_schedule == "manual" and "warmup_steps" in changed:
            ignored.append(("warmup_steps", "lr_schedule='manual' leaves the learning rate to you"))
        if self.precision != "fp16":
            ignored += [(k, f"precision={self.precision!r} uses no loss scaling (only 'fp16' does)")
                        for k in ("loss_scale", "loss_scale_window", "loss_scale_backoff", "loss_scale_growth")
                        if k in changed]
        if self.weight_decay == 0 and "no_weight_decay" in changed:
            ignored.append(("no_weight_decay", "weight_decay=0 decays nothing (set Config.weight_decay)"))
        if self.precision == "fp32" and "fp32_modules" in changed:
            ignored.append(("fp32_modules", "precision='fp32' keeps every module in fp32 already"))
        if self.precision == "fp32" and "low_activations" in changed:
            ignored.append(("low_activations", "precision='fp32' runs everything in fp32 (set precision='bf16')"))
        if self.pipeline == 1:
            ignored += [(k, "pipeline=1 runs no pipeline (set Config.pipeline to the number of stages)")
                        for k in ("schedule", "split_points") if k in changed]
        elif self.schedule != "interleaved" and "pipeline_chunks" in changed:
            ignored.append(("pipeline_chunks", f"schedule={self.schedule!r} places one stage per position (only "
                                               "'interleaved' reads pipeline_chunks)"))
        if self.offload == "none":
            ignored += [(k, "offload='none' moves nothing off the device (set Config.offload='optimizer' to let "
                            "the planner offload optimizer states)")
                        for k in ("offload_device", "nvme_path", "memory_budget_gb") if k in changed]
        elif self.offload_device == "cpu" and "nvme_path" in changed:
            ignored.append(("nvme_path", "offload_device='cpu' keeps the states in host memory, not in files"))
        if self.offload in ("parameters", "activations") and "memory_budget_gb" in changed:
            ignored.append(("memory_budget_gb", "it chooses how much of the optimizer states to offload, and "
                                                f"offload={self.offload!r} keeps them in memory (use offload='all')"))
        for key, why in ignored:
            warn_user(f"Config.{key}={getattr(self, key)!r} has no effect: {why}", ConfigWarning)

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
        warn_user(f"Config(extra={extra!r}) is deprecated: use "
                  + ", ".join(f"Config({k}={extra[k]!r})" for k in extra), FutureWarning)

    def check_supported(self) -> None:
        """Refuse settings whose capability is not built yet, naming the key."""
        if self.microbatches != 1 and self.pipeline == 1:
            raise ConfigError(f"Config.microbatches={self.microbatches!r} needs pipeline > 1 (micro-batches feed a "
                              "pipeline); on one stage use grad_accum to split the batch, or set pipeline")
        if self.offloads_parameters:
            fixes = []
            if self.zero != 3:
                fixes.append(f"zero=3 (Config.zero={self.zero}: parameter offload moves ZeRO-3's shards)")
            if self.precision == "fp32":
                fixes.append("precision='bf16' or 'fp16' (under fp32 the optimizer steps the shards the program "
                             "reads, so they would come back for every step; the low-precision working copies "
                             "are what parameter offload moves)")
            if self.pipeline > 1:
                fixes.append(f"pipeline=1 (Config.pipeline={self.pipeline})")
            if fixes:
                raise ConfigError(f"Config.offload={self.offload!r} needs " + "; ".join(fixes)
                                  + ", or use offload='optimizer'")
        for key, (default, why) in _NOT_YET.items():
            value = getattr(self, key)
            if value != default:
                raise ConfigError(f"Config.{key}={value!r}: {why} in this version of fxspeed; use {key}={default!r}")

    @property
    def offloads_optimizer(self) -> bool:
        """Adam's states (and under bf16/fp16 with zero >= 1 the fp32 masters) live in files."""
        return self.offload in ("optimizer", "all")

    @property
    def offloads_activations(self) -> bool:
        """Forward's saved activations leave the device until backward reads them."""
        return self.offload in ("activations", "all")

    @property
    def offloads_parameters(self) -> bool:
        """ZeRO-3's low-precision working shards live in files, read ahead of their gathers."""
        return self.offload in ("parameters", "all")

    # --- serialization -------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """The fields as plain JSON values (tuples as lists); `Config.from_dict` reads it back."""
        d = dataclasses.asdict(self)
        d["betas"] = list(self.betas)
        d["disable_passes"] = list(self.disable_passes)
        d["fp32_modules"] = list(self.fp32_modules)
        d["no_weight_decay"] = list(self.no_weight_decay)
        d["split_points"] = list(self.split_points)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Config":
        """Build from a dict of field values ("extra", deprecated, is accepted as by Config())."""
        if not isinstance(d, dict):
            raise ConfigError(f"a Config is built from a dict of settings (a JSON object), got {type(d).__name__}: "
                              f"{d!r:.80}")
        _refuse_unknown_keys(d)
        return cls(**d)

    @classmethod
    def from_json(cls, path: str | Path) -> "Config":
        """Read a JSON file of settings (`to_json` writes one); invalid JSON is a ConfigError naming the file."""
        with open(path) as f:
            try:
                d = json.load(f)
            except json.JSONDecodeError as e:
                raise ConfigError(f"Config file {str(path)!r} is not valid JSON: {e}") from None
        return cls.from_dict(d)

    def to_json(self, path: str | Path) -> None:
        """Write `to_dict()` as JSON to `path` (`Config.from_json` reads it back)."""
        Path(path).write_text(json.dumps(self.to_dict(), indent=2))

    @classmethod
    def coerce(cls, config: "Config | dict[str, Any] | str | Path | None") -> "Config":
        """Accept a Config, a dict, a JSON path or None (defaults)."""
        if config is None:
            return cls()
        if isinstance(config, Config):
            config._validate()  # again: a field may have been assigned since it was built
            return config
        if isinstance(config, dict):
            return cls.from_dict(config)
        if isinstance(config, (str, Path)):
            return cls.from_json(config)
        raise ConfigError(f"config={config!r}: pass a fxspeed.Config, a dict, a JSON file path or None")


# What DeepSpeed, Megatron, FSDP, Lightning and HF Trainer users write for a Config key: the
# spelling closest by letters misleads there (`tensor_parallel` is nearest `sequence_parallel`).
_OTHER_NAMES = {
    "tensor": ("tensor_parallel", "tensor_parallel_size", "tensor_model_parallel_size", "tp", "tp_size", "tp_degree"),
    "pipeline": ("pipeline_parallel", "pipeline_parallel_size", "pipeline_model_parallel_size", "pp", "pp_size",
                 "num_stages", "stages"),
    "grad_clip": ("clip_grad_norm", "gradient_clipping", "max_grad_norm", "grad_norm_clip", "clip_grad"),
    "grad_accum": ("gradient_accumulation_steps", "accumulate_grad_batches", "grad_accumulation", "accumulation_steps"),
    "microbatches": ("micro_batches", "num_microbatches", "n_microbatches", "chunks"),
    "zero": ("zero_stage", "stage", "zero_optimization"),
    "lr": ("learning_rate",),
    "precision": ("mixed_precision", "dtype", "bf16", "fp16", "amp"),
    "offload": ("offload_optimizer", "offload_param", "cpu_offload"),
    "warmup_steps": ("warmup", "num_warmup_steps", "lr_warmup_steps"),
    # DeepSpeed's "scheduler" is the lr's; by letters it is nearest the pipeline's `schedule`
    "lr_schedule": ("scheduler", "lr_scheduler", "lr_scheduler_type", "scheduler_type"),
    "total_steps": ("total_num_steps", "max_steps", "num_training_steps", "train_steps"),
    "seed": ("random_seed",),
}
_KEY_FOR = {alias: key for key, aliases in _OTHER_NAMES.items() for alias in aliases}


def _refuse_unknown_keys(d: dict[str, Any]) -> None:
    """Unknown settings (a typo: `zer0=3`, another library's name: `tensor_parallel=2`) name the
    valid key meant, from Config(...) as from a dict or JSON file; the dataclass's own TypeError
    said neither."""
    names = {f.name for f in dataclasses.fields(Config)}
    unknown = sorted(set(d) - names - {"extra"})
    if unknown:
        hints = []
        for key in unknown:
            close = _KEY_FOR.get(key.lower()) or next(iter(difflib.get_close_matches(key, sorted(names), n=1)), None)
            if close:
                hints.append(f"{close!r} for {key!r}")
        hint = f" (did you mean {', '.join(hints)}?)" if hints else ""
        raise ConfigError(f"unknown Config key(s) {unknown}{hint}; valid keys are {sorted(names)}")


_dataclass_init = Config.__init__


@functools.wraps(_dataclass_init)
def _checked_init(self: Config, *args: Any, **kwargs: Any) -> None:
    _refuse_unknown_keys(kwargs)
    _dataclass_init(self, *args, **kwargs)


Config.__init__ = _checked_init  # type: ignore[method-assign]


class _ExtraView(dict):
    """What `Config.extra` returns: a copy of the typed fields, not settings of its own."""


def _extra(self: Config) -> dict[str, Any]:
    """Deprecated read-back of the settings that used to live in `extra` (the typed fields'
    values), for readers not switched to the fields yet. Read the fields instead."""
    return _ExtraView({"pipeline_chunks": self.pipeline_chunks, "split_points": list(self.split_points) or None,
            "layer_extrapolation": self.layer_extrapolation})


# Set after the dataclass is made: in the class body it would become the InitVar's default.
Config.extra = property(_extra)  # type: ignore[assignment,method-assign]


def _defaults() -> dict[str, Any]:
    return {f.name: f.default for f in dataclasses.fields(Config)}


_TYPES: dict[str, Any] = {}


def _field_types() -> dict[str, Any]:
    """The fields' annotations, evaluated (this module uses `from __future__ import annotations`)."""
    if not _TYPES:
        _TYPES.update(typing.get_type_hints(Config))
    return _TYPES


def _describe(tp: Any) -> str:
    args = typing.get_args(tp)
    if typing.get_origin(tp) in (types.UnionType, typing.Union):
        return " or ".join("None" if a is type(None) else _describe(a) for a in args)
    if typing.get_origin(tp) is tuple:
        if len(args) == 2 and args[1] is Ellipsis:
            return f"a list of {_describe(args[0]).split(' ', 1)[1]}s"
        return f"a list of {len(args)} {_describe(args[0]).split(' ', 1)[1]}s"
    return {int: "an integer", float: "a finite number", str: "a string", bool: "a bool (True or False)"}[tp]


def _typed(key: str, value: Any, tp: Any, what: str | None = None) -> Any:
    """`value` checked against the annotation `tp` and normalized (tuples, int, float), or ConfigError.
    `what` describes the accepted type in messages (default: `tp`'s description)."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    what = what or _describe(tp)

    def bad(hint: str = "") -> ConfigError:
        accepted = f"; accepted values: {', '.join(map(repr, _CHOICES[key]))}" if key in _CHOICES else ""
        return ConfigError(f"Config.{key}={value!r} is invalid; it must be {what}, not "
                           f"{type(value).__name__}{hint}{accepted}")

    if origin in (types.UnionType, typing.Union):
        if value is None and type(None) in args:
            return None
        members = [a for a in args if a is not type(None)]
        if len(members) == 1:
            return _typed(key, value, members[0], what)
        if any(type(value) is a for a in members):  # e.g. bool | str: exactly one of them
            return value
        raise bad()
    if origin is tuple:
        if isinstance(value, str):
            if key in _ONE_NAME_OK and args[0] is str:
                return (value,)
            raise ConfigError(f"Config.{key}={value!r} is invalid; it must be {what}, not a string "
                              f"(which would be read character by character): give e.g. [{value!r}]")
        if not isinstance(value, (list, tuple)):
            raise bad()
        if args[-1] is not Ellipsis and len(value) != len(args):
            raise bad(f" with {len(value)} item(s)")
        items = []
        for i, item in enumerate(value):
            try:
                items.append(_typed(f"{key}[{i}]", item, args[0] if args[-1] is Ellipsis else args[i]))
            except ConfigError as e:
                raise ConfigError(f"{e} (in Config.{key}={value!r}, which must be {what})") from None
        return tuple(items)
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise bad()
    if tp is int:
        if isinstance(value, numbers.Integral) and not isinstance(value, bool):
            return int(value)
        if isinstance(value, bool) or (isinstance(value, float) and value.is_integer()):
            raise bad(f" (use {key}={int(value)})")
        # isdecimal, not isdigit: '²' is a digit that int() refuses (found by hypothesis)
        if isinstance(value, str) and value.strip().lstrip("+-").isdecimal():
            raise bad(f" (use {key}={int(value)})")
        raise bad()
    if tp is float:
        if isinstance(value, numbers.Real) and not isinstance(value, bool):
            try:
                number = float(value)
            except OverflowError:
                number = math.inf
            if not math.isfinite(number):
                raise ConfigError(f"Config.{key}={value!r} is invalid; it must be {what} (not nan or inf)")
            return number
        if isinstance(value, str):
            try:
                number = float(value)
            except ValueError:
                raise bad() from None
            raise bad(f" (use {key}={number!r})" if math.isfinite(number) else "")
        raise bad()
    if tp is str:
        if isinstance(value, str):
            return value
        raise bad()
    raise TypeError(f"Config.{key}: no type check for the annotation {tp!r}")  # a new field's type: add it here


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
