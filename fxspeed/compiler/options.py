"""Typed pass options: everything a pass may read besides the graph, derived once.

Passes never read `Config` or the mesh. `derive_options(config, mesh)` turns them into one
frozen `PassOptions` per rank (the engine's `Compiler` does it once); tests and tools that run
on one device use `PassOptions.single_device(config)` or build one by hand, e.g.
`PassOptions(world_size=2, rank=0, zero=3, group_name="g")`.

A plain dict is still accepted where options are passed (`PassContext(options={...})`,
`compile_step(options={...})`): its keys must be field names here, and it is converted.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
from dataclasses import dataclass
from typing import Any, Mapping

from fxspeed.config import DEFAULT_BUCKET_MB, PRECISIONS, REDUCE_DTYPES, SCHEDULES, Config
from fxspeed.errors import ConfigError

MIB = 2**20


def bucket_bytes(bucket_mb: float) -> int:
    """Config.bucket_mb (MiB) as the byte limit the gradient-reduction pass uses."""
    return int(bucket_mb * MIB)


@dataclass(frozen=True)
class PassOptions:
    """What passes read from `ctx.options`. Defaults describe one device, full precision."""

    # numerics (insert_casts, scale_loss, reduce_gradients, shard_parameters)
    precision: str = "fp32"                  # "fp32" | "bf16" | "fp16"
    fp32_modules: tuple[str, ...] = ()       # module path prefixes kept in fp32 under bf16/fp16
    reduce_dtype: str = "auto"               # dtype gradients are reduced in across ranks ("auto": their own)
    # keep_weights_low: trainable parameters enter the training program as low-precision working
    # copies and leave gradients in the working (or reduce_dtype) precision; the fp32 master lives
    # with the optimizer in this rank's partition (ZeRO-1/2/3 joint programs under bf16/fp16)
    master_weights: bool = False
    # data parallelism: this rank's replica group (reduce_gradients, wait_parameter_gathers,
    # shard_parameters, reuse_buffers do nothing when world_size is 1)
    world_size: int = 1                      # the data-parallel degree
    rank: int = 0                            # this rank's index in its data-parallel group
    zero: int = 0                            # ZeRO stage 0-3
    group_name: str = ""                     # the data-parallel process group's name (collectives' target)
    bucket_bytes: int = bucket_bytes(DEFAULT_BUCKET_MB)  # gradient / parameter bucket limit
    # the parameter names of each gradient bucket, as the engine laid out its flat buffers at its
    # first training program (ZeRO, master weights); () at that first one. A later program (a
    # new batch shape) buckets its gradients the same way, whatever order its trace computes
    # them in (reduce_gradients): a tp layout solved for other shapes reorders backward.
    bucket_layout: tuple[tuple[str, ...], ...] = ()
    scatter_via_all_reduce: bool = False     # ZeRO-2/3: all-reduce then keep the slice (gloo)
    gather_via_all_reduce: bool = False      # ZeRO-3: gather by all-reducing zero-padded shards
    # ZeRO-2/3 reduce-scatter and ZeRO-3 gathers as point-to-point exchanges
    # (runtime/kernels/collectives.py; gloo): they take precedence over the two above
    scatter_via_exchange: bool = False
    gather_via_exchange: bool = False
    reuse_grad_buckets: bool = False         # ZeRO-0: persistent reduced-gradient buckets
    # gradient accumulation without a collective per slice (ZeRO-0/1 under Config.grad_accum, as
    # DDP's no_sync): "local" programs flatten the buckets and reduce nothing, the step's "last"
    # slice adds the accumulated flat buckets ("grad_accum" inputs) before its reduction; "whole":
    # every program reduces its own gradients
    grad_accum_role: str = "whole"
    # offload_parameters (ZeRO-3, Config.offload="parameters"/"all"): the name the engine registers
    # this rank's parameter files under (runtime/offloaded_parameters.py); the program reads each
    # shard from them ahead of its gather instead of taking it as an input. "" = shards are inputs.
    parameter_store: str = ""
    # step_in_backward: the name the engine registers its optimizer under
    # (runtime/step_in_backward.py); the program steps each bucket of parameters as soon as its
    # gradients are final, instead of returning them. "" = gradients are outputs.
    optimizer_store: str = ""
    # offload_activations (Config.offload="activations"/"all"): the name the engine registers its
    # activation store under (runtime/offloaded_activations.py); forward's saved activations go
    # there and come back ahead of backward's readers. "" = activations stay.
    activation_store: str = ""
    activation_offload_min_bytes: int = MIB  # smaller activations stay (a transfer each costs more than it frees)
    # the device's FLOP/s over the offload link's bytes/s: an activation moves only when the
    # compute between its last forward and first backward reader covers moving it out and back
    activation_offload_flops_per_byte: float = 100.0
    # reuse_buffers: smallest buffer placed in a workspace (0: small buckets gain little, but one
    # code path for every size is then tested by every run)
    reuse_min_bytes: int = 0
    # pipeline programs (split_stages, lower_schedule, split_backward, accumulate_gradients)
    pipeline: int = 1                        # pipeline positions (Config.pipeline)
    microbatches: int = 1                    # micro-batches per step
    schedule: str = "1f1b"                   # one of Config's SCHEDULES
    pipeline_chunks: int = 1                 # stages per position (1 unless the schedule is interleaved)
    split_points: tuple[str, ...] = ()       # modules stages 1.. start at; () = balanced cuts
    positions: tuple[int, ...] = ()          # pipeline positions whose stages this rank runs
    # tensor parallelism (shard_tensors; does nothing when tp_size is 1)
    tp_size: int = 1                         # tensor-parallel degree (Config.tensor)
    tp_rank: int = 0                         # this rank's index in its tensor-parallel group
    tp_group_name: str = ""                  # the tensor-parallel process group's name (collectives' target)
    sequence_parallel: bool = False          # Config.sequence_parallel: partial sums reduce-scattered by tokens
    # fuse_kernels (passes/graph/fuse_kernels.py: norms and their backward as Triton kernels):
    # "cuda" fuses programs whose tensors are on CUDA (the target device, read off the program),
    # "always" fuses any program (FXSPEED_FUSE_ON_CPU=1: tests, where the kernels run under
    # TRITON_INTERPRET=1 or as their torch fallback), "off" never. See fuse_kernels_mode().
    fuse_kernels: str = "cuda"
    # keep_activations_low (Config.low_activations): "always" (the default), "cuda" on programs
    # whose tensors are on CUDA, "off"
    low_activations: str = "always"
    # chunk_cross_entropy (passes/memory/chunk_cross_entropy.py: vocabulary projection + cross-
    # entropy in chunks of rows, gradients computed in forward): "auto" where the fp32 logits
    # would take at least chunk_cross_entropy_min_bytes, "always", "off".
    chunk_cross_entropy: str = "auto"
    chunk_cross_entropy_min_bytes: int = 64 * MIB
    # upcast_cpu_compute (passes/graph/upcast_cpu_compute.py: bf16/fp16 matmuls, convolutions and
    # attention computed in fp32 where PyTorch's CPU kernels for them are slow): "auto" where the
    # program's tensors are on such a CPU, "off" never (the planner's programs for a CUDA target,
    # which it traces on the host's CPU).
    upcast_cpu_compute: str = "auto"
    # pack_linear_weights (serving programs on the CPU): buckets of at most this many tokens read
    # their fp32 linear weights pre-packed for oneDNN (0: none). Past about 128 rows MKL's GEMM is
    # as fast. why: runtime/kernels/packed_linear.py
    pack_linear_tokens: int = 128
    # what those buckets' linears read: "packed" (oneDNN's layout), or "transposed" (ATen's GEMM, an
    # nn.Linear weight [out, in] through a contiguous [in, out] copy, MKL's fast layout at a few
    # rows), or "split" (copies [k, in, out/k] read by a batched GEMM of one slice per CPU thread,
    # runtime/kernels/packed_linear.split_linear); the serving loop's probe picks per bucket.
    # why: runtime/kernels/packed_linear.py
    linear_copies: str = "packed"
    # the slices k of those "split" copies: the serving loop's PackedWeights.ways (its CPU threads at
    # serve), which holds the copies the program reads; also sizes the split copies the plan counts
    # (gm.meta["split_copy_bytes"], 0 at one way). Set by the loop, not read from torch's threads
    # here: a later torch.set_num_threads must not make a new bucket's program disagree with them.
    linear_split_ways: int = 1
    # kv_cache (serving programs): each attention layer's sliding window in layer order (0: none),
    # from the model's config (`runtime/serving.py:sliding_windows`); () where it names none. A
    # bucket of T <= window tokens cannot show the window in its masks, so it comes from here.
    kv_windows: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        for name in ("fp32_modules", "split_points", "positions", "kv_windows", "bucket_layout"):
            value = getattr(self, name)
            if isinstance(value, str) or not isinstance(value, (tuple, list)):
                raise ConfigError(f"PassOptions.{name}={value!r} is invalid; give a sequence")
            object.__setattr__(self, name, tuple(value))
        if any(isinstance(b, str) or not isinstance(b, (tuple, list)) for b in self.bucket_layout):
            raise ConfigError(f"PassOptions.bucket_layout={self.bucket_layout!r} is invalid; give a sequence of "
                              "sequences of parameter names, one per bucket")
        object.__setattr__(self, "bucket_layout", tuple(tuple(b) for b in self.bucket_layout))
        _one_of("precision", self.precision, PRECISIONS)
        _one_of("reduce_dtype", self.reduce_dtype, REDUCE_DTYPES)
        _one_of("zero", self.zero, (0, 1, 2, 3))
        _one_of("grad_accum_role", self.grad_accum_role, ("whole", "local", "last"))
        _one_of("schedule", self.schedule, SCHEDULES)
        _one_of("linear_copies", self.linear_copies, ("packed", "transposed", "split"))
        for name in ("world_size", "pipeline", "microbatches", "pipeline_chunks", "bucket_bytes", "linear_split_ways"):
            _int(name, getattr(self, name), 1)
        for name in ("rank", "reuse_min_bytes", "tp_rank", "activation_offload_min_bytes", "pack_linear_tokens"):
            _int(name, getattr(self, name), 0)
        _int("tp_size", self.tp_size, 1)
        if self.tp_rank >= self.tp_size:
            raise ConfigError(f"PassOptions.tp_rank={self.tp_rank} is invalid for tp_size={self.tp_size}; "
                              f"it must be in [0, {self.tp_size})")
        if self.rank >= self.world_size:
            raise ConfigError(f"PassOptions.rank={self.rank} is invalid for world_size={self.world_size}; "
                              f"it must be in [0, {self.world_size})")
        if self.pipeline_chunks > 1 and self.schedule != "interleaved":
            raise ConfigError(f"PassOptions.pipeline_chunks={self.pipeline_chunks} needs schedule='interleaved' "
                              f"(schedule={self.schedule!r} places one stage per position)")
        for p in self.positions:
            if not isinstance(p, int) or isinstance(p, bool) or not 0 <= p < self.pipeline:
                raise ConfigError(f"PassOptions.positions={list(self.positions)} is invalid; each must be a "
                                  f"pipeline position in [0, {self.pipeline})")
        if not isinstance(self.activation_offload_flops_per_byte, (int, float)) or \
                isinstance(self.activation_offload_flops_per_byte, bool) or self.activation_offload_flops_per_byte < 0:
            raise ConfigError(f"PassOptions.activation_offload_flops_per_byte={self.activation_offload_flops_per_byte!r} "
                              "is invalid; give a number >= 0")
        _one_of("fuse_kernels", self.fuse_kernels, FUSE_MODES)
        _one_of("chunk_cross_entropy", self.chunk_cross_entropy, ("auto", "always", "off"))
        _one_of("upcast_cpu_compute", self.upcast_cpu_compute, ("auto", "off"))
        _int("chunk_cross_entropy_min_bytes", self.chunk_cross_entropy_min_bytes, 0)
        for name in ("scatter_via_all_reduce", "gather_via_all_reduce", "scatter_via_exchange", "gather_via_exchange",
                     "reuse_grad_buckets", "master_weights", "sequence_parallel"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"PassOptions.{name}={getattr(self, name)!r} is invalid; give True or False")
        if not isinstance(self.group_name, str):
            raise ConfigError(f"PassOptions.group_name={self.group_name!r} is invalid; give the group's name")

    def dp_group(self, pass_name: str) -> str:
        """The data-parallel group's name, for a pass that emits collectives over it."""
        if not self.group_name:
            raise ConfigError(f"pass {pass_name!r} emits collectives over {self.world_size} ranks but "
                              "PassOptions.group_name is empty; derive the options from the mesh (derive_options) "
                              "or name the data-parallel process group")
        return self.group_name

    @property
    def n_stages(self) -> int:
        return self.pipeline * self.pipeline_chunks

    @classmethod
    def single_device(cls, config: Config, **overrides: Any) -> "PassOptions":
        """Options of one process running the whole program: Config's numerics and pipeline
        settings, no data parallelism, every pipeline position local."""
        base = dict(precision=config.precision, fp32_modules=tuple(config.fp32_modules),
                    reduce_dtype=config.reduce_dtype, bucket_bytes=bucket_bytes(config.bucket_mb),
                    **_pipeline_fields(config), positions=tuple(range(config.pipeline)),
                    fuse_kernels=fuse_kernels_mode(), master_weights=master_weights_wanted(config),
                    low_activations=low_activations_mode(config),
                    sequence_parallel=config.sequence_parallel)
        return cls(**{**base, **overrides})

    @classmethod
    def coerce(cls, options: "PassOptions | Mapping[str, Any] | None", config: Config | None = None) -> "PassOptions":
        """A PassOptions as is; a mapping as overrides of `single_device(config)` (of the
        defaults without a config); None as `single_device(config)`."""
        if isinstance(options, PassOptions):
            return options
        base = cls.single_device(config) if config is not None else cls()
        if options is None:
            return base
        if not isinstance(options, Mapping):
            raise ConfigError(f"pass options {options!r}: give a fxspeed.compiler.options.PassOptions")
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(options) - names)
        if unknown:
            raise ConfigError(f"unknown pass option(s) {unknown}; PassOptions fields are {sorted(names)}")
        return dataclasses.replace(base, **options)

    def local(self) -> "PassOptions":
        """The same options without data parallelism (one replica): what a pipeline's joint
        micro-batch graph is compiled with before it is cut into stages."""
        return dataclasses.replace(self, world_size=1, rank=0, zero=0, group_name="", scatter_via_all_reduce=False,
                                   gather_via_all_reduce=False, scatter_via_exchange=False,
                                   gather_via_exchange=False, reuse_grad_buckets=False, grad_accum_role="whole",
                                   master_weights=False, bucket_layout=(),
                                   parameter_store="", optimizer_store="", activation_store="")

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}


