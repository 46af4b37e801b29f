"""Program: the contract between compiler and runtime for one rank.

A GraphModule whose inputs and outputs are described by a StepSignature. The runtime binds
the signature to tensors (parameters, buffers, the batch) and interprets the outputs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
import torch.utils._pytree as pytree

from fxspeed.ir.nodes import IOSpec, StepSignature


def draws_random(n: fx.Node) -> bool:
    """`n` draws from its device's random generator (dropout, bernoulli, rand_like, ...): ATen
    tags those ops nondeterministic_seeded, and fused attention too, which draws only when its
    `dropout_p` is not 0."""
    if not (n.op == "call_function" and isinstance(n.target, torch._ops.OpOverload) and
            torch.Tag.nondeterministic_seeded in n.target.tags):
        return False
    schema = n.target._schema.arguments
    i = next((k for k, a in enumerate(schema) if a.name == "dropout_p"), None)
    if i is None:
        return True
    p = n.args[i] if i < len(n.args) else n.kwargs.get("dropout_p", schema[i].default_value)
    return not isinstance(p, (int, float)) or p != 0


def graphs_draw_random(*gms: fx.GraphModule | None) -> bool:
    return any(draws_random(n) for gm in gms if gm is not None for n in gm.graph.nodes)


@dataclass
class Program:
    gm: fx.GraphModule
    signature: StepSignature
    train: bool = True
    out_spec: pytree.TreeSpec | None = None  # eval programs without a loss: output structure
    out_type: type | None = None  # the model's output class (HF ModelOutput), rebuilt from out_spec's dict

    def describe(self) -> dict[str, Any]:
        return {"nodes": len(self.gm.graph.nodes), "train": self.train, "signature": self.signature.to_dict()}


@dataclass(frozen=True)
class TensorMeta:
    shape: tuple[int, ...]
    dtype: torch.dtype
    # A pipeline message's dims from the outermost in memory to the innermost, where the traced
    # value is not laid out row-major (a transposed q/k/v); None: row-major. The receiving stage's
    # program was traced with that layout (a later `view` of its transpose relies on it), so the
    # message travels in it (runtime/runner.py `_send` / `_post_recv`).
    order: tuple[int, ...] | None = None

    def memory_shape(self) -> tuple[int, ...]:
        """The shape of the contiguous buffer the message travels in."""
        return self.shape if self.order is None else tuple(self.shape[d] for d in self.order)

    def inverse_order(self) -> tuple[int, ...]:
        """The permutation taking the travelling buffer back to `shape` (identity without an order)."""
        order = self.order if self.order is not None else tuple(range(len(self.shape)))
        return tuple(sorted(range(len(order)), key=order.__getitem__))


@dataclass
class StageProgram:
    """The two programs of one pipeline stage and the layout of their inputs and outputs."""

    stage: int
    n_stages: int
    forward: fx.GraphModule
    backward: fx.GraphModule
    state: list[IOSpec]              # parameters / buffers, fed first to both programs
    n_batch: int                     # batch tensors fed after the state
    recv_f: list[TensorMeta]         # forward message from stage - 1
    send_f: list[TensorMeta]         # forward message to stage + 1
    n_saved: int                     # F's outputs after send_f that B reads
    has_loss: bool                   # the last stage's F returns the micro-batch loss last
    recv_b: list[TensorMeta]         # gradient message from stage + 1
    send_b: list[TensorMeta]         # gradient message to stage - 1
    grads: list[str]                 # parameter names of B's outputs after send_b
    backward_input: fx.GraphModule | None = None   # I_s; None: I runs B_s whole and W is a no-op
    backward_weight: fx.GraphModule | None = None  # W_s
    n_carry: int = 0                 # I_s outputs after send_b that W_s reads
    predicted: dict[str, float] = field(default_factory=dict)  # planner seconds: forward, backward_input, ...
    modules: list[str] = field(default_factory=list)  # blocks / top-level modules the forward runs
    starts_at: str = ""              # the module the stage's cut is at (a split point reproducing it)
    tied: dict[str, str] = field(default_factory=dict)  # alias -> canonical, for names this stage uses
    nodes: dict[str, int] = field(default_factory=dict)  # forward/backward node counts, for reports
    # Gradients B (and W) accumulate into buffers instead of returning (passes/accumulate_gradients):
    # those programs then take `beta, *buffers` after their other inputs; `grads` excludes these.
    grads_into: list[str] = field(default_factory=list)
    grads_into_meta: list[TensorMeta] = field(default_factory=list)
    # Saved activations (indices into F's saved outputs) that OFFLOAD moves off the device and
    # RELOAD brings back (passes/program/offload_stage_activations.py)
    offload_saved: list[int] = field(default_factory=list)
    # Buffers the forward writes (BatchNorm's running statistics): F returns their new values
    # last, after the loss; the runtime writes them after each micro-batch's F
    buffer_updates: list[str] = field(default_factory=list)

    def saved_meta(self) -> list[Any]:
        """The fake values of F's saved outputs (shapes, strides, dtypes), in order."""
        out = next(n for n in reversed(self.forward.graph.nodes) if n.op == "output")
        k = len(self.send_f)
        return [v.meta.get("val") if isinstance(v, fx.Node) else None for v in out.args[0][k:k + self.n_saved]]

    def names(self) -> set[str]:
        """Every parameter/buffer name this stage reads or returns a gradient for."""
        return {s.target for s in self.state} | set(self.grads) | set(self.grads_into)

    def describe(self) -> dict[str, Any]:
        return {"stage": self.stage, "params": [s.target for s in self.state if s.kind in ("param", "param_tp")],
                "recv_f": [list(m.shape) for m in self.recv_f], "send_f": [list(m.shape) for m in self.send_f],
                "saved": self.n_saved, "recv_b": [list(m.shape) for m in self.recv_b],
                "send_b": [list(m.shape) for m in self.send_b], "grads": [*self.grads, *self.grads_into],
                "grads_accumulated_in_place": list(self.grads_into),
                "split_backward": self.backward_input is not None, "carry": self.n_carry,
                "offloaded_saved": list(self.offload_saved),
                "predicted_s": dict(self.predicted), **self.nodes}


