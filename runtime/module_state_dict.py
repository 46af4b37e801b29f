"""The user's module's own state_dict machinery, run over the engine's full weights.

A module's state_dict is more than its tensors: hooks rename, add or transform keys
(`register_state_dict_post_hook`), load pre-hooks migrate legacy names, load post-hooks derive
buffers, `get_extra_state` / `set_extra_state` carry Python state, and torch's own modules
override `_load_from_state_dict` (BatchNorm accepts a version-1 checkpoint without
`num_batches_tracked`). The engine keeps the weights elsewhere (shards, slices, other stages),
so it runs that machinery with every Parameter pointed at a full tensor for the duration
(`pointing_at`): what comes out is what eager's module would give.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch
import torch.nn as nn


@contextlib.contextmanager
def pointing_at(values: list[tuple[torch.Tensor, torch.Tensor]]) -> Iterator[None]:
    """Each (Parameter or buffer, full tensor): the tensor's `.data` is the full tensor inside,
    what it was after (its version counter is left as the body leaves it)."""
    saved = []
    try:
        for t, full in values:
            saved.append((t, t.data))
            t.data = full
        yield
    finally:
        for t, data in reversed(saved):
            t.data = data


def _overrides(m: nn.Module, name: str) -> bool:
    return getattr(type(m), name) is not getattr(nn.Module, name)


def has_extra_state(m: nn.Module) -> bool:
    return _overrides(m, "get_extra_state")


def loads_through_module(model: nn.Module, own_hooks: set[int]) -> bool:
    """Whether loading a state needs the module's own load_state_dict (hooks, extra state, a
    class's `_load_from_state_dict`) rather than a copy per key; `own_hooks`: ids of the hook
    dicts' keys the engine registered itself."""
    for m in model.modules():
        hooks = [k for k in (*m._load_state_dict_pre_hooks, *m._load_state_dict_post_hooks) if k not in own_hooks]
        if hooks or has_extra_state(m) or _overrides(m, "_load_from_state_dict"):
            return True
    return False


def extra_states(model: nn.Module) -> dict[str, Any]:
    """`get_extra_state()` of each module that defines it, by module name."""
    return {name: m.get_extra_state() for name, m in model.named_modules() if has_extra_state(m)}


def set_extra_states(model: nn.Module, states: dict[str, Any]) -> None:
    modules = dict(model.named_modules())
    for name, state in states.items():
        if name in modules and has_extra_state(modules[name]):
            modules[name].set_extra_state(state)


def run_load_post_hooks(model: nn.Module, own_hooks: set[int]) -> None:
    """The load post-hooks, as `load_state_dict` runs them after a load that found every key
    (a hook deriving a buffer from the loaded weights)."""
    keys = nn.modules.module._IncompatibleKeys([], [])
    for m in model.modules():
        for k, hook in list(m._load_state_dict_post_hooks.items()):
            if k not in own_hooks:
                hook(m, keys)


def persistent_buffers(model: nn.Module, every_name: bool = False) -> set[str]:
    """Names of the buffers a state_dict holds (not those registered persistent=False): under
    the first name of each module, or with `every_name` under each name of a module registered
    under several (ALBERT's one block in three slots: a state_dict lists all three)."""
    return {f"{prefix}{'.' if prefix else ''}{n}" for prefix, m in model.named_modules(remove_duplicate=not every_name)
            for n, b in m._buffers.items() if b is not None and n not in m._non_persistent_buffers_set}


def is_loadable(value: Any) -> str | None:
    """Why a state's value cannot be loaded into a weight (None: it can)."""
    if not isinstance(value, torch.Tensor):
        return f"is a {type(value).__name__}, not a tensor"
    if value.is_meta:
        return "is on the meta device (it holds no values)"
    return None
