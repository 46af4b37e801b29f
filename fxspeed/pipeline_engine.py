"""PipelineEngine: what `fxspeed.compile` returns when Config.pipeline > 1.

    compile   capture ONE micro-batch's joint graph (batch/M rows; tied weights kept under
              each name) -> passes -> annotate + predicted times -> split_stages into P stages
              -> the schedule (gpipe / 1f1b / interleaved / zb) -> this rank's stage programs;
              the weights of other ranks' stages are freed (p.data = torch.empty(0))
    train_step  every rank passes the same full batch; it is split into M micro-batches along
              dim 0, the rank runs its action list (runtime/pipeline.py), sums gradients over
              micro-batches and divides by M (the loss is a mean: this equals one step on the
              whole batch), sums a tied weight's gradient over the ranks holding it, clips by
              the global norm, and steps torch.optim over its own parameters. Returns the mean
              loss on every rank (broadcast from the last stage).

One pipeline of `pipeline` ranks; combining it with data parallelism (devices > pipeline),
ZeRO, mixed precision and grad_accum is refused with a ConfigError for now.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.utils._pytree as pytree

from fxspeed.runtime import build_optimizer
from fxspeed.runtime.pipeline import PipelineRuntime, StageProgram
from fxspeed.runtime.schedule import Schedule, validate

from .capture import LossFn, input_key, tensor_leaves
from .compiler import compile_step
from .config import Config
from .devices import DeviceSpec
from .distributed import check_agreement, check_same_model, fingerprint, join
from .engine import _optimizer_spec
from .errors import ConfigError, FxspeedError
from .ir import IOSpec

log = logging.getLogger("fxspeed")

_SCHEDULE_NAMES = {"gpipe": "gpipe", "1f1b": "1f1b", "interleaved": "interleaved-1f1b", "zb": "zb-h1"}


def check_pipeline_config(config: Config, n_devices: int) -> None:
    P = config.pipeline
    if n_devices != P:
        raise ConfigError(f"Config.pipeline={P} with devices={n_devices}: only one pipeline (devices == pipeline) "
                          f"is supported yet; use devices={P} (pipeline combined with data parallelism is not "
                          "implemented)")
    for key, default in (("zero", 0), ("grad_accum", 1), ("precision", "fp32"), ("tensor", 1)):
        value = getattr(config, key)
        if value != default:
            hint = " (raise Config.microbatches instead)" if key == "grad_accum" else ""
            raise ConfigError(f"Config.{key}={value!r} with pipeline={P}: not supported with pipeline parallelism "
                              f"yet; use {key}={default!r}{hint}")


class PipelineEngine:
    def __init__(self, model: nn.Module, devices: Sequence[DeviceSpec], config: Config, loss_fn: LossFn | None,
                 split_points: Sequence[str] | None = None):
        check_pipeline_config(config, len(devices))
        self.model = model
        self.devices = list(devices)
        self.config = config
        self.loss_fn = loss_fn
        self.P = config.pipeline
        self.M = config.microbatches
        self.chunks = int(config.extra.get("pipeline_chunks", 2)) if config.schedule == "interleaved" else 1
        self.split_points = split_points if split_points is not None else config.extra.get("split_points")
        self.dist = join(len(self.devices), config.dist_timeout_s)
        self._params = dict(model.named_parameters(remove_duplicate=False))
        self._buffers = dict(model.named_buffers(remove_duplicate=False))
        self.stats: dict[str, float] = {"steps": 0, "compiles": 0}
        self.optimizer: torch.optim.Optimizer | None = None
        self.lr_scheduler: Any = None
        self.schedule: Schedule | None = None
        self.programs: list[StageProgram] = []
        self._key: tuple | None = None
        self._runtime: PipelineRuntime | None = None
        self._owned: list[nn.Parameter] = []
        self._tied_groups: list[tuple[Any, list[int], nn.Parameter]] = []  # (group, ranks, param)
        self.plan = None
        check_same_model(self.dist, model, config)

    @property
    def rank(self) -> int:
        return self.dist.rank

    @property
    def world_size(self) -> int:
        return self.dist.world

    @property
    def stages(self) -> list[int]:
        return [s for s, r in enumerate(self.schedule.placement) if r == self.rank] if self.schedule else []

    # --- compile -----------------------------------------------------------------------------
    def compile(self, args: tuple, kwargs: dict) -> None:
        from fxspeed.passes.split_stages import split_stages
        from fxspeed.schedules import make

        key = input_key(args, kwargs)
        if self._key is not None:
            if key != self._key:
                raise ConfigError("the pipeline engine was compiled for another batch signature; pass batches of the "
                                  "shapes given as example_inputs (a new shape would re-split the model across ranks)")
            return
        check_agreement(self.dist, "the batch signature (shapes, dtypes, structure)", fingerprint(key),
                        "every rank of a pipeline must pass the same full batch")
        n_stages = self.P * self.chunks
        sched = make(_SCHEDULE_NAMES[self.config.schedule], self.P, self.M, self.chunks)
        validate(sched)
        margs, mkw = split_batch(args, kwargs, self.M)[0]
        cfg = dataclasses.replace(self.config, disable_passes=tuple({*self.config.disable_passes,
                                                                      "dedupe_tied_parameters"}),
                                  pipeline=1, microbatches=1, schedule="1f1b")
        compiled = compile_step(self.model, margs, mkw, config=cfg, loss_fn=self.loss_fn, train=True,
                                options={"world_size": 1, "zero": 0, "group_name": "", "bucket_bytes": 1 << 30},
                                devices=self.devices[:1])
        cap = compiled.captured
        self.programs = split_stages(cap.gm, cap.signature, n_stages, split_points=self.split_points,
                                     model_name=type(self.model).__name__)
        self.schedule = sched
        mine = {s: self.programs[s] for s in self.stages}
        self._runtime = PipelineRuntime(mine, self.M, self._bind, group=self.dist.group)
        self._setup_ownership(cap.signature.tied)
        self._key = key
        self.stats["compiles"] += 1
        log.info("fxspeed: pipeline %d stages x %d micro-batches (%s); rank %d runs stages %s", n_stages, self.M,
                 sched.name, self.rank, self.stages)

    def _setup_ownership(self, tied: dict[str, str]) -> None:
        by_id = {}
        for name, p in self._params.items():
            by_id.setdefault(id(p), p)
        ranks_of: dict[int, set[int]] = {}
        for prog in self.programs:
            r = self.schedule.placement[prog.stage]
            for name in prog.names():
                if name in self._params:
                    ranks_of.setdefault(id(self._params[name]), set()).add(r)
        mine = {pid for pid, rs in ranks_of.items() if self.rank in rs}
        self._owned = [by_id[pid] for pid in by_id if pid in mine and by_id[pid].requires_grad]
        # Weights read by several ranks (tied): a group per weight, created on every rank in the same order.
        self._tied_groups = []
        for pid, p in by_id.items():
            rs = sorted(ranks_of.get(pid, ()))
            if len(rs) > 1:
                group = dist.new_group(rs)
                if self.rank in rs:
                    self._tied_groups.append((group, rs, p))
        # The counting rank of each weight for the global gradient norm: the lowest rank holding it.
        self._norm_owner = {pid: min(rs) for pid, rs in ranks_of.items()}
        with torch.no_grad():
            for pid, p in by_id.items():
                if pid not in mine:
                    p.data = torch.empty(0, dtype=p.dtype, device=p.device)
        self.optimizer, self.lr_scheduler = build_optimizer(self._owned, _optimizer_spec(self.config))

    def _bind(self, spec: IOSpec) -> torch.Tensor:
        if spec.kind == "param":
            return self._params[spec.target]
        if spec.kind == "buffer":
            return self._buffers[spec.target]
        raise FxspeedError(f"a pipeline stage has an input {spec} the engine cannot bind")

    # --- steps -------------------------------------------------------------------------------
    def train_step(self, *args: Any, **kwargs: Any) -> float:
        """One optimizer step on the full batch (every rank passes the same batch); returns the mean loss."""
        self.compile(args, kwargs)
        micro = [tensor_leaves(a, kw) for a, kw in split_batch(args, kwargs, self.M)]
        actions = self.schedule.actions[self.rank]
        loss, grads = self._runtime.run(actions, micro, on_step=lambda: None)
        with torch.no_grad():
            for p in self._owned:
                p.grad = None
            for name, g in grads.items():
                p = self._params[name]
                g = g / self.M
                p.grad = g if p.grad is None else p.grad + g
            del grads
            for group, _, p in self._tied_groups:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                dist.all_reduce(p.grad, group=group)
            if self.config.grad_clip is not None:
                self._clip()
        self.optimizer.step()
        self.lr_scheduler.step()
        for p in self._owned:
            p.grad = None
        self.stats["steps"] += 1
        last = self.schedule.placement[-1]
        out = (loss / self.M).detach().clone() if loss is not None else torch.zeros((), dtype=torch.float32)
        dist.broadcast(out, src=last, group=self.dist.group)
        return float(out)

    def _clip(self) -> None:
        counted = [p.grad for p in self._owned if p.grad is not None and self._norm_owner.get(id(p)) == self.rank]
        sq = torch.zeros((), dtype=torch.float64)
        if counted:
            sq = torch.nn.utils.get_total_norm(counted, foreach=True).double() ** 2
        dist.all_reduce(sq, group=self.dist.group)
        norm = sq.sqrt().to(torch.float32)
        grads = [p.grad for p in self._owned if p.grad is not None]
        if grads:
            torch.nn.utils.clip_grads_with_norm_([p for p in self._owned if p.grad is not None],
                                                 self.config.grad_clip, norm, foreach=True)

    # --- state -------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, torch.Tensor]:
        """This rank's parameters (every name of the weights it holds) and buffers; merging the
        dicts of all ranks gives the model's full state."""
        owned = {id(p) for p in self._owned}
        out = {n: p.detach() for n, p in self.model.named_parameters() if id(p) in owned}
        out.update({n: b.detach() for n, b in self.model.named_buffers()})
        return out

    def describe(self) -> dict[str, Any]:
        return {"schedule": self.schedule.format() if self.schedule else None,
                "stages": [p.describe() for p in self.programs]}


def split_batch(args: tuple, kwargs: dict, k: int) -> list[tuple[tuple, dict]]:
    leaves, spec = pytree.tree_flatten((args, kwargs))
    for x in leaves:
        if isinstance(x, torch.Tensor) and (x.dim() == 0 or x.shape[0] % k):
            raise ConfigError(f"Config.microbatches={k} must divide the batch dimension; got a tensor of shape "
                              f"{tuple(x.shape)}. Use a batch size divisible by {k} or change microbatches "
                              f"(a divisor of {x.shape[0] if x.dim() else 'the batch size'})")
    chunks = [x.chunk(k) if isinstance(x, torch.Tensor) else [x] * k for x in leaves]
    return [pytree.tree_unflatten([c[i] for c in chunks], spec) for i in range(k)]
