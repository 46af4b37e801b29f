"""Engine: what `fxspeed.compile` returns. Owns the model's tensors, the optimizer and a cache
of compiled programs keyed by batch signature (a new shape compiles once, then is reused).
"""

from __future__ import annotations

import logging
from typing import Any, Sequence

import torch
import torch.nn as nn
import torch.utils._pytree as pytree

from fxspeed.runtime import OptimizerSpec, Program, StepExecutor, build_optimizer

from .capture import LossFn, input_key, tensor_leaves
from .compiler import compile_step
from .config import Config
from .devices import DeviceSpec
from .errors import ConfigError
from .plan import Plan
from .planner import build_plan

log = logging.getLogger("fxspeed")
RETRACE_WARN_AFTER = 8


class Engine:
    """Trains `model` in place: its parameters are the ones the optimizer updates."""

    def __init__(self, model: nn.Module, devices: Sequence[DeviceSpec], config: Config, loss_fn: LossFn | None):
        self.model = model
        self.devices = list(devices)
        self.config = config
        self.loss_fn = loss_fn
        # Every name of every tensor: a tied weight is one Parameter reachable under two names,
        # and the trace may refer to it by either.
        self._params = dict(model.named_parameters(remove_duplicate=False))
        self._buffers = dict(model.named_buffers(remove_duplicate=False))
        self._unique = list(model.parameters())
        self.optimizer, self.lr_scheduler = build_optimizer(
            [p for p in self._unique if p.requires_grad], _optimizer_spec(config))
        self._executors: dict[tuple, StepExecutor] = {}
        self.plan: Plan | None = None
        self.stats = {"steps": 0, "compiles": 0, "skipped_steps": 0}

    # --- compile -----------------------------------------------------------------------------
    def _executor(self, args: tuple, kwargs: dict, train: bool) -> StepExecutor:
        key = (train, input_key(args, kwargs))
        ex = self._executors.get(key)
        if ex is None:
            compiled = compile_step(self.model, args, kwargs, config=self.config, loss_fn=self.loss_fn, train=train)
            cap = compiled.captured
            program = Program(cap.gm, cap.signature, train=train, out_spec=cap.out_spec)
            ex = StepExecutor(program, self._params, self._buffers)
            self._executors[key] = ex
            self.stats["compiles"] += 1
            if self.stats["compiles"] == RETRACE_WARN_AFTER:
                log.warning("fxspeed: %d batch signatures compiled so far; pad batches to a few fixed shapes "
                            "to avoid recompiling", RETRACE_WARN_AFTER)
            if train and (self.plan is None or self.plan.n_params == 0):
                self.plan = build_plan(cap.gm, cap.signature, model_name=type(self.model).__name__,
                                       config=self.config, devices=self.devices,
                                       passes=[r.to_dict() for r in compiled.records])
        return ex

    # --- steps -------------------------------------------------------------------------------
    def train_step(self, *args: Any, **kwargs: Any) -> float:
        """Forward, backward and optimizer step on one batch; returns the loss as a float.

        With Config.grad_accum=k the batch is split into k equal micro-batches along dim 0 and
        their gradients averaged, which equals one step on the whole batch for a mean loss.
        """
        k = self.config.grad_accum
        micro = [(args, kwargs)] if k == 1 else _split_batch(args, kwargs, k)
        total = None
        grads: dict[str, torch.Tensor] = {}
        for a, kw in micro:
            ex = self._executor(a, kw, train=True)
            loss, g, _ = ex.run(tensor_leaves(a, kw))
            total = loss if total is None else total + loss
            for name, t in g.items():
                grads[name] = t if name not in grads else grads[name] + t
        if k > 1:
            total = total / k
            grads = {n: t / k for n, t in grads.items()}
        for name, g in grads.items():
            # A tied weight enters the graph once per name and gets one gradient per name.
            p = self._params[name]
            p.grad = g if p.grad is None else p.grad + g
        if self.config.grad_clip is not None:
            torch.nn.utils.clip_grad_norm_([p for p in self._unique if p.grad is not None],
                                           self.config.grad_clip, foreach=True)
        self.optimizer.step()
        self.lr_scheduler.step()
        for p in self._unique:
            p.grad = None  # free gradients now rather than holding them through the next forward
        self.stats["steps"] += 1
        return float(total)

    @torch.no_grad()
    def eval_step(self, *args: Any, **kwargs: Any) -> Any:
        """Forward only, model in eval mode, no gradients. Returns the loss as a float when the
        output has one (or loss_fn is set), else the model's outputs as tensors."""
        ex = self._executor(args, kwargs, train=False)
        loss, _, outs = ex.run(tensor_leaves(args, kwargs))
        if loss is not None:
            return float(loss)
        spec = ex.program.out_spec
        return pytree.tree_unflatten(outs, spec) if spec is not None else outs

    # --- state -------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, torch.Tensor]:
        """The model's state in its original names and shapes (tied weights under every name)."""
        return self.model.state_dict()

    def optimizer_state_dict(self) -> dict[str, Any]:
        return {"optimizer": self.optimizer.state_dict(), "lr_scheduler": self.lr_scheduler.state_dict()}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self.model.load_state_dict(state)


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
