"""Optimizers: torch.optim itself, over whatever tensors this rank owns.

Using torch.optim means fxspeed's AdamW/Adam/SGD are torch.optim's own update rules; sharded
ranks run the same optimizer over their flat shards (as ZeRO does). fxspeed asks for torch's
fused kernels (one pass over each tensor; on CPU since torch 2.4, on CUDA) and falls back to the
default implementation where they are not supported (another device, a non-float tensor).
With Config.offload="optimizer" the Adam moments live in files (runtime/offloaded_optimizer.py),
stepped by the same fused kernel.
why: docs/decisions/fused-optimizers.md
"""

from __future__ import annotations

import dataclasses
import fnmatch
import math
from dataclasses import dataclass
from typing import Iterable, Sequence

import torch

from fxspeed.runtime.offloaded_optimizer import OffloadedAdam


@dataclass(frozen=True)
class OptimizerSpec:
    name: str = "adamw"
    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0
    momentum: float = 0.0
    lr_schedule: str = "constant"
    warmup_steps: int = 0
    total_steps: int | None = None
    # Config.offload="optimizer" with states in files: the directory (Config.nvme_path) and this
    # rank's name for its swap directory; None keeps the states in memory.
    swap_root: str | None = None
    swap_name: str = "rank0"
    chunk_bytes: int = 64 * 2**20
    offload_bytes: int | None = None  # None: every state to the file; else at least this many bytes
    masters: bool = False  # the tensors are working copies; their fp32 masters go to the file too
    # positions in the tensor list where a new chunk of the file begins (the first tensor of each
    # gradient bucket, when the program steps buckets inside backward: no chunk spans two)
    chunk_starts: tuple[int, ...] = ()


@dataclass(frozen=True)
class WeightDecay:
    """Weight decay on some elements of the optimizer's tensors only (Config.no_weight_decay).

    torch.optim decays a whole param group; ZeRO's flat shards hold decayed weights and
    undecayed biases/norms side by side, so the optimizer runs with weight_decay=0 and this
    applies the decay to the decayed runs just before each step, as torch.optim would inside it:

        AdamW (decoupled):  p[run] *= 1 - lr * rate          (torch: param.mul_(1 - lr * wd))
        Adam / SGD (L2):    g[run] += rate * p[run]          (torch: grad = grad.add(param, alpha=wd))

    `runs`: id(tensor) -> the [start, end) runs of its elements (flat order) that decay; a
    tensor not in it does not decay."""

    rate: float
    decoupled: bool
    runs: dict[int, tuple[tuple[int, int], ...]]

    @torch.no_grad()  # torch.optim runs step pre-hooks outside its own no_grad
    def apply(self, items: Sequence[tuple[torch.Tensor, torch.Tensor, torch.Tensor, int, int]], lr: float) -> None:
        """`items`: (tensor, weights, gradients, start, count): the elements start .. start + count
        of `tensor`, as `weights` and `gradients` views (the tensor and its .grad themselves, or a
        flat run of them, or the offloaded optimizer's staged copies)."""
        ws: list[torch.Tensor] = []
        gs: list[torch.Tensor] = []
        for t, w, g, start, count in items:
            for a, b in self.runs.get(id(t), ()):
                a, b = max(a, start) - start, min(b, start + count) - start
                if a >= b:
                    continue
                if a == 0 and b == count:
                    ws.append(w)
                    gs.append(g)
                else:  # part of a flat (1-D) shard or run
                    ws.append(w.view(-1)[a:b])
                    gs.append(g.view(-1)[a:b])
        if not ws:
            return
        if self.decoupled:
            torch._foreach_mul_(ws, 1.0 - lr * self.rate)
        else:
            torch._foreach_add_(gs, ws, alpha=self.rate)

    def hook(self, optimizer: torch.optim.Optimizer, args: object, kwargs: object) -> None:
        """A torch.optim step pre-hook: decay the tensors that will step (those with a gradient)."""
        for g in optimizer.param_groups:
            self.apply([(t, t, t.grad, 0, t.numel()) for t in g["params"] if t.grad is not None], g["lr"])


def undecayed_parameters(model: torch.nn.Module, params: dict[str, torch.Tensor], patterns: Sequence[str]) -> set[int]:
    """ids of the Parameters Config.no_weight_decay exempts: a name containing an entry (or
    matching it as a glob), or any Parameter of fewer than two dimensions for "1d". A tied
    Parameter is exempt when any of its names is. An entry that matches nothing is an error
    (a typo would otherwise decay what the user meant to exempt)."""
    from fxspeed.errors import ConfigError

    def matches(pattern: str, name: str) -> bool:
        return fnmatch.fnmatchcase(name, pattern) if any(c in pattern for c in "*?[") else pattern in name

    out: set[int] = set()
    for pattern in patterns:
        hit = {id(p) for name, p in params.items()
               if (p.dim() < 2 if pattern == "1d" else matches(pattern, name)) and p.requires_grad}
        if not hit:
            names = [n for n, p in params.items() if p.requires_grad]
            raise ConfigError(f"Config.no_weight_decay entry {pattern!r} matches no trainable parameter of "
                              f"{type(model).__name__} (names look like {', '.join(map(repr, names[:4]))}); entries "
                              "are name substrings ('bias'), globs ('*norm*.weight') or '1d'")
        out |= hit
    return out


