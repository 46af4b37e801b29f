"""Launching multi-process tests.

A rank has been seen to abort inside gloo's C++ with "terminate called without an active
exception" and no Python error: twice in about 45 multi-process launches across full-suite
runs on a loaded 2-core machine, never when the same test was rerun alone. The cause is not
found yet (see the closing note of the data-parallel work). A launch that dies with exactly
that signature is retried once, loudly; any other failure fails the test at once.
"""

from __future__ import annotations

import subprocess
from typing import Any

GLOO_ABORT = "terminate called without an active exception"


def run_ranks(cmd: list[str], **kwargs: Any) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, **kwargs)
    if proc.returncode != 0 and GLOO_ABORT in f"{proc.stdout}{proc.stderr}":
        print(f"retrying once after a gloo abort in a rank ({GLOO_ABORT!r}):\n{str(proc.stderr)[-2000:]}")
        proc = subprocess.run(cmd, **kwargs)
    return proc
