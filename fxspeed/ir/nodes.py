"""The IR schema: what analyses write into `node.meta` and what passes read.

Every node of a captured graph carries one `NodeInfo` under `node.meta["fxspeed"]`. Sizes and
FLOPs are Python ints for concrete shapes; the planner may fit sympy expressions over the
dims the user marked dynamic, but node-level records stay concrete.

The program's I/O is described by a `StepSignature`: what each graph input and output means
(a parameter, a buffer, a user input, the loss, a gradient, a buffer update). Passes that
add inputs or outputs (shards, communication buffers) update it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx

META_KEY = "fxspeed"

# Roles of a node in the training step. STEP: the optimizer's update inside the program
# (passes/memory/step_in_backward.py); its time is the plan's optimizer time, not backward's.
FORWARD, BACKWARD, IO, STEP = "forward", "backward", "io", "step"
# the op step_in_backward calls (by name: the IR does not import the runtime that defines it)
STEP_PARAMETERS_OP = "fxspeed.step_parameters.default"
STEP_BUCKETS_OP = "fxspeed.step_buckets.default"

# Memory categories (plan.memory breaks the peak down by these).
PARAMETERS = "parameters"
GRADIENTS = "gradients"
OPTIMIZER_STATES = "optimizer_states"
ACTIVATIONS = "activations"
TEMPORARIES = "temporaries"
BUFFERS = "buffers"
INPUTS = "inputs"
COMM_BUFFERS = "communication_buffers"
CATEGORIES = (PARAMETERS, GRADIENTS, OPTIMIZER_STATES, ACTIVATIONS, TEMPORARIES, BUFFERS, INPUTS, COMM_BUFFERS)


@dataclass
class NodeInfo:
    """Per-node annotation. `bytes_read`/`bytes_written` count tensor storage touched."""

    shape: tuple[int, ...] | None = None
    dtype: str | None = None
    output_bytes: int = 0
    flops: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    module: str = ""
    role: str = FORWARD
    category: str = TEMPORARIES
    is_view: bool = False  # output aliases an input's storage: allocates nothing
    workspace: int = 0  # bytes the op allocates and frees inside itself (op_workspace)
    time: float = 0.0  # predicted seconds on the plan's device (roofline)

    def to_dict(self) -> dict[str, Any]:
        return {k: (list(v) if isinstance(v, tuple) else v) for k, v in self.__dict__.items()}


@dataclass(frozen=True)
class IOSpec:
    """Meaning of one graph input or output. `kind` is one of
    inputs:  "param", "buffer", "input", "param_shard" (target: bucket index; ZeRO-3),
             "param_tp" (target: parameter name; this tensor-parallel rank's slice of it, as
             `StepSignature.tp_layout[name]` says),
             "grad_buffer" (target: bucket index; a persistent flat buffer the program reduces
             gradients into, ZeRO-0), "grad_accum" (target: bucket index; the flat bucket summed
             over the step's earlier grad_accum slices, added before the reduction), "loss_scale"
             (fp16: the dynamic loss scale)
             inference programs (passes/inference/): "tokens", "positions", "slot_mapping",
             "block_table", "query_index", "query_pos", "logits_index" (per serving step),
             "kv_cache" (target "<layer>.k" / "<layer>.v"; the paged cache, written in place),
             "packed_weight" / "packed_weight_t" (target: parameter name; the parameter [out, in] /
             transposed, in oneDNN's packed layout: passes/inference/pack_linear_weights.py),
             "transposed_weight" (target: parameter name; the [out, in] parameter as a contiguous
             [in, out] copy, read by ATen's GEMM in the same pass's other mode),
             "split_weight" / "split_weight_t" (target: parameter name; the parameter [out, in] /
             transposed, copied as [k, in, ceil(out / k)] for a product split over k CPU threads)
    outputs: "buffer_update", "loss", "output", "grad", "grad_bucket" (target: bucket index;
             the reduced flat bucket, or this rank's shard of it under ZeRO-2/3)
    `target` is the parameter/buffer name (user's original name) or the input's position.
    The runtime binds inputs by kind (runtime/engine.py: Engine._bind); a new kind needs a
    binding there.
    """

    kind: str
    target: str


@dataclass
class Bucket:
    """A group of parameters that travel together in collectives, laid out flat.

    `offsets[i]` is where parameter `names[i]` starts in the flat buffer; `padded` is the
    flat size rounded up to a multiple of the world size, so each rank's shard has
    `padded // world` elements (uneven sizes are padded, never refused).
    """

    index: int
    names: list[str]
    shapes: list[tuple[int, ...]]
    offsets: list[int]
    numel: int
    padded: int
    dtype: str = "float32"

    def shard_size(self, world: int) -> int:
        return self.padded // world

    def to_dict(self) -> dict[str, Any]:
        return {**self.__dict__, "shapes": [list(s) for s in self.shapes]}


@dataclass
class StepSignature:
    inputs: list[IOSpec] = field(default_factory=list)
    outputs: list[IOSpec] = field(default_factory=list)
    # Tied weights: AOT export feeds a shared Parameter once per name. alias -> canonical name.
    tied: dict[str, str] = field(default_factory=dict)
    # Set by the gradient-reduction pass: flat layout of trainable parameters, in the order
    # backward produces their gradients. Inputs "param_shard" / outputs "grad_bucket" index it.
    buckets: list[Bucket] = field(default_factory=list)
    # Set by wait_parameter_gathers (ZeRO-1/2): the program waits for each bucket's post-step
    # all-gather before it reads the bucket, so the runtime may leave the gathers in flight.
    waits_for_parameters: bool = False
    # Set by shard_tensors: parameter name -> (dim, blocks) of each "param_tp" input. The dim is
    # read as `blocks` equal blocks, each split into tp_size contiguous pieces; tp rank t holds
    # piece t of every block (blocks > 1: a fused QKV weight split by heads).
    tp_layout: dict[str, tuple[int, int]] = field(default_factory=dict)
    # Set by keep_weights_low: trainable parameters enter the program in this dtype (low-precision
    # working copies) and their gradients leave it in `grad_dtype`; the fp32 master weights live
    # with the optimizer. None: parameters enter as they are (fp32 masters cast inside the graph).
    working_dtype: str | None = None
    grad_dtype: str | None = None
    # Set by offload_parameters: the bucket whose shard the program reads from the parameter
    # files first (the runtime starts that read before running it); -1: none read.
    first_fetch: int = -1
    # Set by step_in_backward: the parameters the program steps itself (their gradients are no
    # longer outputs), in the order it steps them.
    stepped_in_backward: list[str] = field(default_factory=list)
    # Set by offload_activations: key -> bytes of each activation the program moves off the
    # device in forward and reads back in backward (the runtime reserves room for them).
    offloaded_activations: dict[int, int] = field(default_factory=dict)

    def is_alias(self, name: str) -> bool:
        return name in self.tied

    def input_positions(self, kind: str) -> list[int]:
        return [i for i, s in enumerate(self.inputs) if s.kind == kind]

    def output_positions(self, kind: str) -> list[int]:
        return [i for i, s in enumerate(self.outputs) if s.kind == kind]

    def to_dict(self) -> dict[str, Any]:
        return {"inputs": [s.__dict__ for s in self.inputs], "outputs": [s.__dict__ for s in self.outputs],
                "tied": dict(self.tied), "buckets": [b.to_dict() for b in self.buckets],
                "waits_for_parameters": self.waits_for_parameters,
                "tp_layout": {k: list(v) for k, v in self.tp_layout.items()},
                "working_dtype": self.working_dtype, "grad_dtype": self.grad_dtype, "first_fetch": self.first_fetch,
                "stepped_in_backward": list(self.stepped_in_backward),
                "offloaded_activations": dict(self.offloaded_activations)}


def info(node: fx.Node) -> NodeInfo:
    """The node's annotation; raises a clear error when the annotate analysis has not run."""
    try:
        return node.meta[META_KEY]
    except KeyError:
        raise KeyError(f"node {node.name!r} has no fxspeed annotation; run the 'annotate' analysis first") from None


def step_calls(graph: fx.Graph) -> list[fx.Node]:
    """The optimizer calls step_in_backward / step_buckets_in_backward put in a program (found by
    name: the IR does not import the runtime that defines the ops). Both take the gradients they
    step as their fourth argument."""
    return [n for n in graph.nodes if n.op == "call_function" and str(n.target) in (STEP_PARAMETERS_OP, STEP_BUCKETS_OP)]


def tensor_bytes(t: Any) -> int:
    if isinstance(t, torch.Tensor):
        return int(t.numel()) * t.element_size()
    if isinstance(t, (list, tuple)):
        return sum(tensor_bytes(x) for x in t)
    return 0


# Scratch that an op allocates and frees inside itself, beyond its outputs: a fused kernel's fp32
# accumulators and per-chunk blocks, a CPU pointwise op's cast copy of an operand, which no graph
# value shows. Other ATen ops' scratch is small next to their outputs and is not modelled. An op
# registers a function of its arguments (FakeTensors or ints, as in node.args) returning bytes;
# the liveness analyses count the bytes as temporaries while the node runs.
_WORKSPACE: dict[Any, Any] = {}


def register_workspace(op: Any, fn: Any) -> None:
    """Declare `fn(*args, **kwargs) -> bytes` as `op`'s internal scratch (an OpOverload)."""
    _WORKSPACE[op] = fn


def op_workspace(n: fx.Node) -> int:
    """The scratch bytes `n`'s op declared for `n`'s arguments (0 for ops that declared none)."""
    fn = _WORKSPACE.get(n.target) if n.op == "call_function" else None
    if fn is None:
        return 0
    args, kwargs = fx.node.map_arg((n.args, n.kwargs), lambda a: a.meta.get("val"))
    return int(fn(*args, **kwargs))


def _cpu_cast_operands(*args: Any, **kwargs: Any) -> int:
    """A CPU pointwise op whose tensor operands differ in dtype copies each operand to the result's
    dtype first (TensorIterator's common-dtype cast; measured: a 98 MiB fp32 + bf16 add peaks 196
    MiB above its inputs, x.add_(bf16) 98 MiB). CUDA kernels cast while loading: no copy. The
    result's dtype is the widest operand's (these binary ops' promotion of same-kind floats)."""
    ts = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor) and a.dim() > 0]
    if len(ts) < 2 or ts[0].device.type != "cpu" or len({t.dtype for t in ts}) == 1:
        return 0
    out = torch.promote_types(ts[0].dtype, ts[1].dtype)
    return sum(int(t.numel()) * out.itemsize for t in ts if t.dtype != out)


for _op in (torch.ops.aten.add.Tensor, torch.ops.aten.sub.Tensor, torch.ops.aten.mul.Tensor, torch.ops.aten.div.Tensor):
    register_workspace(_op, _cpu_cast_operands)


def is_dense(t: torch.Tensor) -> bool:
    """Its elements fill exactly numel() consecutive slots in some dimension order (a permuted
    contiguous tensor: transposed, channels_last), so its bytes move as one run and a
    same-strided view of a flat slot holds it again."""
    expected = 1
    for d in sorted(range(t.dim()), key=t.stride):
        if t.size(d) == 1:
            continue
        if t.stride(d) != expected:
            return False
        expected *= t.size(d)
    return True


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


__all__ = ['META_KEY', 'FORWARD', 'BACKWARD', 'IO', 'STEP', 'STEP_PARAMETERS_OP', 'STEP_BUCKETS_OP', 'step_calls', 'PARAMETERS', 'GRADIENTS', 'OPTIMIZER_STATES', 'ACTIVATIONS', 'TEMPORARIES', 'BUFFERS', 'INPUTS', 'COMM_BUFFERS', 'CATEGORIES', 'NodeInfo', 'IOSpec', 'Bucket', 'StepSignature', 'info', 'tensor_bytes', 'register_workspace', 'op_workspace', 'is_dense', 'dtype_name']