# The IOSpec target of the slot mapping and block table that the sliding layers of a model with
# global layers too read (passes/inference/kv_cache.py writes it, runtime/serving.py binds it)
WINDOW_GROUP = "window"


@dataclass
class InferenceProgram:
    """A forward-only serving program for one bucket of `tokens` packed tokens (prefill chunks and
    decode tokens of several requests in one row), with the paged KV cache threaded through it
    (passes/inference/kv_cache.py).

        gm(*params, *buffers, tokens, positions, slot_mapping, block_table, query_index, query_pos,
           *kv_cache, [logits_index]) -> (logits,)             (inputs in `signature` order)

    logits: [1, N, vocab] for the N rows of `logits_index` when `selects_logits`
    (passes/inference/select_logits.py), else [1, tokens, vocab].
    `kv_layout`: per attention layer (kv_heads, head_dim, dtype), what the runtime allocates.
    `records`: the passes run (PassRecord)."""

    gm: fx.GraphModule
    signature: StepSignature
    tokens: int
    kv_layout: list[tuple[int, int, torch.dtype]]
    selects_logits: bool = False
    # the sliding window its attention masks apply (keys this many positions back or more are
    # hidden): served as plain causal attention, so only up to this context; None: no window
    window: int | None = None
    # per cache layer, the sliding window its paged attention applies (0: none), from the config
    kv_windows: tuple[int, ...] = ()
    # per cache layer, the block table it reads: "" or, for the sliding layers of a model that
    # also has global ones, "window" (its own table and pool of blocks)
    kv_groups: tuple[str, ...] = ()
    records: list[Any] = field(default_factory=list)
    capture_seconds: float = 0.0
    pass_seconds: float = 0.0

    def kv_bytes_per_token(self, group: str | None = None) -> int:
        """Cache bytes one token occupies: keys and values of every layer (of `group`'s layers
        only, when given)."""
        groups = self.layer_groups()
        return sum(2 * h * d * torch.empty((), dtype=dt).element_size()
                   for (h, d, dt), g in zip(self.kv_layout, groups) if group is None or g == group)

    def layer_groups(self) -> tuple[str, ...]:
        """The block table each cache layer reads ("" for all where the program names none)."""
        return tuple(self.kv_groups) or ("",) * len(self.kv_layout)

    def kv_group_windows(self) -> dict[str, tuple[int, ...]]:
        """Each block table's layers' sliding windows (0: none), "" first."""
        groups = self.layer_groups()
        windows = self.kv_windows or (0,) * len(self.kv_layout)
        out: dict[str, list[int]] = {"": []}
        for g, w in zip(groups, windows):
            out.setdefault(g, []).append(w)
        return {g: tuple(ws) for g, ws in out.items()}

    def kv_bytes_read(self, context: int) -> int:
        """Cache bytes one query at `context` cached tokens reads: a layer with a sliding window
        reads at most its window's keys and values."""
        windows = self.kv_windows or (0,) * len(self.kv_layout)
        return sum(2 * h * d * torch.empty((), dtype=dt).element_size() * (min(context, w) if w else context)
                   for (h, d, dt), w in zip(self.kv_layout, windows))
