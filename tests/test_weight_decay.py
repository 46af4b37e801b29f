"""Config.no_weight_decay: parameters weight decay leaves alone, as torch.optim's param groups
with weight_decay=0 do (runtime/optimizer.py WeightDecay). The optimizer runs with no decay and
the engine decays the other elements just before each step: whole Parameters, runs of a ZeRO
flat shard, or pieces of the offloaded optimizer's chunks."""

from __future__ import annotations

import copy
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn as nn
from hypothesis import given, settings
from hypothesis import strategies as st

import fxspeed
from fxspeed.config import ConfigWarning
from fxspeed.errors import ConfigError
from fxspeed.runtime.offloaded_optimizer import OffloadedAdam
from fxspeed.runtime.optimizer import WeightDecay


class NormedMLP(nn.Module):
    """Weights, biases and a LayerNorm: what the usual recipes exempt ("1d", "bias", "norm")."""

    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(16, 48)
        self.norm = nn.LayerNorm(48)
        self.down = nn.Linear(48, 16)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return ((self.down(torch.nn.functional.gelu(self.norm(self.up(x)))) - y) ** 2).mean()


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(8, 16, generator=g), torch.randn(8, 16, generator=g)


def _eager(model: nn.Module, optimizer: str, exempt: set[str], steps: int, **kw: float) -> nn.Module:
    """torch.optim with two param groups, the way a Hugging Face or DeepSpeed script builds them."""
    named = list(model.named_parameters())
    groups = [{"params": [p for n, p in named if n not in exempt], "weight_decay": 0.1},
              {"params": [p for n, p in named if n in exempt], "weight_decay": 0.0}]
    cls = {"adamw": torch.optim.AdamW, "adam": torch.optim.Adam, "sgd": torch.optim.SGD}[optimizer]
    opt = cls(groups, lr=0.05, **kw)
    x, y = _batch()
    for _ in range(steps):
        opt.zero_grad()
        model(x, y).backward()
        opt.step()
    return model


def _trained(model: nn.Module, config: fxspeed.Config, steps: int) -> fxspeed.Engine:
    engine = fxspeed.compile(model, 1, config, example_inputs=_batch())
    for _ in range(steps):
        engine.train_step(*_batch())
    return engine


def _worst(engine: fxspeed.Engine, ref: nn.Module) -> float:
    state = engine.state_dict()
    return max(float((state[n] - p).abs().max() / p.abs().max()) for n, p in ref.state_dict().items())


@pytest.mark.parametrize("optimizer, kw", [("adamw", {}), ("adam", {}), ("sgd", {"momentum": 0.9})])
def test_exempt_parameters_train_as_torch_param_groups_with_no_decay(optimizer: str, kw: dict) -> None:
    torch.manual_seed(0)
    model = NormedMLP()
    ref = copy.deepcopy(model)
    engine = _trained(model, fxspeed.Config(optimizer=optimizer, lr=0.05, weight_decay=0.1,
                                            no_weight_decay=("1d",), **kw), steps=4)
    _eager(ref, optimizer, {"up.bias", "norm.weight", "norm.bias", "down.bias"}, 4, **kw)
    assert _worst(engine, ref) < 1e-5
    # ... and the exemption changed something: decaying everything lands elsewhere
    torch.manual_seed(0)
    everything = _trained(NormedMLP(), fxspeed.Config(optimizer=optimizer, lr=0.05, weight_decay=0.1, **kw), steps=4)
    assert _worst(everything, ref) > 1e-4


def test_entries_are_name_substrings_or_globs() -> None:
    torch.manual_seed(0)
    model = NormedMLP()
    ref = copy.deepcopy(model)
    engine = _trained(model, fxspeed.Config(lr=0.05, weight_decay=0.1, no_weight_decay=("bias", "norm.*")), steps=3)
    _eager(ref, "adamw", {"up.bias", "norm.weight", "norm.bias", "down.bias"}, 3)
    assert _worst(engine, ref) < 1e-5


