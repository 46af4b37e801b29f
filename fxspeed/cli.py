"""Command line: `fxspeed demo` (also `python -m fxspeed demo`)."""

from __future__ import annotations

import argparse
import sys
from typing import Sequence


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="fxspeed", description="fxspeed: distributed training as a torch.fx compiler")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    d = sub.add_parser("demo", help="compile a byte-level GPT and train it on the Python standard library's source",
                       description="Compile fxspeed.models.GPT (byte vocabulary) with fxspeed, print its plan, then "
                                   "train it on the .py files of Python's standard library (offline, deterministic).")
    d.add_argument("--steps", type=int, default=300, help="training steps (default: 300)")
    d.add_argument("--batch-size", type=int, default=16, help="sequences per step (default: 16)")
    d.add_argument("--seq-len", type=int, default=64, help="tokens (bytes) per sequence (default: 64)")
    d.add_argument("--model", choices=("tiny", "small"), default="tiny",
                   help="GPT preset: tiny (~0.4M params, default) or small (~19M params)")
    d.add_argument("--lr", type=float, default=3e-3, help="AdamW learning rate (default: 3e-3)")
    d.add_argument("--threads", type=int, default=None,
                   help="CPU threads for torch (default: 1 for tiny, whose matmuls gain nothing from more and whose "
                        "extra threads only contend on a busy machine; torch's default for small)")
    d.add_argument("--seed", type=int, default=0, help="seed for init and batch sampling (default: 0)")
    d.add_argument("--sample", type=int, default=0, metavar="N",
                   help="after training, print N sampled bytes (default: 0, none)")
    d.add_argument("--devices", type=int, default=1, help="number of devices (only 1 is implemented yet)")
    d.add_argument("--zero", type=int, default=0, choices=(0, 1, 2, 3),
                   help="ZeRO stage (only 0 is implemented yet)")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "demo":
        from .demo import run

        return run(args)
    parser.print_help()
    return 1


if __name__ == "__main__":
    sys.exit(main())
