"""`fxspeed serve`: build a causal LM from a Hugging Face config, serve it and print the tokens.

    fxspeed serve --model gpt2 --prompt "464 2068 7586" --prompt "40 1101" --max-new-tokens 16
    fxspeed serve --model ./my-llama-dir --tensor 2 --precision bf16 --prompt "1 2 3"

`--model` is a folder with a config.json (and its weights, when the folder has them: loaded with
`from_pretrained`; otherwise random init) or a Hugging Face model type (`gpt2`, `llama`, ...: that
architecture's default config, random init; nothing is downloaded). Prompts are token ids (no
tokenizer is involved). `--tensor N` > 1 outside a launched group re-launches itself on N local
processes (`fxspeed run -n N -m fxspeed serve ...`); every rank serves, rank 0 prints.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import time
from typing import Any

from fxspeed.tools.arg_types import key_value, non_negative_float, non_negative_int, positive_int, probability
from fxspeed.tools.launcher import launch


def add_parser(sub: argparse._SubParsersAction) -> None:
    s = sub.add_parser("serve", help="serve a Hugging Face causal LM built from its config and print the tokens",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    s.add_argument("--model", required=True, help="a folder with config.json, or a model type such as gpt2 or llama")
    s.add_argument("--layers", type=positive_int, default=None, help="override the config's layer count (quick trials)")
    s.add_argument("--set", action="append", type=key_value, default=[], metavar="KEY=VALUE",
                   help="override a field of the Hugging Face config (repeatable), e.g. --set hidden_size=256")
    s.add_argument("--prompt", action="append", required=True, metavar="IDS",
                   help="space-separated token ids of one request; repeat for more requests")
    s.add_argument("--max-new-tokens", type=positive_int, default=16)
    s.add_argument("--temperature", type=non_negative_float, default=0.0, help="0 is greedy (default)")
    s.add_argument("--top-k", type=non_negative_int, default=None, help="keep the k most likely tokens (0 or unset: all)")
    s.add_argument("--top-p", type=probability, default=None)
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--eos-token-id", type=non_negative_int, action="append", default=None, metavar="ID",
                   help="stop a request at this token (returned with it); repeat for several")
    s.add_argument("--tensor", type=positive_int, default=1, help="tensor-parallel processes (default: 1)")
    s.add_argument("--precision", choices=("fp32", "bf16", "fp16"), default="fp32")
    s.add_argument("--token-budget", type=positive_int, default=256)
    s.add_argument("--plan", action="store_true", help="print the inference plan first")


def hf_config(name: str, layers: int | None, command: str = "serve",
              overrides: dict[str, Any] | None = None):  # noqa: ANN201 - (PretrainedConfig, bool)
    """The Hugging Face config of `--model` (a folder with a config.json, or a model type: that
    architecture's defaults, nothing downloaded) with `layers` and `overrides` given to its
    constructor, so that the fields it derives follow them (Llama's head_dim from hidden_size,
    Qwen2's layer_types from the layer count: setting them afterwards left those stale; a folder's
    stored values of such fields are derived again too); and whether the folder holds weights
    that fit it. A bad name exits naming the closest types."""
    import difflib

    import transformers

    transformers.logging.set_verbosity_error()
    if os.path.isdir(name):
        if not os.path.isfile(os.path.join(name, "config.json")):
            raise SystemExit(f"fxspeed {command}: --model {name!r} is a folder without a config.json; give a Hugging "
                             "Face model folder (config.json, and weights if it has them) or a model type such as gpt2")
        make = functools.partial(transformers.AutoConfig.from_pretrained, name)
        has_weights = any(f.endswith((".safetensors", ".bin")) for f in os.listdir(name))
    else:
        make = functools.partial(transformers.AutoConfig.for_model, name)
        has_weights = False
    try:
        cfg = make()
    except ValueError as e:
        if os.path.isdir(name):  # an unknown model_type, a malformed field
            raise SystemExit(f"fxspeed {command}: --model {name!r}: its config.json does not load: {e}") from None
        # HF's own message lists every model type it knows (about 10 KB): name the closest few
        known = list(transformers.CONFIG_MAPPING.keys())
        close = difflib.get_close_matches(name, known, n=3, cutoff=0.7)
        hint = (f"; did you mean {', '.join(close)}?" if close else
                f" ({len(known)} types, e.g. gpt2, llama, mistral, qwen2, opt, gpt_neox, phi)")
        raise SystemExit(f"fxspeed {command}: --model {name!r} is neither a folder nor a Hugging Face model type"
                         + hint) from None
    # a common name the config maps to its own field (GPT-2's hidden_size -> n_embd)
    aliases = getattr(cfg, "attribute_map", None) or {}
    kw = {aliases.get(k, k): v for k, v in (overrides or {}).items()}
    fields = cfg.to_dict()
    for key in kw:
        if key not in fields:  # the constructors take any keyword silently
            close = difflib.get_close_matches(key, list(fields), n=3, cutoff=0.7)
            raise SystemExit(f"fxspeed {command}: --set {key}=...: {type(cfg).__name__} has no field {key!r}"
                             + (f"; did you mean {', '.join(close)}?" if close else ""))
    if layers is not None:
        kw.update({key: layers for key in ("num_hidden_layers", "n_layer") if key in fields})
    if kw:
        cls = type(cfg)
        try:
            # The fields a fresh config derives from the overridden ones (Llama's head_dim from
            # hidden_size, Qwen2's layer_types from the layer count) are dropped from the loaded
            # ones and derived again: a folder's config.json stores them, and kept they described
            # another shape than the overrides ask for
            fresh, moved = cls().to_dict(), cls(**kw).to_dict()
            derived = {k for k in fresh if k not in kw and fresh[k] != moved.get(k)}
            cfg = cls(**{**{k: v for k, v in fields.items() if k not in derived}, **kw})
        except Exception as e:  # noqa: BLE001 - HF's validation (sizes that must divide) says what is wrong
            raise SystemExit(f"fxspeed {command}: --set / --layers give {type(cfg).__name__} a config it refuses: "
                             f"{e}") from None
        has_weights = False  # another shape than the checkpoint's
    cfg._attn_implementation = "sdpa"
    return cfg, has_weights


def build_model(name: str, layers: int | None, overrides: dict[str, Any] | None = None):  # noqa: ANN201
    """The causal LM of `--model` (see hf_config): from the folder's weights when it has them and
    nothing overrides its shape, else randomly initialized (seed 0)."""
    import transformers

    cfg, has_weights = hf_config(name, layers, overrides=overrides)
    if has_weights:
        return transformers.AutoModelForCausalLM.from_pretrained(name, config=cfg).eval()
    import torch

    torch.manual_seed(0)
    try:
        return transformers.AutoModelForCausalLM.from_config(cfg).eval()
    except ValueError as e:  # sizes the config takes but the model does not (heads that do not divide the width)
        raise SystemExit(f"fxspeed: --model {name!r} with these --set / --layers: {type(cfg).__name__} builds no "
                         f"model: {e}") from None


_STATUS = "FXSPEED_SERVE_STATUS"  # where launched ranks leave the number of refused requests


def run(args: argparse.Namespace) -> int:
    if args.tensor > 1 and not ("LOCAL_RANK" in os.environ and os.environ.get("WORLD_SIZE") == str(args.tensor)):
        argv = list(getattr(args, "argv", None) or sys.argv[1:])
        # The ranks exit 0 when they served (a request refused is a result, not a crash: a rank
        # exiting 1 makes the launcher report a failure); rank 0 writes how many were refused.
        import tempfile

        with tempfile.TemporaryDirectory() as tmp:
            status = os.path.join(tmp, "refused")
            os.environ[_STATUS] = status
            try:
                code = launch(args.tensor, "fxspeed", argv if "serve" in argv else ["serve", *argv], module=True)
            finally:
                del os.environ[_STATUS]
            if code == 0 and os.path.exists(status):
                with open(status) as f:
                    code = 1 if int(f.read() or 0) else 0
            return code
    import fxspeed

    try:
        prompts = [[int(t) for t in p.split()] for p in args.prompt]
    except ValueError:
        print("fxspeed serve: --prompt takes space-separated token ids, e.g. --prompt \"464 2068\"", file=sys.stderr)
        return 2
    model = build_model(args.model, args.layers, dict(args.set))
    t0 = time.perf_counter()
    engine = fxspeed.serve(model, devices=args.tensor,
                           config=fxspeed.Config(tensor=args.tensor, precision=args.precision),
                           token_budget=args.token_budget, max_batch=min(16, args.token_budget))
    rank0 = int(os.environ.get("RANK", "0")) == 0
    if rank0:
        print(f"fxspeed serve: {type(model).__name__} compiled in {time.perf_counter() - t0:.1f}s", flush=True)
        if args.plan:
            print(engine.plan.summary(), flush=True)
    try:
        outs = engine.generate(prompts, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                               top_k=args.top_k, top_p=args.top_p, seed=args.seed, eos_token_id=args.eos_token_id,
                               on_error="return")
    except fxspeed.ConfigError as e:  # an option the model refuses (an --eos-token-id past its vocabulary), every rank
        if rank0:
            print(f"fxspeed serve: {e}", file=sys.stderr)
        return 2
    failed = sum(isinstance(out, fxspeed.RequestError) for out in outs)
    if rank0:
        for i, out in enumerate(outs):
            if isinstance(out, fxspeed.RequestError):
                print(f"request {i}: error: {out.reason}", flush=True)
            else:
                print(f"request {i}: {' '.join(map(str, out))}", flush=True)
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()  # every rank is done with its collectives before the group goes away
        dist.destroy_process_group()
    if os.environ.get(_STATUS):  # launched by run() above: it gives the exit code
        if rank0:
            with open(os.environ[_STATUS], "w") as f:
                f.write(str(failed))
        return 0
    return 1 if failed else 0
