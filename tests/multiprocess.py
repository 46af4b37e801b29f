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


def launch_worker(module: str, n: int, out: Any, *args: str, timeout: int = 900,
                  env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """Run `python -m <module> --out OUT *args` on `n` local ranks (torch.distributed.run, one
    thread each, the repository on PYTHONPATH) and fail the test with the ranks' stderr unless
    every rank exits 0."""
    import os
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(root), **(env or {})}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={n}",
           "-m", module, "--out", str(out), *args]
    proc = run_ranks(cmd, cwd=root, env=full_env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-6000:]
    return proc


def check_swap_worker(module: str, tmp_path: Any, timeout: int = 300) -> None:
    """Run a 2-rank worker that compares engines with and without files under `tmp_path`
    (`--swap DIR --out FILE`; rank 0 writes "ok" or the mismatches) and require "ok" and no swap
    directory left behind."""
    import os
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    out = Path(tmp_path) / "result.txt"
    cmd = [sys.executable, "-m", "fxspeed", "run", "-n", "2", "-m", module, "--swap", str(tmp_path), "--out", str(out)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(root)}
    proc = run_ranks(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    assert out.read_text() == "ok"
    assert [p.name for p in Path(tmp_path).iterdir()] == ["result.txt"], "swap directories left behind"
