"""Cross-entropy over a vocabulary projection, in chunks of rows, gradients included.

    fxspeed::linear_cross_entropy(h [N, C], wt [C, V], target [N], ignore_index, reduction, chunk_rows)
        -> (loss [], grad_h [N, C], grad_wt_t [V, C])

loss is `nll_loss(log_softmax(h @ wt), target, ignore_index, reduction)` (reduction 1: mean over
the rows whose target is not ignore_index, 2: sum); grad_h and grad_wt_t are its gradients for a
unit upstream gradient: d loss / d h, and (d loss / d wt)^T, i.e. what `dlogits @ wt^T` and
`dlogits^T @ h` give in the backward of the unfused graph. The caller multiplies them by the real
upstream gradient (a scalar), so the gradients are computed here, in forward, one chunk of rows at
a time: the [N, V] logits, log-probabilities and their gradient never exist, only a [chunk_rows, V]
block (the trick of Liger's fused linear cross-entropy; the code is ours).

Numerics: the matmuls run in the inputs' dtype (bf16 under mixed precision, as the unfused graph's
casts make them), the softmax in fp32, the weight gradient accumulates over chunks in fp32 and is
rounded once. `passes/memory/chunk_cross_entropy.py` puts this op into graphs.
"""

from __future__ import annotations

import torch
from torch.utils.flop_counter import register_flop_formula

Tensor = torch.Tensor


@torch.library.custom_op("fxspeed::linear_cross_entropy", mutates_args=())
def linear_cross_entropy(h: Tensor, wt: Tensor, target: Tensor, ignore_index: int, reduction: int,
                         chunk_rows: int) -> tuple[Tensor, Tensor, Tensor]:
    n = h.shape[0]
    valid = target != ignore_index
    count = valid.sum().to(torch.float32)
    scale = 1.0 / count if reduction == 1 else torch.ones((), dtype=torch.float32, device=h.device)
    loss = torch.zeros((), dtype=torch.float32, device=h.device)
    grad_h = torch.empty_like(h)
    grad_wt_t = torch.zeros(wt.shape[1], wt.shape[0], dtype=torch.float32, device=h.device)
    for start in range(0, n, max(1, chunk_rows)):
        stop = min(n, start + chunk_rows)
        hc = h[start:stop]
        logits = (hc @ wt).float()
        lse = torch.logsumexp(logits, dim=1)
        ok = valid[start:stop]
        tgt = torch.where(ok, target[start:stop], 0)
        picked = logits.gather(1, tgt[:, None]).squeeze(1)
        loss += torch.where(ok, lse - picked, 0.0).sum()
        probs = logits.sub_(lse[:, None]).exp_()  # softmax, in the logits' storage
        probs[torch.arange(stop - start, device=h.device), tgt] -= 1.0
        probs.mul_(torch.where(ok, scale, 0.0)[:, None])  # ignored rows: no gradient (even if all are)
        d = probs.to(h.dtype)
        grad_h[start:stop] = d @ wt.t()
        if d.dtype == torch.float32:
            grad_wt_t.addmm_(d.t(), hc)
        else:  # the product in the compute dtype (as the unfused backward's matmul), summed in fp32
            grad_wt_t.add_(d.t() @ hc)
    if reduction == 1:
        loss = loss / count
    return loss, grad_h, grad_wt_t.to(h.dtype)


@linear_cross_entropy.register_fake
def _(h: Tensor, wt: Tensor, target: Tensor, ignore_index: int, reduction: int,
      chunk_rows: int) -> tuple[Tensor, Tensor, Tensor]:
    return (h.new_empty((), dtype=torch.float32), torch.empty_like(h),
            h.new_empty((wt.shape[1], wt.shape[0])))


@register_flop_formula(torch.ops.fxspeed.linear_cross_entropy)
def _flops(h_shape, wt_shape, *args, **kwargs) -> int:  # noqa: ANN001, ANN002, ANN003 - torch's formula signature
    n, c = h_shape
    return 3 * 2 * n * c * wt_shape[1]  # the logits, and the two gradient products


def rows_per_chunk(vocab: int, chunk_bytes: int = 32 * 2**20) -> int:
    """Rows whose fp32 logits fill about `chunk_bytes`."""
    return max(16, chunk_bytes // max(1, 4 * vocab))
