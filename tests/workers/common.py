"""Models and batches shared by multi-process workers and the tests that check them, and the main of
the workers that run named cases (run_cases)."""

from __future__ import annotations

import argparse
import os
import sys
import time
import traceback
from typing import Callable

import torch

from fxspeed.models import GPT, GPTConfig


def build_model(name: str) -> torch.nn.Module:
    """'gpt' / 'gpt2': 2 blocks; 'gpt6' / 'gpt2-6': 6 blocks (enough stages for P=4 interleaved)."""
    torch.manual_seed(0)
    layers = 6 if name.endswith("6") else 2
    if name in ("gpt", "gpt6"):
        return GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=layers, n_head=2, n_embd=32))
    if name in ("gpt2", "gpt2-6"):
        import transformers

        cfg = transformers.GPT2Config(n_layer=layers, n_embd=32, n_head=2, vocab_size=64, n_positions=16,
                                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
        return transformers.GPT2LMHeadModel(cfg)
    raise ValueError(name)


def global_batches(name: str, steps: int, batch: int = 8, seq: int = 16) -> list:
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(steps):
        x = torch.randint(0, 64, (batch, seq), generator=g)
        y = torch.randint(0, 64, (batch, seq), generator=g)
        out.append({"input_ids": x, "labels": x} if name.startswith("gpt2") else (x, y))
    return out


def key_bias_masked(name: str, t: torch.Tensor) -> torch.Tensor:
    """The key third of a QKV bias zeroed: its true gradient is exactly zero (softmax ignores a
    per-row shift), so under Adam its float noise becomes +-lr steps that differ between
    mathematically equal programs. Parity checks compare everything else."""
    if name.endswith(("qkv.bias", "c_attn.bias")):
        t = t.clone()
        c = t.numel() // 3
        t[c:2 * c] = 0
    return t


def captured_gpt_step(layers: int, width: int, rows: int, precision: str = "fp32"):  # noqa: ANN201
    """A small GPT (vocab 64, 8 tokens), its batch and its captured single-device training step
    with the tied weight kept under both names (as the pipeline engine captures it):
    (model, (x, y), captured)."""
    import fxspeed
    from fxspeed.compiler import PassOptions, compile_step
    from fxspeed.devices import normalize_devices

    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=64, block_size=8, n_layer=layers, n_head=2, n_embd=width))
    g = torch.Generator().manual_seed(1)
    x, y = (torch.randint(0, 64, (rows, 8), generator=g) for _ in range(2))
    cfg = fxspeed.Config(precision=precision, disable_passes=("dedupe_tied_parameters",))
    cap = compile_step(model, (x, y), {}, config=cfg, loss_fn=None,
                       options=PassOptions.single_device(cfg)).captured
    return model, (x, y), cap


def run_cases(cases: dict[str, Callable[[], str]], argv: list[str] | None = None) -> None:
    """The main of a worker of named cases, launched as
    `fxspeed run -n N -m tests.workers.<worker> --case CASE --out DIR`.

    --case is one name, several joined by commas, or `all` (every case, in the dict's order). The
    cases run in turn in this launch's one process group (a launch costs more than most cases).
    Each returns "ok" or what went wrong; that text, or an exception's type, message and
    traceback, goes to DIR/{case}_rank{r}.txt, and the launch goes on and exits 0. DIR is also
    in the environment as WORKER_OUT for cases that write more files."""
    import torch.distributed as dist

    ap = argparse.ArgumentParser()
    ap.add_argument("--case", required=True, help=f"all, or some of {sorted(cases)} joined by commas")
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    names = list(cases) if a.case == "all" else a.case.split(",")
    unknown = [n for n in names if n not in cases]
    if unknown:
        ap.error(f"unknown case(s) {unknown}; choose from {sorted(cases)} or all")
    os.environ.setdefault("FXSPEED_BACKEND", "gloo")
    os.environ["WORKER_OUT"] = a.out
    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    for name in names:
        start = time.perf_counter()
        try:
            msg = cases[name]()
        except Exception as e:  # noqa: BLE001 - reported per case, the launch goes on
            msg = f"{type(e).__name__}: {e}\n{traceback.format_exc()[-3000:]}"
        with open(os.path.join(a.out, f"{name}_rank{rank}.txt"), "w") as f:
            f.write(msg)
        if rank == 0:  # where a launch's time goes, in the failing test's captured stderr
            print(f"case {name}: {time.perf_counter() - start:.1f} s", file=sys.stderr, flush=True)
    if dist.is_initialized():
        dist.destroy_process_group()


def write_mismatches(run_case: "Callable[[Any, str], list[str]]", cases: "list[Any]") -> None:
    """The main of a worker comparing engines case by case (`--swap DIR --out FILE`): rank 0
    writes every mismatch `run_case(case, swap_dir)` reports, or "ok"."""
    import argparse

    import torch.distributed as dist

    ap = argparse.ArgumentParser()
    ap.add_argument("--swap", required=True)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    bad: list[str] = []
    for case in cases:
        bad += run_case(case, args.swap)
    if dist.get_rank() == 0:
        with open(args.out, "w") as f:
            f.write("\n".join(bad) or "ok")
