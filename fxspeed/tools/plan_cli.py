"""`fxspeed plan`: plan a Hugging Face causal LM for a cluster without running it, from its config.

    fxspeed plan --model llama --set hidden_size=4096 --set intermediate_size=11008 \\
        --set num_hidden_layers=32 --devices H100-80GB:64 --batch 4 --seq 4096 \\
        --zero 0,1,2,3 --precision bf16
    fxspeed plan --model ./my-model-dir --devices H200:16 --tensor 8 --pipeline 2 --microbatches 8 --plot plan.png

The model is built on the meta device (no memory, no weights, nothing downloaded) and traced on
fake tensors: `fxspeed.plan` with `input_ids` and `labels` of `--batch` x `--seq` tokens per
data-parallel replica. `--zero`, `--precision`, `--tensor` and `--pipeline` take comma-separated
lists: every combination is planned and printed as one row of a table (DeepSpeed's memory
estimators, for every strategy at once); a single combination prints the whole plan summary.
Other Config keys go through `--config KEY=VALUE` (e.g. `--config offload=optimizer`,
`--config grad_accum=4`); a misspelt key is refused with the closest names.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from typing import Any, Callable

from fxspeed.tools.arg_types import key_value, positive_int


def _list_of(convert: Callable[[str], Any], expected: str) -> Callable[[str], list[Any]]:
    def parse(text: str) -> list[Any]:
        try:
            values = [convert(v) for v in text.split(",") if v.strip()]
        except (ValueError, argparse.ArgumentTypeError):
            raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}") from None
        if not values:
            raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}")
        return values

    return parse


def _one_of(*allowed: str) -> Callable[[str], str]:
    def parse(text: str) -> str:
        if text.strip() not in allowed:
            raise ValueError(text)
        return text.strip()

    return parse


def add_parser(sub: argparse._SubParsersAction) -> None:
    s = sub.add_parser("plan", help="plan a Hugging Face causal LM for a cluster from its config, without running it",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    s.add_argument("--model", required=True, help="a folder with config.json, or a model type such as gpt2 or llama")
    s.add_argument("--set", action="append", type=key_value, default=[], metavar="KEY=VALUE",
                   help="override a field of the Hugging Face config (repeatable), e.g. --set hidden_size=4096")
    s.add_argument("--layers", type=positive_int, default=None, help="override the config's layer count")
    s.add_argument("--devices", default="1",
                   help="PRESET:N (e.g. H100-80GB:64, A100-80GB:8, H200:16, cpu:2), PRESET (one), or N local "
                        "devices (default: 1)")
    s.add_argument("--batch", type=positive_int, default=1, help="sequences per data-parallel replica (default: 1)")
    s.add_argument("--seq", type=positive_int, default=None,
                   help="tokens per sequence (default: the config's max_position_embeddings, at most 4096)")
    s.add_argument("--zero", type=_list_of(lambda t: int(_one_of("0", "1", "2", "3")(t)), "ZeRO stages 0-3, comma-separated"), default=[0],
                   help="ZeRO stage(s), e.g. 3 or 0,1,2,3 (default: 0)")
    s.add_argument("--precision", type=_list_of(_one_of("fp32", "bf16", "fp16"), "fp32, bf16 or fp16, comma-separated"), default=["fp32"],
                   help="precision(s), e.g. bf16 or fp32,bf16 (default: fp32)")
    s.add_argument("--tensor", type=_list_of(positive_int, "positive integers, comma-separated"), default=[1],
                   help="tensor-parallel degree(s) (default: 1)")
    s.add_argument("--pipeline", type=_list_of(positive_int, "positive integers, comma-separated"), default=[1],
                   help="pipeline stage count(s) (default: 1)")
    s.add_argument("--microbatches", type=positive_int, default=None,
                   help="micro-batches per step under --pipeline > 1 (default: Config's, 1: a pipeline of one "
                        "micro-batch idles (P-1)/P of its time; --batch must divide by it)")
    s.add_argument("--config", action="append", type=key_value, default=[], metavar="KEY=VALUE",
                   help="any other fxspeed.Config key (repeatable), e.g. --config offload=optimizer")
    s.add_argument("--json", metavar="FILE", help="write the plan (or, for several, a list of them) as JSON")
    s.add_argument("--plot", metavar="FILE", help="one combination only: save its memory breakdown and timeline "
                                                  "(needs matplotlib)")


def _devices(text: str) -> list[Any]:
    import fxspeed
    from fxspeed.errors import ConfigError

    name, _, count = text.partition(":")
    if name.isdigit() and not count:
        name, count = "auto", name
    try:
        n = int(count) if count else 1
        return fxspeed.devices(name, n)
    except ConfigError as e:  # a ValueError too: first
        raise SystemExit(f"fxspeed plan: --devices {text!r}: {e}") from None
    except ValueError:
        raise SystemExit(f"fxspeed plan: --devices {text!r}: expected PRESET:N, PRESET or N") from None


def _model(args: argparse.Namespace) -> Any:
    import torch
    import transformers

    from fxspeed.tools.serve_cli import hf_config

    cfg, _ = hf_config(args.model, args.layers, command="plan", overrides=dict(args.set))
    with torch.device("meta"):
        return transformers.AutoModelForCausalLM.from_config(cfg)


def _row(cfg: dict[str, Any], plan: Any, tokens: int) -> str:
    from fxspeed.units import size

    ranks = range(len(plan.rank_memory))
    peak = max(plan.peak_memory(r) for r in ranks)
    states = sum(plan.model_states.values())
    comm = sum(plan.communication.values()) + sum(plan.tp_communication.values())
    # --batch is per replica, so rows with other tp/pp degrees step other global batches: tokens/s
    # over the whole cluster is the figure that compares them
    rate = tokens * plan.strategy["dp"] / max(plan.time["total"], 1e-12)
    return (f"{cfg['zero']:>4} {cfg['precision']:>9} {cfg['tensor']:>3} {cfg['pipeline']:>3} "
            f"{plan.strategy['dp']:>4} {size(states, 10)} {size(peak, 10)} {'yes' if plan.fits() else 'NO':>4} "
            f"{plan.time['total']:>9.3f} {rate:>10,.0f} {size(comm, 10)}")


HEADER = (f"{'zero':>4} {'precision':>9} {'tp':>3} {'pp':>3} {'dp':>4} {'states/rk':>10} {'peak/rank':>10} "
          f"{'fits':>4} {'step (s)':>9} {'tokens/s':>10} {'comm/rank':>10}")


def run(args: argparse.Namespace) -> int:
    import torch

    import fxspeed
    from fxspeed.errors import FxspeedError

    extra = dict(args.config)
    flagged = sorted(set(extra) & {"zero", "precision", "tensor", "pipeline", "microbatches"})
    if flagged:
        print(f"fxspeed plan: --config {flagged[0]}=...: use --{flagged[0]} (it takes a list)", file=sys.stderr)
        return 2
    if args.microbatches is not None:
        extra["microbatches"] = args.microbatches
    try:  # a misspelt key or a bad value once, before any model is built or traced
        fxspeed.Config(**{**extra, "zero": args.zero[0], "precision": args.precision[0]})
    except FxspeedError as e:
        print(f"fxspeed plan: --config: {e}", file=sys.stderr)
        return 2
    devs = _devices(args.devices)
    model = _model(args)
    seq = args.seq or min(getattr(model.config, "max_position_embeddings", 1024) or 1024, 4096)
    ids = torch.zeros(args.batch, seq, dtype=torch.long, device="meta")
    combos = [dict(zero=z, precision=p, tensor=t, pipeline=pp, **extra)
              for z, p, t, pp in itertools.product(args.zero, args.precision, args.tensor, args.pipeline)]
    if args.plot and len(combos) > 1:
        print(f"fxspeed plan: --plot takes one combination; these flags give {len(combos)}", file=sys.stderr)
        return 2
    n = sum(p.numel() for p in model.parameters())
    print(f"fxspeed plan: {type(model).__name__}, {n / 1e9:.2f}B parameters, {len(devs)} x {devs[0].name}, "
          f"{args.batch} x {seq} tokens per replica", flush=True)
    plans, failed = [], 0
    if len(combos) > 1:
        print(HEADER, flush=True)
    for c in combos:
        t0 = time.perf_counter()
        try:
            plan = fxspeed.plan(model, devs, fxspeed.Config(**c), example_inputs={"input_ids": ids, "labels": ids})
        except Exception as e:  # noqa: BLE001 - one row's failure (a ConfigError, torch's own) ends only that row
            failed += 1
            label = " ".join(f"{k}={v}" for k, v in c.items())
            print(f"{label}: {type(e).__name__}: {e}", flush=True)
            continue
        plans.append((c, plan))
        if len(combos) > 1:
            print(f"{_row(c, plan, args.batch * seq)}   ({time.perf_counter() - t0:.1f}s to plan)", flush=True)
        else:
            print(plan.summary(), flush=True)
    if args.json and plans:
        with open(args.json, "w") as f:
            if len(combos) == 1:
                f.write(plans[0][1].to_json())
            else:
                json.dump([{"config": c, "plan": p.to_dict()} for c, p in plans], f, indent=1)
    if args.plot and plans:
        _plot(plans[0][1], args.plot)
    return 1 if failed == len(combos) else 0


def _plot(plan: Any, path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise SystemExit("fxspeed plan: --plot needs matplotlib (pip install matplotlib)") from None
    from fxspeed.tools import viz

    fig, (a, b) = plt.subplots(1, 2, figsize=(13, 4.5))
    viz.plot_memory_breakdown(plan, ax=a)
    viz.plot_timeline(plan, ax=b)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"fxspeed plan: wrote {path}", flush=True)
