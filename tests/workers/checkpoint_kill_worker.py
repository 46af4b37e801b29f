"""Run as `python -m tests.workers.checkpoint_kill_worker --ckpt DIR --ready FILE --at POINT`: one
process saves `kill_state(2)` to DIR with save_checkpoint and stops at POINT (writes FILE, then
sleeps) so the test can SIGKILL it there:

    tensors  DCP has written every tensor file and .metadata; no extra.pt, no marker yet
    marker   extra.pt and the COMPLETE marker are written; not yet moved into place
    swap     the new directory has been swapped into place; the old one not yet deleted
    aside    the old checkpoint has been renamed aside (two-rename replacement, where no atomic
             swap is used); the new one not yet renamed into place. With the atomic swap this
             point is never reached: the save completes and the process exits 0.

--no-exchange: replace with two renames (as where renameat2 is unavailable).
"""

from __future__ import annotations

import argparse
import os
import time

import torch

from fxspeed.runtime import checkpoint as ckpt


def kill_state(version: int) -> ckpt.CanonicalState:
    g = torch.Generator().manual_seed(version)
    model = {f"layers.{i}.weight": torch.randn(64, 64, generator=g) for i in range(4)}
    model["step_counter"] = torch.tensor(version, dtype=torch.int64)
    optimizer = {n: {"exp_avg": torch.randn(64, 64, generator=g), "step": torch.tensor(float(version))}
                 for n in model if n.startswith("layers")}
    return ckpt.CanonicalState(model=model, optimizer=optimizer, extra={"version": version})


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ckpt", required=True)
    ap.add_argument("--ready", required=True)
    ap.add_argument("--at", choices=("tensors", "marker", "swap", "aside"), required=True)
    ap.add_argument("--no-exchange", action="store_true")
    a = ap.parse_args()
    target = os.path.normpath(a.ckpt)
    if a.no_exchange:
        ckpt._exchange = lambda x, y: False  # type: ignore[assignment]

    def stop() -> None:
        with open(a.ready, "w") as f:
            f.write("saving")
        time.sleep(120)  # killed here
        raise SystemExit("not killed")

    if a.at == "tensors":
        real = ckpt.dcp.save

        def save(*args: object, **kwargs: object) -> object:
            out = real(*args, **kwargs)
            stop()
            return out

        ckpt.dcp.save = save  # type: ignore[assignment]
    elif a.at == "marker":
        ckpt._move_into_place = lambda *args: stop()  # type: ignore[assignment]
    elif a.at == "swap":
        ckpt._fsync_dir = lambda path: stop()  # type: ignore[assignment]
    else:
        real_replace = os.replace

        def replace(src: str, dst: str) -> None:
            real_replace(src, dst)
            if os.path.normpath(src) == target:  # the old checkpoint moved aside
                stop()

        os.replace = replace  # type: ignore[assignment]
    ckpt.save_checkpoint(a.ckpt, kill_state(2))


if __name__ == "__main__":
    main()
