"""Deferred initialization: a model built on the meta device is materialized by the engine one
bucket at a time, so a rank never holds the whole fp32 model (DeepSpeed's `zero.Init`, FSDP's
meta-device init).

    with fxspeed.parameters_on_meta():        # parameters hold no memory; buffers are real
        model = GPT(cfg)
    engine = fxspeed.compile(model, 2, fxspeed.Config(zero=3), example_inputs=...)
    # each rank built each bucket in turn, kept its shard and dropped the rest

Values do not depend on the order buckets are built in, nor on the ranks, the ZeRO stage or the
layout: each module is initialized by its own init function under a generator seeded from
(seed, the module's name), so every rank makes the same values and `fxspeed.materialize(model,
seed=...)` makes the same model eagerly (the reference to compare with, or to save). They are
not the values an eager build under `torch.manual_seed(seed)` draws (that is one generator
running through the modules in construction order).

Init functions, per module holding meta tensors: the `init` given; else a Hugging Face model's
own `_init_weights(module)`; else the module's `reset_parameters()`. Every floating-point tensor
is filled with NaN before its module's init runs and checked after: a tensor the init left unset
is an error naming it, never uninitialized memory trained on in silence.
"""

from __future__ import annotations

import contextlib
import logging
import zlib
from typing import Callable, Iterable, Iterator

import torch
import torch.nn as nn

from fxspeed.errors import ConfigError

log = logging.getLogger("fxspeed")

InitFn = Callable[[nn.Module], None]


def has_meta_tensors(model: nn.Module) -> bool:
    return any(t.is_meta for t in (*model.parameters(), *model.buffers()))


