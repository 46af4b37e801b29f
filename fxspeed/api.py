"""Public entry points: `compile` (returns an Engine), `serve` (an Engine compiled for inference) and
`plan` (returns a Plan, runs nothing)."""

from __future__ import annotations

import logging
from typing import Any, Callable, Sequence

import torch
import torch.nn as nn

from fxspeed.compiler.capture import LossFn
from fxspeed.config import Config
from fxspeed.devices import DeviceSpec, normalize_devices
from fxspeed.compiler import Compiler
from fxspeed.mesh import Mesh
from fxspeed.runtime.deferred_init import DeferredInit, has_meta_tensors, refuse_init_without_meta
from fxspeed.runtime.engine import Engine, check_pipeline_config
from fxspeed.runtime.serving import check_pack_linear
from fxspeed.errors import ConfigError
from fxspeed.ir.batch import split_inputs
from fxspeed.global_state import refuse_autocast
from fxspeed.planner.plan import Plan
from fxspeed.planner import plan_model

log = logging.getLogger("fxspeed")

Devices = int | str | DeviceSpec | Sequence[DeviceSpec]
ExampleInputs = tuple | dict


def _split_example(example_inputs: ExampleInputs, where: str) -> tuple[tuple, dict]:
    """A tuple of positional arguments, a dict of keyword arguments, one tensor, or torch.export's
    (args tuple, kwargs dict) pair for both. The pair was taken as two positional arguments, so
    `((), {"input_ids": x})` fed forward an empty tuple and the capture error blamed the model's code."""
    if isinstance(example_inputs, dict):
        return (), dict(example_inputs)
    if isinstance(example_inputs, tuple) and len(example_inputs) == 2 and isinstance(example_inputs[0], tuple) \
            and isinstance(example_inputs[1], dict) and all(isinstance(k, str) for k in example_inputs[1]):
        return example_inputs[0], dict(example_inputs[1])
    if isinstance(example_inputs, tuple):
        return example_inputs, {}
    if isinstance(example_inputs, torch.Tensor):
        return (example_inputs,), {}
    hint = (" (a DataLoader's default collate gives a list: pass tuple(batch))"
            if isinstance(example_inputs, list) else "")
    raise ConfigError(f"{where}: example_inputs must be a tuple of positional arguments or a dict of keyword "
                      f"arguments of the model's forward, got {type(example_inputs).__name__}{hint}")


def _check_model(model: Any, where: str) -> None:
    if not isinstance(model, nn.Module):
        raise ConfigError(f"{where}: model must be a torch.nn.Module, got {type(model).__name__}")


def compile(model: nn.Module, devices: Devices = 1, config: Config | dict | str | None = None, *,  # noqa: A001
            example_inputs: ExampleInputs, loss_fn: LossFn | None = None,
            init: Callable[[nn.Module], None] | None = None) -> Engine:
    """Compile `model`'s training step for `devices`; returns an Engine.

    The example batch is traced (on fake tensors) so the plan is ready at once; batches of
    other shapes are traced when first seen. `example_inputs`: a tuple of forward's positional
    arguments, a dict of its keyword arguments, or an (args tuple, kwargs dict) pair for both (as
    torch.export takes them).

    A model built on the meta device (`with fxspeed.parameters_on_meta():`) is given its values
    by the engine, one gradient bucket at a time, each rank keeping what its layout keeps (ZeRO's
    shards; under tensor parallelism one init group at a time, cut to the rank's slices; under a
    pipeline the rank's stages' weights only): `init(module)` fills a module's own tensors (default: a Hugging Face model's
    `_init_weights`, else the module's `reset_parameters()`), under a generator seeded from
    Config.seed (None: 0) and the module's name; `fxspeed.materialize(model, init, seed)` makes the
    same values eagerly.
    """
    _check_model(model, "compile")
    refuse_autocast("fxspeed.compile")
    cfg = Config.coerce(config)
    cfg.check_supported()
    devs = normalize_devices(devices)
    _say_parameters_outside_precision(model, cfg)
    _refuse_offloading_low_precision_parameters(model, cfg)
    if cfg.seed is not None:
        torch.manual_seed(cfg.seed)
    args, kwargs = _split_example(example_inputs, "compile")
    refuse_init_without_meta(model, init, "compile")
    deferred = None
    if has_meta_tensors(model):
        deferred = DeferredInit(model, _device_of(args, kwargs, devs), seed=cfg.seed or 0, init=init)
    if cfg.pipeline > 1:
        check_pipeline_config(cfg, len(devs))
    analyses = []
    if cfg.tensor > 1:
        from fxspeed.planner.placement import check_tensor_config, make_placement_analysis

        check_tensor_config(cfg, len(devs))
        analyses.append(make_placement_analysis(devs))  # the parameter layout, chosen once per engine
    mesh = Mesh.join(len(devs), cfg.dist_timeout_s, pp=cfg.pipeline, tp=cfg.tensor)
    with torch.inference_mode(False):  # the engine's state made under inference_mode could not be stepped outside it
        engine = Engine(model, devs, cfg, loss_fn, compiler=Compiler(cfg, mesh, loss_fn, analyses=analyses,
                                                                     device=devs[mesh.rank % len(devs)]), mesh=mesh,
                        deferred=deferred)
        engine.compile(args, kwargs)
    return engine


