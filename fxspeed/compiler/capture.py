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
import os
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator
from unittest import mock

import torch
import torch.fx as fx
import torch.nn as nn
import torch.utils._pytree as pytree

from fxspeed.errors import CaptureError
from fxspeed.ir.batch import input_key, split_inputs, tensor_leaves  # noqa: F401
from fxspeed.ir import IOSpec, StepSignature

LossFn = Callable[..., torch.Tensor]


@dataclass
class CapturedStep:
    """A traced step: the graph, what its inputs/outputs mean, and how to feed it."""

    gm: fx.GraphModule
    signature: StepSignature
    in_spec: pytree.TreeSpec
    tensor_leaf: list[bool]  # which leaves of (args, kwargs) are graph inputs
    module_of: dict[str, str] = field(default_factory=dict)  # node name -> owning module path
    out_spec: pytree.TreeSpec | None = None  # eval graphs without a loss: structure of outputs
    train: bool = True


# --------------------------------------------------------------------------------------------
# Inputs: which leaves are traced, and the key under which a trace is cached
# --------------------------------------------------------------------------------------------

# --------------------------------------------------------------------------------------------
# Loss extraction (shared by the traced wrapper and by eager reference code in tests)
# --------------------------------------------------------------------------------------------

def extract_loss(output: Any, loss_fn: LossFn | None, args: tuple, kwargs: dict, model_name: str = "model") -> torch.Tensor:
    """The scalar loss of one forward: `loss_fn(output, *args, **kwargs)`, else the output
    itself when it is a scalar, else `output.loss` / `output["loss"]` (Hugging Face)."""
    if loss_fn is not None:
        loss = loss_fn(output, *args, **kwargs)
    elif isinstance(output, torch.Tensor):
        if output.numel() != 1:
            raise CaptureError(
                f"{model_name}'s output is a tensor of shape {tuple(output.shape)}, not a scalar loss, and no "
                "loss_fn was given: pass compile(..., loss_fn=fn) where fn(output, *batch, **batch_kwargs) returns "
                "a scalar, or return the loss from forward"
            )
        loss = output
    elif isinstance(output, dict) and output.get("loss") is not None:
        loss = output["loss"]
    elif getattr(output, "loss", None) is not None:
        loss = output.loss
    elif isinstance(output, (tuple, list)) and output and isinstance(output[0], torch.Tensor) and output[0].numel() == 1:
        loss = output[0]
    else:
        raise CaptureError(
            f"{model_name}'s output ({type(output).__name__}) has no loss: return a scalar tensor, an object "
            "or dict with a 'loss' (Hugging Face: pass labels=...), or give compile(..., loss_fn=fn) where "
            "fn(output, *batch) returns a scalar"
        )
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        raise CaptureError(
            f"the loss of {model_name} must be a scalar tensor, got "
            f"{'a tensor of shape ' + str(tuple(loss.shape)) if isinstance(loss, torch.Tensor) else type(loss).__name__}"
            "; reduce it "
            "(e.g. .mean()) in the model or in loss_fn"
        )
    return loss.reshape(())