def derive_options(config: Config, mesh: Any, device: Any = None) -> PassOptions:
    """Pass options for this rank from the Config and the mesh (fxspeed.mesh.Mesh): the one
    place Config and mesh become pass options. `device`: this rank's DeviceSpec (fxspeed.devices),
    for the cost of moving activations; None: a CPU's."""
    import torch.distributed as dist

    gloo = bool(mesh.active) and dist.get_backend(mesh.group("world")) == "gloo"
    coords = mesh.coords()
    return PassOptions(
        precision=config.precision, fp32_modules=tuple(config.fp32_modules), reduce_dtype=config.reduce_dtype,
        world_size=mesh.dp, rank=coords["dp"], zero=config.zero, group_name=mesh.group_name("dp"),
        bucket_bytes=bucket_bytes(config.bucket_mb),
        # On gloo, gloo's own reduce-scatter and all-gather cost more than an all-reduce; ZeRO-2/3
        # reduce-scatter gradients and ZeRO-3 gathers parameters with point-to-point exchanges,
        # which cost about half an all-reduce each (ZeRO-2 then moves DDP's bytes).
        # why: docs/decisions/zero-scatter-via-all-reduce-on-gloo.md, zero-gather-via-all-reduce-on-gloo.md
        scatter_via_exchange=gloo,
        gather_via_exchange=gloo,
        # why: docs/decisions/persistent-gradient-buckets-for-zero0.md
        reuse_grad_buckets=True,
        **_pipeline_fields(config), positions=(coords.get("pp", 0),),
        tp_size=getattr(mesh, "tp", 1), tp_rank=coords.get("tp", 0),
        tp_group_name=mesh.group_name("tp") if getattr(mesh, "tp", 1) > 1 else "",
        sequence_parallel=config.sequence_parallel,
        fuse_kernels=fuse_kernels_mode(), low_activations=low_activations_mode(config),
        master_weights=masters_kept(config, mesh.dp),
        parameter_store=f"rank{mesh.rank}-{next(_STORE_IDS)}" if config.offloads_parameters else "",
        optimizer_store=f"rank{mesh.rank}-{next(_STORE_IDS)}" if steps_in_backward(config, mesh.dp) else "",
        activation_store=f"rank{mesh.rank}-{next(_STORE_IDS)}" if config.offloads_activations else "",
        activation_offload_flops_per_byte=offload_flops_per_byte(config, device))