def _device_of(args: tuple, kwargs: dict, devs: list) -> torch.device:
    """Where a meta model's values go: the example batch's device, else the devices' kind (a CUDA
    rank's current device)."""
    for t in split_inputs(args, kwargs)[0]:
        if isinstance(t, torch.Tensor):
            return t.device
    if devs[0].kind == "cuda" and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _say_parameters_outside_precision(model: nn.Module, cfg: Config) -> None:
    """Config.precision casts fp32 values: trainable parameters in another floating dtype train in
    their own, which a user of precision='bf16' may not expect (no fp32 master copies)."""
    if cfg.precision == "fp32":
        return
    other = sorted({str(p.dtype).removeprefix("torch.") for p in model.parameters()
                    if p.requires_grad and p.is_floating_point() and p.dtype != torch.float32})
    if other:
        log.warning("fxspeed: %s has %s trainable parameters; Config(precision=%r) computes in that precision from "
                    "fp32 parameters (with fp32 master weights) and leaves parameters of other dtypes as they are: "
                    "these train in their own dtype, their updates rounded to it. Build the model in fp32 for "
                    "mixed precision", type(model).__name__, " and ".join(other), cfg.precision)


def _refuse_offloading_low_precision_parameters(model: nn.Module, cfg: Config) -> None:
    """The offloaded optimizer keeps fp32 Adam moments (and, under precision='bf16'/'fp16', fp32
    masters made from fp32 parameters), and parameter offload moves the working copies of fp32
    masters: a model given as bf16/fp16 Parameters reached them as low-precision tensors and
    failed deep in the build (an internal "please report" error; "this layout is ZeRO-3 without
    master weights"). Without offload such parameters train in their own dtype; with it they are
    refused here, with the recipe that offloads them."""
    if not (cfg.offloads_optimizer or cfg.offloads_parameters):
        return
    other = [(n, p.dtype) for n, p in model.named_parameters()
             if p.requires_grad and p.is_floating_point() and p.dtype != torch.float32]
    if other:
        names = ", ".join(f"{n} ({str(d).removeprefix('torch.')})" for n, d in other[:4])
        more = f" and {len(other) - 4} more" if len(other) > 4 else ""
        raise ConfigError(
            f"Config.offload={cfg.offload!r} keeps fp32 parameters (or fp32 masters of bf16/fp16 working copies) off "
            f"the device; {type(model).__name__} has {len(other)} trainable parameter(s) of another dtype: "
            f"{names}{more}. Build the model in fp32 (`model.float()`) and set Config(precision='bf16') (the engine "
            "keeps bf16 working copies; with zero>=1 their fp32 masters go to the offload file with the moments), or "
            "use offload='none' to train them in their own dtype")