class _StepModule(nn.Module):
    """Wraps the user's model so the traced function takes only tensors and returns the loss."""

    def __init__(self, model: nn.Module, loss_fn: LossFn | None, spec: pytree.TreeSpec,
                 leaves: list[Any], want_loss: bool):
        super().__init__()
        self.model = model
        self._loss_fn = loss_fn
        self._spec = spec
        self._consts = [None if isinstance(x, torch.Tensor) else x for x in leaves]
        self._want_loss = want_loss
        self.out_spec: pytree.TreeSpec | None = None

    def forward(self, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        it = iter(tensors)
        leaves = [next(it) if c is None else c for c in self._consts]
        args, kwargs = pytree.tree_unflatten(leaves, self._spec)
        out = self.model(*args, **kwargs)
        name = type(self.model).__name__
        if self._want_loss:
            return (extract_loss(out, self._loss_fn, args, kwargs, name),)
        try:
            return (extract_loss(out, self._loss_fn, args, kwargs, name),)
        except CaptureError:
            flat, self.out_spec = pytree.tree_flatten(_plain(out))
            return tuple(flat)


def _plain(out: Any) -> Any:
    """Hugging Face ModelOutput -> dict, so pytree can flatten it. Entries that are not trees
    of tensors (a KV cache object such as `past_key_values`) are left out of eval outputs."""
    if hasattr(out, "to_tuple") and hasattr(out, "keys"):
        return {k: out[k] for k in out.keys() if _is_tensor_tree(out[k])}
    return out


def _is_tensor_tree(x: Any) -> bool:
    return all(leaf is None or isinstance(leaf, (torch.Tensor, int, float, bool)) for leaf in pytree.tree_leaves(x))


# --------------------------------------------------------------------------------------------
# Capture
# --------------------------------------------------------------------------------------------

def capture_step(model: nn.Module, args: tuple, kwargs: dict, *, loss_fn: LossFn | None = None,
                 train: bool = True) -> CapturedStep:
    """Trace forward+loss+backward (train) or forward only (eval) into an FX GraphModule.

    Runs on fake tensors: nothing the size of an activation is allocated, and a model on the
    meta device can be captured.
    """
    with fake_model_state(model, args, kwargs) as (fargs, fkwargs):
        return _capture(model, args, kwargs, fargs, fkwargs, loss_fn=loss_fn, train=train)


def _capture(model: nn.Module, args: tuple, kwargs: dict, fargs: tuple, fkwargs: dict, *,
             loss_fn: LossFn | None, train: bool) -> CapturedStep:
    from torch._functorch.aot_autograd import aot_export_module

    args, kwargs = fargs, fkwargs
    leaves, spec = split_inputs(args, kwargs)
    tensors = [x for x in leaves if isinstance(x, torch.Tensor)]
    wrapper = _StepModule(model, loss_fn, spec, leaves, want_loss=train)
    frozen: list[nn.Parameter] = []
    hidden: list[tuple[nn.Module, str, nn.Parameter]] = []
    saved: dict[int, tuple[nn.Module, dict[str, Any]]] = {}
    was_training = model.training
    model.train(train)
    owners = _ModuleOwners(model)
    try:
        with _tracing_flags(), owners, _rng_untouched(model, tensors):
            try:
                gm, sig = aot_export_module(wrapper, tensors, trace_joint=train,
                                            output_loss_index=0 if train else None)
            except AssertionError as e:
                if not (train and "did not receive a gradient" in str(e)):
                    raise
                # AOT export lifts a parameter once per *name* and refuses a name that gets no
                # gradient. Two cases, told apart per name: a tied alias the forward never reads
                # (BERT's `cls.predictions.bias` is used as `decoder.bias`; T5's `shared` is used
                # as `encoder.embed_tokens`) is hidden from the trace, since the weight still
                # gets its gradient through its other name; a parameter the loss does not reach
                # under any name (e.g. BERT's pooler under an MLM loss) is frozen: eager leaves
                # its .grad None and the optimizer skips it, which is what happens here.
                frozen, hidden = _names_without_grad(wrapper, tensors)
                saved = {id(owner): (owner, dict(owner._parameters)) for owner, _, _ in hidden}
                for owner, leaf, _ in hidden:
                    del owner._parameters[leaf]
                for p in frozen:
                    p.requires_grad_(False)
                gm, sig = aot_export_module(wrapper, tensors, trace_joint=True, output_loss_index=0)
    except CaptureError:
        raise
    except Exception as e:  # noqa: BLE001 - every tracing failure becomes one clear error
        raise _capture_error(model, e, train) from e
    finally:
        for owner, params in saved.values():  # restore, in the original order
            owner._parameters.clear()
            owner._parameters.update(params)
        for p in frozen:
            p.requires_grad_(True)
        model.train(was_training)
    _drop_metadata_asserts(gm)
    signature = _signature(gm, sig, n_user=len(tensors), train=train, loss_out=wrapper.out_spec is None)
    # The canonical name of a tied weight is the first name the graph is fed (a hidden alias
    # is never canonical: passes that merge aliases look the canonical up among the inputs).
    fed = {s.target for s in signature.inputs if s.kind == "param"}
    first: dict[int, str] = {}
    named = list(model.named_parameters(remove_duplicate=False))
    for name, p in sorted(named, key=lambda np_: np_[0] not in fed):  # stable: fed names first
        if id(p) in first:
            signature.tied[name] = first[id(p)]
        else:
            first[id(p)] = name
    gm.meta["fxspeed_frozen"] = [n for n, p in model.named_parameters() if any(p is f for f in frozen)]
    return CapturedStep(gm=gm, signature=signature, in_spec=spec,
                        tensor_leaf=[isinstance(x, torch.Tensor) for x in leaves],
                        module_of=owners.owner, out_spec=wrapper.out_spec, train=train)


@contextlib.contextmanager
def fake_model_state(model: nn.Module, args: tuple, kwargs: dict) -> Iterator[tuple[tuple, dict]]:
    """Swap the model's parameters and buffers for fake tensors while tracing.

    Tracing real weights costs real memory (AOT export materializes functional copies; why:
    docs/decisions/capture-on-fake-tensors.md), and a model on the meta device cannot be traced
    faithfully at all:
    meta tensors skip autograd for some ops (torch registers meta kernels for e.g. nll_loss,
    which then bypass the op's autograd formula, so `cross_entropy` gives no gradient). Fake
    CPU tensors behave as CPU tensors in every respect but hold no data. For the duration of
    the block, the model's meta parameters and buffers are swapped for fake CPU ones (tied
    weights stay tied) and the batch's meta tensors likewise; the originals come back after.
    """
    from torch._subclasses.fake_tensor import FakeTensorMode

    # Non-fake inputs allowed: AOT export retraces its first graph with plain make_fx, and
    # constants that graph captured (e.g. an arange of positions) are real tensors.
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    made: dict[int, torch.Tensor] = {}

    def fake(t: torch.Tensor) -> torch.Tensor:
        if id(t) not in made:
            with mode:
                f = torch.empty_strided(tuple(t.shape), tuple(t.stride()), dtype=t.dtype,
                                        device="cpu" if t.is_meta else t.device)
            made[id(t)] = nn.Parameter(f, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else f
        return made[id(t)]

    swapped: list[tuple[dict, str, torch.Tensor]] = []
    try:
        for mod in model.modules():
            for store in (mod._parameters, mod._buffers):
                for k, t in list(store.items()):
                    if t is not None:
                        swapped.append((store, k, t))
                        store[k] = fake(t)
        yield pytree.tree_map(lambda x: fake(x) if isinstance(x, torch.Tensor) and x.is_meta else x, (args, kwargs))
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


def _rng_untouched(model: nn.Module, tensors: list[torch.Tensor]) -> contextlib.AbstractContextManager:
    """Tracing must not advance the user's RNG: AOT export runs the model's random ops
    (dropout's bernoulli) on fake tensors, which still draws from the real CPU/CUDA
    generators, so a step after compile() would see other dropout masks than eager under
    the same torch.manual_seed. Save the generators' states and restore them afterwards."""
    cuda = sorted({t.device.index or 0 for t in [*model.parameters(), *model.buffers(), *tensors] if t.is_cuda})
    return torch.random.fork_rng(devices=cuda)


@contextlib.contextmanager
def _tracing_flags() -> Iterator[None]:
    # Libraries (Hugging Face in particular) skip data-dependent Python branches when they
    # believe they are being compiled; our trace is a compilation in exactly that sense.
    with mock.patch.object(torch.compiler, "is_compiling", lambda: True):
        yield


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
            self.owner.setdefault(node.name, _strip(name) if name else "")
            node = node.next


# --------------------------------------------------------------------------------------------
# Errors
# --------------------------------------------------------------------------------------------

_SKIP_DIRS = tuple(os.path.dirname(m.__file__) for m in (torch, contextlib) if getattr(m, "__file__", None)) + (
    os.path.dirname(os.path.abspath(__file__)),
)


def _user_frame(tb: Any) -> traceback.FrameSummary | None:
    frames = traceback.extract_tb(tb)
    for fr in reversed(frames):
        f = os.path.abspath(fr.filename)
        if not f.startswith(_SKIP_DIRS) and "site-packages/torch" not in f and "<" not in fr.filename:
            return fr
    return None


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
    reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    if op_name and "_local_scalar_dense" in op_name or "data-dependent" in str(e).lower() or "DataDependent" in type(e).__name__:
        op_name = op_name or "aten._local_scalar_dense"
        reason = "a tensor's value is used in Python control flow or converted to a Python number (.item(), if tensor:, int(tensor))"
        hint = "compute it with tensor ops (torch.where, masking) or pass it as a non-tensor argument"
    where = f" at {source}{code}" if source else ""
    opmsg = f" in op {op_name}" if op_name else ""
    return CaptureError(
        f"cannot capture the {'training' if train else 'eval'} step of {type(model).__name__}{opmsg}{where}: {reason}. How to fix: {hint}.",
        op=op_name, source=source,
    )
