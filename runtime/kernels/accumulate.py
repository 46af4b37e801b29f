"""In-place gradient accumulation ops that passes/program/accumulate_gradients puts in graphs."""

from __future__ import annotations

import torch


def accumulate_rows_(buf: torch.Tensor, beta: float, indices: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """buf = beta * buf + the embedding gradient of (indices, grad), written in place: what
    `embedding_dense_backward` (no padding index, no frequency scaling) adds, as a row
    scatter-add. beta is 0 or 1 (passes/program/accumulate_gradients.py); 0 discards stale contents."""
    if beta == 0:
        buf.zero_()
    return buf.index_add_(0, indices.reshape(-1), grad.reshape(-1, buf.shape[-1]))
