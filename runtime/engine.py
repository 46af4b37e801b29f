"""Engine: what `fxspeed.compile` returns. Owns the model's tensors, the optimizer and a cache
of compiled programs keyed by batch signature (a new shape compiles once, then is reused).
"""

from __future__ import annotations

import contextlib
import logging
import os
from typing import Any, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.utils._pytree as pytree

from fxspeed.runtime import DynamicLossScaler, FlatParameters, OptimizerSpec, Program, StepExecutor, build_optimizer

from fxspeed.compiler.capture import LossFn, input_key, tensor_leaves
from fxspeed.compiler import compile_step
from fxspeed.config import Config
from fxspeed.devices import DeviceSpec
from fxspeed.mesh import check_same_everywhere, check_same_model, fingerprint, join
from fxspeed.errors import ConfigError, FxspeedError
from fxspeed.ir import Bucket, IOSpec, StepSignature
from fxspeed.planner.plan import Plan
from fxspeed.planner import costs_reader, finish_plan

log = logging.getLogger("fxspeed")
RETRACE_WARN_AFTER = 8


class Engine:
    """Trains `model` in place: its parameters are the ones the optimizer updates.

    On several ranks (data parallel, ZeRO) the trainable parameters live in flat buckets laid
    out by the gradient-reduction pass (runtime.FlatParameters); zero 0-2 keep the model's
    Parameters as views into them, ZeRO-3 keeps only this rank's shards.
    """

    def __init__(self, model: nn.Module, devices: Sequence[DeviceSpec], config: Config, loss_fn: LossFn | None):
        self.model = model
        self.devices = list(devices)
        self.config = config
        self.loss_fn = loss_fn
        self.dist = join(len(self.devices), config.dist_timeout_s)
        # Every name of every tensor: a tied weight is one Parameter reachable under two names,
        # and the trace may refer to it by either.
        self._params = dict(model.named_parameters(remove_duplicate=False))
        self._buffers = dict(model.named_buffers(remove_duplicate=False))
        self._unique = list(model.parameters())
        self._flat: FlatParameters | None = None
        self.optimizer: torch.optim.Optimizer | None = None
        self.lr_scheduler: Any = None
        self._executors: dict[tuple, StepExecutor] = {}
        self.plan: Plan | None = None
        self.stats: dict[str, float] = {"steps": 0, "compiles": 0, "skipped_steps": 0}
        self.scaler: DynamicLossScaler | None = None
        if config.precision == "fp16":
            self.scaler = DynamicLossScaler(config.loss_scale or 2.0**16, config.loss_scale_window,
                                            config.loss_scale_backoff, config.loss_scale_growth,
                                            self.dist.group if self.dist.active else None)
            self.stats["loss_scale"] = float(self.scaler.scale)
        gloo = self.dist.active and dist.get_backend(self.dist.group) == "gloo"
        self._options = {"world_size": self.dist.world, "rank": self.dist.rank, "zero": config.zero,
                         "group_name": self.dist.group_name, "bucket_bytes": int(config.bucket_mb * 2**20),
                         # gloo's reduce-scatter of a 25 MB bucket took 1.5x as long as all-reduce plus
                         # the slice copy (2 CPU ranks), so ZeRO-2/3 all-reduce and keep their slice there.
                         "scatter_via_all_reduce": gloo,
                         # gloo's all-gather allocates a full-size temporary per call and took 1.6x an
                         # all-reduce of the zero-padded shard, so ZeRO-3 gathers that way there.
                         "gather_via_all_reduce": gloo,
                         "reuse_grad_buckets": True}
        if self.dist.active:
            check_same_model(self.dist, model, config)

    @property
    def rank(self) -> int:
        return self.dist.rank

    @property
    def world_size(self) -> int:
        return self.dist.world

    # --- compile -----------------------------------------------------------------------------
    def _executor(self, args: tuple, kwargs: dict, train: bool) -> StepExecutor:
        key = (train, input_key(args, kwargs))
        if self.dist.active:
            # Every step: a rank meeting a new shape alone would otherwise trace and run
            # collectives the others never join.
            check_same_everywhere(self.dist, "the batch signature (shapes, dtypes, structure)", fingerprint(key),
                                  "every rank must pass local batches of the same shapes; split the global batch "
                                  "evenly with fxspeed.data.local_batch")
        ex = self._executors.get(key)
        if ex is not None:
            return ex
        self.synchronize()  # tracing reads the weights
        # ZeRO-3 keeps only shards between steps; tracing needs the full parameters once.
        with self._flat.gathered() if self._flat is not None else contextlib.nullcontext():
            compiled = compile_step(self.model, args, kwargs, config=self.config, loss_fn=self.loss_fn, train=train,
                                    options=self._options if train else {},
                                    analyze=costs_reader(self.config, self.devices) if train and self.plan is None else None)
        cap = compiled.captured
        if train and self.optimizer is None:
            self._setup_state(cap.signature)
        elif train and self._flat is not None and _layout(cap.signature.buckets) != _layout(self._flat.buckets):
            raise FxspeedError("a new batch shape produced a different gradient bucket layout; please report this "
                               "with the model and shapes")
        program = Program(cap.gm, cap.signature, train=train, out_spec=cap.out_spec)
        ex = StepExecutor(program, self._bind)
        self._executors[key] = ex
        self.stats["compiles"] += 1
        if self.stats["compiles"] == RETRACE_WARN_AFTER:
            log.warning("fxspeed: %d batch signatures compiled so far; pad batches to a few fixed shapes "
                        "to avoid recompiling", RETRACE_WARN_AFTER)
        if train and self.plan is None:
            self.plan = finish_plan(compiled.costs, model_name=type(self.model).__name__, config=self.config,
                                    devices=self.devices, passes=[r.to_dict() for r in compiled.records])
        return ex

    def _setup_state(self, sig: StepSignature) -> None:
        if sig.buckets:
            canonical = {b_name: self._params[b_name] for b in sig.buckets for b_name in b.names}
            gather_group = None
            if sig.waits_for_parameters:
                # Deferred post-step gathers get their own group (same ranks): on the main one the
                # next step's batch-signature check and loss mean would queue behind all of them.
                gather_group = dist.new_group(list(range(self.dist.world)), backend=dist.get_backend(self.dist.group))
            self._flat = FlatParameters(canonical, sig.buckets, rank=self.dist.rank, world=self.dist.world,
                                        zero=self.config.zero, group=self.dist.group, gather_group=gather_group)
            tensors = self._flat.optimizer_tensors()
        else:
            tensors = [p for p in self._unique if p.requires_grad]
        self.optimizer, self.lr_scheduler = build_optimizer(tensors, _optimizer_spec(self.config))

    def _bind(self, spec: IOSpec) -> torch.Tensor:
        if spec.kind == "param":
            return self._params[spec.target]
        if spec.kind == "buffer":
            return self._buffers[spec.target]
        if spec.kind == "param_shard" and self._flat is not None:
            return self._flat.shards[int(spec.target)]
        if spec.kind == "grad_buffer" and self._flat is not None:
            return self._flat.grad_buffer(int(spec.target))
        if spec.kind == "loss_scale" and self.scaler is not None:
            return _ScaleRef(self.scaler)
        raise FxspeedError(f"the program has an input {spec} the engine cannot bind")

    def graph(self) -> "torch.fx.GraphModule":
        """The annotated training GraphModule of the first compiled batch signature (each node
        carries its NodeInfo under node.meta["fxspeed"]). For inspection; do not mutate."""
        for (train, _), ex in self._executors.items():
            if train:
                return ex.program.gm
        raise ValueError("no training step compiled yet; call fxspeed.compile(..., example_inputs=...) or "
                         "engine.train_step(batch) first")

    # --- steps -------------------------------------------------------------------------------
    def train_step(self, *args: Any, **kwargs: Any) -> float:
        """Forward, backward and optimizer step on one batch; returns the loss as a float.

        On several ranks each passes its own local batch (as with DDP) and the returned loss is
        the mean over ranks, i.e. the loss of the global batch. With Config.grad_accum=k the
        batch is split into k equal micro-batches along dim 0 and their gradients averaged,
        which equals one step on the whole batch for a mean loss.
        """
        k = self.config.grad_accum
        micro = [(args, kwargs)] if k == 1 else _split_batch(args, kwargs, k)
        total: torch.Tensor | None = None
        grads: dict[str, torch.Tensor] = {}
        buckets: dict[int, torch.Tensor] = {}
        defer = False
        for a, kw in micro:
            ex = self._executor(a, kw, train=True)
            defer = ex.program.signature.waits_for_parameters
            if not defer:
                self.synchronize()
            out = ex.run(tensor_leaves(a, kw))
            total = out.loss if total is None else total + out.loss
            _accumulate(grads, out.grads)
            # Reduced buckets may be persistent buffers the next micro-batch overwrites: copy them.
            _accumulate(buckets, out.grad_buckets if k == 1 else {n: t.clone() for n, t in out.grad_buckets.items()})
        del out  # the accumulated dicts now hold the only references
        self.synchronize()  # a no-op when the program waited; the optimizer must not race a gather
        if k > 1:
            total = total / k
            grads = {n: t / k for n, t in grads.items()}
            buckets = {n: t / k for n, t in buckets.items()}
        for name, g in grads.items():
            # A tied weight the graph still feeds under several names gets one gradient per name.
            p = self._params[name]
            p.grad = g if p.grad is None else p.grad + g
        if self._flat is not None:
            self._flat.set_grads(buckets)
        del grads, buckets  # free before the optimizer allocates its temporaries
        stepped = self._opt_tensors()
        if not unscale_or_skip(self.scaler, stepped, self.stats):
            if self.config.grad_clip is not None:
                self._clip(stepped)
            self.optimizer.step()
            self.lr_scheduler.step()
            if self._flat is not None:
                # Deferred: the gathers overlap the next forward, which waits for each bucket
                # just before its first use (passes/wait_parameter_gathers).
                self._flat.after_step(defer=defer)
        for t in stepped:
            t.grad = None  # free gradients now rather than holding them through the next forward
        self.stats["steps"] += 1
        if self.dist.active:
            total = total.detach().clone()
            dist.all_reduce(total, group=self.dist.group)
            total /= self.dist.world
        return float(total)

    def synchronize(self) -> None:
        """Finish the parameter all-gathers a ZeRO-1/2 step left in flight; afterwards the model's
        Parameters hold the updated weights. state_dict(), save(), load() and eval_step() call it;
        call it yourself before reading the model's Parameters directly between steps."""
        if self._flat is not None:
            self._flat.wait_gathers()

    def _opt_tensors(self) -> list[torch.Tensor]:
        return [t for g in self.optimizer.param_groups for t in g["params"] if t.grad is not None]

    def _clip(self, tensors: list[torch.Tensor]) -> None:
        grads = [t.grad for t in tensors]
        norm = torch.nn.utils.get_total_norm(grads, foreach=True)
        if self._flat is not None and self.config.zero >= 1:
            # Each rank holds a disjoint shard of every gradient: the global norm needs all of them.
            sq = norm.double() ** 2
            dist.all_reduce(sq, group=self.dist.group)
            norm = sq.sqrt().to(norm.dtype)
        torch.nn.utils.clip_grads_with_norm_(tensors, self.config.grad_clip, norm, foreach=True)

    @torch.no_grad()
    def eval_step(self, *args: Any, **kwargs: Any) -> Any:
        """Forward only, model in eval mode, no gradients. Returns the loss as a float when the
        output has one (or loss_fn is set), else the model's outputs as tensors. Under ZeRO-3
        the parameters are gathered for the call (a collective: call it on every rank)."""
        ex = self._executor(args, kwargs, train=False)
        self.synchronize()
        with self._flat.gathered() if self._flat is not None else contextlib.nullcontext():
            out = ex.run(tensor_leaves(args, kwargs))
        if out.loss is not None:
            return float(out.loss)
        spec = ex.program.out_spec
        return pytree.tree_unflatten(out.outputs, spec) if spec is not None else out.outputs

    # --- state -------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, torch.Tensor]:
        """The model's state in its original names and shapes (tied weights under every name),
        loadable into the plain model with `load_state_dict(strict=True)`. Under ZeRO-3 the full
        tensors are gathered into new tensors: call it on every rank. Under ZeRO 0-2, as with
        nn.Module.state_dict(), the tensors alias the live weights: clone them to keep a snapshot."""
        self.synchronize()
        if self._flat is None or self.config.zero < 3:
            return self.model.state_dict()
        full = self._flat.full_state()
        by_id = {id(self._params[n]): t for n, t in full.items()}
        state = self.model.state_dict(keep_vars=True)
        return {n: by_id.get(id(v), v.detach()) for n, v in state.items()}

    def optimizer_state_dict(self) -> dict[str, Any]:
        return {"optimizer": self.optimizer.state_dict(), "lr_scheduler": self.lr_scheduler.state_dict()}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self.synchronize()  # an in-flight gather would overwrite what is loaded
        if self._flat is not None and self.config.zero >= 3:
            with self._flat.gathered():
                self.model.load_state_dict(state)
                self._flat.capture_from_parameters()
        else:
            self.model.load_state_dict(state)

    def save(self, directory: str | os.PathLike) -> None:
        """Write this rank's parameters (its shards under ZeRO), buffers, optimizer and RNG
        state to `directory/rank{r}.pt`. Resuming with load() continues bit-exactly on CPU."""
        os.makedirs(directory, exist_ok=True)
        self.synchronize()
        state = {
            "world_size": self.dist.world, "zero": self.config.zero, "stats": dict(self.stats),
            "layout": _layout(self._flat.buckets) if self._flat else None,
            "shards": self._flat.shard_state() if self._flat else None,
            # ZeRO-0 ranks hold (and step) the full buckets; the shard views cover only 1/N of them.
            "full": [f.detach().clone() for f in self._flat.full] if self._flat and self.config.zero == 0 else None,
            "params": {n: p.detach().clone() for n, p in self.model.named_parameters()
                       if self._flat is None or not self._flat.owns(n)},
            "buffers": {n: b.detach().clone() for n, b in self.model.named_buffers()},
            "optimizer": self.optimizer.state_dict() if self.optimizer else None,
            "lr_scheduler": self.lr_scheduler.state_dict() if self.lr_scheduler else None,
            "rng": torch.get_rng_state(),
            "loss_scaler": self.scaler.state_dict() if getattr(self, "scaler", None) is not None else None,
        }
        torch.save(state, os.path.join(directory, f"rank{self.dist.rank}.pt"))

    def load(self, directory: str | os.PathLike) -> None:
        """Restore what save() wrote; the world size and ZeRO stage must match."""
        path = os.path.join(directory, f"rank{self.dist.rank}.pt")
        if not os.path.exists(path):
            raise FileNotFoundError(f"{path} not found: was the checkpoint saved with {self.dist.world} ranks?")
        state = torch.load(path, weights_only=False)
        if (state["world_size"], state["zero"]) != (self.dist.world, self.config.zero):
            raise ConfigError(f"checkpoint {directory} was saved with world_size={state['world_size']} "
                              f"zero={state['zero']}, this engine has world_size={self.dist.world} "
                              f"zero={self.config.zero}; resharding is not supported yet")
        self.synchronize()
        if self.optimizer is None:
            raise FxspeedError("load() needs a compiled engine: call fxspeed.compile(..., example_inputs=...) first")
        if state["layout"] != (_layout(self._flat.buckets) if self._flat else None):
            raise ConfigError(f"checkpoint {directory} has another parameter layout (different model or bucket_mb)")
        with torch.no_grad():
            params = dict(self.model.named_parameters())
            for n, t in state["params"].items():
                params[n].copy_(t)
            buffers = dict(self.model.named_buffers())
            for n, t in state["buffers"].items():
                buffers[n].copy_(t)
        if self._flat is not None and self.config.zero == 0:
            with torch.no_grad():
                for mine, saved in zip(self._flat.full, state["full"]):
                    mine.copy_(saved)  # the Parameters and the shard views point into these
        elif self._flat is not None:
            self._flat.load_shards(state["shards"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.lr_scheduler.load_state_dict(state["lr_scheduler"])
        self.stats.update(state["stats"])
        if getattr(self, "scaler", None) is not None and state.get("loss_scaler") is not None:
            self.scaler.load_state_dict(state["loss_scaler"])  # fp16: resume with the same loss scale
        torch.set_rng_state(state["rng"])


class _ScaleRef:
    """Placeholder bound once; the executor asks for the current scale each run."""

    def __init__(self, scaler: DynamicLossScaler):
        self.scaler = scaler

    def current(self) -> torch.Tensor:
        return self.scaler.scale


def unscale_or_skip(scaler: DynamicLossScaler | None, stepped: list[torch.Tensor], stats: dict) -> bool:
    """fp16: unscale the gradients of `stepped` in place and agree on overflow with every rank;
    True means skip this step (parameters, optimizer states and the lr schedule stay as they
    were). Counts skipped steps and the scale in `stats`, and says so in the log."""
    if scaler is None:
        return False
    overflow = scaler.unscale_and_check([t.grad for t in stepped if t.grad is not None])
    scaler.update(overflow)
    stats["loss_scale"] = float(scaler.scale)
    if overflow:
        stats["skipped_steps"] += 1
        log.warning("fxspeed: step %d overflowed in fp16; skipped (loss scale now %g, %d skipped so far)",
                    stats["steps"], float(scaler.scale), stats["skipped_steps"])
    return overflow


def _accumulate(into: dict, new: dict) -> None:
    for k, t in new.items():
        into[k] = t if k not in into else into[k] + t


def _layout(buckets: list[Bucket]) -> list[tuple]:
    return [(b.names, [tuple(s) for s in b.shapes], b.padded) for b in buckets]


def _optimizer_spec(c: Config) -> OptimizerSpec:
    return OptimizerSpec(name=c.optimizer, lr=c.lr, betas=tuple(c.betas), eps=c.eps, weight_decay=c.weight_decay,
                         momentum=c.momentum, lr_schedule=c.lr_schedule, warmup_steps=c.warmup_steps,
                         total_steps=c.total_steps)


def _split_batch(args: tuple, kwargs: dict, k: int) -> list[tuple[tuple, dict]]:
    leaves, spec = pytree.tree_flatten((args, kwargs))
    for x in leaves:
        if isinstance(x, torch.Tensor) and (x.dim() == 0 or x.shape[0] % k):
            raise ConfigError(f"Config.grad_accum={k} must divide the batch dimension; got a tensor of shape "
                              f"{tuple(x.shape)}. Use a batch size divisible by {k} or change grad_accum")
    chunks = [x.chunk(k) if isinstance(x, torch.Tensor) else [x] * k for x in leaves]
    return [pytree.tree_unflatten([c[i] for c in chunks], spec) for i in range(k)]
