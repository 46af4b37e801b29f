"""The local launcher: N processes of a script on this machine, via torch.distributed.run.

Its own module so that the command line (cli.py) and the demo (demo.py) both use it without
importing each other.
"""

from __future__ import annotations

import os
import sys
from typing import Sequence


def default_threads(nproc: int) -> int:
    """CPU threads per process when OMP_NUM_THREADS is unset: the cores shared out, at least 1."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    return max(1, cores // max(1, nproc))


def launch(nproc: int, script: str, script_args: Sequence[str] = (), *, module: bool = False) -> int:
    """Run `script` in `nproc` local processes via torch.distributed.run; returns an exit code.

    When a process fails, torch's elastic agent stops the others and this prints which rank
    failed (and its error) instead of hanging or raising a launcher traceback.
    """
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run

    os.environ.setdefault("OMP_NUM_THREADS", str(default_threads(nproc)))
    targs = ["--standalone", f"--nproc-per-node={nproc}", "--max-restarts=0"]
    if module:
        targs.append("--module")
    targs += [script, *script_args]
    # torchrun's own parser, without abbreviations: a script argument such as `--nproc 3` was
    # taken for an abbreviation of torchrun's --nproc-per-node ("ambiguous option", exit 2)
    parser = get_args_parser()
    parser.allow_abbrev = False
    try:
        run(parser.parse_args(targs))
    except SignalException as e:  # Ctrl-C or SIGTERM to the launcher: the agent has ended every process
        print(f"fxspeed run: stopped by {e.sigval.name}; every process was ended", file=sys.stderr, flush=True)
        return 128 + int(e.sigval)
    except ChildFailedError as e:
        rank, failure = e.get_first_failure()
        print(e.format_msg(), file=sys.stderr)
        # Ranks ended by a signal after the first failure were (almost always) stopped by the agent.
        also = sorted(r for r, f in e.failures.items() if r != rank and f.exitcode > 0)
        print(f"fxspeed run: rank {rank} (of {nproc}) failed first, with exit code {failure.exitcode}"
              + (f"; rank(s) {also} failed too" if also else "")
              + "; the launcher stopped the other processes", file=sys.stderr, flush=True)
        code = failure.exitcode
        return code if isinstance(code, int) and 0 < code < 256 else 1
    return 0
