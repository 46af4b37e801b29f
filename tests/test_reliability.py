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


def errors_of_both_ranks(case: str, out: Path) -> tuple[list[str], list[str]]:
    """A 2-rank launch of `case` that ends in time, each rank's error lines (write_errors)."""
    proc, wall = fxspeed_run(2, case, out)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    assert wall < DEADLINE_S, f"took {wall:.0f} s"
    return tuple((out / f"{case}_rank{r}.txt").read_text().splitlines() for r in range(2))  # type: ignore[return-value]


@pytest.mark.parametrize("case,code", [("raise", 1), ("exit", 13), ("sys_exit", 7)])
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


CONFIG_ERROR_CASES = ("model", "config", "devices", "shapes", "indivisible", "buffer", "frozen", "attribute", "branch")


@pytest.fixture(scope="module")
def config_errors(tmp_path_factory: pytest.TempPathFactory) -> tuple[subprocess.CompletedProcess, float, Path]:
    """One launch going through every ConfigError case in turn (a launch costs more than a case)."""
    out = tmp_path_factory.mktemp("config_errors")
    proc, wall = fxspeed_run(2, ",".join(CONFIG_ERROR_CASES), out)
    return proc, wall, out


@pytest.mark.parametrize("case,what", [
    ("model", "ranks disagree on the model, config and devices: rank(s) [1] differ from rank 0"),
    ("config", "ranks disagree on the model, config and devices: rank(s) [1] differ from rank 0 (Config.lr is 0.03 "
               "on rank 1 and 0.01 on rank 0)"),
    ("devices", "rank(s) [1] differ from rank 0 (device 0 mem_bandwidth is 20000000000.0 on rank 1 and "
                "10000000000.0 on rank 0"),
    ("shapes", "rank(s) [1] differ from rank 0 (batch value 0 is a tensor of shape (4, 8), int64 on cpu "
               "(contiguous) on rank 1 and a tensor of shape (4, 16), int64 on cpu (contiguous) on rank 0"),
    ("indivisible", "a global batch of 5 rows cannot be split evenly across 2 ranks"),
    ("buffer", "ranks disagree on the model, config and devices: rank(s) [1] differ from rank 0"),
    ("frozen", "ranks disagree on the model, config and devices: rank(s) [1] differ from rank 0 (parameter "),
    ("attribute", "rank(s) [1] differ from rank 0 (GPT.loss_scale_hint is 2.0 on rank 1 and 1.0 on rank 0)"),
    # (an FxspeedError: both ranks agree; forward left b without a gradient, which crashed as an internal error)
    ("branch", "forward now leaves other parameters without a gradient than at its first step (no gradient now: "
               "b.bias, b.weight)"),
], ids=["model", "config", "devices", "shapes", "indivisible", "buffer", "frozen", "attribute", "branch"])
def test_ranks_that_disagree_or_a_batch_that_cannot_be_split_raise_a_config_error_on_every_rank(
        case: str, what: str, config_errors: tuple[subprocess.CompletedProcess, float, Path]) -> None:
    proc, wall, tmp_path = config_errors
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert wall < DEADLINE_S, f"took {wall:.0f} s for the {len(CONFIG_ERROR_CASES)} cases"
    for r in range(2):
        msg = (tmp_path / f"{case}_rank{r}.txt").read_text()
        assert msg.startswith("FxspeedError: " if case == "branch" else "ConfigError: ") and what in msg, (r, msg)



@pytest.mark.parametrize("case", ["longer", "longer_tp"])
def test_a_rank_whose_loader_ran_one_batch_longer_is_told_the_other_finished_in_seconds(
        case: str, tmp_path: Path) -> None:
    """Rank 1 ends its script after 2 steps, rank 0 starts a third: rank 0 waited in the step's
    collective to dist_timeout_s (300 s; the exit barrier, a gloo collective, could pair with
    it), and its error said only that another rank left. Under tensor=2 the step's first
    collective, the tp ranks' batch check, ran outside the step's failure handling: rank 0 got
    gloo's bare "Connection closed by peer" (a RuntimeError, no FxspeedError)."""
    proc, wall = fxspeed_run(2, case, tmp_path)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert wall < DEADLINE_S, f"took {wall:.0f} s"
    r0 = (tmp_path / f"{case}_rank0.txt").read_text()
    assert "rank(s) [1] had ended their script without an error" in r0, r0
    assert "while this rank ran train_step 3: the ranks ran different numbers of steps" in r0, r0