def plan(model: nn.Module, devices: Devices = 1, config: Config | dict | str | None = None, *,
         example_inputs: ExampleInputs, loss_fn: LossFn | None = None,
         dynamic: dict[str | int, dict[int, str]] | None = None) -> Plan:
    """Plan without running: trace on fake tensors (works for models on the meta device) and
    predict per-rank memory and step time for `config` on `devices`.

    `dynamic` marks input dims as symbols, e.g. {"input_ids": {0: "batch", 1: "seq"}} (keys
    are keyword names or positional indices); the plan then holds sympy expressions fitted
    over those symbols and answers `plan.max_size("batch", 80e9)`.

    With Config(pipeline=P > 1) the program the engine would run is planned: one micro-batch
    (example_inputs split into Config.microbatches) cut into stages and scheduled; the plan
    then has per-stage and per-rank memory and time and the simulated bubble (plan.pipeline),
    and the rank layout over the dp x pp x tp mesh (plan.mesh).
    """
    _check_model(model, "plan")
    refuse_autocast("fxspeed.plan")
    cfg = Config.coerce(config)
    devs = normalize_devices(devices)
    args, kwargs = _split_example(example_inputs, "plan")
    # The degrees against the devices first: a tracing error would otherwise hide that the mesh
    # cannot be built at all (plan_pipeline checks its own).
    if cfg.tensor > 1 and cfg.pipeline == 1:
        from fxspeed.planner.placement import check_tensor_config

        check_tensor_config(cfg, len(devs))
    if cfg.pipeline > 1:
        if dynamic:
            raise ConfigError(f"plan: dynamic dims are not supported with Config.pipeline={cfg.pipeline} yet; plan "
                              "each shape separately (example_inputs of that shape) or use pipeline=1")
        from fxspeed.planner.pipeline import plan_pipeline

        return plan_pipeline(model, args, kwargs, config=cfg, devices=devs, loss_fn=loss_fn)
    if dynamic:
        from fxspeed.planner.symbolic import check_dynamic

        check_dynamic(args, kwargs, dynamic)  # a bad mark fails before any tracing
    # Meta models trace as fake CPU tensors; deep stacks of identical blocks are traced with a
    # few blocks and extrapolated (see planner.plan_model).
    p = plan_model(model, args, kwargs, config=cfg, devices=devs, loss_fn=loss_fn)
    if cfg.tensor > 1:
        from fxspeed.planner.placement import TP_PLAN_NOTE

        p.notes.append(TP_PLAN_NOTE)
    if dynamic:
        from fxspeed.planner.symbolic import fit_symbolic

        fit_symbolic(p, model, args, kwargs, dynamic, cfg, devs, loss_fn)
    return p


