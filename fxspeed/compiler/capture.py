"""Capture: trace the user's training step into one ATen-level FX graph.

This is the only module that touches torch's private tracing APIs (AOTAutograd's
`aot_export_module`, FakeTensor, the proxy mode). A torch upgrade should change only this file.

    model(*args, **kwargs) -> output -> loss          (eager, Python)
                 becomes
    gm(*params, *buffers, *input_tensors) -> (*buffer_updates, loss, *grads)   (one FX graph)

The graph is functional: BatchNorm running stats come back as `buffer_update` outputs that
the runtime copies into the buffers, so a step updates them exactly as eager does. Dropout
stays a random op executed at run time from torch's global RNG, in the same order as eager.
Tracing runs on fake parameters and inputs, so nothing is computed and meta models trace.
why: docs/decisions/aot-export-not-dynamo.md, docs/decisions/capture-on-fake-tensors.md
"""

from __future__ import annotations

import contextlib
import copy
import functools
import inspect
import logging
import operator
import os
import re
import sys
import traceback
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Sequence
from unittest import mock

import torch
import torch.fx as fx
import torch.nn as nn
import torch.utils._pytree as pytree

from fxspeed.errors import CaptureError, FxspeedError, warn_user
from fxspeed.ir.batch import input_key, split_inputs, tensor_leaves, traced_format  # noqa: F401
from fxspeed.ir import IOSpec, StepSignature

LossFn = Callable[..., torch.Tensor]

log = logging.getLogger("fxspeed")


@dataclass
class CapturedStep:
    """A traced step: the graph, what its inputs/outputs mean, and how to feed it."""

    gm: fx.GraphModule
    signature: StepSignature
    in_spec: pytree.TreeSpec
    tensor_leaf: list[bool]  # which leaves of (args, kwargs) are graph inputs
    module_of: dict[str, str] = field(default_factory=dict)  # node name -> owning module path
    out_spec: pytree.TreeSpec | None = None  # eval graphs without a loss: structure of outputs
    # ... and the model's output class where it was a Hugging Face ModelOutput (flattened as a
    # dict of its tensor entries; eval_step gives the class back, so `out.logits` works)
    out_type: type | None = None
    train: bool = True


# --------------------------------------------------------------------------------------------
# Inputs: which leaves are traced, and the key under which a trace is cached
# --------------------------------------------------------------------------------------------

# --------------------------------------------------------------------------------------------
# Loss extraction (shared by the traced wrapper and by eager reference code in tests)
# --------------------------------------------------------------------------------------------

def extract_loss(output: Any, loss_fn: LossFn | None, args: tuple, kwargs: dict, model_name: str = "model") -> torch.Tensor:
    """The scalar loss of one forward: `loss_fn(output, *args, **kwargs)`, else the output
    itself when it is a 0-dim tensor, else `output.loss` / `output["loss"]` (Hugging Face),
    else the first element of a tuple/list when it is a 0-dim tensor."""
    # Rule: without loss_fn, only a 0-dim tensor is taken for a loss where the model's output
    # is guessed at (the output itself, a tuple's first element). A one-element tensor of shape
    # (1,) or (1, 1) is more often a prediction (a regressor at batch size 1) than a loss, and
    # training on it silently is the worst outcome. Named losses (loss_fn, `.loss`) are the
    # user's word and may have one element of any shape.
    if loss_fn is not None:
        loss = loss_fn(output, *args, **kwargs)
    elif isinstance(output, torch.Tensor):
        if output.dim() != 0:
            raise CaptureError(
                f"{model_name} returned a tensor of shape {tuple(output.shape)}, which is not a loss (a loss is a "
                "0-dim tensor), and no loss_fn was given: pass compile(..., loss_fn=fn) where "
                "fn(output, *batch, **batch_kwargs) returns a 0-dim tensor, or return the loss from forward "
                "(e.g. output.mean() or F.mse_loss(output, target))"
            )
        loss = output
    elif isinstance(output, dict) and output.get("loss") is not None:
        loss = output["loss"]
    elif getattr(output, "loss", None) is not None:
        loss = output.loss
    elif isinstance(output, (tuple, list)) and output and isinstance(output[0], torch.Tensor) and output[0].dim() == 0:
        loss = output[0]
    else:
        first = ""
        if isinstance(output, (tuple, list)) and output and isinstance(output[0], torch.Tensor):
            first = f" whose first element has shape {tuple(output[0].shape)} (a loss is a 0-dim tensor)"
        raise CaptureError(
            f"{model_name}'s output ({type(output).__name__}{first}) has no loss: return a 0-dim tensor (e.g. "
            "output.mean()), an object or dict with a 'loss' (Hugging Face: pass labels=...), or give "
            "compile(..., loss_fn=fn) where fn(output, *batch) returns a 0-dim tensor"
        )
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        raise CaptureError(
            f"the loss of {model_name} must be a scalar tensor, got "
            f"{'a tensor of shape ' + str(tuple(loss.shape)) if isinstance(loss, torch.Tensor) else type(loss).__name__}"
            "; reduce it "
            "(e.g. .mean()) in the model or in loss_fn"
        )
    if not (loss.is_floating_point() or loss.is_complex()):
        # An integer loss ((logits > 0).sum(), a count) has no gradient: say so here, not as
        # AOT export's "marked as the loss, but it does not require gradients".
        raise CaptureError(
            f"the loss of {model_name} is an integer tensor ({loss.dtype}), which has no gradient, so it "
            "does not depend on any trainable parameter: compute a floating-point loss (e.g. "
            "F.binary_cross_entropy_with_logits(logits, target) instead of counting with (logits > 0).sum())"
        )
    return loss.reshape(())


def _members_of_unique_modules(root: nn.Module, prefix: str, kind: str) -> Iterator[tuple[str, Any]]:
    """(name, tensor) of `kind` ("_parameters" / "_buffers") of every module reached once (the
    first path to it), each tensor under every such module's name."""
    for path, m in root.named_modules(prefix=prefix):  # (deduplicated by module object)
        for k, v in getattr(m, kind).items():
            if v is not None:
                yield (f"{path}.{k}" if path else k), v


_TRACED = object()  # _StepModule._consts: this leaf is a graph input


