"""Torch's process-wide modes around the public calls (compile, train_step, eval_step, serve,
generate, stream) that a captured program cannot follow.

Autocast: the program is traced once and replayed as ATen ops; an autocast around the trace was
baked into it for later calls without it, and one around a replay re-dispatched some ops to the
low precision only (the graph's `_log_softmax` is not on autocast's fp32 list: an eval loss 5.531
where eager autocast gives 5.571). Mixed precision is `Config(precision=...)`, a pass, so an
autocast in effect is refused by name; `no_autocast` keeps a replay exact where a refusal cannot
reach (a stream's steps run while the caller iterates).
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch

from fxspeed.errors import ConfigError

# the device types whose autocast a CPU or CUDA program can meet
_DEVICE_TYPES = ("cpu", "cuda")


def autocast_in_effect() -> str | None:
    """`torch.autocast(...)` as the user wrote it, for the first device type it is enabled for."""
    for device_type in _DEVICE_TYPES:
        if torch.is_autocast_enabled(device_type):
            dtype = str(torch.get_autocast_dtype(device_type)).removeprefix("torch.")
            return f"torch.autocast({device_type!r}, dtype=torch.{dtype})"
    return None


def refuse_autocast(where: str) -> None:
    """Raise a ConfigError naming `where` when an autocast is in effect."""
    found = autocast_in_effect()
    if found is not None:
        raise ConfigError(f"{where} was called under {found}: fxspeed compiles mixed precision into its program "
                          "(an autocast around the call would be baked into the trace, or change only some ops of "
                          "the compiled step). Call it outside the autocast and set Config(precision='bf16') (or "
                          "'fp16') for mixed precision")


@contextlib.contextmanager
def no_autocast() -> Iterator[None]:
    """Run a compiled program as compiled, whatever autocast the caller is in."""
    with contextlib.ExitStack() as stack:
        for device_type in _DEVICE_TYPES:
            if torch.is_autocast_enabled(device_type):
                stack.enter_context(torch.autocast(device_type, enabled=False))
        yield