def build_optimizer(params: Iterable[torch.Tensor], spec: OptimizerSpec, decay: WeightDecay | None = None
                    ) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
    """The optimizer over `params` and its lr schedule. With `decay`, the optimizer itself decays
    nothing and `decay` decays what it names before each step (Config.no_weight_decay)."""
    params = list(params)
    if decay is not None:
        spec = dataclasses.replace(spec, weight_decay=0.0)
    if spec.swap_root is not None:
        if spec.name not in ("adamw", "adam"):
            raise ValueError(f"optimizer offload steps Adam/AdamW only, not {spec.name!r}")
        opt: torch.optim.Optimizer = OffloadedAdam(params, lr=spec.lr, betas=spec.betas, eps=spec.eps,
                                                   weight_decay=spec.weight_decay, decoupled=spec.name == "adamw",
                                                   swap_root=spec.swap_root, name=spec.swap_name,
                                                   chunk_bytes=spec.chunk_bytes, offload_bytes=spec.offload_bytes,
                                                   masters=spec.masters, chunk_starts=spec.chunk_starts, decay=decay)
    elif spec.name in ("adamw", "adam"):
        cls = torch.optim.AdamW if spec.name == "adamw" else torch.optim.Adam
        opt = _fused(cls, params, lr=spec.lr, betas=spec.betas, eps=spec.eps, weight_decay=spec.weight_decay)
    elif spec.name == "sgd":
        opt = _fused(torch.optim.SGD, params, lr=spec.lr, momentum=spec.momentum, weight_decay=spec.weight_decay)
    else:
        raise ValueError(f"unknown optimizer {spec.name!r}; accepted: 'adamw', 'adam', 'sgd'")
    if decay is not None and not isinstance(opt, OffloadedAdam):  # OffloadedAdam applies it chunk by chunk
        opt.register_step_pre_hook(decay.hook)
    return opt, torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(spec))


def _fused(cls: type[torch.optim.Optimizer], params: list[torch.Tensor], **kw: object) -> torch.optim.Optimizer:
    """`cls` with torch's fused kernel where every tensor supports it, else its default implementation."""
    if not params:  # a pipeline stage whose weights are all frozen: one empty group (torch refuses no group)
        return cls([{"params": []}], **kw)
    if any(p.is_complex() for p in params):  # accepted at construction, refused at the first step
        return cls(params, **kw)
    if not all(_fused_steps_right(cls, p.dtype, p.device, kw) for p in {(p.dtype, p.device): p for p in params}.values()):
        return cls(params, **kw)
    try:
        return cls(params, fused=True, **kw)
    except (RuntimeError, ValueError, TypeError):  # unsupported device / dtype, or no `fused` argument
        return cls(params, **kw)


_FUSED_CHECKED: dict[tuple, bool] = {}


def _fused_steps_right(cls: type[torch.optim.Optimizer], dtype: torch.dtype, device: torch.device,
                       kw: dict) -> bool:
    """Whether torch's fused kernel steps `dtype` tensors on `device` as the default implementation
    does: one step of each on a 67-element probe from zero, updates within 1% of each other.
    torch 2.13's fused CPU SGD leaves every bf16/fp16 element in whole 16-element vectors unchanged
    (pytorch/pytorch#191763), so a bf16 model trained with SGD never moved. An unsupported
    combination says True here and is refused by the constructor instead. Once per combination."""
    kw = {**kw, "lr": kw.get("lr") or 1e-3}  # (lr 0 moves nothing either way: the probe would pass any kernel)
    key = (cls, dtype, torch.device(device).type, repr(sorted(kw.items())))
    if key not in _FUSED_CHECKED:
        grad = torch.randn(67, generator=torch.Generator().manual_seed(0)).to(device=device, dtype=dtype)
        steps = []
        try:
            for fused in (True, None):
                p = torch.zeros(67, dtype=dtype, device=device, requires_grad=True)
                opt = cls([p], fused=fused, **kw)
                p.grad = grad.clone()
                opt.step()
                steps.append(p.detach().double())
        except (RuntimeError, ValueError, TypeError):
            _FUSED_CHECKED[key] = True
        else:
            fused_step, plain_step = steps
            _FUSED_CHECKED[key] = bool((fused_step - plain_step).abs().max() <= 1e-2 * plain_step.abs().max())
    return _FUSED_CHECKED[key]


def lr_lambda(spec: OptimizerSpec):  # noqa: ANN201 - returns a step -> factor function
    """Learning-rate factor per step: linear warmup, then constant / linear / cosine decay to 0."""
    warm, total, kind = spec.warmup_steps, spec.total_steps, spec.lr_schedule

    def factor(step: int) -> float:
        if kind == "manual":  # the user sets the lr; the engine never steps this schedule
            return 1.0
        if warm and step < warm:
            return (step + 1) / warm
        if kind == "constant" or total is None:
            return 1.0
        progress = min(1.0, (step - warm) / max(1, total - warm))
        return 1.0 - progress if kind == "linear" else 0.5 * (1.0 + math.cos(math.pi * progress))

    return factor