class _StepModule(nn.Module):
    """Wraps the user's model so the traced function takes only tensors and returns the loss."""

    def __init__(self, model: nn.Module, loss_fn: LossFn | None, spec: pytree.TreeSpec,
                 leaves: list[Any], want_loss: bool):
        super().__init__()
        self.model = model
        self._loss_fn = loss_fn
        self._spec = spec
        # A marker of its own for the traced (tensor) leaves: a batch value that is None
        # (`token_type_ids=None`) is a constant leaf too, and read as a tensor slot it ran out of
        # tensors (a bare StopIteration from capture).
        self._consts = [_TRACED if isinstance(x, torch.Tensor) else x for x in leaves]
        self._want_loss = want_loss
        self.out_spec: pytree.TreeSpec | None = None
        self.out_type: type | None = None
        self.scalars: list[tuple[dict, str, Any]] | None = None  # _scalars_before: reset at every run

    # AOT export lifts a tensor per name, `named_parameters(remove_duplicate=False)`, and binds
    # each name on its module. One module registered under two names (`self.b = self.a`, ALBERT's
    # ModuleList([block] * 3)) would take two tensors on one module object: the later binding wins
    # and the other name gets no gradient. Module aliases are listed once; a Parameter tied across
    # two modules keeps a name per module.
    def named_parameters(self, prefix: str = "", recurse: bool = True,
                         remove_duplicate: bool = True) -> Iterator[tuple[str, nn.Parameter]]:
        if remove_duplicate or not recurse:
            yield from super().named_parameters(prefix, recurse, remove_duplicate)
            return
        yield from _members_of_unique_modules(self, prefix, "_parameters")

    def named_buffers(self, prefix: str = "", recurse: bool = True,
                      remove_duplicate: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
        if remove_duplicate or not recurse:
            yield from super().named_buffers(prefix, recurse, remove_duplicate)
            return
        yield from _members_of_unique_modules(self, prefix, "_buffers")

    def forward(self, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        if self.scalars is not None:
            _reset_scalars(self.model, self.scalars)
        it = iter(tensors)
        leaves = [next(it) if c is _TRACED else c for c in self._consts]
        args, kwargs = pytree.tree_unflatten(leaves, self._spec)
        out = self.model(*args, **kwargs)
        name = type(self.model).__name__
        if self._want_loss:
            return (extract_loss(out, self._loss_fn, args, kwargs, name),)
        try:
            return (extract_loss(out, self._loss_fn, args, kwargs, name),)
        except CaptureError:
            flat, self.out_spec = pytree.tree_flatten(_plain(out))
            self.out_type = type(out) if _is_model_output(out) else None
            return tuple(flat)


def _plain(out: Any) -> Any:
    """Hugging Face ModelOutput -> dict, so pytree can flatten it. Entries that are not trees
    of tensors (a KV cache object such as `past_key_values`) are left out of eval outputs."""
    if _is_model_output(out):
        return {k: out[k] for k in out.keys() if _is_tensor_tree(out[k])}
    return out


def _is_model_output(out: Any) -> bool:
    return hasattr(out, "to_tuple") and hasattr(out, "keys")


def _is_tensor_tree(x: Any) -> bool:
    return all(leaf is None or isinstance(leaf, (torch.Tensor, int, float, bool)) for leaf in pytree.tree_leaves(x))


# --------------------------------------------------------------------------------------------
# Capture
# --------------------------------------------------------------------------------------------

def capture_step(model: nn.Module, args: tuple, kwargs: dict, *, loss_fn: LossFn | None = None,
                 train: bool = True, check_constants: bool = True) -> CapturedStep:
    """Trace forward+loss+backward (train) or forward only (eval) into an FX GraphModule.

    Runs on fake tensors: nothing the size of an activation is allocated, and a model on the
    meta device can be captured. `check_constants=False`: the caller runs
    `check_no_fake_constants` itself, after passes that may drop a constant's reader.
    """
    from fxspeed.compiler.checkpoint_regions import checkpoint_regions

    # torch.utils.checkpoint regions: traced directly, their nodes tagged meta["recompute"]
    try:
        # A step is traced with gradients on whatever mode the caller is in: a compile (or a new
        # batch shape) under no_grad / inference_mode said the loss reached no parameter.
        with torch.inference_mode(False), torch.enable_grad(), fake_model_state(model, args, kwargs) as (fargs, fkwargs), \
                checkpoint_regions() as regions:
            cap = _capture(model, args, kwargs, fargs, fkwargs, loss_fn=loss_fn, train=train)
    except CaptureError as e:
        empty = [f"{i}: {tuple(t.shape)}" for i, t in enumerate(split_inputs(args, kwargs)[0])
                 if isinstance(t, torch.Tensor) and t.numel() == 0]
        if empty:  # mse_loss's backward divides by numel(): the error named the user's loss line
            raise CaptureError(f"the batch holds empty tensors (batch value {', '.join(empty[:3])}); an empty batch "
                               "has no loss to train on (eager gives NaN). Skip it, or give every rank rows. "
                               f"The capture said: {e}") from e
        raise
    regions.tag(cap.gm)
    _check_matmul_dtypes(model, cap.gm, train)
    if not train:
        _note_nested_fast_path(model)
    if check_constants:
        check_no_fake_constants(model, cap.gm, cap.module_of)
    _widen_loss_targets(cap)
    _certain_dropout_draws_nothing(cap)
    _batch_norm_outputs_as_traced(cap)
    return cap


def _note_nested_fast_path(model: nn.Module) -> None:
    """nn.TransformerEncoder in eager eval under no_grad, given a src_key_padding_mask, runs on
    nested tensors and returns 0 at the padded positions; a step is traced with gradients on, so
    the compiled eval step computes those positions as eager does with gradients on (h39: a max
    difference of 2.35 there, the other positions equal). Said once per capture, naming it."""
    found = [n or type(model).__name__ for n, m in model.named_modules()
             if isinstance(m, nn.TransformerEncoder) and getattr(m, "use_nested_tensor", False)]
    if found:
        warn_user(f"fxspeed: {found[0]} (nn.TransformerEncoder, enable_nested_tensor=True): eager eval under no_grad "
                  "with a src_key_padding_mask returns 0 at the padded positions (its nested-tensor fast path); the "
                  "compiled eval step computes them, as eager does with gradients on. The other positions are the "
                  "same: leave the padded ones out of what you read (or build it with enable_nested_tensor=False)")


def _certain_dropout_draws_nothing(cap: CapturedStep) -> None:
    """Dropout with p = 1 zeroes its input without drawing in eager (ATen's dropout returns
    input * 0 before it reaches bernoulli), but the trace decomposes it to native_dropout, which
    draws a whole mask: every later random op then saw other numbers than eager's under the same
    seed. The mask it would draw is all zeros anyway:

        out, mask = native_dropout(x, 1.0, True)  ->  out = mul(x, 0.0); mask = zeros_like(x, bool)
    """
    aten = torch.ops.aten
    graph, changed = cap.gm.graph, False
    for n in list(graph.nodes):
        if not (n.op == "call_function" and n.target == aten.native_dropout.default and len(n.args) > 1
                and isinstance(n.args[1], (int, float)) and n.args[1] >= 1.0
                and (len(n.args) < 3 or n.args[2] is None or n.args[2])):
            continue
        x, (out_val, mask_val) = n.args[0], n.meta["val"]
        with graph.inserting_before(n):
            out = graph.call_function(aten.mul.Tensor, (x, 0.0))
            mask = graph.call_function(aten.zeros_like.default, (x,), {"dtype": mask_val.dtype})
        out.meta["val"], mask.meta["val"] = out_val, mask_val
        for m in (out, mask):
            if n.name in cap.module_of:
                cap.module_of[m.name] = cap.module_of[n.name]
        for user in list(n.users):
            if user.op == "call_function" and user.target is operator.getitem:
                user.replace_all_uses_with(out if user.args[1] == 0 else mask)
                graph.erase_node(user)
        if not n.users:
            graph.erase_node(n)
            changed = True
    if changed:
        cap.gm.recompile()


def _batch_norm_outputs_as_traced(cap: CapturedStep) -> None:
    """ATen's CPU batch norm writes its output in the input's suggested memory format (contiguous
    unless channels_last), but its fake kernel keeps the input's strides: `bn(h.transpose(1, 2))`
    traced as laid out like the transposed input, and a `view` the trace then chose for the
    transpose back failed at the first step ("view size is not compatible with input tensor's size
    and stride"). Where the two differ, the output is copied into the layout the trace assumed:

        out = getitem(batch_norm(x, ...), 0)  ->  out = copy(empty_strided(shape, traced), getitem(...))
    """
    from torch._prims_common import make_channels_last_strides_for, make_contiguous_strides_for, suggest_memory_format

    from fxspeed.compiler.rewrite import call

    aten = torch.ops.aten
    norms = {aten._native_batch_norm_legit_functional.default, aten._native_batch_norm_legit.default,
             aten._native_batch_norm_legit.no_stats, aten._native_batch_norm_legit_no_training.default,
             aten.native_batch_norm.default}
    graph, changed = cap.gm.graph, False
    for n in list(graph.nodes):
        if n.op != "call_function" or n.target not in norms or not isinstance(n.args[0], fx.Node):
            continue
        x, out = n.args[0].meta.get("val"), n.meta["val"][0]
        if not isinstance(x, torch.Tensor) or x.device.type != "cpu" or out.numel() <= 1:
            continue
        shape = tuple(out.shape)
        kernel = make_channels_last_strides_for(shape) if suggest_memory_format(x) == torch.channels_last \
            else make_contiguous_strides_for(shape)
        if all(a == b for a, b, d in zip(out.stride(), kernel, shape) if d > 1):
            continue
        for user in [u for u in n.users if u.target is operator.getitem and u.args[1] == 0]:
            with graph.inserting_after(user):
                empty = call(graph, aten.empty_strided.default, (shape, tuple(out.stride())),
                             {"dtype": out.dtype, "device": out.device})
            with graph.inserting_after(empty):
                laid = call(graph, aten.copy.default, (empty, user))
            user.replace_all_uses_with(laid, delete_user_cb=lambda u: u is not laid)
            for m in (empty, laid):
                if n.name in cap.module_of:
                    cap.module_of[m.name] = cap.module_of[n.name]
            changed = True
    if changed:
        cap.gm.recompile()


def _widen_loss_targets(cap: CapturedStep) -> None:
    """Class indices of another integer dtype (int32 labels, uint8) reach nll_loss (cross_entropy's)
    through an int64 copy. The fake kernel accepted int32, so the trace passed and the first CPU
    train_step failed inside the compiled program with ATen's bare "expected target dtype to be
    Long or Byte"; the CUDA chunked cross-entropy kernel read them as they are. Lossless, so
    converted rather than refused (eager PyTorch refuses int32 here).

        nll_loss_forward(x, t: int32, ...)  ->  nll_loss_forward(x, _to_copy(t, dtype=int64), ...)
        (the backward's nll_loss_backward reads the same copy)
    """
    aten = torch.ops.aten
    at = {aten.nll_loss_forward.default: 1, aten.nll_loss2d_forward.default: 1,
          aten.nll_loss_backward.default: 2, aten.nll_loss2d_backward.default: 2}
    graph, widened = cap.gm.graph, {}
    for n in list(graph.nodes):
        i = at.get(n.target) if n.op == "call_function" else None
        t = n.args[i] if i is not None else None
        val = t.meta.get("val") if isinstance(t, fx.Node) else None
        if val is None or val.dtype == torch.int64 or val.is_floating_point() or val.dtype == torch.bool:
            continue
        if t not in widened:
            with graph.inserting_before(n):  # before the first reader (a placeholder stays among the inputs)
                w = graph.call_function(aten._to_copy.default, (t,), {"dtype": torch.int64})
            w.meta["val"] = val.to(torch.int64)
            if n.name in cap.module_of:
                cap.module_of[w.name] = cap.module_of[n.name]
            widened[t] = w
        n.update_arg(i, widened[t])
    if widened:
        cap.gm.recompile()


def check_no_fake_constants(model: nn.Module, gm: fx.GraphModule, module_of: dict[str, str]) -> None:
    """A graph constant that is a FakeTensor was made by the model's forward from the traced (fake)
    tensors and kept outside the graph's inputs (HF longrope builds `long_inv_freq` on first call
    and stores it on the module): the program would compute on a tensor without data. Refused
    where a node still reads it, naming the module, not later with fake outputs."""
    from torch._subclasses.fake_tensor import FakeTensor

    for n in gm.graph.nodes:
        if n.op == "get_attr" and n.users and isinstance(getattr(gm, str(n.target), None), FakeTensor):
            where = sorted({module_of.get(u.name, "") for u in n.users} - {""}) or ["the model"]
            raise CaptureError(f"{type(model).__name__}: forward makes a tensor from the traced values and keeps it on "
                               f"the module for a later call (read in {', '.join(where)}); the compiled program cannot "
                               "hold it. Make it in __init__ (a buffer) or recompute it in every forward")


def _capture(model: nn.Module, args: tuple, kwargs: dict, fargs: tuple, fkwargs: dict, *,
             loss_fn: LossFn | None, train: bool, unroll_rnns: bool = False) -> CapturedStep:
    from torch._functorch.aot_autograd import aot_export_module

    if train and not any(p.requires_grad for p in model.parameters()):
        n = sum(1 for _ in model.parameters())
        raise CaptureError(
            f"{type(model).__name__} has no trainable parameters: requires_grad is False on all of its {n} "
            "parameters, so there is nothing to train. Set requires_grad_(True) on the parameters to train "
            "(a frozen backbone needs at least one trainable head), or use engine.eval_step for inference"
        )
    args, kwargs = fargs, fkwargs
    leaves, spec = split_inputs(args, kwargs)
    tensors = [x for x in leaves if isinstance(x, torch.Tensor)]
    wrapper = _StepModule(model, loss_fn, spec, leaves, want_loss=train)
    frozen: list[nn.Parameter] = []
    hidden: list[tuple[nn.Module, str, nn.Parameter]] = []
    saved: dict[int, tuple[nn.Module, dict[str, Any]]] = {}
    # A training step is traced in the modes the user's modules are in (a BatchNorm put in eval
    # mode stays frozen, as in eager); an eval step in eval mode throughout. Every module's own
    # mode is restored after: model.train(flag) would overwrite them all.
    modes = [(m, m.training) for m in model.modules()]
    retry_unrolled = False
    if not train:
        model.eval()
    owners = _ModuleOwners(model)
    attrs = _attributes_before(model)
    wrapper.scalars = _scalars_before(model)
    grad_calls: list[traceback.FrameSummary] = []
    try:
        with _tracing_flags(), owners, _rng_untouched(model, tensors), _without_torch_compile(model), \
                _buffer_rebinds_as_writes(), _rng_control_said(model), _OneHotRangeChecked(), \
                (_rnns_unrolled(model) if unroll_rnns else contextlib.nullcontext()), \
                _autograd_grad_calls(grad_calls):
            # AOT export lifts a parameter once per *name* and refuses a name that gets no
            # gradient. Two cases, told apart per name: a tied alias the forward never reads
            # (BERT's `cls.predictions.bias` is used as `decoder.bias`; T5's `shared` is used
            # as `encoder.embed_tokens`) is hidden from the trace, since the weight still
            # gets its gradient through its other name; a parameter the loss does not reach
            # under any name (e.g. BERT's pooler under an MLM loss) is frozen: eager leaves
            # its .grad None and the optimizer skips it, which is what happens here.
            def hide_names_without_grad() -> None:
                nonlocal frozen, hidden, saved
                frozen, hidden = _names_without_grad(wrapper, tensors)
                saved = {id(owner): (owner, dict(owner._parameters)) for owner, _, _ in hidden}
                for owner, leaf, _ in hidden:
                    del owner._parameters[leaf]
                for p in frozen:
                    p.requires_grad_(False)

            # With tied aliases, found first: a fake forward+backward costs a tenth of the joint
            # trace that would fail on them (T5: 0.4 s against 4 s; GPT-2, whose aliases are both
            # read, pays 0.1 s of a 1.4 s trace).
            checked = train and _has_aliases(wrapper)
            if checked:
                try:
                    hide_names_without_grad()
                except Exception:  # noqa: BLE001 - the trace below names what is wrong, or its retry hides them
                    checked = False
            try:
                gm, sig = aot_export_module(wrapper, tensors, trace_joint=train,
                                            output_loss_index=0 if train else None)
            except AssertionError as e:
                if checked or not (train and "did not receive a gradient" in str(e)):
                    raise
                hide_names_without_grad()
                gm, sig = aot_export_module(wrapper, tensors, trace_joint=True, output_loss_index=0)
            if getattr(sig, "user_inputs_to_mutate", None):
                raise _input_mutation_error(model, wrapper, tensors, leaves, spec, sig, train)
            if getattr(sig, "parameters_to_mutate", None):  # (a training trace fails before: the
                raise _parameter_mutation_error(model, wrapper, tensors, train)  # parameter needs grad)
    except CaptureError:
        raise
    except Exception as e:  # noqa: BLE001 - every tracing failure becomes one clear error
        if not (train and not unroll_rnns and _is_rnn_export_limit(model, e)):
            known = (_batch_dict_as_positional(model, args, e, train)
                     or _signature_mismatch(model, args, kwargs, e, train)
                     or _loss_fn_mismatch(model, loss_fn, args, kwargs, e, train)
                     or (_known_capture_error(model, wrapper, tensors, e) if train else None)
                     or _gradient_in_forward(model, grad_calls, train))
            raise (known or _capture_error(model, e, train)) from e
        retry_unrolled = True  # below, once the model is restored
    finally:
        _forget_torch_trace_nodes()
        for owner, params in saved.values():  # restore, in the original order
            owner._parameters.clear()
            owner._parameters.update(params)
        for p in frozen:
            p.requires_grad_(True)
        for m, mode in modes:
            m.training = mode
        _restore_attributes(model, attrs)
    if retry_unrolled:
        return _capture(model, fargs, fkwargs, fargs, fkwargs, loss_fn=loss_fn, train=train, unroll_rnns=True)
    _drop_metadata_asserts(gm)
    signature = _signature(gm, sig, n_user=len(tensors), train=train, loss_out=wrapper.out_spec is None)
    _check_dense_grads(model, gm, signature)
    _name_ties(signature, list(model.named_parameters(remove_duplicate=False)))
    gm.meta["fxspeed_frozen"] = [n for n, p in model.named_parameters() if any(p is f for f in frozen)]
    return CapturedStep(gm=gm, signature=signature, in_spec=spec,
                        tensor_leaf=[isinstance(x, torch.Tensor) for x in leaves],
                        module_of=owners.of(gm.graph), out_spec=wrapper.out_spec, out_type=wrapper.out_type, train=train)


# --------------------------------------------------------------------------------------------
# What forward's Python does besides computing: attributes it sets, inputs it writes, gradients
# --------------------------------------------------------------------------------------------

_MODULE_INTERNALS = frozenset(nn.Module().__dict__)  # _parameters, _buffers, _modules, hooks, training


def _tensor_ids(value: Any) -> list[int]:
    try:
        return [id(t) for t in pytree.tree_leaves(value) if isinstance(t, torch.Tensor)]
    except Exception:  # noqa: BLE001 - an object pytree cannot walk holds no tensor we can see
        return []


def _attributes_before(model: nn.Module) -> dict[tuple[int, str], tuple[Any, Any, list[int]]]:
    """Each module's own attributes (not its parameters, buffers or submodules) before a trace:
    (value, shallow copy of a list/dict value, ids of the tensors it holds)."""
    snap: dict[tuple[int, str], tuple[Any, Any, list[int]]] = {}
    for mod in model.modules():
        for k, v in mod.__dict__.items():
            if k not in _MODULE_INTERNALS:
                snap[(id(mod), k)] = (v, copy.copy(v) if type(v) in (list, dict) else None, _tensor_ids(v))
    return snap


_SCALAR_TYPES = (int, float, bool, str)


def _scalars_before(model: nn.Module) -> list[tuple[dict, str, Any]]:
    """(module.__dict__, name, value) of each number or string a module holds, before a trace.

    A trace runs forward's Python more than once (AOT export collects metadata in a first run,
    the alias check runs another): a counter forward bumps (`self.calls += 1`) would be baked in
    at its second or third value. Every run starts from these values instead, so the step computes
    what eager's first call computes and the module is left as one call leaves it."""
    out = [(mod.__dict__, k, v) for mod in model.modules() for k, v in _own_scalars(mod)]
    # and the contents of lists and dicts of them (`self.calls[0] += 1`, `self.seen.append(n)`):
    # kept as (the container, None, a copy), put back in place
    out += [(v, None, copy.copy(v)) for mod in model.modules() for k, v in mod.__dict__.items()
            if k not in _MODULE_INTERNALS and type(v) in (list, dict) and len(v) <= 64
            and all(type(x) in _SCALAR_TYPES for x in (v.values() if type(v) is dict else v))]
    return out


def _own_scalars(mod: nn.Module) -> list[tuple[str, Any]]:
    return [(k, v) for k, v in mod.__dict__.items() if type(v) in _SCALAR_TYPES and k != "training"]


def _reset_scalars(model: nn.Module, before: list[tuple[Any, str | None, Any]]) -> None:
    """Numbers and strings back to `before` (_scalars_before); ones forward added are removed;
    lists and dicts of them get their contents back."""
    known = {(id(d), k) for d, k, _ in before if k is not None}
    for mod in model.modules():
        for k, _ in _own_scalars(mod):
            if (id(mod.__dict__), k) not in known:
                del mod.__dict__[k]
    for d, k, v in before:
        if k is not None:
            d[k] = v
        elif type(d) is list:
            d[:] = v
        else:
            d.clear()
            d.update(v)


def _restore_attributes(model: nn.Module, before: dict[tuple[int, str], tuple[Any, Any, list[int]]]) -> None:
    """Undo the tensor-valued attributes forward set on modules while it was traced.

    Rule: a tensor forward stores on a module (`self.last = h.detach()`, a list of activations)
    is a trace-time fake/functional tensor; left in place it fails at its next use ("Attempting
    to use FunctionalTensor on its own"), and the compiled step never runs forward's Python, so
    it would never be updated either. Such attributes get their value from before the trace back
    (a new one is removed), and a warning names them and the way out (not for the private
    attributes of torch's own modules, such as nn.LSTM's `_flat_weights`)."""
    names = {id(m): n for n, m in model.named_modules(remove_duplicate=False)}
    undone: list[tuple[nn.Module, str]] = []
    for mod in model.modules():
        d = mod.__dict__
        for k in list(d):
            if k in _MODULE_INTERNALS:
                continue
            v, now = d[k], _tensor_ids(d[k])
            old = before.get((id(mod), k))
            if old is None:
                if now:
                    del d[k]
                    undone.append((mod, k))
                continue
            ov, ocopy, oids = old
            if (v is ov and now == oids) or (not now and not oids):
                continue
            if v is ov and isinstance(v, list) and ocopy is not None:
                v[:] = ocopy
            elif v is ov and isinstance(v, dict) and ocopy is not None:
                v.clear()
                v.update(ocopy)
            else:
                d[k] = ov
            undone.append((mod, k))
    for mod, k in undone:
        if k.startswith("_") and type(mod).__module__.startswith("torch."):
            continue  # torch's own bookkeeping (nn.LSTM's _flat_weights, set as parameters are swapped)
        path = names.get(id(mod), "")
        who = f"`{path}` ({type(mod).__name__})" if path else type(mod).__name__
        ref = f"{path}.{k}" if path else f"model.{k}"
        log.warning(
            "fxspeed: forward of %s stores a tensor in `self.%s` while it is traced. The compiled step does not "
            "run forward's Python, so train_step never updates `%s`: it is left as it was before compile "
            "(fxspeed removed the trace-time value). To keep a value from each step, register a buffer in "
            "__init__ (self.register_buffer(%r, torch.zeros(shape), persistent=False)) and update it in place "
            "in forward (self.%s.copy_(h.detach())): in-place buffer updates are part of the compiled step. "
            "Or return it from forward and read it with engine.eval_step.",
            who, k, ref, k, k,
        )


@contextlib.contextmanager
def _autograd_grad_calls(calls: list[traceback.FrameSummary]) -> Iterator[None]:
    """Note each call of torch.autograd.grad made directly from user code while tracing (a
    gradient penalty inside forward), so a failure can be blamed on it. Calls from torch's
    own code (AOT autograd's backward) pass through unrecorded."""
    real = torch.autograd.grad

    @functools.wraps(real)
    def grad(*a: Any, **kw: Any) -> Any:
        caller = sys._getframe(1)
        if _is_user_file(caller.f_code.co_filename):
            calls.append(traceback.FrameSummary(caller.f_code.co_filename, caller.f_lineno, caller.f_code.co_name))
        return real(*a, **kw)

    with mock.patch.object(torch.autograd, "grad", grad):
        yield


def _gradient_in_forward(model: nn.Module, calls: list[traceback.FrameSummary], train: bool
                         ) -> CaptureError | None:
    if not calls:
        return None
    fr = calls[0]
    code = f" `{fr.line.strip()}`" if fr.line else ""
    return CaptureError(
        f"cannot capture the {'training' if train else 'eval'} step of {type(model).__name__}: forward calls "
        f"torch.autograd.grad at {fr.filename}:{fr.lineno}{code}. A gradient taken inside forward (a gradient "
        "penalty with create_graph=True, double backward, gradients with respect to the inputs) is not supported "
        "by fxspeed's capture, which traces one forward and one backward. How to fix: train this model with "
        "plain PyTorch, or drop the gradient term from the loss (or replace it with a penalty that needs no "
        "gradient, such as weight decay or spectral_norm).",
        op="torch.autograd.grad", source=f"{fr.filename}:{fr.lineno}",
    )


def _leaf_names(model: nn.Module, spec: pytree.TreeSpec, leaves: list[Any]) -> list[str]:
    """A readable name for each leaf of the batch: forward's parameter name for a positional
    argument (`x`), the key of a keyword argument, with the path inside a nested structure."""
    try:
        params = [n for n, p in inspect.signature(model.forward).parameters.items()
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    except (TypeError, ValueError):
        params = []
    try:
        paths, _ = pytree.tree_flatten_with_path(pytree.tree_unflatten(leaves, spec))
    except Exception:  # noqa: BLE001 - a name is a nicety
        return [f"input {i}" for i in range(len(leaves))]
    out = []
    for path, _ in paths:
        first, rest = path[0].idx, path[1:]
        if first == 0:  # positional
            i = rest[0].idx
            base = params[i] if i < len(params) else f"args[{i}]"
        else:
            base = str(rest[0].key)
        out.append(base + pytree.keystr(rest[1:]))
    return out


def _input_mutation_error(model: nn.Module, wrapper: "_StepModule", tensors: list[torch.Tensor],
                          leaves: list[Any], spec: pytree.TreeSpec, sig: Any, train: bool) -> CaptureError:
    """Forward writes into a batch tensor (`x.mul_(2)`, `mask[:, 0] = 1`).

    Rule: refused. Eager changes the caller's tensor; the compiled step runs on its own copy of
    each batch tensor and writes nothing back, so the two would differ after the step."""
    user = list(getattr(sig, "user_inputs", []))
    at = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor)]
    names = _leaf_names(model, spec, leaves)
    mutated = [user.index(n) for n in sig.user_inputs_to_mutate.values() if n in user]
    which = [names[at[i]] for i in mutated if i < len(at)] or ["a batch tensor"]
    found = _find_write(wrapper, [(which[0], tensors[mutated[0]])] if mutated else [], tensors)
    where, op, source = "", None, None
    if found is not None:
        _, op, frame = found
        if frame is not None:
            source = f"{frame.filename}:{frame.lineno}"
            where = f" at {source} `{(frame.line or '').strip()}`"
    opmsg = f" ({op})" if op else ""
    x = which[0] if len(which) == 1 else "x"
    return CaptureError(
        f"cannot capture the {'training' if train else 'eval'} step of {type(model).__name__}: forward modifies "
        f"its input {', '.join(f'`{w}`' for w in which)} in place{opmsg}{where}. Eager PyTorch changes the "
        "caller's tensor; fxspeed's compiled step works on its own copy of each batch tensor and does not write "
        f"changes back to your batch. How to fix: compute a new tensor instead ({x} = {x} * 2 rather than "
        f"{x}.mul_(2)), or clone it first ({x} = {x}.clone()) when the in-place op is needed.",
        op=op, source=source,
    )


def _signature_mismatch(model: nn.Module, args: tuple, kwargs: dict, e: BaseException,
                        train: bool = True) -> CaptureError | None:
    """The batch does not fit forward's parameters (forward(x) given (x, y)): fxspeed calls the
    model with the whole batch, which users of a loss_fn often do not expect."""
    refused = _call_refused(model.forward, args, kwargs, e)
    if refused is None:
        return None
    sig, why = refused
    name = type(model).__name__
    return CaptureError(
        f"cannot capture the {'training' if train else 'eval'} step of {name}: fxspeed calls the model with the "
        "whole batch, "
        f"{name}(*args, **kwargs) of example_inputs (and of each train_step(*args, **kwargs)), here "
        f"{_given(args, kwargs)}, but {name}.forward{sig} does not accept that ({why}). loss_fn does not change "
        "how the model is called: it is called after forward as loss_fn(output, *args, **kwargs), with the same "
        "batch. How to fix: let forward take every batch element (e.g. def forward(self, x, y=None) that ignores "
        "y, which loss_fn(out, x, y) then receives), or wrap the model in a module whose forward(x, y) returns "
        "the loss, e.g. loss_fn(self.model(x), y), and compile that without loss_fn.",
    )


def _forget_torch_trace_nodes() -> None:
    """torch's make_fx keeps the last trace's nodes in a module global (for torch.export's fake
    tensor leak check, read right after its own trace): it held the last compiled program's graph
    and fake tensors after its engine was dropped (1,654 nodes and ~2,300 fake tensors, ~19 MB, for
    an 18M HF Llama), until the next trace."""
    from torch.fx.experimental import proxy_tensor

    nodes = getattr(proxy_tensor, "_FAKE_TENSOR_ID_TO_PROXY_MAP_FOR_EXPORT", None)
    if isinstance(nodes, dict):
        nodes.clear()


def _fx_source_cache() -> dict | None:
    """torch.fx's module-global cache of generated GraphModule sources (private: None if gone)."""
    from torch.fx import graph_module

    cache = getattr(getattr(graph_module, "_loader", None), "eval_cache", None)
    return cache if isinstance(cache, dict) else None


def graph_source_keys() -> set[str]:
    """The generated-code keys torch.fx holds now (see forget_stale_graph_sources)."""
    return set(_fx_source_cache() or ())


def forget_stale_graph_sources(before: set[str], *keep: fx.GraphModule | None) -> None:
    """torch.fx keeps the Python source of every GraphModule it ever generated code for, in a
    module global (for linecache and tracebacks), never freed: each pass that rewrites the program
    recompiles it, so a compile left ten sources of the program's stages behind (1.3 MB for an 18M
    HF Llama's 1,600 nodes), and every new batch signature ten more; serve, two dozen for its
    first two buckets. Drops the ones made since `before` except those of the programs in `keep`
    (None: none) and their GraphModule submodules, whose tracebacks still show their lines.
    Called by each compile entry point (compile_step, compile_program, compile_inference) on
    what it returns, and by `trial_compiles` (the planner's) on nothing."""
    import linecache

    cache = _fx_source_cache()
    if cache is None:
        return
    live = {type(m).forward.__code__.co_filename for gm in keep if gm is not None
            for m in gm.modules() if isinstance(m, fx.GraphModule)}
    for key in set(cache) - before - live:
        del cache[key]
        linecache.cache.pop(key, None)


@contextlib.contextmanager
def trial_compiles() -> Iterator[None]:
    """Compiles whose programs are read and dropped (the planner's: fxspeed.plan traces the model,
    reads the costs and keeps no GraphModule) leave no generated source behind: on exit, the
    sources made inside are forgotten, the programs each compile entry point returned included
    (forget_stale_graph_sources keeps those for the engine, which runs them). Forgetting a live
    program's only costs its tracebacks their source lines."""
    before = graph_source_keys()
    try:
        yield
    finally:
        forget_stale_graph_sources(before)


def _batch_dict_as_positional(model: nn.Module, args: tuple, e: BaseException, train: bool = True
                              ) -> CaptureError | None:
    """A batch dict given as one positional argument (`train_step(batch)`, `example_inputs=(batch,)`)
    whose keys are all forward's parameter names: forward's first parameter got the whole dict and
    failed somewhere inside the model ("'dict' object has no attribute 'dtype'" at a transformers
    line), far from the cause. Only read after a failure, so a forward that takes a dict is untouched."""
    try:
        sig = inspect.signature(model.forward)
    except (TypeError, ValueError):
        return None
    names = list(sig.parameters)
    positional = [n for n, p in sig.parameters.items() if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    for i, a in enumerate(args):
        if not (isinstance(a, dict) and a and all(isinstance(k, str) and k in names for k in a)):
            continue
        name = type(model).__name__
        param = positional[i] if i < len(positional) else f"args[{i}]"
        keys = ", ".join(a)
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        return CaptureError(
            f"cannot capture the {'training' if train else 'eval'} step of {name}: {name}.forward's `{param}` "
            f"received the whole batch dict (keys {keys}), given as positional argument {i}; fxspeed calls the model "
            f"as {name}(*args, **kwargs) with the batch as given, and forward failed on the dict ({reason}). How to "
            "fix: pass the dict's entries as keyword arguments, engine.train_step(**batch) and "
            "engine.eval_step(**batch), and compile with example_inputs=batch (a dict is taken as forward's "
            "keyword arguments), not (batch,)."
        )
    return None


def _call_refused(f: Callable, args: tuple, kwargs: dict, e: BaseException
                  ) -> tuple[inspect.Signature, str] | None:
    """(f's signature, why) when the failure `e` holds a TypeError and f(*args, **kwargs) does not
    bind; None when it binds or f has no signature to read (a builtin)."""
    cur: BaseException | None = e
    while cur is not None and not isinstance(cur, TypeError):
        cur = cur.__cause__ or cur.__context__
    if cur is None:
        return None
    try:
        sig = inspect.signature(f)
    except (TypeError, ValueError):
        return None
    try:
        sig.bind(*args, **kwargs)
        return None
    except TypeError as bad:
        return sig, str(bad)


def _given(args: tuple, kwargs: dict) -> str:
    given = [f"{len(args)} positional argument{'s' if len(args) != 1 else ''}"]
    if kwargs:
        given.append("keywords " + ", ".join(kwargs))
    return " and ".join(given)


_MATMULS = {"mm", "addmm", "bmm", "baddbmm", "mv", "addmv"}


def _check_matmul_dtypes(model: nn.Module, gm: fx.GraphModule, train: bool) -> None:
    """A matmul of two floating dtypes (a float64 batch into float32 weights) traces: fake
    tensors' addmm does not check dtypes, where eager raises "mat1 and mat2 must have the same
    dtype". The compiled step then failed when it ran, and on several ranks as "the ranks are
    out of step", though every rank failed alike. Said at capture, as eager says it."""
    for n in gm.graph.nodes:
        if n.op != "call_function" or getattr(n.target, "__name__", "").split(".")[0] not in _MATMULS:
            continue
        dtypes = {a.meta["val"].dtype for a in n.args
                  if isinstance(a, fx.Node) and isinstance(a.meta.get("val"), torch.Tensor)}
        if len(dtypes) < 2:
            continue
        names = " and ".join(sorted(str(d).removeprefix("torch.") for d in dtypes))
        raise CaptureError(
            f"cannot capture the {'training' if train else 'eval'} step of {type(model).__name__}: a matrix "
            f"multiply ({n.target}) of {names} tensors; eager PyTorch refuses it too (mat1 and mat2 must have the "
            "same dtype). How to fix: give the batch the model's floating dtype (x.float() for a float32 model; "
            "integer ids stay int64), or cast before the multiply.", op=str(n.target))


def _loss_fn_mismatch(model: nn.Module, loss_fn: LossFn | None, args: tuple, kwargs: dict, e: BaseException,
                      train: bool = True) -> CaptureError | None:
    """loss_fn does not take (output, *args, **kwargs): `lambda out, *batch: ...` given a keyword
    batch failed as "<lambda>() got an unexpected keyword argument 'input_ids'. How to fix: rewrite
    that line without the unsupported construct", naming no line."""
    refused = _call_refused(loss_fn, (None, *args), kwargs, e) if loss_fn is not None else None
    if refused is None:
        return None
    why = refused[1]
    name = getattr(loss_fn, "__name__", type(loss_fn).__name__)
    return CaptureError(
        f"cannot capture the {'training' if train else 'eval'} step of {type(model).__name__}: loss_fn {name} is "
        f"called as loss_fn(output, *args, **kwargs) with the whole batch, here the output and "
        f"{_given(args, kwargs)}, and it does not accept that ({why}). How to fix: take what the batch holds, e.g. "
        "loss_fn=lambda out, *args, **kwargs: ... (a keyword batch such as engine.train_step(**batch) arrives "
        "as keywords), or def loss_fn(out, input_ids, labels, **rest).",
    )


def _check_dense_grads(model: nn.Module, gm: fx.GraphModule, signature: StepSignature) -> None:
    """Sparse gradients (nn.Embedding / nn.EmbeddingBag with sparse=True) are refused at capture:
    the runtime and its optimizers work on dense gradients."""
    out_node = next(n for n in gm.graph.nodes if n.op == "output")
    for spec, arg in zip(signature.outputs, out_node.args[0]):
        val = arg.meta.get("val") if isinstance(arg, fx.Node) else None
        if spec.kind == "grad" and isinstance(val, torch.Tensor) and val.layout != torch.strided:
            path = spec.target.rpartition(".")[0]
            try:
                mod = model.get_submodule(path)
                who = f"`{path}` ({type(mod).__name__})" if path else type(mod).__name__
            except AttributeError:
                who = f"`{path}`"
            raise CaptureError(
                f"cannot capture the training step of {type(model).__name__}: the parameter `{spec.target}` of "
                f"{who} gets a sparse gradient ({val.layout}), as nn.Embedding / nn.EmbeddingBag give with "
                "sparse=True (or F.embedding(..., sparse=True)). fxspeed does not support sparse gradients: its "
                "optimizers update parameters from dense gradients. How to fix: use sparse=False (the default); "
                "the gradient then has the same values, held dense.",
                op="aten.embedding_backward",
            )


@contextlib.contextmanager
def _rnns_unrolled(model: nn.Module) -> Iterator[None]:
    """Trace nn.LSTM / nn.GRU / nn.RNN modules as a loop over time steps of cell math.

    Rule: the fused RNN op is kept when AOT export can trace its backward; when it cannot
    (torch 2.11-2.13 lose a weight gradient of a unidirectional nn.LSTM: "len(
    gradients_to_parameters)=3 + ... != len(backward_output_names)=4"), the training trace is
    retried with each RNN module's forward, for the trace only, written as linear/sigmoid/tanh
    per time step over the module's own parameters (same names, same gradients; equal to
    eager within float rounding). The graph grows with sequence length x layers. Not unrolled
    (the capture error then names the module):
    PackedSequence inputs, and dropout between layers in training (its random draws would not
    follow eager's)."""
    mods = [m for m in model.modules() if type(m) in (nn.LSTM, nn.GRU, nn.RNN)
            and not (m.training and m.dropout > 0 and m.num_layers > 1)]
    with _forwards_replaced({m: functools.partial(_unrolled_rnn_forward, m) for m in mods}):
        yield


@contextlib.contextmanager
def _forwards_replaced(forwards: dict[nn.Module, Callable]) -> Iterator[None]:
    """Each module's forward replaced by an instance attribute for the block (the class and any
    forward the user set on the instance come back after)."""
    saved = [(m, m.__dict__.get("forward")) for m in forwards]
    try:
        for m, fwd in forwards.items():
            m.__dict__["forward"] = fwd
        yield
    finally:
        for m, fwd in saved:
            if fwd is None:
                m.__dict__.pop("forward", None)
            else:
                m.__dict__["forward"] = fwd


def _unrolled_rnn_forward(m: nn.RNNBase, input: Any, hx: Any = None) -> Any:  # noqa: A002 - torch's name
    import torch.nn.functional as F

    if isinstance(input, nn.utils.rnn.PackedSequence):
        raise CaptureError(f"{type(m).__name__} with a PackedSequence input cannot be captured for training: pad "
                           "the batch instead (a padded tensor and a mask in the loss)")
    lstm, gru = isinstance(m, nn.LSTM), isinstance(m, nn.GRU)
    batched = input.dim() == 3
    x = input if batched else input.unsqueeze(1)
    if m.batch_first and batched:
        x = x.transpose(0, 1)  # time-major from here on
    T, B = x.shape[0], x.shape[1]
    D = 2 if m.bidirectional else 1
    out_size = m.proj_size if getattr(m, "proj_size", 0) else m.hidden_size
    if hx is None:
        h0 = x.new_zeros(m.num_layers * D, B, out_size)
        c0 = x.new_zeros(m.num_layers * D, B, m.hidden_size) if lstm else None
    else:
        h0, c0 = hx if lstm else (hx, None)
        if not batched:
            h0 = h0.unsqueeze(1)
            c0 = c0.unsqueeze(1) if c0 is not None else None
    act = torch.relu if getattr(m, "nonlinearity", "tanh") == "relu" else torch.tanh
    h_n, c_n = [], []
    layer_in = x
    for layer in range(m.num_layers):
        outs = []
        for d in range(D):
            sfx = f"_l{layer}" + ("_reverse" if d else "")
            w_ih, w_hh = getattr(m, "weight_ih" + sfx), getattr(m, "weight_hh" + sfx)
            b_ih = getattr(m, "bias_ih" + sfx) if m.bias else None
            b_hh = getattr(m, "bias_hh" + sfx) if m.bias else None
            w_hr = getattr(m, "weight_hr" + sfx, None) if lstm else None
            h = h0[layer * D + d]
            c = c0[layer * D + d] if lstm else None
            xw = F.linear(layer_in, w_ih, b_ih)
            seq: list[Any] = [None] * T
            for t in (reversed(range(T)) if d else range(T)):
                gh = F.linear(h, w_hh, b_hh)
                if lstm:
                    i, f, g, o = (xw[t] + gh).chunk(4, 1)
                    c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
                    h = torch.sigmoid(o) * torch.tanh(c)
                    if w_hr is not None:
                        h = F.linear(h, w_hr)
                elif gru:
                    i_r, i_z, i_n = xw[t].chunk(3, 1)
                    h_r, h_z, h_n_ = gh.chunk(3, 1)
                    r = torch.sigmoid(i_r + h_r)
                    z = torch.sigmoid(i_z + h_z)
                    n = torch.tanh(i_n + r * h_n_)
                    h = n + z * (h - n)
                else:
                    h = act(xw[t] + gh)
                seq[t] = h
            outs.append(torch.stack(seq))
            h_n.append(h)
            if lstm:
                c_n.append(c)
        layer_in = torch.cat(outs, -1) if D == 2 else outs[0]
        if m.training and m.dropout > 0 and layer < m.num_layers - 1:
            layer_in = F.dropout(layer_in, m.dropout, True)  # not reached: such modules are not unrolled
    out = layer_in
    if m.batch_first and batched:
        out = out.transpose(0, 1)
    hn = torch.stack(h_n)
    cn = torch.stack(c_n) if lstm else None
    if not batched:
        out, hn = out.squeeze(1), hn.squeeze(1)
        cn = cn.squeeze(1) if cn is not None else None
    return (out, (hn, cn)) if lstm else (out, hn)


@contextlib.contextmanager
def _without_torch_compile(model: nn.Module) -> Iterator[None]:
    """Run `torch.compile`d modules (OptimizedModule, the model itself or a submodule) as their
    original module while tracing.

    Rule: fxspeed compiles the original module; the OptimizedModule wrapper stays in place (so
    parameter names keep their `_orig_mod.` prefix and match the engine's), only its forward is
    pointed at the original for the trace. Tracing through dynamo would run inductor's generated
    kernels on fake tensors and fail inside a generated file."""
    try:
        from torch._dynamo.eval_frame import OptimizedModule
    except Exception:  # noqa: BLE001 - no dynamo: nothing can be wrapped
        yield
        return
    wrapped = [m for m in model.modules() if isinstance(m, OptimizedModule)]
    if not wrapped:
        yield
        return
    import warnings

    names = {id(m): n for n, m in model.named_modules()}
    warn_user(
        "fxspeed: " + ", ".join(f"`{names.get(id(m)) or type(m._orig_mod).__name__}`" for m in wrapped)
        + " is a torch.compile'd module (OptimizedModule); fxspeed compiles the original module "
        "(._orig_mod) instead. Pass the module without torch.compile to silence this warning."
    )
    with _forwards_replaced({m: m._orig_mod.__call__ for m in wrapped}), warnings.catch_warnings():
        # torch's note on global module hooks concerns dynamo; the hooks are capture's own
        warnings.filterwarnings("ignore", message=r"Using `torch.compile\(module\)` when there are global hooks")
        yield


@contextlib.contextmanager
def fake_model_state(model: nn.Module, args: tuple, kwargs: dict) -> Iterator[tuple[tuple, dict]]:
    """Swap the model's parameters and buffers for fake tensors while tracing.

    Tracing real weights costs real memory (AOT export materializes functional copies; why:
    docs/decisions/capture-on-fake-tensors.md), and a model on the meta device cannot be traced
    faithfully at all:
    meta tensors skip autograd for some ops (torch registers meta kernels for e.g. nll_loss,
    which then bypass the op's autograd formula, so `cross_entropy` gives no gradient). Fake
    CPU tensors behave as CPU tensors in every respect but hold no data. For the duration of
    the block, the model's parameters and buffers are swapped for fake ones (meta -> CPU; tied
    weights stay tied) and each batch tensor for its own dense fake (aliasing between batch
    tensors is not kept, on purpose); the originals come back after.
    """
    from torch._subclasses.fake_tensor import FakeTensorMode

    # Non-fake inputs allowed: AOT export retraces its first graph with plain make_fx, and
    # constants that graph captured (e.g. an arange of positions) are real tensors.
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    made: dict[int, torch.Tensor] = {}
    # Meta parameters beside real ones (the engine's stand-ins for weights a rank holds only part
    # of) are faked on the real ones' device, or the buffers' (a model built under
    # fxspeed.parameters_on_meta); an all-meta model (fxspeed.plan) on the CPU.
    home = next((t.device for t in (*model.parameters(), *model.buffers()) if not t.is_meta), torch.device("cpu"))

    def fake(t: torch.Tensor) -> torch.Tensor:
        if id(t) not in made:
            with mode:
                f = torch.empty_strided(tuple(t.shape), tuple(t.stride()), dtype=t.dtype,
                                        device=home if t.is_meta else t.device)
            made[id(t)] = nn.Parameter(f, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else f
        return made[id(t)]

    def fake_input(t: torch.Tensor) -> torch.Tensor:
        # Rule: every tensor leaf of the batch is its own fresh, dense fake (no memo by id, no
        # storage shared with another leaf or with the example), laid out by `traced_format`.
        # Tracing the example itself would bake its aliasing into the graph: `(x, x)` gave one
        # input read twice, so a later `train_step(a, b)` computed `model(b, b)`; and its
        # strides into view ops. The runtime feeds each leaf in the same format
        # (`tensor_leaves`), so neither aliasing nor strides can differ from what was traced.
        if t.layout != torch.strided:
            return t
        with mode:
            return torch.empty(tuple(t.shape), dtype=t.dtype, device="cpu" if t.is_meta else t.device,
                               memory_format=traced_format(t))

    swapped: list[tuple[dict, str, torch.Tensor]] = []
    try:
        for mod in model.modules():
            for store in (mod._parameters, mod._buffers):
                for k, t in list(store.items()):
                    if t is not None:
                        swapped.append((store, k, t))
                        store[k] = fake(t)
        yield pytree.tree_map(lambda x: fake_input(x) if isinstance(x, torch.Tensor) else x, (args, kwargs))
    finally:
        for store, k, t in reversed(swapped):
            store[k] = t


def _strip(name: str) -> str:
    return name[len("model."):] if name.startswith("model.") else name


def _signature(gm: fx.GraphModule, sig: Any, n_user: int, train: bool, loss_out: bool) -> StepSignature:
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    inputs: list[IOSpec] = []
    user_i = 0
    for ph in placeholders:
        if ph.name in sig.inputs_to_parameters:
            inputs.append(IOSpec("param", _strip(sig.inputs_to_parameters[ph.name])))
        elif ph.name in sig.inputs_to_buffers:
            inputs.append(IOSpec("buffer", _strip(sig.inputs_to_buffers[ph.name])))
        else:
            inputs.append(IOSpec("input", str(user_i)))
            user_i += 1
    assert user_i == n_user, "graph inputs do not match the batch's tensors"
    out_node = next(n for n in gm.graph.nodes if n.op == "output")
    outs = list(out_node.args[0])
    n_mut, n_user = len(sig.buffers_to_mutate), len(sig.user_outputs)
    mutated = list(sig.buffers_to_mutate.values())  # in output order
    grads = sig.backward_signature.gradients_to_parameters if train else {}
    outputs: list[IOSpec] = []
    for i, arg in enumerate(outs):
        if i < n_mut:
            outputs.append(IOSpec("buffer_update", _strip(mutated[i])))
        elif i < n_mut + n_user:
            k = i - n_mut
            outputs.append(IOSpec("loss", "loss") if (train or loss_out) and k == 0 else IOSpec("output", str(k)))
        else:
            outputs.append(IOSpec("grad", _strip(grads[arg.name])))
    return StepSignature(inputs, outputs)


def _name_ties(signature: StepSignature, named: list[tuple[str, nn.Parameter]]) -> None:
    """A tied weight's canonical name is its first name in `model.named_parameters()` (the one the
    runtime, checkpoints and `state_dict` use); its other names go to `signature.tied`. A tie the
    graph is fed only under a later name is fed under the canonical one instead, so the canonical
    name is always among the inputs (passes that merge aliases look it up there).

    Before: `inputs=[param enc.weight]`, outputs `[grad enc.weight]` (the forward reaches the
    weight through `enc` only; `shared` is hidden from the trace as an unused alias).
    After:  `inputs=[param shared.weight]`, `[grad shared.weight]`, `tied={"enc.weight":
    "shared.weight"}` -- under ZeRO-3 the flat shards held it as `enc.weight` and state_dict read
    it back 0-size.
    """
    first: dict[int, str] = {}
    for name, p in named:
        if id(p) in first:
            signature.tied[name] = first[id(p)]
        else:
            first[id(p)] = name
    by_name = dict(named)
    fed = {s.target for s in signature.inputs if s.kind == "param"}
    rename: dict[str, str] = {}
    for s in signature.inputs:
        p = by_name.get(s.target) if s.kind == "param" else None
        if p is not None and first[id(p)] not in fed and first[id(p)] not in rename.values():
            rename[s.target] = first[id(p)]
    if rename:
        signature.inputs = [IOSpec(s.kind, rename[s.target]) if s.kind in ("param", "grad") and s.target in rename
                            else s for s in signature.inputs]
        signature.outputs = [IOSpec(s.kind, rename[s.target]) if s.kind == "grad" and s.target in rename
                             else s for s in signature.outputs]


def _has_aliases(module: nn.Module) -> bool:
    """Whether a trainable Parameter is reachable under more than one name (tied weights)."""
    params = [p for _, p in module.named_parameters(remove_duplicate=False) if p.requires_grad]
    return len({id(p) for p in params}) < len(params)


def _names_without_grad(wrapper: _StepModule, tensors: list[torch.Tensor]
                        ) -> tuple[list[nn.Parameter], list[tuple[nn.Module, str, nn.Parameter]]]:
    """Run forward+loss once on fake tensors with real autograd, every parameter *name* bound
    to its own tensor (as AOT export binds them), and see which names the loss does not reach.

    Returns (parameters reached under no name: to freeze, (owner module, attribute, parameter)
    of unreached aliases of parameters reached under another name: to hide from the trace).
    """
    from torch._subclasses.fake_tensor import FakeTensorMode

    named = [(n, p) for n, p in wrapper.named_parameters(remove_duplicate=False) if p.requires_grad]
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        fake_params = {n: mode.from_tensor(p.detach()).requires_grad_(True) for n, p in named}
        fake_buffers = {n: mode.from_tensor(b) for n, b in wrapper.named_buffers(remove_duplicate=False)}
        fake_inputs = [mode.from_tensor(t) for t in tensors]
        (loss,) = torch.func.functional_call(wrapper, {**fake_params, **fake_buffers}, tuple(fake_inputs),
                                             tie_weights=False)
        grads = torch.autograd.grad(loss, list(fake_params.values()), allow_unused=True)
    reached = {id(p) for (_, p), g in zip(named, grads) if g is not None}
    frozen: dict[int, nn.Parameter] = {}
    hidden: list[tuple[nn.Module, str, nn.Parameter]] = []
    for (name, p), g in zip(named, grads):
        if g is not None:
            continue
        if id(p) in reached:
            path, _, leaf = name.rpartition(".")
            hidden.append((wrapper.get_submodule(path), leaf, p))
        else:
            frozen[id(p)] = p
    return list(frozen.values()), hidden


def _drop_metadata_asserts(gm: fx.GraphModule) -> None:
    """Remove `aten._assert_tensor_metadata` nodes (emitted for `.to(dtype)` calls, e.g. in
    Hugging Face models): trace-time checks of dtype/device that return nothing, hold by
    construction for the traced shapes, and carry no meta['val'] for passes to read."""
    asserts = [n for n in gm.graph.nodes
               if n.op == "call_function" and n.target is torch.ops.aten._assert_tensor_metadata.default]
    for n in asserts:
        if not n.users:
            gm.graph.erase_node(n)
    if asserts:
        gm.recompile()
    # Checks of values (F.one_hot's "class values must be smaller than num_classes") stay: they
    # run every step, as eager's do. They return nothing; typed as such for the passes.
    for n in gm.graph.nodes:
        if n.op == "call_function" and n.target in _VALUE_ASSERTS and "val" not in n.meta:
            n.meta["val"] = None


_VALUE_ASSERTS = (torch.ops.aten._assert_async.msg, torch.ops.aten._assert_async.default)


class _OneHotRangeChecked(torch.overrides.TorchFunctionMode):
    """F.one_hot checks its labels' range from their values, which a trace on fake tensors does
    not have: torch 2.13's export records that check as `aten._assert_async`, torch 2.11's drops
    it, and an out-of-range label then trained silently as an all-zero row (eager raises "Class
    values must be smaller than num_classes"). While tracing, the checks are put in the program
    here, on every torch (on 2.13 a second pair: two reductions over the labels).
    `num_classes=-1` (inferred from the largest label) needs no upper check."""

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func is torch.nn.functional.one_hot and args and isinstance(args[0], torch.Tensor):
            labels = args[0]
            classes = args[1] if len(args) > 1 else kwargs.get("num_classes", -1)
            if labels.numel() and labels.dtype == torch.long:
                torch._assert_async(labels.min() >= 0, "Class values must be non-negative.")
                if isinstance(classes, int) and classes > 0:
                    torch._assert_async(labels.max() < classes, "Class values must be smaller than num_classes.")
        return func(*args, **kwargs)


@contextlib.contextmanager
def _buffer_rebinds_as_writes() -> Iterator[None]:
    """`self.ema = self.ema * 0.5 + 1` in forward rebinds a buffer to a new tensor. The trace
    runs on stand-ins of the buffers and puts the originals back, so the update was lost with no
    word (eager's ema moved every step; the step's stayed at its first value). While tracing, such
    an assignment of a tensor of the buffer's shape and dtype writes into the buffer instead: a
    buffer mutation the program carries out, as it does BatchNorm's running statistics.

    A value that requires grad (`self.stat = self.stat * 0.9 + h.mean()`) is written detached:
    eager's buffer would carry this step's graph into the next step, whose backward could not
    go through it, so only its value can matter. A value of another shape, dtype or device
    cannot be written into the buffer the program holds, and is refused naming the buffer."""
    real = nn.Module.__setattr__

    def setattr_(self: nn.Module, name: str, value: Any) -> None:
        buffers = self.__dict__.get("_buffers")
        old = buffers.get(name) if buffers is not None else None
        if isinstance(value, torch.Tensor) and isinstance(old, torch.Tensor) and value is not old:
            if (value.shape, value.dtype, value.device) != (old.shape, old.dtype, old.device):
                raise CaptureError(
                    f"{type(self).__name__}.forward rebinds its buffer `{name}` to a tensor of "
                    f"shape {tuple(value.shape)}, {value.dtype} on {value.device}; the buffer is "
                    f"{tuple(old.shape)}, {old.dtype} on {old.device}. A compiled step writes "
                    "buffers in place, so the new value must keep the buffer's shape, dtype and "
                    "device: convert it (`.to(self.{0})`) or keep the tensor as a plain "
                    "attribute or output instead of a buffer.".replace("{0}", name))
            with torch.no_grad():
                old.copy_(value.detach())
            return
        real(self, name, value)

    nn.Module.__setattr__ = setattr_  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Module.__setattr__ = real  # type: ignore[method-assign]


def _rng_untouched(model: nn.Module, tensors: list[torch.Tensor]) -> contextlib.AbstractContextManager:
    """Tracing must not advance the user's RNG: AOT export runs the model's random ops
    (dropout's bernoulli) on fake tensors, which still draws from the real CPU/CUDA
    generators, so a step after compile() would see other dropout masks than eager under
    the same torch.manual_seed. Save the generators' states and restore them afterwards."""
    cuda = sorted({t.device.index or 0 for t in [*model.parameters(), *model.buffers(), *tensors] if t.is_cuda})
    return _generators_untouched(model, torch.random.fork_rng(devices=cuda))


@contextlib.contextmanager
def _generators_untouched(model: nn.Module, default: contextlib.AbstractContextManager) -> Iterator[None]:
    """Besides the default generators: a torch.Generator a module holds (`self.gen`) is put back
    too (the trace's draw left it one draw ahead: every step drew eager's next step's numbers),
    and Python's and numpy's generators, whose draws a trace cannot follow: forward that draws
    from them (`random.random() < p` to drop a layer) takes the trace's branch at every step,
    which is said."""
    import random

    held = [g for m in model.modules() for g in m.__dict__.values() if isinstance(g, torch.Generator)]
    states = [g.get_state() for g in held]
    py = random.getstate()
    np_random = sys.modules.get("numpy.random")
    np_state = np_random.get_state() if np_random is not None else None
    try:
        with default:
            yield
    finally:
        for g, st in zip(held, states):
            g.set_state(st)
        drew = []
        if random.getstate() != py:
            drew.append("Python's random")
            random.setstate(py)
        if np_random is not None and not _same_np_state(np_random.get_state(), np_state):
            drew.append("numpy.random")
            np_random.set_state(np_state)
        if drew:
            log.warning("fxspeed: %s's forward draws from %s while traced; the compiled step does not run that "
                        "Python again, so every step takes the draws (and branches) of the trace. Draw with torch "
                        "(torch.rand(()) < p), which the step draws anew each time", type(model).__name__,
                        " and ".join(drew))


@contextlib.contextmanager
def _rng_control_said(model: nn.Module) -> Iterator[None]:
    """Forward that seeds or restores torch's generator (`torch.manual_seed(42)` for a fixed mask,
    get/set_rng_state to draw one mask twice) or makes its own torch.Generator: the program draws
    from the step's generator as traced and runs none of that Python, so its masks are not
    eager's. Said once per trace (calls from torch itself, as checkpoint's recompute, are not
    the user's)."""
    calls: list[str] = []
    torch_dir = os.path.dirname(torch.__file__)

    def noted(name: str, fn: Any) -> Any:
        @functools.wraps(fn)
        def call(*a: Any, **k: Any) -> Any:
            caller = sys._getframe(1).f_code.co_filename
            if not caller.startswith(torch_dir) and name not in calls:
                calls.append(name)
            return fn(*a, **k)
        return call

    class AnyGenerator(type(torch.Generator)):  # isinstance(g, torch.Generator) stays true of every generator
        def __instancecheck__(cls, obj: Any) -> bool:
            return isinstance(obj, torch._C.Generator)

    class Generator(torch._C.Generator, metaclass=AnyGenerator):  # a stand-in that notes its creation
        def __init__(self, *a: Any, **k: Any) -> None:
            if "torch.Generator()" not in calls and not sys._getframe(1).f_code.co_filename.startswith(torch_dir):
                calls.append("torch.Generator()")
            super().__init__(*a, **k)

    patches = [mock.patch.object(torch, n, noted(f"torch.{n}", getattr(torch, n)))
               for n in ("manual_seed", "set_rng_state", "seed")]
    patches += [mock.patch.object(torch.random, n, noted(f"torch.{n}", getattr(torch.random, n)))
                for n in ("manual_seed", "set_rng_state", "seed")]
    patches.append(mock.patch.object(torch, "Generator", Generator))
    with contextlib.ExitStack() as stack:
        for patch in patches:
            stack.enter_context(patch)
        yield
    if calls:
        log.warning("fxspeed: %s's forward calls %s while traced; the compiled step draws its random numbers from "
                    "the step's generator and runs none of that Python, so its dropout masks and random draws are "
                    "not those eager would make (a fixed seed is not fixed, a replayed mask is not replayed). Keep "
                    "seeding outside forward", type(model).__name__, ", ".join(calls))


def _same_np_state(a: Any, b: Any) -> bool:
    return a[0] == b[0] and bool((a[1] == b[1]).all()) and tuple(a[2:]) == tuple(b[2:])


@contextlib.contextmanager
def _tracing_flags() -> Iterator[None]:
    # Libraries (Hugging Face in particular) skip data-dependent Python branches when they
    # believe they are being compiled; our trace is a compilation in exactly that sense.
    # FakeTensor logs a traceback at ERROR for an op whose meta check fails (a float index to
    # gather) before raising it; the CaptureError made of it says what failed and where, once.
    # AOT's joint trace runs backward under anomaly mode, which warns "Error detected in
    # MseLossBackward0" with the forward's whole traceback before a failure re-raises: the
    # CaptureError says the same once (an empty batch printed both).
    fake_log = logging.getLogger("torch._subclasses.fake_tensor")
    level = fake_log.level
    fake_log.setLevel(logging.CRITICAL)
    try:
        with mock.patch.object(torch.compiler, "is_compiling", lambda: True), warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="Error detected in ")
            yield
    finally:
        fake_log.setLevel(level)


class _ModuleOwners:
    """Records which module call created each traced node (node name -> module path).

    Forward hooks note the last graph node at a module's entry; at its exit, every node
    created since then and not claimed by an inner module belongs to it. Only the last
    traced graph is kept (AOT export traces more than once).
    """

    def __init__(self, model: nn.Module):
        self.names = {id(m): n for n, m in model.named_modules(remove_duplicate=False)}
        self.owner: dict[str, str] = {}
        self._graph: fx.Graph | None = None
        self._stack: list[tuple[fx.Graph | None, fx.Node | None]] = []
        self._handles: list[Any] = []

    def of(self, final: fx.Graph) -> dict[str, str]:
        """The owners of `final`'s nodes. A training step's joint graph is a retrace of the graph
        the hooks saw: its forward nodes keep their names there, but a name is taken only where
        its node computes the same op from the same inputs (AOT export adds and reorders some
        nodes, e.g. the `detach`es autograd saves, so `detach_2` may be another value's)."""
        if self._graph is None or final is self._graph:
            return dict(self.owner)
        seen = {n.name: n for n in self._graph.nodes}
        out: dict[str, str] = {}
        for n in final.nodes:
            was = seen.get(n.name)
            if n.name in self.owner and was is not None and _same_op(was, n):
                out[n.name] = self.owner[n.name]
        return out

    def __enter__(self) -> "_ModuleOwners":
        from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook

        self._handles = [register_module_forward_pre_hook(self._pre), register_module_forward_hook(self._post)]
        return self

    def __exit__(self, *exc: Any) -> None:
        for h in self._handles:
            h.remove()

    @staticmethod
    def _current_graph() -> fx.Graph | None:
        from torch.fx.experimental.proxy_tensor import get_proxy_mode

        mode = get_proxy_mode()
        return None if mode is None else mode.tracer.graph

    def _pre(self, module: nn.Module, args: Any) -> None:
        if id(module) not in self.names:
            # Not the user's: AOT export retraces its first graph by calling that GraphModule, and
            # a new graph seen there would drop every owner recorded (the joint graph of a
            # training step keeps the first graph's node names for its forward).
            self._stack.append((None, None))
            return
        g = self._current_graph()
        if g is not None and g is not self._graph:
            self._graph, self.owner = g, {}
        last = next(iter(reversed(g.nodes)), None) if g is not None else None
        self._stack.append((g, last))

    def _post(self, module: nn.Module, args: Any, out: Any) -> None:
        if not self._stack:
            return
        g, last = self._stack.pop()
        name = self.names.get(id(module))
        if g is None or name is None or g is not self._graph:
            return
        node = last.next if last is not None else next(iter(g.nodes), None)
        root = g._root  # sentinel of fx's doubly linked node list
        while node is not None and node is not root:
            # (names are the user model's own: no wrapper prefix to strip. Stripping "model." cut HF
            # Llama's `model.layers.2` to `layers.2`, and a pipeline's eval split missed its points)
            self.owner.setdefault(node.name, name)
            node = node.next


def _same_op(a: fx.Node, b: fx.Node) -> bool:
    """Two nodes of two traces of one step compute the same thing: same op, and the same inputs by
    name (placeholders, which the traces name differently, count as alike)."""
    if a.target != b.target or len(a.all_input_nodes) != len(b.all_input_nodes):
        return False
    return all(x.op == y.op == "placeholder" or x.name == y.name for x, y in zip(a.all_input_nodes, b.all_input_nodes))


# --------------------------------------------------------------------------------------------
# Errors
# --------------------------------------------------------------------------------------------

def _package_dir(name: str) -> str:
    import importlib.util

    spec = importlib.util.find_spec(name)
    return os.path.abspath(next(iter(spec.submodule_search_locations))) if spec and spec.submodule_search_locations \
        else ""


# Frames here are torch's, the standard library's or fxspeed's, never the user's line: fxspeed's own
# folders (the runtime and passes live outside fxspeed/ in the source tree) but for its models,
# which are user code to an error (a Sequential's error was blamed on runtime/engine.py's call of
# the compiler, h39). Packages installed beside the standard library (a python without a venv puts
# site-packages inside it) are not the standard library: Hugging Face's lines are the user's.
_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep
_STDLIB_DIR = os.path.dirname(os.path.abspath(contextlib.__file__)) + os.sep
_FXSPEED_DIRS = tuple(d + os.sep for d in map(_package_dir, ("fxspeed", "fxspeed.runtime", "fxspeed.passes")) if d)
_USER_DIRS = tuple(d + os.sep for d in (_package_dir("fxspeed.models"),) if d)
_INSTALLED = (os.sep + "site-packages" + os.sep, os.sep + "dist-packages" + os.sep)


def _user_frame(tb: Any) -> traceback.FrameSummary | None:
    frames = traceback.extract_tb(tb)
    for fr in reversed(frames):
        if _is_user_file(fr.filename):
            return fr
    return None


def _is_rnn_export_limit(model: nn.Module, e: BaseException) -> bool:
    """AOT export's failure on the fused LSTM op ("len(gradients_to_parameters)=3 + ... !=
    len(backward_output_names)=4") in a model holding RNN modules `_rnns_unrolled` can unroll."""
    msg = str(e)
    return ("len(gradients_to_parameters)" in msg and "backward_output_names" in msg
            and any(type(m) in (nn.LSTM, nn.GRU, nn.RNN) for m in model.modules()))


def _known_capture_error(model: nn.Module, wrapper: "_StepModule", tensors: list[torch.Tensor],
                         e: BaseException) -> CaptureError | None:
    """Torch limitations and user mistakes that AOT export reports in its own terms and with no
    user line: say what the user did and the way out, naming the module, parameter and line."""
    msg = str(e)
    name = type(model).__name__
    if "len(gradients_to_parameters)" in msg and "backward_output_names" in msg:
        rnns = [(n, m) for n, m in model.named_modules() if isinstance(m, nn.RNNBase)]
        stuck = [(n, m) for n, m in rnns if type(m) not in (nn.LSTM, nn.GRU, nn.RNN)
                 or (m.training and m.dropout > 0 and m.num_layers > 1)]  # those `_rnns_unrolled` left
        rnns = stuck or rnns
        if rnns:
            which = ", ".join(f"`{n or name}` ({type(m).__name__})" for n, m in rnns)
            return CaptureError(
                f"cannot capture the training step of {name}: {which} cannot be captured for training. fxspeed "
                "traces RNN modules as a loop over time steps, except with dropout between layers (num_layers > 1 "
                "and dropout > 0 in training, whose random draws would not follow eager's), and torch's export of "
                "the fused RNN op does not give a gradient for every weight "
                f"({msg.strip().splitlines()[0]}). How to fix: stack single-layer modules with nn.Dropout between "
                "them (or set dropout=0), or write a loop over nn.LSTMCell / nn.GRUCell / nn.RNNCell, or keep the "
                "RNN out of the model given to fxspeed.compile.",
                op=f"aten.{type(rnns[0][1]).__name__.lower()}",
            )
    if "marked as the loss, but it does not require gradients" in msg:
        return CaptureError(
            f"cannot capture the training step of {name}: the loss does not depend on any trainable parameter "
            "(it does not require gradients). How to fix: compute the loss from the model's output (not only "
            "from the batch, or from detached / no_grad values), and check that the parameters it should "
            "train have requires_grad=True."
        )
    chain = _exception_chain(e)
    if any("DynamicOutputShape" in type(c).__name__ for c in chain) and not any(
            _user_frame(c.__traceback__) for c in chain):
        # Raised in AOT export's backward, where no user line is: index_put's backward reads the
        # gradient at the mask's True entries (nonzero: as many as the data has)
        found = _find_op(wrapper, tensors, _mask_assignment)
        if found is not None:
            _, op, frame = found
            where = f" at {frame.filename}:{frame.lineno} `{(frame.line or '').strip()}`" if frame else ""
            return CaptureError(
                f"cannot capture the training step of {name} in op {op}{where}: an assignment through a boolean "
                "mask (h[mask] = v) has a backward whose shape depends on the mask's values (the gradient of v "
                "is read at the mask's True entries), and one captured graph needs every shape before it sees "
                "the data. How to fix: write it as a select of fixed shape, h = torch.where(mask.unsqueeze(-1), "
                "v, h) for a mask over h's leading dims and v broadcast over the selected rows (or "
                "h.masked_fill(mask.unsqueeze(-1), value) for a constant); Hugging Face speech models do this "
                "for SpecAugment: set config.mask_time_prob=0 and mask_feature_prob=0.",
                op=op, source=f"{frame.filename}:{frame.lineno}" if frame else None,
            )
    if "requires gradients, and received a mutation" in msg:
        found = _find_parameter_mutation(wrapper, tensors)
        if found is not None:
            pname, op, frame = found
            where = f" at {frame.filename}:{frame.lineno} `{(frame.line or '').strip()}`" if frame else ""
            fix = ("do not modify parameters inside forward (in-place ops on a parameter or on its .data); change "
                   "them outside the training step under torch.no_grad(), or compute a new tensor "
                   "(w = self.weight * s) and use it")
            if "embedding_renorm" in op:
                # no in-place op in the user's code: nn.Embedding(max_norm=...) rescales the rows it
                # looks up, in place, in every forward
                fix = (f"nn.Embedding(max_norm=...) rescales the rows it looks up in place in forward: build "
                       f"`{_python_path(pname.rpartition('.')[0])}` with max_norm=None, and if the norm bound matters rescale "
                       "its rows between steps under torch.no_grad() (or use F.normalize on the looked-up rows "
                       "inside forward)")
            return CaptureError(
                f"cannot capture the training step of {name}: forward modifies the trainable parameter `{pname}` "
                f"in place ({op}){where}. How to fix: {fix}.",
                op=op, source=f"{frame.filename}:{frame.lineno}" if frame else None,
            )
    return None


def _parameter_mutation_error(model: nn.Module, wrapper: "_StepModule", tensors: list[torch.Tensor],
                              train: bool) -> CaptureError:
    """Forward writes a parameter in place where the trace allowed it (an eval step: Hugging Face
    RWKV rescales its weights in eval mode). The program would hand the new values back as
    outputs nobody reads: eval_step failed with a bare KeyError. Said with the op and line."""
    named = [(_strip(n), p) for n, p in wrapper.named_parameters()]
    found = _find_write(wrapper, named, tensors)
    pname, op, frame = found if found is not None else ("?", "an in-place op", None)
    where = f" at {frame.filename}:{frame.lineno} `{(frame.line or '').strip()}`" if frame else ""
    return CaptureError(
        f"cannot capture the {'training' if train else 'eval'} step of {type(model).__name__}: forward modifies the "
        f"parameter `{pname}` in place ({op}){where}, which a compiled step does not do. How to fix: change "
        "parameters outside the step under torch.no_grad(), or compute a new tensor (w = self.weight * s) and "
        "use it (Hugging Face RWKV: config.rescale_every=0).",
        op=op, source=f"{frame.filename}:{frame.lineno}" if frame else None,
    )


def _find_parameter_mutation(wrapper: "_StepModule", tensors: list[torch.Tensor]
                             ) -> tuple[str, str, traceback.FrameSummary | None] | None:
    """Run forward+loss once more on the (fake) tensors, watching for an op that writes into
    the storage of a trainable parameter (`p.data.mul_(...)`, `p.add_(...)` under no_grad).
    Returns (parameter name, op, user frame) of the first one, or None."""
    named = [(_strip(n), p) for n, p in wrapper.named_parameters() if p.requires_grad]
    return _find_write(wrapper, named, tensors)


def _find_write(wrapper: "_StepModule", named: list[tuple[str, torch.Tensor]], tensors: list[torch.Tensor]
                ) -> tuple[str, str, traceback.FrameSummary | None] | None:
    """Run forward+loss once more on the (fake) tensors, watching for an op that writes into
    the storage of one of the `named` tensors. Returns (name, op, user frame) of the first one."""
    from torch.multiprocessing.reductions import StorageWeakRef

    if not named:
        return None
    try:
        storages = {StorageWeakRef(p.untyped_storage()): n for n, p in named}
    except Exception:  # noqa: BLE001 - a diagnostic only
        return None

    def writes(func: Any, args: tuple, kwargs: dict) -> str | None:
        for i, a in enumerate(func._schema.arguments):
            if a.alias_info is None or not a.alias_info.is_write:
                continue
            t = args[i] if i < len(args) else kwargs.get(a.name)
            if isinstance(t, torch.Tensor) and StorageWeakRef(t.untyped_storage()) in storages:
                return storages[StorageWeakRef(t.untyped_storage())]
        return None

    return _find_op(wrapper, tensors, writes, [p for _, p in named])


def _find_op(wrapper: "_StepModule", tensors: list[torch.Tensor], match: Callable[[Any, tuple, dict], str | None],
             more: Sequence[torch.Tensor] = ()) -> tuple[str, str, traceback.FrameSummary | None] | None:
    """Run forward+loss once more on the (fake) tensors, watching the ATen ops it calls for the
    first that `match(func, args, kwargs)` names (a non-None label). Returns (label, op, user
    frame), or None. For errors that torch raises with no user line (in AOT export's backward)."""
    from torch._guards import detect_fake_mode
    from torch.utils._python_dispatch import TorchDispatchMode

    found: list[tuple[str, str, traceback.FrameSummary | None]] = []

    class _Watch(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
            kwargs = kwargs or {}
            if not found:
                label = match(func, args, kwargs)
                if label is not None:
                    frames = traceback.StackSummary.extract(traceback.walk_stack(None))
                    found.append((label, str(func), _first_user_frame(reversed(frames))))
            return func(*args, **kwargs)

    mode = detect_fake_mode(tensors) or detect_fake_mode(list(more))
    try:
        with contextlib.ExitStack() as stack:
            if mode is not None:
                stack.enter_context(mode)
            stack.enter_context(torch.random.fork_rng())
            stack.enter_context(_without_torch_compile(wrapper.model))
            stack.enter_context(_Watch())
            wrapper(*tensors)
    except Exception:  # noqa: BLE001 - a diagnostic only; what it saw before failing still counts
        pass
    return found[0] if found else None


_INDEX_PUT = ("aten::index_put", "aten::index_put_", "aten::_index_put_impl_")


def _mask_assignment(func: Any, args: tuple, kwargs: dict) -> str | None:
    """`h[mask] = v` whose backward runs: an index_put with a boolean mask for an index, into or
    from a tensor that needs a gradient (`y[y > 5] = 0` on the targets traces fine)."""
    if func._schema.name not in _INDEX_PUT or len(args) < 3:
        return None
    masks = [i for i in args[1] if isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8)]
    grads = any(isinstance(t, torch.Tensor) and t.requires_grad for t in (args[0], args[2]))
    return "mask assignment" if masks and grads else None


def _first_user_frame(frames: Any) -> traceback.FrameSummary | None:
    """The innermost frame outside torch and fxspeed's capture, of frames given innermost-last."""
    for fr in reversed(list(frames)):
        if _is_user_file(fr.filename):
            return fr
    return None


# Shape errors ATen raises for any tensor, fake or real (view, matmul, broadcasting, cat, indexing).
_SHAPE_ERROR = re.compile(r"is invalid for input of size|shapes cannot be multiplied|must match the size of tensor"
                          r"|size mismatch|Sizes of tensors must match|out of bounds for dimension|expected .* size"
                          r"|expected input batch_size", re.IGNORECASE)


# Dtype errors ATen raises for fake and real tensors alike (float indices, mixed matmul dtypes).
_DTYPE_ERROR = re.compile(r"to have one of the following scalar types|Expected dtype int|expected scalar type"
                          r"|must have the same dtype|to have the same dtype|expected target dtype|dtype .* but got")


def _near(frame: traceback.FrameSummary, word: str, lines: int = 3) -> bool:
    """Whether `word` is in the source of `frame`'s line or the `lines` before it."""
    import linecache

    return any(word in linecache.getline(frame.filename, i).lower()
               for i in range(max(1, (frame.lineno or 1) - lines), (frame.lineno or 0) + 1))


def _exception_chain(e: BaseException) -> list[BaseException]:
    """`e` and the exceptions it was raised from or during, innermost last."""
    chain: list[BaseException] = []
    cur: BaseException | None = e
    while cur is not None and cur not in chain:
        chain.append(cur)
        cur = cur.__cause__ or cur.__context__
    return chain


def _capture_error(model: nn.Module, e: BaseException, train: bool = True) -> CaptureError:
    op = getattr(e, "func", None)
    op_name = str(op) if op is not None else None
    # Walk the chain: torch often re-raises, and the user's frame is on the original one.
    frame = None
    cur: BaseException | None = e
    while cur is not None and frame is None:
        frame = _user_frame(cur.__traceback__)
        cur = cur.__cause__ or cur.__context__
    source = f"{frame.filename}:{frame.lineno}" if frame else None
    code = f" `{frame.line.strip()}`" if frame and frame.line else ""
    hint = "rewrite that line without the unsupported construct"
    reason = str(e).strip().splitlines()[0].rstrip(".") if str(e).strip() else type(e).__name__
    chain = _exception_chain(e)
    if any("DynamicOutputShape" in type(c).__name__ for c in chain) or (
            op_name and any(k in op_name for k in ("nonzero", "masked_select", "unique"))):
        # Rule: boolean-mask indexing (h[mask]) lowers to aten.nonzero, whose output shape is the
        # number of True entries: known only from the data, so no static graph can hold it.
        reason = (f"the output shape of {op_name or 'an op'} depends on the tensor's values (a data-dependent "
                  "shape, as boolean-mask indexing h[mask], nonzero, masked_select and unique give), and one "
                  "captured graph needs every shape before it sees the data")
        hint = ("keep the shapes fixed: select with torch.where(mask, a, b) or masked_fill, and average over "
                "the selected entries with the mask as a weight, e.g. for ((h[m] - y[m]) ** 2).mean() with a "
                "bool mask m over rows: w = m.unsqueeze(-1).to(h.dtype); (((h - y) ** 2) * w).sum() / "
                "(w.sum() * h.shape[-1])")
        if frame is not None and "transformers" in frame.filename and _near(frame, "expert"):
            # Hugging Face's "eager" mixture of experts loops over the experts that got tokens
            reason += (" (the mixture of experts' loop over the experts that received tokens, Hugging Face's "
                       "'eager' experts implementation)")
            hint = ("choose an experts implementation of fixed shapes before compile: "
                    "model.set_experts_implementation('grouped_mm') (or 'batched_mm'), as Hugging Face does by default")
    elif op_name and "_local_scalar_dense" in op_name or "data-dependent" in str(e).lower() or "DataDependent" in type(e).__name__:
        op_name = op_name or "aten._local_scalar_dense"
        reason = "a tensor's value is used in Python control flow or converted to a Python number (.item(), if tensor:, int(tensor))"
        hint = "compute it with tensor ops (torch.where, masking) or pass it as a non-tensor argument"
        inside = next((c for c in (_torch_callee(model, x) for x in chain) if c is not None), None)
        if inside is not None:
            reason, hint = _torch_module_hint(inside, reason, hint)
        elif frame is not None and _near(frame, "layerdrop"):
            # LayerDrop (Wav2Vec2, HuBERT, Whisper, BART, ...): a Python branch on a random draw per
            # layer per step, in library code the user cannot rewrite
            reason = ("LayerDrop decides in Python, from a random draw, whether each layer runs this step, and "
                      "one captured graph cannot branch on the data")
            hint = ("set the model's LayerDrop probability to 0 before compile (Hugging Face: config.layerdrop, "
                    "encoder_layerdrop or decoder_layerdrop = 0.0, when building the model from its config); "
                    "every layer then runs, as in evaluation")
    elif any(str(c).startswith("SyncBatchNorm expected input tensor to be on GPU") for c in chain):
        # torch's own rule (eager raises it too on a CPU with a process group): its statistics
        # exchange has GPU kernels only
        reason = "nn.SyncBatchNorm runs only on GPUs under a process group (eager raises this on the CPU too)"
        hint = ("on the CPU use BatchNorm, whose statistics each rank computes over its own part of the batch (as "
                "DDP without SyncBatchNorm): before compile, replace each nn.SyncBatchNorm with an nn.BatchNorm2d "
                "(or 1d/3d) of the same num_features, eps, momentum, affine and track_running_stats, and copy its "
                "state_dict over")
    elif any(isinstance(c, (RuntimeError, ValueError, TypeError)) and _DTYPE_ERROR.search(str(c)) for c in chain):
        hint = ("the model raises this for the example's dtypes, eagerly too: token ids, class labels and indices "
                "must be int64 (torch.long) tensors, and the tensors a matmul or cat combines of one floating "
                "dtype; check the example inputs' dtypes and any cast at that line")
    elif any(isinstance(c, (RuntimeError, ValueError, IndexError)) and _SHAPE_ERROR.search(str(c)) for c in chain):
        # Not a tracing limit: fake tensors check shapes as eager does, so the model raises this
        # on these inputs too (a view that does not divide, a width that is not heads x head_dim).
        hint = ("the model raises this for the example's shapes, eagerly too: check the example inputs' shapes "
                "and the model's config (sizes that must divide or match) at that line")
    elif any("in tensor_tracker" in str(c) and "FakeTensor" in str(c) for c in chain):
        # torch 2.11 fails here on a tensor forward made from the traced values on an earlier
        # (fake) call and kept on the module; 2.13 traces it as a constant, which
        # check_no_fake_constants refuses with the same advice
        reason = ("forward reads a tensor it made from the traced values on an earlier call and kept on the module "
                  "for a later call (as Hugging Face's longrope keeps long_inv_freq); the compiled program cannot "
                  "hold it")
        hint = "make it in __init__ (a buffer) or recompute it in every forward"
    elif any("spec mismatch" in str(c) for c in chain):
        # AOT export calls forward twice (metadata, then the trace) and both must return the same
        # structure; Hugging Face's output-capturing hooks (router logits, attentions, hidden
        # states asked for by the config) returned more outputs from each call
        reason = ("forward returned a different number of outputs from each of the trace's calls (as Hugging Face "
                  "models do with config.output_router_logits, output_attentions or output_hidden_states, which "
                  "collect those outputs through hooks)")
        hint = ("turn those outputs off for this step: model.config.output_router_logits = False (and "
                "output_attentions / output_hidden_states = False); an MoE's auxiliary loss is then left out, which "
                "serving and evaluation do not need")
    elif any("complex dtype" in str(c) and "automatic differentiation" in str(c) for c in chain):
        # torch's AOT export cannot differentiate some ops with complex outputs (the backward of
        # torch.fft.rfft / irfft writes through slice_scatter); eager and torch.compile can
        hint = ("this is a limit of torch's export" + ("" if frame else ", and no line of your code is on the trace")
                + ": compute on tensors that export can differentiate: torch.fft.fft (and take the first n // 2 + 1 "
                "frequencies) instead of rfft, torch.fft.ifft(...).real instead of irfft, or real tensors "
                "through torch.view_as_real")
    elif any("modified by an inplace operation" in str(c) for c in chain):
        # autograd's own message ends "... Good luck!" and names no line: the write is in forward,
        # the failure in backward, where no user frame is
        reason = ("an in-place operation in forward (a method ending in _ such as x.mul_(2), x += y, an "
                  "out= write) changed a tensor that backward needs; eager backward fails the same way")
        hint = ("use the out-of-place form where forward writes that tensor (x = x * 2); on the eager model, "
                "torch.autograd.set_detect_anomaly(True) names the op whose saved tensor was changed")
    own = next((c for c in chain if isinstance(c, FxspeedError)), None)
    if own is not None:
        # fxspeed's own error raised inside the trace (a model whose parameters another engine
        # holds, called directly): it says what to do itself, "rewrite that line" would not fit
        reason, hint = str(own).strip().rstrip("."), ""
    where = f" at {source}{code}" if source else ""
    opmsg = f" in op {op_name}" if op_name else ""
    fix = f". How to fix: {hint}." if hint else "."
    return CaptureError(
        f"cannot capture the {'training' if train else 'eval'} step of {type(model).__name__}{opmsg}{where}: {reason}{fix}",
        op=op_name, source=source,
    )


def _is_user_file(filename: str) -> bool:
    """Whether a frame of `filename` is the user's code: not torch's, not fxspeed's but its models."""
    f = os.path.abspath(filename)
    if "<" in filename or f.startswith(_TORCH_DIR) or f"{os.sep}site-packages{os.sep}torch{os.sep}" in f:
        return False
    if f.startswith(_USER_DIRS):
        return True
    if f.startswith(_FXSPEED_DIRS):
        return False
    return not f.startswith(_STDLIB_DIR) or any(p in f[len(_STDLIB_DIR) - 1:] for p in _INSTALLED)


def _torch_callee(model: nn.Module, e: BaseException
                  ) -> tuple[str, nn.Module, str, nn.Module, traceback.FrameSummary | None, list[str]] | None:
    """When `e` was raised inside a torch module (nn.BatchNorm1d, nn.Transformer) called from the
    user's innermost line: (path of the innermost such module, the module, path of the outermost
    one, which the user's line calls, that module, torch's own line, function names below the
    user's line). None when the failing line is the user's own."""
    entries = list(traceback.walk_tb(e.__traceback__))
    users = [i for i, (f, _) in enumerate(entries) if _is_user_file(f.f_code.co_filename)]
    if not users:
        return None
    deeper = entries[users[-1] + 1:]
    names = {id(m): n for n, m in model.named_modules(remove_duplicate=False)}
    mods: list[nn.Module] = []
    for f, _ in deeper:
        try:
            me = f.f_locals.get("self")
        except Exception:  # noqa: BLE001 - a frame we cannot read names nothing
            me = None
        if isinstance(me, nn.Module) and id(me) in names and type(me).__module__.startswith("torch.") \
                and (not mods or mods[-1] is not me):
            mods.append(me)
    if not mods:
        return None
    nn_dir = os.path.dirname(os.path.abspath(nn.__file__))
    line = None
    for f, lineno in deeper:
        if os.path.abspath(f.f_code.co_filename).startswith(nn_dir):
            line = traceback.FrameSummary(f.f_code.co_filename, lineno, f.f_code.co_name)
    return (names[id(mods[-1])], mods[-1], names[id(mods[0])], mods[0], line,
            [f.f_code.co_name for f, _ in deeper])


def _python_path(path: str, root: str = "model") -> str:
    """A submodule's dotted name as Python that reaches it: "f.1.bn" -> "model.f[1].bn"."""
    return root + "".join(f"[{p}]" if p.isdigit() else f".{p}" for p in path.split(".") if p)


def _torch_module_hint(inside: tuple, reason: str, hint: str) -> tuple[str, str]:
    """A tensor's value read inside torch's own module code, which the user cannot rewrite:
    name the module and, for the known cases, the setting that avoids it."""
    path, mod, outer_path, outer, line, funcs = inside
    who = f"`{path}` ({type(mod).__name__})"
    at = f" at {line.filename}:{line.lineno} `{(line.line or '').strip()}`" if line is not None else ""
    reason = f"{reason}, inside torch's {who}{at}, called from your line"
    if isinstance(mod, nn.modules.batchnorm._BatchNorm) and mod.momentum is None:
        reason += (f". {who} has momentum=None: torch then keeps a cumulative average of the running "
                   "statistics, dividing by the step count as a Python number (float(num_batches_tracked))")
        hint = (f"give {who} a fixed momentum (e.g. momentum=0.1, the default, in its constructor, or "
                f"{_python_path(path)}.momentum = 0.1 before compile)")
    elif "_detect_is_causal_mask" in funcs:
        arg = "is_causal" if isinstance(mod, (nn.TransformerEncoder, nn.TransformerEncoderLayer)) else "tgt_is_causal"
        if isinstance(outer, nn.Transformer):
            arg = "src_is_causal" if arg == "is_causal" else arg
        reason += (": with a mask and no causal flag, torch compares the mask's values with a causal mask to "
                   "decide whether it is causal")
        hint = (f"say it in the call, so torch does not read the mask: pass {arg}=True to `{outer_path}` "
                f"({type(outer).__name__}) when the mask is the causal mask of "
                f"nn.Transformer.generate_square_subsequent_mask, or {arg}=False for any other mask")
    else:
        hint = (f"torch's code cannot be changed from your model: change how {who} is built or called so that it "
                "does not read a tensor's value (see torch's line above), or keep it out of the model given to "
                "fxspeed.compile")
    return reason, hint