def test_with_the_optimizer_offloaded_exempt_parameters_train_as_torch_param_groups(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = NormedMLP()
    ref = copy.deepcopy(model)
    engine = _trained(model, fxspeed.Config(lr=0.05, weight_decay=0.1, no_weight_decay=("1d",), offload="optimizer",
                                            nvme_path=str(tmp_path)), steps=4)
    assert isinstance(engine.optimizer, OffloadedAdam)
    _eager(ref, "adamw", {"up.bias", "norm.weight", "norm.bias", "down.bias"}, 4)
    assert _worst(engine, ref) < 1e-5


@pytest.mark.parametrize("decoupled", [True, False])
def test_the_offloaded_optimizer_decays_the_runs_it_is_given_across_chunk_cuts(tmp_path: Path, decoupled: bool) -> None:
    """4096-byte chunks cut the 1200- and 1000-element tensors into runs over several chunks; the
    decay names whole tensors, and a run of the long vector (elements 100 .. 900, as a flat ZeRO
    shard's Parameter would be), so some chunk pieces decay partly."""
    torch.manual_seed(0)
    ours = [nn.Parameter(torch.randn(40, 30)), nn.Parameter(torch.randn(7)), nn.Parameter(torch.randn(1000))]
    ref = [nn.Parameter(p.detach().clone()) for p in ours]
    decay = WeightDecay(0.1, decoupled, {id(ours[0]): ((0, 1200),), id(ours[2]): ((100, 900),)})
    opt = OffloadedAdam(ours, lr=1e-2, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.0, decoupled=decoupled,
                        swap_root=tmp_path, name="t", chunk_bytes=4096, decay=decay)
    assert max(len(pieces) for pieces in opt._where.values()) >= 2
    moments: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    for step in range(3):
        g = torch.Generator().manual_seed(step)
        for a, b in zip(ours, ref):
            a.grad = torch.randn(a.shape, generator=g)
            b.grad = a.grad.clone()
        opt.step()
        with torch.no_grad():  # the reference: Adam by hand, decay on the same elements
            for i, p in enumerate(ref):
                mask = torch.zeros(p.numel(), dtype=torch.bool)
                for lo, hi in decay.runs.get(id(ours[i]), ()):
                    mask[lo:hi] = True
                mask = mask.view(p.shape)
                grad = p.grad if decoupled else torch.where(mask, p.grad + 0.1 * p, p.grad)
                if decoupled:
                    p.copy_(torch.where(mask, p * (1 - 1e-2 * 0.1), p))
                m, v = moments.get(i, (torch.zeros_like(p), torch.zeros_like(p)))
                m, v = 0.8 * m + 0.2 * grad, 0.95 * v + 0.05 * grad * grad
                moments[i] = (m, v)
                t = step + 1
                p -= 1e-2 * (m / (1 - 0.8 ** t)) / ((v / (1 - 0.95 ** t)).sqrt() + 1e-6)
    for a, b in zip(ours, ref):
        torch.testing.assert_close(a.detach(), b.detach(), rtol=1e-5, atol=1e-6)


def test_an_entry_that_matches_nothing_an_empty_entry_and_an_ineffective_one_are_said_by_name() -> None:
    with pytest.raises(ConfigError, match=r"'LayerNorm\.weight' matches no trainable parameter of NormedMLP .*'up\.weight'"):
        fxspeed.compile(NormedMLP(), 1, fxspeed.Config(weight_decay=0.1, no_weight_decay=("LayerNorm.weight",)),
                        example_inputs=_batch())
    with pytest.raises(ConfigError, match="empty entry"):
        fxspeed.Config(weight_decay=0.1, no_weight_decay=("bias", ""))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        c = fxspeed.Config(no_weight_decay="bias")
    assert c.no_weight_decay == ("bias",)  # one entry, not characters
    assert any(issubclass(w.category, ConfigWarning) and "no_weight_decay" in str(w.message) for w in caught)


@settings(max_examples=60, deadline=None)
@given(numel=st.integers(1, 40), data=st.data(), decoupled=st.booleans())
def test_decaying_a_tensor_piece_by_piece_equals_decaying_it_whole_with_a_mask(numel: int, data: st.DataObject,
                                                                                decoupled: bool) -> None:
    """However the offloaded optimizer cuts a tensor into pieces, the runs each piece decays are
    exactly the masked elements."""
    cuts = sorted(set(data.draw(st.lists(st.integers(1, numel), max_size=4)) + [0, numel]))
    bounds = sorted(set(data.draw(st.lists(st.integers(0, numel), max_size=6)) + [0, numel]))
    runs = tuple((a, b) for i, (a, b) in enumerate(zip(bounds, bounds[1:])) if i % 2 == 0 and a < b)
    w, g = torch.randn(numel), torch.randn(numel)
    mask = torch.zeros(numel, dtype=torch.bool)
    for a, b in runs:
        mask[a:b] = True
    decay = WeightDecay(0.3, decoupled, {id(w): runs})
    ws, gs = w.clone(), g.clone()
    decay.apply([(w, ws[a:b], gs[a:b], a, b - a) for a, b in zip(cuts, cuts[1:])], lr=0.5)
    want_w = torch.where(mask, w * (1 - 0.5 * 0.3), w) if decoupled else w
    want_g = g if decoupled else torch.where(mask, g + 0.3 * w, g)
    torch.testing.assert_close(ws, want_w, rtol=1e-6, atol=1e-6)  # fused multiply-adds round once
    torch.testing.assert_close(gs, want_g, rtol=1e-6, atol=1e-6)
