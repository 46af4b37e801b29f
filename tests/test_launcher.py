"""`fxspeed run -n N script.py [args...]`: N local processes through torch.distributed.run, and
`fxspeed demo --devices N --zero S`, which re-launches itself through it."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from fxspeed.tools.cli import build_parser, default_threads

ROOT = Path(__file__).resolve().parents[1]
PROBE = str(ROOT / "tests" / "workers" / "launch_probe.py")


def fxspeed(*args: str, env: dict | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1", **(env or {})}
    return subprocess.run([sys.executable, "-m", "fxspeed", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=timeout)


def probes(stdout: str) -> dict[int, str]:
    # Ranks share one stdout pipe, so two probes can land on one line: match each probe by its
    # own fields rather than by line.
    pattern = r"probe rank=(\d+) world=\d+ local=\d+ omp=\S+ args=\[[^\]]*\]"
    return {int(m.group(1)): m.group(0) for m in re.finditer(pattern, stdout)}


def test_run_starts_n_ranked_processes_and_passes_the_script_arguments_through() -> None:
    # (--nproc / --master abbreviate torchrun's own options: they were refused as ambiguous)
    r = fxspeed("run", "-n", "3", PROBE, "--lr", "0.1", "-n", "7", "--nproc", "2", "--master", "x",
                env={"OMP_NUM_THREADS": "2"})
    assert r.returncode == 0, r.stdout + r.stderr
    lines = probes(r.stdout)
    assert sorted(lines) == [0, 1, 2]
    for rank, line in lines.items():
        assert (f"world=3 local={rank} omp=2 args=['--lr', '0.1', '-n', '7', '--nproc', '2', '--master', 'x']"
                in line)  # OMP_NUM_THREADS kept


def test_run_sets_omp_threads_to_the_cores_shared_out_when_unset() -> None:
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    r = subprocess.run([sys.executable, "-m", "fxspeed", "run", "-n", "2", PROBE], cwd=ROOT,
                       env={**env, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    want = default_threads(2)
    assert all(f"omp={want} " in line for line in probes(r.stdout).values()), r.stdout


def test_default_threads_share_the_cores_and_never_drop_below_one() -> None:
    assert default_threads(1) >= default_threads(2) >= 1
    assert default_threads(10_000) == 1


def test_run_with_module_flag_runs_a_module_like_python_dash_m() -> None:
    r = fxspeed("run", "-n", "2", "-m", "tests.workers.launch_probe", "x")
    assert r.returncode == 0, r.stdout + r.stderr
    assert sorted(probes(r.stdout)) == [0, 1] and "args=['x']" in r.stdout


def test_run_reports_the_rank_that_failed_and_returns_its_exit_code() -> None:
    r = fxspeed("run", "-n", "2", PROBE, "--fail-rank", "1")
    assert r.returncode == 5
    assert "probe rank 1 failing on request" in r.stderr
    assert "fxspeed run: rank 1 (of 2) failed first, with exit code 5" in r.stderr
    assert "Traceback" not in r.stderr  # a report, not a launcher crash


def test_python_dash_m_fxspeed_run_is_the_same_command_as_the_console_script() -> None:
    exe = Path(sys.executable).parent / "fxspeed"
    if not exe.exists():
        pytest.skip("the fxspeed console script is not installed in this environment")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    r = subprocess.run([str(exe), "run", "-n", "2", PROBE, "hi"], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    assert sorted(probes(r.stdout)) == [0, 1]


def test_run_requires_a_positive_process_count_and_a_script() -> None:
    p = build_parser()
    for argv in (["run", "-n", "0", "a.py"], ["run", "-n", "two", "a.py"], ["run", "a.py"], ["run", "-n", "2"]):
        with pytest.raises(SystemExit):
            p.parse_args(argv)
    a = p.parse_args(["run", "-n", "2", "train.py", "--steps", "3"])
    assert (a.nproc, a.script, a.script_args, a.module) == (2, "train.py", ["--steps", "3"], False)


def test_run_without_a_script_names_only_the_script_as_missing(capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["run", "-n", "2"])
    assert capsys.readouterr().err.rstrip().endswith("the following arguments are required: SCRIPT")


def test_run_of_a_script_that_does_not_exist_is_a_usage_error_before_any_rank_starts(
        capsys: pytest.CaptureFixture) -> None:
    from fxspeed.tools.cli import main

    with pytest.raises(SystemExit):
        main(["run", "-n", "2", "no_such_script.py"])
    assert "run: no such script 'no_such_script.py' (use -m to run a module)" in capsys.readouterr().err


def test_demo_on_two_processes_with_zero3_prints_the_plan_once_and_finishes() -> None:
    r = fxspeed("demo", "--devices", "2", "--zero", "3", "--steps", "3", "--batch-size", "4", "--seq-len", "32",
                env={"OMP_NUM_THREADS": "1"}, timeout=180)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-4000:]
    assert r.stdout.count("fxspeed plan · GPT") == 1  # only rank 0 prints
    assert "strategy: dp=2 zero=3" in r.stdout
    assert "2 processes, ZeRO-3, 2 sequences per rank" in r.stdout
    m = re.search(r"loss: first \d+ steps ([0-9.]+) -> last \d+ steps ([0-9.]+)", r.stdout)
    assert m and r.stdout.count("loss: first") == 1, out[-4000:]
    assert 0 < float(m.group(2)) < 6.0
    assert "3/3" in r.stderr  # rank 0's progress bar reached the end


def test_demo_refuses_a_global_batch_that_the_devices_cannot_share() -> None:
    r = fxspeed("demo", "--devices", "3", "--batch-size", "4", "--steps", "1", timeout=60)
    assert r.returncode == 2
    assert "--batch-size 4" in r.stderr and "divisible by --devices 3" in r.stderr