# Host <-> device copies of pinned memory over PCIe 4/5 x16 (bytes/s, one direction), the link
# activation offload uses on a CUDA device; a CPU device's is its disk (DeviceSpec.disk_bandwidth).
HOST_LINK_BANDWIDTH = 25e9


def offload_flops_per_byte(config: Config, device: Any = None) -> float:
    """FLOPs the device computes in the time the activation-offload link moves one byte."""
    from fxspeed.devices import PRESETS

    spec = device if device is not None else PRESETS["cpu"]
    link = HOST_LINK_BANDWIDTH if spec.kind == "cuda" else (spec.disk_bandwidth or PRESETS["cpu"].disk_bandwidth)
    return spec.peak_flops(config.precision) / link


def steps_in_backward(config: Config, replicas: int) -> bool:
    """Whether the training program steps the optimizer inside backward (passes/memory/
    step_in_backward.py by parameter on one replica; step_buckets_in_backward.py by reduced
    gradient bucket where there are buckets): only where that is the same computation as one
    step at the end. Not with gradient accumulation, clipping, fp16 loss scaling or
    Config.nan_check (each needs every gradient before any update), parameter offload (its
    working shards are written through their files after the step), an offloaded optimizer
    without buckets, or a pipeline (stages accumulate over micro-batches). `replicas`: the
    data-parallel degree.
    why: docs/decisions/step-in-backward.md"""
    # An offloaded optimizer reads its files in the order of its tensors, which is backward's for
    # the flat buckets but the reverse for one replica's Parameters (no buckets there).
    buckets = replicas > 1 or master_weights_wanted(config)
    return (config.pipeline == 1 and config.grad_accum == 1 and config.grad_clip is None
            and config.precision != "fp16" and config.nan_check == "off"
            and (config.offload == "none" or config.offload == "optimizer" and buckets))