def serve(model: nn.Module, devices: Devices = 1, config: Config | dict | str | None = None, *,
          token_budget: int = 256, max_batch: int = 16, block_size: int = 16,
          cache_tokens: int | None = None, cuda_graphs: bool | None = None, pack_linear: str = "auto",
          prefix_caching: bool = True) -> Engine:
    """Compile a causal LM for inference; returns the Engine, with `generate` and `stream`.

        engine = fxspeed.serve(model)
        outs = engine.generate([[1, 2, 3], [4, 5]], max_new_tokens=16)   # list of token-id lists

    Forward-only programs over a packed row of tokens (one per token bucket, compiled on first
    use) with a paged KV cache of `cache_tokens` tokens (default: max_batch x the model's
    context, capped at half the memory free after compiling, with a warning) in blocks of
    `block_size`; each step runs at most `token_budget` tokens (at most the model's context) and
    `max_batch` requests (continuous batching, prompts split in chunks). `engine.plan` is an
    InferencePlan (`engine.plan.summary()`). `devices=N` with `Config(tensor=N)` serves
    tensor-parallel (every rank of a `fxspeed run -n N` launch calls serve and generate with the
    same prompts; heads and MLP split, the cache split by heads; every rank returns the same
    tokens). `cuda_graphs` (default: on for one CUDA device): the decode-sized buckets are
    captured as CUDA graphs, each step one replay (runtime/serving.py `_Static`). Before
    returning, two short packed requests are served and checked against the model's own eager
    forward (a model the passes would serve wrongly is refused here). Puts the model in eval mode
    and, for a Hugging Face model built with another attention implementation, switches it to
    SDPA (`model.config._attn_implementation == "sdpa"` afterwards: the same attention, as the one
    op the KV cache is threaded through).
    `pack_linear` (CPU): buckets of a few tokens run their fp32 linears over weights pre-packed
    for oneDNN or through ATen's GEMM, whichever a probe pass over the model's weights measures
    faster on this machine ("auto": timed when each such bucket is first used, except the first
    program serve compiles; tensor-parallel ranks may choose differently, which changes rounding
    only; a bucket that does not pack reads [in, out] copies of the [out, in] weights, ATen's
    fast layout at a few rows); "always" packs; "never" reads the model's own weights (no copy
    beside them: the least memory).
    `prefix_caching`: a request whose first tokens fill cache blocks another request (or an
    earlier call) already computed reads them instead of computing them again (a shared system
    prompt, a chat's earlier turns); blocks no request holds stay cached until their room is
    needed. Models with a sliding window compute every prompt. Forgotten when the weights change.
    """
    _check_model(model, "serve")
    refuse_autocast("fxspeed.serve")
    cfg = Config.coerce(config)
    cfg.check_supported()
    devs = normalize_devices(devices)
    if cfg.pipeline > 1 or len(devs) != cfg.tensor:
        raise ConfigError(f"serve: devices={len(devs)} with Config.tensor={cfg.tensor}, Config.pipeline={cfg.pipeline}; "
                          "serving runs on one device or tensor-parallel over all of them: give devices=1, or "
                          "devices=N with Config(tensor=N) (no data-parallel replicas or pipeline stages yet)")
    if any(p.is_meta for p in model.parameters()):
        raise ConfigError("serve: the model has parameters on the meta device; give it its values first "
                          "(fxspeed.materialize(model), then load_state_dict of your weights)")
    check_pack_linear(pack_linear)
    if cuda_graphs and (cfg.tensor > 1 or not all(d.kind == "cuda" for d in devs)):
        raise ConfigError(f"serve: cuda_graphs=True needs one CUDA device (devices: {[d.name for d in devs]}, "
                          f"Config.tensor={cfg.tensor}); tensor-parallel steps are not captured yet. Leave "
                          "cuda_graphs unset (on where it applies) or set it to False")
    set_attn = getattr(model, "set_attn_implementation", None)
    impl = getattr(getattr(model, "config", None), "_attn_implementation", None)
    if impl is not None and impl != "sdpa":
        if set_attn is None:
            raise ConfigError(f"serve: {type(model).__name__} uses attn_implementation={impl!r}; build it with "
                              "attn_implementation='sdpa' so the KV cache can be threaded through its attention")
        try:
            set_attn("sdpa")  # the same attention, as one op the kv_cache pass can find
        except (ValueError, ImportError) as e:  # HF: this architecture has no SDPA attention (Gemma2)
            raise ConfigError(f"serve: {type(model).__name__} cannot run with attn_implementation='sdpa' "
                              f"({str(e).splitlines()[0][:200]}); serving threads the KV cache through SDPA "
                              "attention, so this model cannot be served yet") from e
    analyses = []
    if cfg.tensor > 1:
        from fxspeed.planner.placement import check_tensor_config, make_placement_analysis

        check_tensor_config(cfg, len(devs))
        analyses.append(make_placement_analysis(devs))  # solved on the largest bucket, kept for the others
    mesh = Mesh.join(len(devs), cfg.dist_timeout_s, tp=cfg.tensor)
    engine = Engine(model, devs, cfg, None, compiler=Compiler(cfg, mesh, None, analyses=analyses), mesh=mesh)
    with torch.inference_mode(False):  # a cache made under inference_mode could not be written outside it
        engine.setup_serving(token_budget=token_budget, max_batch=max_batch, block_size=block_size,
                             cache_tokens=cache_tokens, cuda_graphs=cuda_graphs, pack_linear=pack_linear,
                             prefix_caching=prefix_caching)
    return engine