def test_a_step_that_fails_on_one_rank_is_said_on_every_rank_and_the_failed_rank_refuses_further_steps(
        tmp_path: Path) -> None:
    """Rank 1's forward raises (a token id outside the vocabulary) while rank 0 is in the step's
    gradient all-reduce. Rank 1 said nothing of the ranks being out of step, and a caught error
    let it start its next step against rank 0's pending all-reduce (gloo aborted the process on
    the mismatched sizes); rank 0 got a bare gloo error. Now rank 1's error says the ranks are out
    of step and its next step refuses at once; rank 0's says a collective failed because
    another rank left the step."""
    r0, r1 = errors_of_both_ranks("midstep", tmp_path)
    assert r1[0].startswith("FxspeedError: train_step failed on rank 1 (IndexError: index out of range"), r1
    assert "the ranks are out of step" in r1[0] and "restart from the last checkpoint" in r1[0], r1
    assert r1[1].startswith("FxspeedError: train_step: train_step failed on rank 1"), r1
    assert r0[0].startswith("FxspeedError: a collective of train_step failed on rank 0"), r0
    # what rank 1 left in the store as it failed, not only "another rank left the step"
    assert "because rank 1 failed: train_step 2 raised IndexError" in r0[0], r0
    assert r0[1].startswith("FxspeedError: train_step: a collective of train_step failed on rank 0"), r0


def test_a_serving_step_that_fails_on_one_tensor_parallel_rank_is_said_on_every_rank(tmp_path: Path) -> None:
    """Tensor-parallel serving: rank 1's step raises (injected) while rank 0 waits in the step's
    collectives. Rank 1's generate raised the bare error and a caught one let it call again
    against rank 0's pending collective; rank 0 got a bare gloo error. Now, as for training, rank
    1 says the ranks are out of step and refuses its next call, and rank 0's error names rank 1's
    failure, within seconds of rank 1's script ending."""
    r0, r1 = errors_of_both_ranks("midserve", tmp_path)
    assert r1[0].startswith("FxspeedError: generate failed on rank 1 (RuntimeError: injected step failure)"), r1
    assert "the ranks are out of step" in r1[0] and "serve again" in r1[0], r1
    assert r1[1].startswith("FxspeedError: generate: generate failed on rank 1"), r1
    assert r0[0].startswith("FxspeedError: a collective of generate failed on rank 0 because rank 1 failed: "
                            "generate raised RuntimeError: injected step failure"), r0
    assert r0[1].startswith("FxspeedError: generate: a collective of generate failed on rank 0"), r0


def test_a_peer_that_failed_only_because_another_left_is_not_named_as_the_cause(monkeypatch) -> None:
    """8 ranks, rank 5 calling state_dict() alone: most ranks' errors said "because rank 0 failed:
    Connection closed by peer", rank 0 having failed only in turn. The rank that failed on its own
    is the cause; the ones that failed in turn are named after it, and this rank's own note says it
    failed in turn when a peer had failed first."""
    import types

    from fxspeed.runtime import engine as engine_module

    notes: list[tuple[str, bool]] = []
    monkeypatch.setattr(engine_module, "peers_gone", lambda: (
        [(0, "train_step 4 raised RuntimeError: Connection closed by peer", True),
         (5, "its script raised ConfigError: engine.state_dict() was called on rank 5 only", False)], []))
    monkeypatch.setattr(engine_module, "note_failure_for_peers", lambda what, in_turn=False: notes.append((what, in_turn)))
    stub = types.SimpleNamespace(stats={"steps": 3}, rank=2, _out_of_step=None)
    err = engine_module.Engine._failed_mid_step(stub, "train_step", RuntimeError("[gloo] Connection closed by peer"))
    said = str(err)
    assert "rank 5 failed: its script raised ConfigError" in said and "rank 0 failed:" not in said, said
    assert "rank(s) [0] failed in turn" in said, said
    assert notes and notes[0][1] is True  # this rank failed in turn too: its peers do not blame it

    # every rank that said anything failed in turn, and one ended its script: the ended one is the cause
    notes.clear()
    monkeypatch.setattr(engine_module, "peers_gone", lambda: (
        [(0, "train_step 4 raised RuntimeError: Connection closed by peer", True)], [7]))
    said = str(engine_module.Engine._failed_mid_step(stub, "train_step", RuntimeError("[gloo] Connection closed by peer")))
    assert "rank(s) [7] had ended their script" in said and "rank 0 failed:" not in said, said
