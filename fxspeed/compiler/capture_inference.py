"""Capture and compile a causal LM's forward as a serving program for one packed row of tokens.

    model(input_ids [1, T], position_ids [1, T], use_cache=False) -> logits      (eager)
                 becomes
    gm(*params, *buffers, tokens, positions, slot_mapping, block_table, query_index, query_pos,
       *kv_cache) -> (logits,)                                                    (one ATen graph)

The forward is captured once per token bucket T with `capture_step(train=False)` (fake tensors,
the model's Python never runs at serve time), its inputs relabelled (`tokens`, `positions`), its
outputs cut to the logits, then the inference passes run under the pass manager:

    dedupe_tied_parameters, normalize_graph, insert_casts (bf16/fp16 configs),
    keep_activations_low (bf16/fp16 unless Config.low_activations=False), [shard_tensors],
    kv_cache, select_logits, [fuse_kernels, fuse_rotary, fuse_activations, fuse_residual_norms,
    fold_norm_casts (CUDA programs; after shard_tensors, so on this tp rank's heads and columns);
    fuse_activations alone elsewhere], [upcast_cpu_compute], drop_clones (the capture's copies of
    eval-mode dropout), eliminate_dead_code, pack_linear_weights (CPU programs of at most
    pack_linear_tokens tokens: fp32 linear weights pre-packed for oneDNN), annotate

Tensor parallelism (options.tp_size > 1): `shard_tensors` cuts the program for this tp rank
before `kv_cache`, with the parameter layout of the engine's "tp_placements" analysis (solved
on the first program, the largest bucket, and kept for every later one, so every bucket reads
the same weight slices and the same KV-cache heads). The cache pass then sees this rank's
attention heads, so the cache holds only them: [blocks, block_size, kv_heads / T, head_dim].

A model whose forward takes no `position_ids` (fxspeed's GPT) makes its own `arange(T)`, which
`kv_cache` replaces by a `positions` input.
"""

from __future__ import annotations

import dataclasses
import inspect
import time
from typing import Any, Sequence

import torch
import torch.nn as nn

from fxspeed.compiler.annotate import make_annotate_pass
from fxspeed.compiler.capture import (capture_step, check_no_fake_constants, forget_stale_graph_sources,
                                     graph_source_keys)
from fxspeed.compiler.rewrite import wanted_on
from fxspeed.compiler.options import PassOptions
from fxspeed.compiler.pass_manager import PassContext, PassManager
from fxspeed.compiler.pipelines import FUSION_PASS_NAMES, OPTIONAL_PASS_NAMES
from fxspeed.compiler.rewrite import output_node
from fxspeed.config import Config
from fxspeed.errors import CaptureError
from fxspeed.ir import IOSpec
from fxspeed.ir.program import InferenceProgram




def _inputs(model: nn.Module, T: int, device: torch.device) -> tuple[tuple, dict, list[str]]:
    """The example call and the meaning of each traced tensor, in the order capture feeds them."""
    ids = torch.zeros(1, T, dtype=torch.long, device=device)
    pos = torch.arange(T, device=device)[None]
    # a torch.compile'd model is traced as its original module (capture's _without_torch_compile):
    # its arguments are the original forward's, not OptimizedModule's (*args, **kwargs)
    params = inspect.signature(getattr(model, "_orig_mod", model).forward).parameters
    if "input_ids" in params:
        kwargs: dict = {"input_ids": ids}
        kinds = ["tokens"]
        if "position_ids" in params:
            kwargs["position_ids"] = pos
            kinds.append("positions")
        if "use_cache" in params:
            kwargs["use_cache"] = False
        return (), kwargs, kinds
    first = next((p for p in params.values() if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)), None)
    if first is None:
        raise CaptureError(f"{type(model).__name__}.forward takes no token ids (neither `input_ids` nor a positional "
                           "argument); a served model is called as model(input_ids) -> logits")
    return (ids,), {}, ["tokens"]


