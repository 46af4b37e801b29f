"""engine.state_dict / load_state_dict / save / load run the user's module's own state_dict
machinery (hooks, extra state, a class's _load_from_state_dict) over the full weights, as eager
does: each case here once failed, crashed or gave other values than eager (a helper's sweep).
One process; the released layout (the module's Parameters 0-size between steps) is bf16 ZeRO-1
with the optimizer offloaded to a file."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fxspeed


class Hooked(nn.Module):
    """Saves `lin` under a legacy name and a derived norm (state_dict hook), loads the legacy name
    back (load pre-hook), keeps a Python counter (extra state) and a buffer derived from a weight
    on load (load post-hook)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.out = nn.Linear(8, 4)
        self.temp = nn.Parameter(torch.tensor(2.0), requires_grad=False)
        self.register_buffer("inv_temp", torch.tensor(0.5), persistent=False)
        self.counter = 7
        self.register_state_dict_post_hook(Hooked._to_legacy)
        self.register_load_state_dict_pre_hook(Hooked._from_legacy)
        self.register_load_state_dict_post_hook(Hooked._derive)

    @staticmethod
    def _to_legacy(module: nn.Module, state: dict, prefix: str, local_metadata: dict) -> None:
        for leaf in ("weight", "bias"):
            state[f"{prefix}legacy_lin.{leaf}"] = state.pop(f"{prefix}lin.{leaf}")
        state[f"{prefix}lin_norm"] = module.lin.weight.detach().norm().reshape(1)

    @staticmethod
    def _from_legacy(module: nn.Module, state: dict, prefix: str, *args: object) -> None:
        for leaf in ("weight", "bias"):
            if f"{prefix}legacy_lin.{leaf}" in state:
                state[f"{prefix}lin.{leaf}"] = state.pop(f"{prefix}legacy_lin.{leaf}")
        state.pop(f"{prefix}lin_norm", None)

    @staticmethod
    def _derive(module: nn.Module, incompatible: object) -> None:
        with torch.no_grad():
            module.inv_temp.copy_(1.0 / module.temp)

    def get_extra_state(self) -> dict:
        return {"counter": self.counter}

    def set_extra_state(self, state: dict) -> None:
        self.counter = state["counter"]

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(self.out(torch.tanh(self.lin(x))) * self.inv_temp, y)


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(6, 8, generator=g), torch.randn(6, 4, generator=g)


def _configs(tmp_path: Path) -> list[fxspeed.Config]:
    return [fxspeed.Config(lr=1e-2),
            fxspeed.Config(lr=1e-2, precision="bf16", zero=1, offload="optimizer", offload_device="nvme",
                           nvme_path=str(tmp_path))]  # released: the module holds 0-size Parameters


def test_engine_state_dict_gives_the_keys_and_values_of_the_modules_own_state_dict_hooks_and_extra_state(
        tmp_path: Path) -> None:
    x, y = _batch()
    for config in _configs(tmp_path):
        torch.manual_seed(0)
        model = Hooked()
        engine = fxspeed.compile(model, 1, config, example_inputs=(x, y))
        engine.train_step(x, y)
        state = engine.state_dict()  # crashed on the extra state ('dict' has no attribute 'detach')
        with engine.gathered():
            want = model.state_dict()
        assert list(state) == list(want)
        assert state["_extra_state"] == {"counter": 7}
        for k, v in want.items():
            if isinstance(v, torch.Tensor):  # the norm was taken of the 0-size weight when released
                assert torch.equal(state[k], v), (config.precision, k)
        fresh = Hooked()
        fresh.load_state_dict(state)  # the legacy names load into a plain model
        assert torch.equal(fresh.lin.weight, state["legacy_lin.weight"])


def test_engine_load_state_dict_runs_the_modules_load_hooks_and_set_extra_state_and_returns_its_keys(
        tmp_path: Path) -> None:
    x, y = _batch()
    torch.manual_seed(5)
    source = Hooked()
    source.counter = 42
    with torch.no_grad():
        source.temp.fill_(4.0)
    saved = source.state_dict()  # legacy names, a derived norm, extra state
    for config in _configs(tmp_path):
        torch.manual_seed(0)
        model = Hooked()
        ref = copy.deepcopy(model)
        engine = fxspeed.compile(model, 1, config, example_inputs=(x, y))
        result = engine.load_state_dict(saved)  # was refused: "legacy_lin.weight is not in the model"
        eager = ref.load_state_dict(saved)
        assert tuple(result) == tuple(eager) and model.counter == 42
        assert float(model.inv_temp) == 0.25  # the post-hook ran over the loaded temp
        assert engine.eval_step(x, y) == pytest.approx(float(ref(x, y)), rel=1e-2 if config.precision == "bf16" else 1e-6)
        partial = {k: v for k, v in saved.items() if not k.startswith("out.")} | {"stray": torch.zeros(1)}
        assert tuple(engine.load_state_dict(partial, strict=False)) == tuple(ref.load_state_dict(partial, strict=False))
        with pytest.raises(fxspeed.FxspeedError, match="nothing was loaded"):
            engine.load_state_dict(partial)


