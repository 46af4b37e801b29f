"""A fork server for the suite's multi-process launches (a zygote, as Android and Chromium call it).

Why: a rank started by `fxspeed run` / `torch.distributed.run` spends about 4.5 CPU-seconds
before it does any work (importing torch and fxspeed, then the lazy imports and first-call
caches of the first compile), and the launcher's own process about 3 more. The suite makes
about 60 launches on a 2-core machine: measured with FXSPEED_CPU_REPORT, two thirds of the
suite's CPU time went to rank processes, and a large share of it to those fixed costs.

What: one long-lived process per pytest process imports torch and fxspeed and compiles a tiny
GPT once, then forks the ranks of each launch (`python -m tests.rank_forker` speaks JSON lines
on stdin/stdout). A forked rank gets the environment torchrun would give it (RANK, LOCAL_RANK,
WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT), the launch's cwd, environment and
argv, torch's default seed, and runs the worker module as `__main__`. As with torchrun's agent,
the first rank that fails stops the others.

Only launches that do not measure memory go through it (tests.multiprocess decides): a forked
rank shares the server's pages and its malloc settings, so its RSS is not a fresh process's.
The launcher itself (`fxspeed run`) keeps its own tests (test_launcher, test_demo, ...).
FXSPEED_TEST_FORK=0 turns the server off: every launch then execs, as before.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import sys
import tempfile
import time
import traceback
from typing import Any

# torch's default generator seed in a fresh process (torch.initial_seed() before any seeding).
FRESH_SEED = 67280421310721


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _warm_up() -> None:
    """Import and run once what every rank would otherwise load itself."""
    import torch

    torch.set_num_threads(1)
    # Start autograd's engine with a real backward before anything runs one under FakeTensorMode
    # (the compile below traces the training step with fake tensors): in a CUDA build of torch
    # the engine started inside FakeTensorMode counts fake CUDA devices (8), starts a thread for
    # each and marks every later fork as unable to run backward ("Unable to handle autograd's
    # threading in combination with fork-based multiprocessing"). Started here, it counts the
    # real devices: none on a CPU-only host, so no threads; a host with a GPU still has some
    # (see _ranks_can_run_backward).
    w = torch.zeros(1, requires_grad=True)
    (w * 2).sum().backward()
    import torch.distributed  # noqa: F401

    import fxspeed
    import tests.workers.common  # noqa: F401
    from fxspeed.models import GPT, GPTConfig

    model = GPT(GPTConfig.preset("tiny"))
    x = torch.randint(0, 256, (2, 16))
    fxspeed.compile(model, 1, fxspeed.Config(zero=0, optimizer="adam"), example_inputs=(x, x)).train_step(x, x)
    _warm_up_hugging_face()
    import fxspeed.runtime.checkpoint  # noqa: F401 - torch.distributed.checkpoint: every rank that saves
    import gc

    gc.collect()


def _warm_up_hugging_face() -> None:
    """Import transformers and the model classes the workers build: about a third of the forked
    launches (tensor-parallel, pipeline, serving, correctness) build a Hugging Face GPT-2, Llama,
    BERT or T5 in every rank, and importing transformers and a model's modules (modeling_utils,
    masking_utils, generation, ...) cost each such rank about 1.5 CPU-seconds of its own (a forked
    child building and compiling a tiny GPT-2: 2.3-3.0 CPU-s from a server without them, 1.0-1.5
    with). Without transformers installed the workers that need it fail in the rank as before."""
    try:
        import transformers
    except ImportError:
        return
    for name in ("GPT2LMHeadModel", "LlamaForCausalLM", "BertForMaskedLM", "T5ForConditionalGeneration"):
        getattr(transformers, name)  # the lazy module imports the model's modules here


def _ranks_can_run_backward() -> bool:
    """Whether a child forked now can run a backward (see _warm_up); where it cannot, the client
    execs every launch instead."""
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            import torch

            w = torch.zeros(1, requires_grad=True)
            (w * 2).sum().backward()
            code = 0
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status) == 0


def _rank_main(req: dict[str, Any], rank: int, port: int, out_dir: str) -> None:
    """In the forked child: become rank `rank` of the launch and never return."""
    code = 1
    try:
        os.setpgid(0, 0)
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)
        for fd, name in ((1, "out"), (2, "err")):
            f = os.open(os.path.join(out_dir, f"{name}{rank}.txt"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
            os.dup2(f, fd)
            os.close(f)
        sys.stdout = sys.__stdout__  # the server pointed it at stderr; fd 1 is the rank's out file now
        os.chdir(req["cwd"])
        os.environ.clear()
        os.environ.update(req["env"])
        n = req["nproc"]
        os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(n), LOCAL_WORLD_SIZE=str(n),
                          GROUP_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        import runpy

        import torch

        torch.manual_seed(FRESH_SEED)
        sys.argv = [req["module"], *req["args"]]
        sys.path[0] = req["cwd"]
        try:
            runpy.run_module(req["module"], run_name="__main__", alter_sys=True)
            code = 0
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        except BaseException:  # noqa: BLE001 - reported like an uncaught exception in a fresh process
            traceback.print_exc()
            code = 1
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def _stop(pids: list[int]) -> None:
    """SIGTERM, then SIGKILL after 5 s: what torchrun's agent does to the ranks left."""
    for sig, wait in ((signal.SIGTERM, 5.0), (signal.SIGKILL, 0.0)):
        for pid in pids:
            try:
                os.killpg(pid, sig)
            except ProcessLookupError:
                pass
        end = time.monotonic() + wait
        while pids and time.monotonic() < end:
            pids = [p for p in pids if os.waitpid(p, os.WNOHANG) == (0, 0)]
            time.sleep(0.05)
    for pid in pids:
        try:
            os.waitpid(pid, 0)
        except ChildProcessError:
            pass


