"""Run under torch.distributed.run: train every case of a JSON list of random data-parallel
cases (see tests/test_data_parallel_properties.py, which draws them with hypothesis) for a few
steps on this rank's slice of the global batch, and write per rank and case what the test
checks: the losses, engine.state_dict(), and this rank's raw flat shards with the bucket layout.

The case format, the model and the batches live here so the worker and the test's eager
reference build exactly the same things:

    {"depth": 1-4, "width": 3-33, "activation": "relu"|"gelu"|"tanh", "residual": bool,
     "layernorm": bool, "tied": bool, "no_grad": "none"|"unused"|"frozen"|"detached",
     "zero": 0-3, "bucket_mb": float, "optimizer": "adamw"|"sgd", "weight_decay": float,
     "grad_clip": float|null, "rows_per_rank": int, "seed": int, "grad_accum": 1|2, "no_decay": bool}

(rows_per_rank rows per grad_accum slice; no_decay: Config.no_weight_decay=("1d",), where a
1-D parameter trains)
"""

from __future__ import annotations

import argparse
import json
import os
import traceback
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

STEPS = 3
LR = 1e-2
MOMENTUM = 0.9  # SGD only
ACTIVATIONS = {"relu": F.relu, "gelu": F.gelu, "tanh": torch.tanh}


class CaseModel(nn.Module):
    """depth x Linear(width, width) + activation, optional pre-LayerNorm and residuals; the
    loss is the mean squared error to a target. Optional: the last layer's weight tied to the
    first (depth >= 2), and one parameter that gets no gradient:

        unused    a Parameter that forward never reads
        frozen    the first layer's bias with requires_grad=False
        detached  a per-feature scale that forward reads only through .detach()
    """

    def __init__(self, c: dict[str, Any]):
        super().__init__()
        w = c["width"]
        self.act = ACTIVATIONS[c["activation"]]
        self.residual = c["residual"]
        self.layers = nn.ModuleList(nn.Linear(w, w) for _ in range(c["depth"]))
        self.norms = nn.ModuleList(nn.LayerNorm(w) for _ in range(c["depth"])) if c["layernorm"] else None
        if c["tied"] and c["depth"] >= 2:
            self.layers[-1].weight = self.layers[0].weight
        self.no_grad = c["no_grad"]
        if self.no_grad == "unused":
            self.unused = nn.Parameter(torch.randn(w))
        elif self.no_grad == "frozen":
            self.layers[0].bias.requires_grad_(False)
        elif self.no_grad == "detached":
            self.scale = nn.Parameter(1.0 + 0.1 * torch.randn(w))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        for i, layer in enumerate(self.layers):
            h = self.act(layer(self.norms[i](x) if self.norms is not None else x))
            x = x + h if self.residual else h
        if self.no_grad == "detached":
            x = x * self.scale.detach()
        return F.mse_loss(x, y)


def build(c: dict[str, Any]) -> CaseModel:
    torch.manual_seed(c["seed"])
    return CaseModel(c)


def global_batches(c: dict[str, Any], world: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """STEPS global batches of rows_per_rank * world * grad_accum rows (so every world size and
    slice count splits evenly)."""
    g = torch.Generator().manual_seed(c["seed"] + 1)
    rows = c["rows_per_rank"] * world * c.get("grad_accum", 1)
    return [(torch.randn(rows, c["width"], generator=g), torch.randn(rows, c["width"], generator=g))
            for _ in range(STEPS)]


def config_kwargs(c: dict[str, Any]) -> dict[str, Any]:
    """The fxspeed.Config fields of a case (the eager reference uses the same numbers)."""
    return {"zero": c["zero"], "bucket_mb": c["bucket_mb"], "optimizer": c["optimizer"], "lr": LR,
            "momentum": MOMENTUM if c["optimizer"] == "sgd" else 0.0, "weight_decay": c["weight_decay"],
            "grad_clip": c["grad_clip"], "grad_accum": c.get("grad_accum", 1), "no_weight_decay": exempt(c)}


def exempt(c: dict[str, Any]) -> tuple[str, ...]:
    """Config.no_weight_decay of a case: ("1d",) when asked for and something it names trains."""
    if not (c.get("no_decay") and c["weight_decay"]):
        return ()
    return ("1d",) if any(p.dim() < 2 and p.requires_grad for p in build(c).parameters()) else ()


def run_case(c: dict[str, Any], world: int) -> dict[str, Any]:
    import fxspeed
    from fxspeed.data import local_batch

    model = build(c)
    batches = global_batches(c, world)
    cfg = fxspeed.Config(**config_kwargs(c), dist_timeout_s=60.0)
    engine = fxspeed.compile(model, world, cfg, example_inputs=local_batch(batches[0]))
    losses = [engine.train_step(*local_batch(b)) for b in batches]
    state = {k: v.detach().clone() for k, v in engine.state_dict().items()}  # collective under ZeRO-3
    flat = engine._flat
    out: dict[str, Any] = {"losses": losses, "state": state, "buckets": None, "shards": None, "full": None}
    if flat is not None:
        out["buckets"] = [b.to_dict() for b in flat.buckets]
        out["shards"] = [s.detach().clone() for s in flat.shards]
        out["full"] = [None if f is None else f.detach().clone() for f in flat.full]
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", required=True, help="JSON file: a list of cases")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    os.environ.setdefault("FXSPEED_BACKEND", "gloo")
    torch.set_num_threads(1)
    with open(a.cases) as f:
        cases = json.load(f)
    dist.init_process_group("gloo")  # fxspeed.compile joins this group
    world, rank = dist.get_world_size(), dist.get_rank()
    for i, c in enumerate(cases):
        try:
            result = run_case(c, world)
        except Exception:  # noqa: BLE001 - recorded for the test to report, with the case
            result = {"error": traceback.format_exc()}
        torch.save(result, os.path.join(a.out, f"case{i}_rank{rank}.pt"))
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
