"""PipelineEngine: what `fxspeed.compile` returns when Config.pipeline > 1.

    compile   capture ONE micro-batch's joint graph (batch/M rows; tied weights kept under
              each name) -> single-device passes (insert_casts, scale_loss, ...) -> annotate +
              predicted times -> split_stages into P (x v) stages -> the schedule (gpipe /
              1f1b / interleaved / zb) -> this rank's stage programs; the weights of other
              stages are freed (p.data = torch.empty(0))
    train_step  every rank of one pipeline passes the same batch (its data-parallel replica's
              batch); it is split into M micro-batches along dim 0, the rank runs its action
              list (runtime/pipeline.py), sums gradients over micro-batches and divides by M
              (the loss is a mean: this equals one step on the whole batch), sums a tied
              weight's gradient over the stages holding it, averages over the D replicas
              (all-reduce, or reduce-scatter into ZeRO-1 shards), unscales/checks fp16
              overflow on every rank, clips by the global norm and steps. Returns the mean loss
              of the global batch on every rank.

Ranks: devices = P x D. Global rank g is pipeline position g % P of replica g // P, so the
ranks of one pipeline are consecutive (p2p stays within a node when nodes hold whole pipelines)
and the data-parallel group of a stage holds the ranks with the same position.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from pathlib import Path
from typing import Any, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.utils._pytree as pytree

from fxspeed.ir import Bucket
from fxspeed.runtime import build_optimizer
from fxspeed.runtime.flat_parameters import FlatParameters
from fxspeed.runtime.loss_scale import DynamicLossScaler
from fxspeed.runtime.runner import PipelineRuntime, StageProgram
from fxspeed.ir.schedule import B, F, I, RECV_B, RECV_F, SEND_F, STEP, W, Action, Schedule, validate

from fxspeed.compiler.capture import LossFn, input_key, tensor_leaves
from fxspeed.compiler import compile_step
from fxspeed.config import Config
from fxspeed.devices import DeviceSpec
from fxspeed.mesh import check_agreement, check_same_model, fingerprint, join
from fxspeed.runtime.engine import _optimizer_spec, unscale_or_skip
from fxspeed.errors import ConfigError, FxspeedError
from fxspeed.ir import IOSpec
from fxspeed.compiler.rewrite import scale_backward_seed

log = logging.getLogger("fxspeed")

_SCHEDULE_NAMES = {"gpipe": "gpipe", "1f1b": "1f1b", "interleaved": "interleaved-1f1b", "zb": "zb-h1"}


def check_pipeline_config(config: Config, n_devices: int) -> None:
    P = config.pipeline
    if n_devices % P:
        lo = max(P, n_devices - n_devices % P)
        raise ConfigError(f"Config.pipeline={P} with devices={n_devices}: devices must be a multiple of the "
                          f"pipeline degree (pipeline x data-parallel replicas); use devices={lo} or "
                          f"{lo + P}, or a pipeline degree dividing {n_devices}")
    if config.zero > 1:
        raise ConfigError(f"Config.zero={config.zero} with pipeline={P}: ZeRO-2/3 under a pipeline are not "
                          "supported (each micro-batch's backward would reduce-scatter or re-gather); use zero=1 "
                          "(optimizer states sharded over the data-parallel replicas) or zero=0")
    for key, default in (("grad_accum", 1), ("tensor", 1)):
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
        self.dp_size = len(self.devices) // self.P
        self.M = config.microbatches
        self.chunks = int(config.extra.get("pipeline_chunks", 2)) if config.schedule == "interleaved" else 1
        self.split_points = split_points if split_points is not None else config.extra.get("split_points")
        self.dist = join(len(self.devices), config.dist_timeout_s)
        self._params = dict(model.named_parameters(remove_duplicate=False))
        self._buffers = dict(model.named_buffers(remove_duplicate=False))
        self.stats: dict[str, Any] = {"steps": 0, "compiles": 0, "skipped_steps": 0}
        self.optimizer: torch.optim.Optimizer | None = None
        self.lr_scheduler: Any = None
        self.schedule: Schedule | None = None
        self.programs: list[StageProgram] = []
        self._key: tuple | None = None
        self._runtime: PipelineRuntime | None = None
        self._eval_runtime: PipelineRuntime | None = None
        self._freed_shapes: dict[int, tuple[int, ...]] = {}
        self._p2p_latency = 0.0  # seconds per message for measured_costs(); see measure_p2p_latency  # id(Parameter) -> shape, for other stages' weights
        self._owned: list[nn.Parameter] = []
        self._owned_names: list[str] = []
        self._tied_groups: list[tuple[Any, list[int], nn.Parameter]] = []  # (group, global ranks, param)
        self._flat: FlatParameters | None = None
        self.plan = None
        self.scaler: DynamicLossScaler | None = None
        self._scale = torch.ones((), dtype=torch.float32)  # the graph's loss_scale input, updated in place
        if config.precision == "fp16":
            self.scaler = DynamicLossScaler(config.loss_scale or 2.0**16, config.loss_scale_window,
                                            config.loss_scale_backoff, config.loss_scale_growth, self.dist.group)
            self.stats["loss_scale"] = float(self.scaler.scale)
        self._make_groups()
        check_same_model(self.dist, model, config)

    def _make_groups(self) -> None:
        """The pipeline group of this rank's replica and the data-parallel group of its position.

        new_group is collective over the default group: every rank creates every group, in the
        same order, and keeps the ones it belongs to."""
        P, D, g = self.P, self.dp_size, self.dist.rank
        self.dp_rank, self.position = divmod(g, P)
        self.pipe_ranks = [self.dp_rank * P + p for p in range(P)]
        if D == 1:
            self.pipe_group, self.dp_group = self.dist.group, None
            return
        for d in range(D):
            grp = dist.new_group([d * P + p for p in range(P)])
            if d == self.dp_rank:
                self.pipe_group = grp
        for p in range(P):
            grp = dist.new_group([d * P + p for d in range(D)])
            if p == self.position:
                self.dp_group = grp

    @property
    def rank(self) -> int:
        return self.dist.rank

    @property
    def world_size(self) -> int:
        return self.dist.world

    @property
    def stages(self) -> list[int]:
        """The stages this rank runs (one, or `pipeline_chunks` under the interleaved schedule)."""
        return [s for s, r in enumerate(self.schedule.placement) if r == self.position] if self.schedule else []

    # --- compile -----------------------------------------------------------------------------
    def compile(self, args: tuple, kwargs: dict) -> None:
        from fxspeed.passes.program.accumulate_gradients import accumulate_stage_gradients
        from fxspeed.passes.program.split_stages import split_stages
        from fxspeed.planner import costs_reader, finish_plan
        from fxspeed.passes.program.lower_schedule import make

        key = input_key(args, kwargs)
        if self._key is not None:
            if key != self._key:
                raise ConfigError("the pipeline engine was compiled for another batch signature; pass batches of the "
                                  "shapes given as example_inputs (a new shape would re-split the model across ranks)")
            return
        check_agreement(self.dist, "the batch signature (shapes, dtypes, structure)", fingerprint(key),
                        "every rank must pass a batch of the same shapes (each pipeline: the same batch)")
        n_stages = self.P * self.chunks
        sched = make(_SCHEDULE_NAMES[self.config.schedule], self.P, self.M, self.chunks)
        validate(sched)
        margs, mkw = split_batch(args, kwargs, self.M)[0]
        cfg = self._micro_config()
        compiled = compile_step(self.model, margs, mkw, config=cfg, loss_fn=self.loss_fn, train=True,
                                options={"world_size": 1, "zero": 0, "group_name": "", "bucket_bytes": 1 << 30},
                                analyze=costs_reader(cfg, self.devices[:1]))
        cap = compiled.captured
        # Gradients of the global-batch mean come straight out of backward: the seed carries
        # 1/(M x replicas) (exact for powers of two), so no pass over the gradients divides them.
        self._grad_divisor = 1.0 if scale_backward_seed(cap.gm, cap.signature, 1.0 / (self.M * self.dp_size)) \
            else float(self.M * self.dp_size)
        cap.gm.recompile()
        self.programs = split_stages(cap.gm, cap.signature, n_stages, split_points=self.split_points,
                                     model_name=type(self.model).__name__)
        self.schedule = sched
        if "accumulate_gradients" not in self.config.disable_passes:
            for s in self.stages:
                self.programs[s] = accumulate_stage_gradients(self.programs[s])
        mine = {s: self.programs[s] for s in self.stages}
        self._runtime = PipelineRuntime(mine, self.M, self._bind, group=self.pipe_group, peers=self.pipe_ranks)
        self._setup_ownership()
        self._key = key
        self.stats["compiles"] += 1
        self.plan = finish_plan(compiled.costs, model_name=type(self.model).__name__, config=cfg,
                                devices=self.devices[:1], passes=[r.to_dict() for r in compiled.records])
        self.plan.pipeline = self.pipeline_report()
        self._per_rank_memory()
        log.info("fxspeed: pipeline %d stages x %d micro-batches (%s) x %d replicas; rank %d runs stages %s",
                 n_stages, self.M, sched.name, self.dp_size, self.rank, self.stages)

    def _micro_config(self) -> Config:
        """The config one micro-batch's graph is captured with: single-device passes only, tied
        weights kept under each name (stages may hold either), no ZeRO inside the graph."""
        return dataclasses.replace(self.config, disable_passes=tuple({*self.config.disable_passes,
                                                                       "dedupe_tied_parameters"}),
                                   pipeline=1, microbatches=1, schedule="1f1b", zero=0)

    def _setup_ownership(self) -> None:
        by_id: dict[int, tuple[str, nn.Parameter]] = {}
        for name, p in self._params.items():
            by_id.setdefault(id(p), (name, p))
        ranks_of: dict[int, set[int]] = {}  # parameter -> pipeline positions holding it
        for prog in self.programs:
            r = self.schedule.placement[prog.stage]
            for name in prog.names():
                if name in self._params:
                    ranks_of.setdefault(id(self._params[name]), set()).add(r)
        mine = {pid for pid, rs in ranks_of.items() if self.position in rs}
        owned = [(name, p) for pid, (name, p) in by_id.items() if pid in mine and p.requires_grad]
        self._owned = [p for _, p in owned]
        self._owned_names = [n for n, _ in owned]
        # Weights read by several positions (tied): per weight and replica a group, created on
        # every rank in the same order.
        self._tied_groups = []
        for pid in by_id:
            rs = sorted(ranks_of.get(pid, ()))
            if len(rs) < 2:
                continue
            for d in range(self.dp_size):
                ranks = [d * self.P + r for r in rs]
                group = dist.new_group(ranks)
                if self.rank in ranks:
                    self._tied_groups.append((group, ranks, by_id[pid][1]))
        # The counting position of each weight for the global gradient norm: the lowest holder.
        counted = {id(p) for _, p in owned if min(ranks_of[id(p)]) == self.position}
        self._counted = [p for p in self._owned if id(p) in counted]
        with torch.no_grad():
            for pid, (_, p) in by_id.items():
                if pid not in mine:
                    self._freed_shapes[pid] = tuple(p.shape)
                    p.data = torch.empty(0, dtype=p.dtype, device=p.device)
        tensors: list[torch.Tensor] = list(self._owned)
        if self.config.zero == 1 and self.dp_size > 1:
            # Two buckets, so the norm can count the first only: weights whose norm this
            # position counts, and tied copies counted elsewhere.
            groups = [g for g in ([(n, p) for n, p in owned if id(p) in counted],
                                  [(n, p) for n, p in owned if id(p) not in counted]) if g]
            buckets = [_bucket(i, g, self.dp_size) for i, g in enumerate(groups)]
            self._counted_buckets = [i for i, g in enumerate(groups) if id(g[0][1]) in counted]
            self._flat = FlatParameters(dict(owned), buckets, rank=self.dp_rank, world=self.dp_size, zero=1,
                                        group=self.dp_group)
            tensors = self._flat.optimizer_tensors()
        self.optimizer, self.lr_scheduler = build_optimizer(tensors, _optimizer_spec(self.config))

    def _bind(self, spec: IOSpec) -> torch.Tensor:
        if spec.kind == "param":
            return self._params[spec.target]
        if spec.kind == "buffer":
            return self._buffers[spec.target]
        if spec.kind == "loss_scale":
            return self._scale
        raise FxspeedError(f"a pipeline stage has an input {spec} the engine cannot bind")

    # --- steps -------------------------------------------------------------------------------
    def train_step(self, *args: Any, **kwargs: Any) -> float:
        """One optimizer step on the global batch; each pipeline's ranks pass the same batch.

        Returns the mean loss over the global batch (all replicas) on every rank."""
        self.compile(args, kwargs)
        micro = [tensor_leaves(a, kw) for a, kw in split_batch(args, kwargs, self.M)]
        if self.scaler is not None:
            self._scale.copy_(self.scaler.scale)
        actions = self.schedule.actions[self.position]
        t0 = time.perf_counter()
        loss, grads = self._runtime.run(actions, micro)
        self._record_timing(time.perf_counter() - t0)
        with torch.no_grad():
            self._set_grads(grads)
            del grads
            stepped = [t for t in self._opt_tensors() if t.grad is not None]
            overflow = unscale_or_skip(self.scaler, stepped, self.stats)
            if not overflow and self.config.grad_clip is not None:
                self._clip(stepped)
        if not overflow:
            self.optimizer.step()
            self.lr_scheduler.step()
            if self._flat is not None:
                self._flat.after_step()
        for t in self._opt_tensors():
            t.grad = None
        self.stats["steps"] += 1
        return self._global_mean(loss)

    def _opt_tensors(self) -> list[torch.Tensor]:
        return self._flat.optimizer_tensors() if self._flat is not None else list(self._owned)

    def _set_grads(self, grads: dict[str, torch.Tensor]) -> None:
        """Per-micro-batch sums -> the gradient of the global-batch mean loss on every tensor
        the optimizer steps (full gradients, or this replica's ZeRO-1 shard)."""
        for p in self._owned:
            p.grad = None
        for name, g in grads.items():
            p = self._params[name]
            if self._grad_divisor != 1.0:
                g = g / self._grad_divisor
            p.grad = g if p.grad is None else p.grad + g
        for p in self._owned:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        works = [dist.all_reduce(p.grad, group=group, async_op=True) for group, _, p in self._tied_groups]
        for w in works:
            w.wait()
        if self.dp_size == 1:
            return
        if self._flat is None:
            flat = torch.cat([p.grad.reshape(-1) for p in self._owned])
            dist.all_reduce(flat, group=self.dp_group)  # a sum: each replica's share is pre-divided
            off = 0
            for p in self._owned:
                p.grad = flat[off:off + p.numel()].view_as(p)
                off += p.numel()
            return
        for k in range(len(self._flat.buckets)):
            shard = torch.empty_like(self._flat.shards[k])
            _reduce_scatter(shard, self._flat.flat_grads(k), group=self.dp_group)
            self._flat.shards[k].grad = shard
        for p in self._owned:
            p.grad = None

    def _clip(self, stepped: list[torch.Tensor]) -> None:
        if self._flat is not None:
            # Disjoint shards over replicas and positions: sum everyone's counted squares.
            counted = [self._flat.shards[k].grad for k in self._counted_buckets]
            group = self.dist.group
        else:
            # Replicas hold identical gradients: sum over this pipeline's positions only.
            counted = [p.grad for p in self._counted if p.grad is not None]
            group = self.pipe_group
        sq = torch.zeros((), dtype=torch.float64)
        if counted:
            sq = torch.nn.utils.get_total_norm(counted, foreach=True).double() ** 2
        dist.all_reduce(sq, group=group)
        norm = sq.sqrt().to(torch.float32)
        if stepped:
            torch.nn.utils.clip_grads_with_norm_(stepped, self.config.grad_clip, norm, foreach=True)

    def _record_timing(self, step_s: float) -> None:
        """This rank's last step: compute (F/B/I/W), blocked (in receives, and at STEP waiting
        for its sends to be taken) and overhead (the rest: posting sends, Python between actions).
        The idle fraction is the blocked share: the bubble as this rank lives it."""
        tl = self._runtime.timeline
        compute = sum(e - b for k, _, _, b, e in tl if k in (F, B, I, W))
        blocked = sum(e - b for k, _, _, b, e in tl if k in (RECV_F, RECV_B, STEP))
        self.stats["step_s"] = step_s
        self.stats["compute_s"] = compute
        self.stats["blocked_s"] = blocked
        self.stats["idle_fraction"] = blocked / step_s if step_s > 0 else 0.0
        self.stats["overhead_fraction"] = max(0.0, 1.0 - (compute + blocked) / step_s) if step_s > 0 else 0.0

    def stage_times(self) -> dict[int, dict[str, float]]:
        """Measured seconds per micro-batch of each of this rank's stages in the last step, by
        action kind (F, B, I, W)."""
        acc: dict[int, dict[str, list[float]]] = {}
        for kind, s, _, start, end in self._runtime.timeline if self._runtime else []:
            if kind in (F, B, I, W):
                acc.setdefault(s, {}).setdefault(kind, []).append(end - start)
        return {s: {k: sum(v) / len(v) for k, v in d.items()} for s, d in acc.items()}

    # --- plan --------------------------------------------------------------------------------
    def pipeline_report(self, costs: "Any | None" = None) -> dict[str, Any]:
        """Per stage: modules, parameters, predicted time and memory; the schedule's simulated
        bubble and step time. `costs` (a simulator.Costs) overrides the planner's stage times."""
        from fxspeed.planner.simulator import Costs, StageCosts, simulate

        if costs is None:
            costs = Costs([StageCosts(p.predicted.get("forward", 1.0), p.predicted.get("backward_input", 1.0),
                                      p.predicted.get("backward_weight", 0.0),
                                      activation=p.predicted.get("saved_bytes", 1.0),
                                      send_bytes=p.predicted.get("send_bytes", 0.0)) for p in self.programs])
        sim = simulate(self.schedule, costs)
        state_f = 2 if self.config.optimizer in ("adam", "adamw") else (1 if self.config.momentum else 0)
        stages = []
        for p in self.programs:
            n_par = int(p.predicted.get("params", 0))
            pb = p.predicted.get("param_bytes", 0.0)
            opt = state_f * pb / (self.dp_size if self.config.zero == 1 else 1)
            rank = self.schedule.placement[p.stage]
            stages.append({"stage": p.stage, "rank": rank, "modules": p.modules, "params": n_par,
                           "forward_s": p.predicted.get("forward", 0.0),
                           "backward_s": p.predicted.get("backward_input", 0.0) + p.predicted.get("backward_weight", 0.0),
                           "memory_bytes": {"parameters": pb, "gradients": pb, "optimizer_states": opt,
                                            "activations": sim.peak_activations[rank]}})
        return {"schedule": self.schedule.name, "stages_n": len(self.programs), "microbatches": self.M,
                "replicas": self.dp_size, "stages": stages, "bubble": sim.bubble, "step_s": sim.step_time,
                "idle_fraction": [i / sim.step_time if sim.step_time else 0.0 for i in sim.idle],
                "own_idle_fraction": [sim.own_idle_fraction(r) for r in range(len(sim.idle))]}

    def _per_rank_memory(self) -> None:
        """plan.rank_memory per rank from its stages (the captured graph is the whole model's)."""
        from fxspeed.ir import ACTIVATIONS, GRADIENTS, OPTIMIZER_STATES, PARAMETERS

        by_pos: dict[int, dict[str, int]] = {}
        for st in self.plan.pipeline["stages"]:
            m = st["memory_bytes"]
            d = by_pos.setdefault(st["rank"], {})
            for cat, key in ((PARAMETERS, "parameters"), (GRADIENTS, "gradients"),
                             (OPTIMIZER_STATES, "optimizer_states")):
                d[cat] = d.get(cat, 0) + int(m[key])
            d[ACTIVATIONS] = int(m["activations"])  # the simulator's peak is per rank already
        self.plan.rank_memory = [by_pos.get(g % self.P, {}) for g in range(self.world_size)]
        self.plan.peak_phase = ["step"] * self.world_size
        self.plan.devices = [self.plan.devices[0]] * self.world_size
        self.plan.notes.append("pipeline: per-rank memory = the rank's stages' weights, gradients, optimizer "
                               "states (sharded over replicas under ZeRO-1) and the simulated activation peak")

    def measure_p2p_latency(self, repeats: int = 20) -> float:
        """One-way seconds for a stage-boundary message (the largest activation sent), measured
        by ping-pong between pipeline positions 0 and 1 and shared over the pipeline. The
        simulator charges it to every message; it includes what a receive costs even when the
        message is ready (gloo wakes the receiving thread). Collective over the pipeline."""
        shape = max((m.shape for p in self.programs for m in p.send_f),
                    key=lambda sh: torch.Size(sh).numel(), default=(1,))
        t = torch.zeros(shape)
        out = torch.zeros(())
        a, b = self.pipe_ranks[0], self.pipe_ranks[1]
        if self.position in (0, 1):
            times = []
            for _ in range(repeats + 2):
                t0 = time.perf_counter()
                if self.position == 0:
                    dist.send(t, b, group=self.pipe_group)
                    dist.recv(t, b, group=self.pipe_group)
                else:
                    dist.recv(t, a, group=self.pipe_group)
                    dist.send(t, a, group=self.pipe_group)
                times.append(time.perf_counter() - t0)
            out = torch.tensor(sorted(times[2:])[len(times[2:]) // 2] / 2)
        dist.broadcast(out, src=a, group=self.pipe_group)
        self._p2p_latency = float(out)
        return self._p2p_latency

    def measured_costs(self) -> "Any":
        """simulator.Costs from the last step's measured per-micro-batch stage times (all ranks;
        collective over the pipeline)."""
        from fxspeed.planner.simulator import Costs, StageCosts

        mine = self.stage_times()
        # The rank's overhead (posting sends, glue between actions) is work the simulator has no
        # action for: spread it over the rank's compute, so the simulated rank is as busy.
        compute = self.stats.get("compute_s", 0.0)
        grow = 1.0 + (self.stats.get("overhead_fraction", 0.0) * self.stats.get("step_s", 0.0) / compute
                      if compute > 0 else 0.0)
        rows = []
        for s in range(len(self.programs)):
            d = mine.get(s, {})
            f, i, w = d.get("F", 0.0), d.get("I", d.get("B", 0.0)), d.get("W", 0.0)
            rows.append([f * grow, i * grow, w * grow])
        t = torch.tensor(rows, dtype=torch.float64)
        dist.all_reduce(t, group=self.pipe_group)  # each stage's times come from the one rank running it
        return Costs([StageCosts(*map(float, r)) for r in t], p2p_latency=self._p2p_latency)

    # --- state -------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, torch.Tensor]:
        """This rank's parameters (every name of the weights it holds) and buffers; merging the
        dicts of one pipeline's ranks gives the model's full state."""
        owned = {id(p) for p in self._owned}
        out = {n: p.detach() for n, p in self.model.named_parameters(remove_duplicate=False) if id(p) in owned}
        out.update({n: b.detach() for n, b in self.model.named_buffers()})
        return out

    def save(self, directory: str | os.PathLike) -> None:
        """Each rank writes its stage weights, optimizer state (its ZeRO-1 shard), lr schedule
        and loss scale to `directory/rank{r}.pt`."""
        if self.optimizer is None:
            raise FxspeedError("engine.save: nothing to save before the engine is compiled; run a train_step first")
        d = Path(directory)
        d.mkdir(parents=True, exist_ok=True)
        torch.save({"world": self.world_size, "pipeline": self.P, "schedule": self.config.schedule,
                    "params": {n: t.clone() for n, t in self.state_dict().items()},
                    "optimizer": self.optimizer.state_dict(), "lr_scheduler": self.lr_scheduler.state_dict(),
                    "scaler": self.scaler.state_dict() if self.scaler is not None else None,
                    "stats": dict(self.stats)}, d / f"rank{self.rank}.pt")
        dist.barrier(group=self.dist.group)

    def load(self, directory: str | os.PathLike) -> None:
        """Restore what `save` wrote; the engine must be compiled with the same world, pipeline
        and schedule (pass example_inputs to compile, or run a step first)."""
        if self.optimizer is None:
            raise FxspeedError("engine.load: compile the engine first (fxspeed.compile(..., example_inputs=...)) so "
                               "the stage split and optimizer exist")
        path = Path(directory) / f"rank{self.rank}.pt"
        if not path.exists():
            raise FxspeedError(f"engine.load: {path} does not exist; was the checkpoint saved with "
                               f"{self.world_size} ranks?")
        ck = torch.load(path, weights_only=False)
        for key, mine in (("world", self.world_size), ("pipeline", self.P), ("schedule", self.config.schedule)):
            if ck[key] != mine:
                raise ConfigError(f"engine.load: the checkpoint was saved with {key}={ck[key]!r}, this engine has "
                                  f"{key}={mine!r}; load it with the same setting")
        named = dict(self.model.named_parameters(remove_duplicate=False))
        with torch.no_grad():
            for n, t in ck["params"].items():
                if n in named:
                    named[n].copy_(t)
                else:
                    dict(self.model.named_buffers())[n].copy_(t)
        self.optimizer.load_state_dict(ck["optimizer"])
        self.lr_scheduler.load_state_dict(ck["lr_scheduler"])
        if self.scaler is not None and ck["scaler"] is not None:
            self.scaler.load_state_dict(ck["scaler"])
        self.stats.update(ck["stats"])

    @torch.no_grad()
    def eval_step(self, *args: Any, **kwargs: Any) -> float:
        """Forward only through the pipeline, model in eval mode (no dropout); returns the mean
        loss over the global batch on every rank. The model must return a loss (or loss_fn be
        set). The first call captures the eval graph and splits it at the training split's
        module boundaries, so every rank runs the same stages with the weights it holds."""
        self.compile(args, kwargs)
        if self._eval_runtime is None:
            self._eval_runtime = self._compile_eval(args, kwargs)
        micro = [tensor_leaves(a, kw) for a, kw in split_batch(args, kwargs, self.M)]
        actions = [a for a in self.schedule.actions[self.position] if a.kind in (F, SEND_F, RECV_F)]
        loss, _ = self._eval_runtime.run(actions + [Action(STEP)], micro, forward_only=True)
        return self._global_mean(loss)

    def _compile_eval(self, args: tuple, kwargs: dict) -> PipelineRuntime:
        from fxspeed.passes.program.split_stages import split_stages

        margs, mkw = split_batch(args, kwargs, self.M)[0]
        cfg = self._micro_config()
        # Other stages' weights were freed; tracing needs only their shapes: meta stand-ins
        # (one per Parameter, so tied weights stay tied) are swapped in for the capture.
        stand_in: dict[int, nn.Parameter] = {}
        swapped: list[tuple[dict, str, nn.Parameter]] = []
        was_training = self.model.training
        try:
            for mod in self.model.modules():
                for name, t in list(mod._parameters.items()):
                    if t is not None and id(t) in self._freed_shapes:
                        if id(t) not in stand_in:
                            stand_in[id(t)] = nn.Parameter(torch.empty(self._freed_shapes[id(t)], dtype=t.dtype,
                                                                        device="meta"), requires_grad=t.requires_grad)
                        swapped.append((mod._parameters, name, t))
                        mod._parameters[name] = stand_in[id(t)]
            self.model.eval()
            cap = compile_step(self.model, margs, mkw, config=cfg, loss_fn=self.loss_fn, train=False, options={},
                               ).captured
        finally:
            self.model.train(was_training)
            for store, name, t in swapped:
                store[name] = t
        if not any(s.kind == "loss" for s in cap.signature.outputs):
            raise ConfigError(f"eval_step under pipeline parallelism needs a loss: {type(self.model).__name__} "
                              "returns no loss for this batch; pass targets or compile with loss_fn=")
        starts = [p.starts_at for p in self.programs[1:]]
        progs = split_stages(cap.gm, cap.signature, len(self.programs), split_points=starts,
                             model_name=type(self.model).__name__)
        mine = {s: progs[s] for s in self.stages}
        return PipelineRuntime(mine, self.M, self._bind, group=self.pipe_group, peers=self.pipe_ranks)

    def _global_mean(self, loss: torch.Tensor | None) -> float:
        """Mean micro-batch loss from the last stage, on every rank, averaged over replicas."""
        last = self.pipe_ranks[self.schedule.placement[-1]]
        out = (loss / self.M).detach().float().clone() if loss is not None else torch.zeros((), dtype=torch.float32)
        dist.broadcast(out, src=last, group=self.pipe_group)
        if self.dp_group is not None:
            dist.all_reduce(out, group=self.dp_group)
            out /= self.dp_size
        return float(out)

    def describe(self) -> dict[str, Any]:
        return {"schedule": self.schedule.format() if self.schedule else None,
                "stages": [p.describe() for p in self.programs]}


def _bucket(index: int, named: list[tuple[str, nn.Parameter]], world: int) -> Bucket:
    offsets, off = [], 0
    for _, p in named:
        offsets.append(off)
        off += p.numel()
    padded = -(-off // world) * world
    return Bucket(index, [n for n, _ in named], [tuple(p.shape) for _, p in named], offsets, off, padded,
                  str(named[0][1].dtype).replace("torch.", ""))


# torch 2.13 renamed reduce_scatter_tensor to reduce_scatter_single (same arguments).
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def split_batch(args: tuple, kwargs: dict, k: int) -> list[tuple[tuple, dict]]:
    leaves, spec = pytree.tree_flatten((args, kwargs))
    for x in leaves:
        if isinstance(x, torch.Tensor) and (x.dim() == 0 or x.shape[0] % k):
            raise ConfigError(f"Config.microbatches={k} must divide the batch dimension; got a tensor of shape "
                              f"{tuple(x.shape)}. Use a batch size divisible by {k} or change microbatches "
                              f"(a divisor of {x.shape[0] if x.dim() else 'the batch size'})")
    chunks = [x.chunk(k) if isinstance(x, torch.Tensor) else [x] * k for x in leaves]
    return [pytree.tree_unflatten([c[i] for c in chunks], spec) for i in range(k)]