class DeferredInit:
    """The meta tensors of `model` and how to give them values on `device`.

    `materialize(params)` gives values to the modules holding those Parameters (each module once,
    all its own meta tensors together); `materialize_all()` to every module still holding meta
    tensors. The Parameter objects stay the same (only `.data` changes): the engine keys its
    layout, hooks and optimizer on them."""

    def __init__(self, model: nn.Module, device: torch.device | str, seed: int = 0, init: InitFn | None = None):
        self.model, self.device, self.seed, self.init = model, torch.device(device), seed, init
        self._name = {id(m): name for name, m in model.named_modules(remove_duplicate=False)}
        self._order = {id(m): i for i, m in enumerate(model.modules())}
        self._made: set[int] = set()  # ids of the tensors given memory here
        self._pending: dict[int, nn.Module] = {}  # id(module) -> module holding meta tensors of its own
        self._owners: dict[int, list[nn.Module]] = {}  # id(Parameter) -> the modules holding it, in module order
        for m in model.modules():
            own = [t for t in (*m._parameters.values(), *m._buffers.values()) if t is not None and t.is_meta]
            if own:
                self._pending[id(m)] = m
                for p in m._parameters.values():
                    if p is not None and p.is_meta:
                        self._owners.setdefault(id(p), []).append(m)
        self._hf_init = getattr(model, "_init_weights", None) if init is None else None
        missing = [m for m in self._pending.values() if self._init_of(m) is None]
        if missing:
            m = missing[0]
            raise ConfigError(
                f"{self._where(m)} holds tensors on the meta device and has no reset_parameters() to give them values"
                f"{f' (and {len(missing) - 1} more modules)' if len(missing) > 1 else ''}. Pass "
                "fxspeed.compile(..., init=fn), where fn(module) fills the module's own parameters and buffers "
                "(recurse=False), or build the model with real weights")

    def _where(self, m: nn.Module) -> str:
        name = self._name[id(m)]
        return f"{type(self.model).__name__}.{name} ({type(m).__name__})" if name else \
            f"{type(self.model).__name__} (the root module)"

    @property
    def done(self) -> bool:
        return not self._pending

    def _init_of(self, m: nn.Module) -> InitFn | None:
        if self.init is not None:
            return self.init
        if self._hf_init is not None:
            return self._hf_init
        reset = getattr(m, "reset_parameters", None)
        return (lambda module: reset()) if callable(reset) else None

    def materialize_buffers(self) -> None:
        """Modules holding meta buffers, now: the programs read buffers whole from the first step
        (and they are small)."""
        for m in [m for m in self._pending.values() if any(b is not None and b.is_meta for b in m._buffers.values())]:
            self._materialize(m)

    def materialize(self, params: Iterable[torch.Tensor]) -> None:
        """Values for `params` (and the rest of their modules' own meta tensors)."""
        for p in params:
            for m in self._owners.get(id(p), ()):
                self._materialize(m)

    def materialize_all(self) -> None:
        for m in list(self._pending.values()):
            self._materialize(m)

    def _materialize(self, m: nn.Module) -> None:
        """m and every module sharing a Parameter with it (a tied embedding and head), in module
        order: a tied weight ends with its last holder's init whatever asked for it first."""
        if id(m) not in self._pending:
            return
        group, todo = {id(m): m}, [m]
        while todo:
            for p in todo.pop()._parameters.values():
                for o in self._owners.get(id(p), ()) if p is not None else ():
                    if id(o) in self._pending and id(o) not in group:
                        group[id(o)] = o
                        todo.append(o)
        made: list[tuple[str, torch.Tensor, bool]] = []  # (name, tensor, is a buffer)
        for o in group.values():
            del self._pending[id(o)]
            made += self._allocate(o)
        for o in sorted(group.values(), key=lambda o: self._order[id(o)]):
            self._run_init(o)
        unset = [(full, buffer) for full, t, buffer in made if t.is_floating_point() and bool(torch.isnan(t).any())]
        if unset:
            raise ConfigError(
                f"the init of {type(self.model).__name__} left {', '.join(n for n, _ in unset[:5])} unset (NaN where it gave no "
                "value). Pass fxspeed.compile(..., init=fn) / fxspeed.materialize(..., init=fn) with an fn(module) "
                "that fills every parameter and buffer the module holds itself, or build the model with real weights"
                + (" (a buffer computed in __init__, such as rotary frequencies, is lost on the meta device: build "
                   "with `with fxspeed.parameters_on_meta():` to keep buffers real)" if any(b for _, b in unset) else ""))

    def _allocate(self, m: nn.Module) -> list[tuple[str, torch.Tensor, bool]]:
        """m's own meta tensors get memory on the device, NaN where floating point (to tell what the
        init left unset)."""
        name, made = self._name[id(m)], []
        with torch.no_grad():
            for buffer, d in ((False, m._parameters), (True, m._buffers)):
                for n, t in d.items():
                    if t is None or not t.is_meta:
                        continue
                    # (`.data =` cannot move a tensor off meta; the swap keeps the Python object, so
                    # ties and the engine's references to it hold)
                    new = torch.empty_like(t, device=self.device)
                    torch.utils.swap_tensors(t, nn.Parameter(new, t.requires_grad) if isinstance(t, nn.Parameter) else new)
                    if t.is_floating_point():
                        t.fill_(float("nan"))
                    made.append((f"{name}.{n}" if name else n, t, buffer))
                    self._made.add(id(t))
        return made

    def _run_init(self, m: nn.Module) -> None:
        """m's init under its own generator. Tensors of m that were real before (not made here) keep
        their values: the init fills a module's tensors all together."""
        name = self._name[id(m)]
        kept = [(t, t.detach().clone()) for t in (*m._parameters.values(), *m._buffers.values())
                if t is not None and id(t) not in self._made and t.numel()]
        for t in (m, *m._parameters.values(), *m._buffers.values()):
            # transformers skips what it flagged as initialized: a flag set while on meta would leave
            # the new memory unset
            if t is not None and hasattr(t, "_is_hf_initialized"):
                del t._is_hf_initialized
        with torch.random.fork_rng(devices=[self.device] if self.device.type == "cuda" else []), torch.no_grad():
            torch.manual_seed(module_seed(self.seed, name))
            self._init_of(m)(m)
            for t, value in kept:
                t.copy_(value)


def module_seed(seed: int, name: str) -> int:
    """The generator seed of the module named `name`: the same on every rank and in every order."""
    return (seed * 1_000_003 + zlib.crc32(name.encode())) % (1 << 63)


def materialize(model: nn.Module, init: InitFn | None = None, seed: int = 0,
                device: torch.device | str = "cpu") -> nn.Module:
    """Give a model built on the meta device values on `device`, eagerly, in place: the same values
    `fxspeed.compile(model, ..., init=init)` builds with `Config(seed=seed)` (seed None -> 0).
    Returns the model."""
    DeferredInit(model, device, seed, init).materialize_all()
    return model


@contextlib.contextmanager
def parameters_on_meta() -> Iterator[None]:
    """Inside, every Parameter a module registers goes to the meta device as soon as it is made;
    buffers stay real (rotary frequencies, masks computed in __init__ keep their values, which
    `with torch.device("meta")` would lose). Each Parameter is made (and initialized by the
    module's __init__) on its usual device first and dropped at once: the peak is one tensor."""
    original = nn.Module.register_parameter

    def register(self: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if param is not None and not param.is_meta:
            param = nn.Parameter(param.detach().to("meta"), requires_grad=param.requires_grad)
        original(self, name, param)

    nn.Module.register_parameter = register
    try:
        yield
    finally:
        nn.Module.register_parameter = original
