"""Command line (also `python -m fxspeed ...`):

    fxspeed run -n N script.py [args...]   launch N local processes (torch.distributed.run)
    fxspeed demo [--devices N] [--zero S] [--pipeline P] [--precision bf16]
                                           compile a byte-level GPT and train it
    fxspeed serve --model gpt2|DIR --prompt "IDS" [--tensor N]
                                           serve a Hugging Face causal LM, print its tokens
    fxspeed plan --model llama|DIR --devices H100-80GB:64 [--zero 0,1,2,3] [--tensor T] ...
                                           plan it for a cluster from its config (meta device)
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Sequence

from fxspeed.tools.arg_types import positive_int
from fxspeed.tools.launcher import default_threads, launch  # noqa: F401  (re-exported: the CLI's own API)


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
    d.add_argument("--devices", type=int, default=1,
                   help="local processes to train on, data parallel (default: 1); >1 re-launches the demo "
                        "through `fxspeed run -n N`")
    d.add_argument("--zero", type=int, default=0, choices=(0, 1, 2, 3),
                   help="ZeRO stage: 0 replicates everything (DDP), 1 shards optimizer state, 2 also "
                        "gradients, 3 also parameters (default: 0)")
    d.add_argument("--pipeline", type=int, default=1,
                   help="pipeline stages (default: 1); --devices must be a multiple of it (the rest are "
                        "data-parallel replicas); a pipeline's ranks share their replica's batch, split into "
                        "2 x pipeline micro-batches")
    d.add_argument("--precision", choices=("fp32", "bf16", "fp16"), default="fp32",
                   help="compute precision (default: fp32); bf16/fp16 keep fp32 master weights")

    from fxspeed.tools.serve_cli import add_parser as add_serve

    add_serve(sub)
    from fxspeed.tools.plan_cli import add_parser as add_plan

    add_plan(sub)
    r = sub.add_parser("run", help="launch N local processes of a training script (torch.distributed.run)",
                       description="Run `script.py` (or `-m module`) in N local processes joined by "
                                   "torch.distributed, through torch.distributed.run --standalone. Each process "
                                   "gets RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT; fxspeed.compile(model, N, "
                                   "...) joins the group. If one process fails the others are stopped and the "
                                   "failed rank is reported.")
    r.add_argument("-n", "--nproc", type=positive_int, required=True, metavar="N", help="number of processes")
    r.add_argument("-m", "--module", action="store_true",
                   help="treat SCRIPT as a Python module name and run it like `python -m`")
    r.add_argument("script", metavar="SCRIPT", help="training script (or module name with -m)")
    rest = r.add_argument("script_args", nargs=argparse.REMAINDER, metavar="ARGS", help="arguments passed to the script")
    rest.required = False  # argparse marks a REMAINDER positional required: "required: SCRIPT, ARGS" without a script
    return p


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "demo":
        from fxspeed.tools.demo import run

        args.argv = list(argv) if argv is not None else sys.argv[1:]
        return run(args)
    if args.command == "serve":
        from fxspeed.tools.serve_cli import run as serve

        args.argv = list(argv) if argv is not None else sys.argv[1:]
        return serve(args)
    if args.command == "plan":
        from fxspeed.tools.plan_cli import run as plan

        return plan(args)
    if args.command == "run":
        script_args = list(args.script_args)
        if script_args[:1] == ["--"]:
            script_args = script_args[1:]
        if not args.module and not os.path.isfile(args.script):
            # else every rank starts, fails to open it, and torchrun's failure report buries the cause
            parser.error(f"run: no such script {args.script!r}" + (" (use -m to run a module)"
                                                                      if "/" not in args.script else ""))
        return launch(args.nproc, args.script, script_args, module=args.module)
    parser.print_help()
    return 1


if __name__ == "__main__":
    sys.exit(main())
