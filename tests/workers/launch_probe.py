"""A tiny script for `fxspeed run` tests: prints what the launcher gave this process, and fails
on request (`--fail-rank R`)."""

import os
import sys

if __name__ == "__main__":
    args = sys.argv[1:]
    print(f"probe rank={os.environ['RANK']} world={os.environ['WORLD_SIZE']} local={os.environ['LOCAL_RANK']} "
          f"omp={os.environ.get('OMP_NUM_THREADS')} args={args}", flush=True)
    if "--fail-rank" in args and os.environ["RANK"] == args[args.index("--fail-rank") + 1]:
        print(f"probe rank {os.environ['RANK']} failing on request", file=sys.stderr, flush=True)
        sys.exit(5)