def frees_gradients_in_backward(config: Config, replicas: int) -> bool:
    """Whether the optimizer steps inside backward (steps_in_backward) and so the gradients die
    there, as the planner counts them: not under ZeRO-0 over replicas, whose reduced buckets are
    persistent buffers (docs/decisions/persistent-gradient-buckets-for-zero0.md)."""
    return steps_in_backward(config, replicas) and not (replicas > 1 and config.zero == 0)


# Each engine's parameter files are registered under their own name (two engines in one process).
_STORE_IDS = itertools.count()


def master_weights_wanted(config: Config) -> bool:
    """The ZeRO paper's mixed-precision layout (low-precision working parameters and gradients, fp32
    master + optimizer states in the partition) where it is built: bf16/fp16 with ZeRO-1/2/3 over
    data-parallel ranks, with or without tensor parallelism (the working copies and masters are then
    of this rank's tp slices), without a pipeline (which keeps fp32 parameters and casts them per
    step). ZeRO-0 keeps fp32 parameters too: its partition is the whole model, so the fp32 weights
    are the master, and the bytes are the paper's 16 per parameter either way.
    why: docs/decisions/master-weights-in-the-partition.md"""
    return config.precision != "fp32" and config.zero >= 1 and config.pipeline == 1


def masters_kept(config: Config, dp: int) -> bool:
    """Whether a run over `dp` replicas builds `master_weights_wanted`'s layout. On one replica it
    saves nothing (the partition is the whole model) unless the fp32 master goes to the offload
    file with the optimizer states (ZeRO-Offload's layout) or the working copies go to theirs
    (ZeRO-Infinity's). Activation offload alone moves no state: with masters it would round
    differently from the same run without it, and hold fp32 masters beside the working copies."""
    return master_weights_wanted(config) and (dp > 1 or config.offloads_optimizer or config.offloads_parameters)