def _launch(req: dict[str, Any]) -> dict[str, Any]:
    out_dir = tempfile.mkdtemp(prefix="rank_forker_")
    port = _free_port()
    pids: dict[int, int] = {}
    for rank in range(req["nproc"]):
        pid = os.fork()
        if pid == 0:
            _rank_main(req, rank, port, out_dir)
        try:  # also here: a rank stopped before its own setpgid ran must still be in its group
            os.setpgid(pid, pid)
        except OSError:
            pass
        pids[pid] = rank
    codes: dict[int, int] = {}
    deadline = time.monotonic() + req["timeout"] if req.get("timeout") else None
    timed_out = False
    cpu_s = 0.0
    while len(codes) < len(pids):
        pid, status, usage = os.wait4(-1, os.WNOHANG)
        if pid == 0:
            if deadline is not None and time.monotonic() > deadline:
                timed_out = True
                _stop([p for p in pids if pids[p] not in codes])
                break
            time.sleep(0.02)
            continue
        if pid not in pids:
            continue
        cpu_s += usage.ru_utime + usage.ru_stime
        codes[pids[pid]] = os.waitstatus_to_exitcode(status)
        if codes[pids[pid]] != 0:  # the first failure stops the others
            left = [p for p in pids if pids[p] not in codes]
            _stop(left)
            for p in left:
                codes.setdefault(pids[p], -signal.SIGTERM)
    texts = {}
    for name in ("out", "err"):
        parts = []
        for rank in range(req["nproc"]):
            path = os.path.join(out_dir, f"{name}{rank}.txt")
            if os.path.exists(path):
                with open(path, errors="replace") as f:
                    parts.append(f.read())
                os.remove(path)
        texts[name] = "".join(parts)
    os.rmdir(out_dir)
    failed = sorted((r, c) for r, c in codes.items() if c != 0)
    rc = 0 if not failed else (failed[0][1] if failed[0][1] > 0 else 1)
    if failed:
        texts["err"] += (f"\nrank_forker: rank(s) {[r for r, _ in failed]} failed with exit code(s) "
                         f"{[c for _, c in failed]}\n")
    return {"rc": rc, "stdout": texts["out"], "stderr": texts["err"], "timed_out": timed_out,
            "cpu_s": cpu_s}


def serve() -> None:
    """Warm up, say "ready" (and whether forked ranks can run backward; if not, exit), then
    answer one launch per line of stdin."""
    reply = sys.stdout
    sys.stdout = sys.stderr  # anything the warm-up prints must not corrupt the replies
    _warm_up()
    forkable = _ranks_can_run_backward()
    reply.write(json.dumps({"ready": True, "pid": os.getpid(), "forkable": forkable}) + "\n")
    reply.flush()
    if not forkable:
        return
    for line in sys.stdin:
        req = json.loads(line)
        try:
            ans = _launch(req)
        except Exception:  # noqa: BLE001 - the client falls back to exec on an error
            ans = {"error": traceback.format_exc()}
        reply.write(json.dumps(ans) + "\n")
        reply.flush()


if __name__ == "__main__":
    serve()
