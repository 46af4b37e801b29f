"""Property: for random small models and random batches — inputs aliasing each other, views
of one another, non-contiguous slices, transposed and channels_last layouts, and parameters
that are themselves transposed or channels_last — N fxspeed train_steps equal N eager steps with
the same fused AdamW (losses and parameters). The batch the engine was compiled with has one
layout and aliasing pattern; the batches it trains on draw others."""

from __future__ import annotations

import copy

import torch
import torch.nn as nn
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import fxspeed

LAYOUTS = ("contiguous", "sliced", "strided", "transposed")


class Mlp(nn.Module):
    def __init__(self, d: int, depth: int, transposed: bool) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(d, d) for _ in range(depth))
        # A Parameter that is a transposed view: its gradient must come back in its own layout.
        self.w = nn.Parameter(torch.randn(d, d).t() * 0.3) if transposed else None

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        h = a
        for layer in self.layers:
            h = torch.tanh(layer(h))
        if self.w is not None:
            h = h @ self.w
        return ((h - b) ** 2).mean()


class Conv(nn.Module):
    def __init__(self, channels_last_weight: bool) -> None:
        super().__init__()
        self.c = nn.Conv2d(3, 4, 3)
        if channels_last_weight:
            self.c.weight.data = self.c.weight.data.contiguous(memory_format=torch.channels_last)
        self.head = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return ((self.head(torch.relu(self.c(x)).mean((2, 3))) - y) ** 2).mean()


def _laid_out(t: torch.Tensor, layout: str) -> torch.Tensor:
    """`t`'s values in another memory layout (same shape, same values)."""
    if layout == "sliced":  # a slice of a wider tensor: rows not contiguous with each other
        wide = torch.randn(*t.shape[:-1], t.shape[-1] + 3)
        wide[..., 1:1 + t.shape[-1]] = t
        return wide[..., 1:1 + t.shape[-1]]
    if layout == "strided":  # every other row of a taller tensor
        tall = torch.randn(2 * t.shape[0], *t.shape[1:])
        tall[::2] = t
        return tall[::2]
    if layout == "transposed" and t.dim() == 2:
        return t.t().contiguous().t()
    if layout == "transposed" and t.dim() == 4:
        return t.contiguous(memory_format=torch.channels_last)
    return t


@st.composite
def batches(draw: st.DrawFn, kind: str, n: int, d: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    if kind == "mlp":
        alias = draw(st.sampled_from(("none", "same", "shift")))
        if alias == "shift":  # overlapping windows of one tensor, as an LM's inputs and labels are
            base = torch.randn(n, d + 1, generator=g)
            return base[:, :-1], base[:, 1:]
        a = _laid_out(torch.randn(n, d, generator=g), draw(st.sampled_from(LAYOUTS)))
        if alias == "same":
            return a, a  # one tensor passed twice
        return a, _laid_out(torch.randn(n, d, generator=g), draw(st.sampled_from(LAYOUTS)))
    x = _laid_out(torch.randn(n, 3, 6, 6, generator=g), draw(st.sampled_from(LAYOUTS)))
    if draw(st.booleans()):
        return x, x[:, 0, 0, :2]  # the target is a non-contiguous view into the image batch
    return x, _laid_out(torch.randn(n, 2, generator=g), draw(st.sampled_from(LAYOUTS)))


@st.composite
def cases(draw: st.DrawFn) -> tuple[nn.Module, list[tuple[torch.Tensor, torch.Tensor]]]:
    kind = draw(st.sampled_from(("mlp", "conv")))
    n = draw(st.sampled_from((2, 4)))
    d = draw(st.sampled_from((4, 6)))
    torch.manual_seed(draw(st.integers(0, 100)))
    if kind == "mlp":
        model: nn.Module = Mlp(d, draw(st.integers(1, 2)), draw(st.booleans()))
    else:
        model = Conv(draw(st.booleans()))
    steps = [draw(batches(kind, n, d)) for _ in range(draw(st.integers(2, 3)))]
    return model, [draw(batches(kind, n, d))] + steps  # the first batch is the compile example


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(cases())
def test_train_steps_on_any_layout_and_aliasing_equal_eager_fused_adamw(case: tuple) -> None:
    model, (example, *steps) = case
    ref = copy.deepcopy(model)
    engine = fxspeed.compile(model, 1, fxspeed.Config(lr=1e-2), example_inputs=example)
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.0, fused=True)
    for i, batch in enumerate(steps):
        loss = engine.train_step(*batch)
        opt.zero_grad()
        ref_loss = ref(*batch)
        ref_loss.backward()
        opt.step()
        assert abs(loss - float(ref_loss.detach())) <= 1e-5 * max(1.0, abs(float(ref_loss.detach()))), f"step {i}"
    state = engine.state_dict()
    for name, p in ref.state_dict().items():
        torch.testing.assert_close(state[name], p, rtol=1e-5, atol=1e-6, msg=name)
