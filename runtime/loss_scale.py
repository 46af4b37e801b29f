"""Dynamic loss scaling for fp16 (the graph multiplies the backward seed by `scale`).

After backward: unscale the gradients in place and look for inf/NaN; every rank must agree
(under ZeRO each holds a different shard), so the flag is all-reduced. An overflowing step is
skipped — parameters and optimizer states untouched — and the scale backs off; after
`window` clean steps it grows.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


class DynamicLossScaler:
    def __init__(self, init_scale: float = 2.0**16, window: int = 1000, backoff: float = 0.5, growth: float = 2.0,
                 group: dist.ProcessGroup | None = None):
        self.scale = torch.tensor(float(init_scale))
        self.window, self.backoff, self.growth, self.group = window, backoff, growth, group
        self.clean_steps = 0
        self.skipped = 0

    def unscale_and_check(self, grads: list[torch.Tensor], unscale: bool = True) -> bool:
        """Divide `grads` by the scale in place (with `unscale=False`, only check them); True if
        any rank saw inf/NaN.

        The flag and the scale live on the gradients' device (the CUDA kernel refuses CPU ones
        next to CUDA gradients, and NCCL all-reduces only CUDA tensors); gradients on several
        devices are checked per device and their flags combined."""
        by_device: dict[torch.device, list[torch.Tensor]] = {}
        for g in grads:
            by_device.setdefault(g.device, []).append(g)
        device = next(iter(by_device), self.scale.device)
        if self.scale.device != device:
            self.scale = self.scale.to(device)  # once: it stays there, update() keeps its device
        found = torch.zeros(1, device=device)
        inv = (1.0 / self.scale) if unscale else torch.ones((), device=device)
        for dev, group in by_device.items():
            if dev == device:
                torch._amp_foreach_non_finite_check_and_unscale_(group, found, inv.reshape(1))
            else:
                other = torch.zeros(1, device=dev)
                torch._amp_foreach_non_finite_check_and_unscale_(group, other, inv.to(dev).reshape(1))
                found = torch.maximum(found, other.to(device))
        if self.group is not None:
            dist.all_reduce(found, op=dist.ReduceOp.MAX, group=self.group)
        return bool(found.item())

    def update(self, overflow: bool) -> None:
        if overflow:
            self.scale = self.scale * self.backoff
            self.clean_steps = 0
            self.skipped += 1
            return
        self.clean_steps += 1
        if self.clean_steps % self.window == 0:
            self.scale = self.scale * self.growth

    def state_dict(self) -> dict:
        return {"scale": float(self.scale), "clean_steps": self.clean_steps, "skipped": self.skipped}

    def load_state_dict(self, d: dict) -> None:
        self.scale = torch.tensor(d["scale"])
        self.clean_steps, self.skipped = d["clean_steps"], d["skipped"]