FUSE_MODES = ("cuda", "always", "off")


def low_activations_mode(config: Config) -> str:
    """PassOptions.low_activations from Config.low_activations (True, the default: every program;
    it was CUDA programs only until the plan counted ZeRO-3's gradient buckets,
    docs/decisions/keep-activations-low.md)."""
    return "always" if config.low_activations else "off"


def fuse_kernels_mode() -> str:
    """PassOptions.fuse_kernels: "cuda" (fuse where the target device is CUDA), or "always" when
    FXSPEED_FUSE_ON_CPU=1 (read here, once per derivation; never in a pass)."""
    return "always" if os.environ.get("FXSPEED_FUSE_ON_CPU", "") == "1" else "cuda"


def _pipeline_fields(config: Config) -> dict[str, Any]:
    return dict(pipeline=config.pipeline, microbatches=config.microbatches, schedule=config.schedule,
                pipeline_chunks=config.pipeline_chunks if config.schedule == "interleaved" else 1,
                split_points=tuple(config.split_points))


def _one_of(name: str, value: Any, accepted: tuple[Any, ...]) -> None:
    if value not in accepted or isinstance(value, bool):
        raise ConfigError(f"PassOptions.{name}={value!r} is invalid; accepted values: {', '.join(map(repr, accepted))}")


def _int(name: str, value: Any, low: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise ConfigError(f"PassOptions.{name}={value!r} is invalid; it must be an integer >= {low}")