def compile_inference(model: nn.Module, tokens: int, *, config: Config, options: PassOptions | None = None,
                      analyses: Sequence[Any] = ()) -> InferenceProgram:
    """The serving program for a packed row of `tokens` tokens (see the module docstring).
    `analyses`: planner-made analyses (the "tp_placements" that shard_tensors requires when
    options.tp_size > 1)."""
    from fxspeed.passes import (ALL_PASSES, STAGE_PASS_NAMES, dedupe_tied_parameters, eliminate_dead_code,
                                insert_casts, keep_activations_low, normalize_graph, shard_tensors)
    from fxspeed.passes.graph.fuse_kernels import fuse_kernels, wanted as fusion_wanted
    from fxspeed.passes.graph.fuse_activations import fuse_activations
    from fxspeed.passes.graph.fuse_residual_norms import fuse_residual_norms
    from fxspeed.passes.graph.fold_norm_casts import fold_norm_casts
    from fxspeed.passes.graph.fuse_rotary import fuse_rotary
    from fxspeed.passes.inference.drop_clones import drop_clones
    from fxspeed.passes.inference.kv_cache import kv_cache
    from fxspeed.passes.inference.pack_linear_weights import pack_linear_weights
    from fxspeed.runtime.serving import model_vocab, sliding_windows
    from fxspeed.passes.inference.select_logits import select_logits
    from fxspeed.passes.graph.upcast_cpu_compute import upcast_cpu_compute, wanted as upcast_wanted

    opts = options or PassOptions.single_device(config)
    if not opts.kv_windows and (windows := sliding_windows(model)):
        opts = dataclasses.replace(opts, kv_windows=windows)
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    args, kwargs, kinds = _inputs(model, tokens, device)
    sources = graph_source_keys()
    t0 = time.perf_counter()
    # constants checked after the passes: the kv_cache pass may drop a cached mask's only reader
    cap = capture_step(model, args, kwargs, train=False, check_constants=False)
    t1 = time.perf_counter()
    sig = cap.signature
    user = [i for i, s in enumerate(sig.inputs) if s.kind == "input"]
    for i, kind in zip(user, kinds):
        sig.inputs[i] = IOSpec(kind, "")
    gm = cap.gm
    out = output_node(gm)
    written = [s.target for s in sig.outputs if s.kind == "buffer_update"]
    _check_buffer_writes(model, written)
    outs = list(out.args[0])
    names = _output_names(cap.out_spec, len(outs))
    want = names.index("logits") if "logits" in names else 0
    logits = outs[want]
    shape = tuple(logits.meta["val"].shape)
    if len(shape) != 3 or shape[:2] != (1, tokens):
        raise CaptureError(f"{type(model).__name__}'s output {names[want]!r} has shape {shape}; a served model "
                           f"returns logits [batch, tokens, vocab] (here [1, {tokens}, vocab])")
    if "logits" not in names:
        # A Hugging Face base model (LlamaModel: hidden states, no LM head), or a forward whose first
        # output is not the logits, was served with the argmax of its hidden units as the next token
        # (h61). An output named logits is taken as it is: some heads are narrower than the
        # embedding's padded vocabulary (config.unpadded_vocab_size)
        vocab = model_vocab(model)
        if cap.out_type is not None:
            raise CaptureError(f"{type(model).__name__} returns no logits (its outputs: {', '.join(names)}): a base "
                               "model without its language-model head; serve its ...ForCausalLM class")
        if vocab is not None and shape[-1] != vocab:
            raise CaptureError(f"{type(model).__name__}'s output {names[want]!r} has {shape[-1]} entries per token but "
                               f"its vocabulary has {vocab}; a served model returns next-token logits over its "
                               "vocabulary, as its first output or one named 'logits'")
    out.args = ((logits,),)
    sig.outputs = [IOSpec("output", "logits")]
    gm.graph.eliminate_dead_code()
    gm.recompile()
    ctx = PassContext(signature=sig, module_of=cap.module_of, options=opts.local(), model_name=type(model).__name__)
    tp = [shard_tensors] if opts.tp_size > 1 else []
    # A tied weight (GPT-2's wte / lm_head) is fed once: shard_tensors must see one tensor, or it
    # could slice it one way for the embedding and keep it whole for the head.
    # Norms, rotaries, activations and residual adds + norms (forward regions only) as Triton
    # kernels where the program runs on CUDA: after select_logits, so the final norm of a program
    # that keeps one row per sequence is fused at the size it runs at; and, under tensor
    # parallelism, after shard_tensors, so each fused region is local to this rank.
    fusion = [fuse_kernels, fuse_rotary, fuse_activations, fuse_residual_norms, fold_norm_casts]
    # On the CPU only the activations (unless fusion is "off"): the runtime calls the fused op's torch
    # body, one aten.gelu where GPT-2's written-out tanh GELU runs eight ops (runtime/kernels/direct_calls.py).
    on_cpu = opts.fuse_kernels != "off" and not wanted_on(gm, "cuda")
    fuse = fusion if fusion_wanted(gm, opts) else [fuse_activations] if on_cpu else []
    upcast = [upcast_cpu_compute] if upcast_wanted(gm, opts) else []
    passes = [dedupe_tied_parameters, normalize_graph, insert_casts, keep_activations_low, *tp, kv_cache, select_logits,
              *fuse, *upcast, drop_clones, eliminate_dead_code, pack_linear_weights]
    pm = PassManager(passes, analyses=[make_annotate_pass(), *analyses], disabled=config.disable_passes,
                     known=[*ALL_PASSES, *STAGE_PASS_NAMES, *OPTIONAL_PASS_NAMES, *FUSION_PASS_NAMES,
                            *(p.name for p in passes)])
    gm = pm.ensure("annotate", pm.run(gm, ctx), ctx)
    check_no_fake_constants(model, gm, cap.module_of)
    t2 = time.perf_counter()
    forget_stale_graph_sources(sources, gm)  # the passes' intermediate programs' (a dozen per bucket)
    return InferenceProgram(gm=gm, signature=sig, tokens=tokens, kv_layout=list(gm.meta["kv_cache_layout"]),
                            selects_logits=bool(gm.meta.get("selects_logits")), window=gm.meta.get("kv_cache_window"),
                            kv_windows=tuple(gm.meta.get("kv_cache_windows", ())),
                            kv_groups=tuple(gm.meta.get("kv_cache_groups", ())),
                            records=pm.records, capture_seconds=t1 - t0, pass_seconds=t2 - t1)


def _check_buffer_writes(model: nn.Module, written: list[str]) -> None:
    """A serving program keeps no state between steps but the KV cache: a model whose forward
    writes its buffers (HF's longrope and dynamic rotary embeddings rewrite `inv_freq` from the
    positions) would be served with the writes of the trace's positions baked in. Refused."""
    if written:
        raise CaptureError(f"{type(model).__name__}'s forward writes its buffer(s) {', '.join(written)}; a served "
                           "program keeps no state between steps but the KV cache, so it cannot follow these writes "
                           "(a rotary embedding that rescales with the sequence length does this). Serve a model whose "
                           "forward in eval mode leaves its buffers as they are")


def _output_names(out_spec: object, n: int) -> list[str]:
    if out_spec is not None and getattr(out_spec, "context", None) is not None and \
            isinstance(out_spec.context, (list, tuple)) and len(out_spec.context) == n:
        return [str(c) for c in out_spec.context]
    return [str(i) for i in range(n)]
