"""Failures across ranks end the whole job quickly with an error that names the culprit, never a
hang: a dying rank under `fxspeed run`, ranks that disagree on the model, config or batch, and
global batches that cannot be split across ranks."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.multiprocess import rank_env

ROOT = Path(__file__).resolve().parents[1]
DEADLINE_S = 60


def fxspeed_run(n: int, case: str, out: Path) -> tuple[subprocess.CompletedProcess, float]:
    cmd = [sys.executable, "-m", "fxspeed", "run", "-n", str(n), "-m", "tests.workers.reliability_worker",
           "--case", case, "--out", str(out)]
    env = rank_env()
    t0 = time.monotonic()
    # The subprocess timeout is a safety net only; the assertion below is the real deadline.
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=3 * DEADLINE_S)
    return proc, time.monotonic() - t0


@pytest.mark.parametrize("case,code", [("raise", 1), ("exit", 13)])
def test_a_rank_that_fails_after_compile_stops_every_rank_with_an_error_naming_it(
        case: str, code: int, tmp_path: Path) -> None:
    proc, wall = fxspeed_run(2, case, tmp_path)
    out = proc.stdout + proc.stderr
    assert wall < DEADLINE_S, f"took {wall:.0f} s\n{out[-4000:]}"
    assert proc.returncode == code, out[-4000:]
    assert "fxspeed run: rank 1 (of 2) failed first" in out, out[-4000:]
    assert "rank      : 1 (local_rank: 1)" in out  # torchrun's root-cause report
    assert "trained" not in proc.stdout  # rank 0 never ran on alone
    if case == "raise":
        assert "rank 1 fails on purpose after compile" in out  # the failed rank's own traceback


CONFIG_ERROR_CASES = ("model", "config", "shapes", "indivisible")


@pytest.fixture(scope="module")
def config_errors(tmp_path_factory: pytest.TempPathFactory) -> tuple[subprocess.CompletedProcess, float, Path]:
    """One launch going through every ConfigError case in turn (a launch costs more than a case)."""
    out = tmp_path_factory.mktemp("config_errors")
    proc, wall = fxspeed_run(2, ",".join(CONFIG_ERROR_CASES), out)
    return proc, wall, out


@pytest.mark.parametrize("case,what", [
    ("model", "ranks disagree on the model and config: rank(s) [1] differ from rank 0"),
    ("config", "ranks disagree on the model and config: rank(s) [1] differ from rank 0"),
    ("shapes", "ranks disagree on the step (train_step or eval_step) and its batch signature (shapes, dtypes, "
               "structure): rank(s) [1] differ from rank 0"),
    ("indivisible", "a global batch of 5 rows cannot be split evenly across 2 ranks"),
], ids=["model", "config", "shapes", "indivisible"])
def test_ranks_that_disagree_or_a_batch_that_cannot_be_split_raise_a_config_error_on_every_rank(
        case: str, what: str, config_errors: tuple[subprocess.CompletedProcess, float, Path]) -> None:
    proc, wall, tmp_path = config_errors
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert wall < DEADLINE_S, f"took {wall:.0f} s for the {len(CONFIG_ERROR_CASES)} cases"
    for r in range(2):
        msg = (tmp_path / f"{case}_rank{r}.txt").read_text()
        assert msg.startswith("ConfigError: ") and what in msg, (r, msg)