def test_a_checkpoint_keeps_the_modules_extra_state_and_a_load_reruns_its_post_hooks(tmp_path: Path) -> None:
    x, y = _batch()
    torch.manual_seed(0)
    model = Hooked()
    engine = fxspeed.compile(model, 1, fxspeed.Config(lr=1e-2), example_inputs=(x, y))
    engine.train_step(x, y)
    model.counter = 9
    with torch.no_grad():
        model.temp.fill_(8.0)
        model.inv_temp.fill_(0.125)
    engine.save(tmp_path / "ck")  # was refused at load: "buffer legacy_lin.bias is missing"
    other = Hooked()  # inv_temp 0.5 until the load's post-hook derives it again (a non-persistent buffer)
    resumed = fxspeed.compile(other, 1, fxspeed.Config(lr=1e-2), example_inputs=(x, y))
    resumed.load(tmp_path / "ck")
    assert other.counter == 9 and float(other.inv_temp) == 0.125
    assert resumed.train_step(x, y) == engine.train_step(x, y)


def test_an_old_batchnorm_checkpoint_without_num_batches_tracked_loads_as_in_eager() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    x = torch.randn(8, 4)
    engine = fxspeed.compile(model, 1, fxspeed.Config(lr=0.0), example_inputs=(x,), loss_fn=lambda out, x: out.square().mean())
    state = copy.deepcopy(model.state_dict())
    del state["1.num_batches_tracked"]
    state._metadata = {"1": {"version": 1}}  # torch's BatchNorm before num_batches_tracked
    engine.load_state_dict(state)  # refused before: "buffer 1.num_batches_tracked is missing"


def test_values_that_cannot_be_loaded_are_refused_before_anything_is_written() -> None:
    x, y = _batch()
    model = nn.Sequential(nn.Linear(8, 4))
    engine = fxspeed.compile(model, 1, fxspeed.Config(lr=0.0), example_inputs=(x,),
                             loss_fn=lambda out, x: out.square().mean())
    before = {k: v.clone() for k, v in model.state_dict().items()}
    for bad, why in ((torch.empty(4, device="meta"), "meta device"), ([0.0] * 4, "is a list")):
        state = {"0.weight": torch.zeros(4, 8), "0.bias": bad}
        with pytest.raises(fxspeed.FxspeedError, match=why):  # a raw NotImplementedError after writing 0.weight
            engine.load_state_dict(state)
        assert all(torch.equal(model.state_dict()[k], v) for k, v in before.items())


def test_a_refused_load_under_a_released_layout_leaves_the_next_step_alone(tmp_path: Path) -> None:
    """The module's load_state_dict writes the full-size copies through the Parameters before it
    finds a bad shape: the next step took that for the user's write to a 0-size Parameter."""
    x, y = _batch()
    torch.manual_seed(0)
    model = Hooked()
    engine = fxspeed.compile(model, 1, _configs(tmp_path)[1], example_inputs=(x, y))
    engine.train_step(x, y)
    bad = Hooked().state_dict()
    bad["out.weight"] = torch.zeros(5, 8)
    with pytest.raises(fxspeed.FxspeedError, match="nothing was loaded"):
        engine.load_state_dict(bad)
    engine.train_step(x, y)  # was "parameter(s) [...] were written after compile, outside engine.gathered()"


class _SharedBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.register_buffer("shift", torch.linspace(-1, 1, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.lin(x) + self.shift)


class _Albert(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        block = _SharedBlock()
        self.layers = nn.ModuleList([block, block, block])
        self.out = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return F.mse_loss(self.out(x), y)


def test_one_block_under_three_names_round_trips_its_state_and_checkpoint(tmp_path: Path) -> None:
    """A state_dict lists the block's buffer under all three names; loading it back was refused
    ("layers.1.shift is not in the model")."""
    x, y = _batch()
    engine = fxspeed.compile(_Albert(), 1, fxspeed.Config(lr=1e-2), example_inputs=(x, y))
    engine.train_step(x, y)
    state = engine.state_dict()
    assert {"layers.1.shift", "layers.2.lin.weight"} <= set(state)
    assert tuple(engine.load_state_dict(state)) == ([], [])
    engine.save(tmp_path / "ck")
    engine.load(tmp_path / "ck")


def test_export_leaves_out_extra_state_that_is_not_a_tensor_and_says_so(tmp_path: Path, caplog) -> None:
    x, y = _batch()
    engine = fxspeed.compile(Hooked(), 1, fxspeed.Config(lr=1e-2), example_inputs=(x, y))
    with caplog.at_level("WARNING", logger="fxspeed"):
        engine.export(tmp_path / "m.safetensors")  # was "model_state['_extra_state'] is a dict ... CanonicalState"
    assert "leaves out ['_extra_state']" in caplog.text
