"""Pipeline runtime: executes one rank's action list (fxspeed/ir/schedule.py) over its stage programs.

A stage s is GraphModules made by the split_stages pass:

    F_s(*state_s, *batch_mb, *recv_f)                    -> (*send_f, *saved, [loss on the last stage])
    B_s(*state_s, *batch_mb, *saved, *recv_b)            -> (*send_b, *param_grads)
    I_s(*state_s, *batch_mb, *saved, *recv_b)            -> (*send_b, *carry)       (zero-bubble split)
    W_s(*state_s, *batch_mb, *saved, *recv_b, *carry)    -> (*param_grads)

I_s holds only the backward nodes the input gradient (send_b) depends on; W_s the rest (the
weight gradients), reading what I_s computed for it (`carry`). B = I then W.

Gradients named in `grads_into` are not returned: B and W accumulate them into this runtime's
per-stage buffers (`beta, *buffers` follow their other inputs; beta is 0 on the stage's first
backward of the step, which overwrites, and 1 after). The buffers persist across steps and are
what `run` returns for those names.

`state_s` are the stage's parameters (and read-only buffers), bound once; `batch_mb` is the
micro-batch's tensors (every stage gets them: a stage reads only what it needs); `recv_f` are
the activations produced upstream (the message of RECV_F), `send_f` what goes downstream;
`recv_b`/`send_b` are the gradient messages. The last stage seeds its backward from the loss
inside B_s, so it receives nothing backward.

Point-to-point: sends are `isend`s whose completion is awaited only at STEP (a blocking send
deadlocks 1F1B); a recv blocks until its message arrived. Each tensor of a message has its
own tag (direction, edge, micro-batch, index), so messages between two ranks cannot be
confused whatever order the transport delivers them in.

Receives are posted ahead (`recv_prefetch` per stream, a stream being one (direction, stage)
pair): the first `recv_prefetch` of each stream when the step starts, and the next one of its
stream at each RECV before it waits. gloo's TCP transport moves a message only once both
sides posted it; posted ahead, the data moves when it is sent and the RECV finds it there,
which is what the simulator assumes (a message arrives `p2p_latency` after its send).
why: docs/decisions/post-receives-ahead.md

F, B and W run in torch.fx's boxed calling convention (one input list the program empties), so
each input is freed at its last use inside the program; I keeps the plain call, since W reads
the same inputs. why: docs/decisions/boxed-calling-convention.md

At GATHER(s) / RELEASE(s) (ZeRO-3, passes/program/gather_stage_weights.py) the caller's
`on_weights` makes stage s's weights whole / drops them; the programs' state inputs are the
Parameters themselves, so they read whatever the engine points them at.

At OFFLOAD(s,m) the activations F(s,m) saved that the stage lists in `offload_saved` go to the
`activations` store (runtime/offloaded_activations.py; passes/program/offload_stage_activations.py)
and the runtime drops its references; RELOAD(s,m) starts their copies back; the backward of
(s,m) waits for them.

At REDUCE(s) the stage's finished gradients (returned sums and accumulation buffers) go to the
caller's `on_reduce`, which starts the data-parallel reduction while the rest of the action
list runs (runtime/engine.py). why: docs/decisions/zero-under-a-pipeline.md

This module never decides anything: it runs the schedule and accumulates gradients. It
records when each action ran (`PipelineRuntime.timeline`, perf_counter seconds from the start
of the step), so the engine can report compute, blocked (receives and the final wait for sends)
and overhead time per rank, and per-stage compute times.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, Callable

import time

import torch
import torch.distributed as dist
import torch.fx as fx

try:  # torch's boxed calling convention for generated code (private, present since 2.1)
    from torch.fx.graph import _BoxedCodeGen
except ImportError:  # pragma: no cover - older/newer torch: programs keep holding their inputs
    _BoxedCodeGen = None

from fxspeed.ir import IOSpec
from fxspeed.ir.program import StageProgram, TensorMeta

from fxspeed.ir import is_dense, tensor_bytes
from fxspeed.ir.schedule import (OFFLOAD, RELOAD, B, F, I, PARAMETER_KINDS, RECV_B, RECV_F, REDUCE, SEND_B, SEND_F,
                                 STEP, W, Action)


@dataclass(frozen=True)
class _Away:
    """A saved activation the store holds between OFFLOAD and the backward that reads it (the
    store keeps the layout it left with)."""
    key: int


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def _storages(ts: list[Any]) -> set[int]:
    return {_storage(t) for t in ts if isinstance(t, torch.Tensor)}


def _boxed(gm: fx.GraphModule | None) -> Callable[[list[Any]], Any] | None:
    """`gm` as a function of one list of inputs, which it empties (see PipelineRuntime.__init__)."""
    if gm is None:
        return None
    if _BoxedCodeGen is None:
        return lambda args: gm(*args)
    graph = copy.deepcopy(gm.graph)
    graph.set_codegen(_BoxedCodeGen())
    return fx.GraphModule(gm, graph).forward


def _private_storages(outs: list[torch.Tensor], others: list[torch.Tensor]) -> set[int]:
    """Storages of `outs` holding data that no other output and nothing in `others` shares."""
    count: dict[int, int] = {}
    for t in outs:
        if isinstance(t, torch.Tensor):
            count[_storage(t)] = count.get(_storage(t), 0) + 1
    shared = {_storage(t) for t in others if isinstance(t, torch.Tensor)}
    return {ptr for t in outs if isinstance(t, torch.Tensor) and t.numel() > 0
            for ptr in (_storage(t),) if ptr != 0 and count[ptr] == 1 and ptr not in shared}


def _tag(direction: int, edge: int, mb: int, idx: int, n_mb: int) -> int:
    # direction 0: activations over edge (edge, edge+1); 1: gradients over the same edge.
    return ((edge * 2 + direction) * n_mb + mb) * 256 + idx


class PipelineRuntime:
    """Runs the actions of one rank. `bind(spec)` gives the live tensor of a state input."""

    def __init__(self, programs: dict[int, StageProgram], n_microbatches: int,
                 bind: Callable[[IOSpec], torch.Tensor], group: Any = None, peers: list[int] | None = None,
                 recv_prefetch: int = 2, device: torch.device | str = "cpu", activations: Any = None):
        """`activations`: the store OFFLOAD/RELOAD actions move saved activations through (an
        ActivationOffload, reserved for `activation_sizes()`); None when the schedule has none."""
        if recv_prefetch < 1:
            raise ValueError(f"recv_prefetch={recv_prefetch!r}: at least the receive being waited for is posted; use >= 1")
        self.programs = programs
        self.activations = activations
        self.M = n_microbatches
        # the store's key of each (stage, micro-batch, saved output) OFFLOAD may move
        moved = [(s, m, i) for s, p in sorted(programs.items()) for m in range(n_microbatches) for i in p.offload_saved]
        self._keys = {smi: k for k, smi in enumerate(moved)}
        self.device = torch.device(device)  # where received messages and gradient buffers live
        self.recv_prefetch = recv_prefetch  # receives posted ahead per (kind, stage) stream, the awaited one included
        self.group = group
        self.peers = peers  # global rank of each pipeline position (schedules name positions)
        self._state = {s: [bind(spec) for spec in p.state] for s, p in programs.items()}
        self._updated = {s: [bind(IOSpec("buffer", name)) for name in p.buffer_updates] for s, p in programs.items()}
        # F, B and W as programs that take one list of inputs and empty it: each input (a received
        # activation, a saved one) is then freed at its last use inside the program, as autograd
        # frees saved tensors during backward, instead of when the program returns. I keeps the
        # plain call: W reads the same inputs after it.
        self._run_f = {s: _boxed(p.forward) for s, p in programs.items()}
        self._run_b = {s: _boxed(p.backward) for s, p in programs.items()}
        self._run_w = {s: _boxed(p.backward_weight) for s, p in programs.items() if p.backward_weight is not None}
        # Gradient buffers of the stages' `grads_into`, allocated at the first step, kept across steps.
        self._grad_bufs: dict[int, list[torch.Tensor]] = {}
        self.timeline: list[tuple[str, int, int, float, float]] = []  # (kind, stage, mb, start, end)
        self.t0 = 0.0  # perf_counter at the start of the last run (CLOCK_MONOTONIC: comparable across ranks)
        for p in programs.values():
            if len(p.send_f) > 256 or len(p.send_b) > 256:
                raise ValueError(f"stage {p.stage} sends more than 256 tensors per message; not supported")

    def updated_buffers(self) -> list[torch.Tensor]:
        """The buffers this rank's stages write in their forwards."""
        return [t for ts in self._updated.values() for t in ts]

    def activation_sizes(self) -> dict[int, int]:
        """Bytes of every activation OFFLOAD may move, by the key the store files it under."""
        sizes = {}
        for s, p in self.programs.items():
            metas = p.saved_meta()
            for i in p.offload_saved:
                for m in range(self.M):
                    sizes[self._keys[(s, m, i)]] = tensor_bytes(metas[i])
        return sizes

    def _offload(self, s: int, m: int, ts: list[Any]) -> None:
        for i in self.programs[s].offload_saved:
            t = ts[i]
            if isinstance(t, torch.Tensor) and t.numel() and is_dense(t):  # else it stays (the plan said dense)
                key = self._keys[(s, m, i)]
                self.activations.offload(key, t)
                ts[i] = _Away(key)

    def _reloaded(self, ts: list[Any]) -> list[Any]:
        return [self.activations.reload(t.key) if isinstance(t, _Away) else t for t in ts]

    def release_gradient_buffers(self) -> None:
        """Drop the stages' accumulation buffers (allocated again at the next step's first backward)."""
        self._grad_bufs.clear()

    # --- one step --------------------------------------------------------------------------
    def run(self, actions: list[Action], microbatches: list[list[torch.Tensor]],
            on_reduce: Callable[[int, dict[str, torch.Tensor]], None] | None = None, on_step: Callable[[], None] | None = None,
            forward_only: bool = False, on_weights: Callable[[str, int], None] | None = None,
            ) -> tuple[torch.Tensor | None, dict[str, torch.Tensor]]:
        """Execute `actions`; returns (sum of micro-batch losses or None, summed gradients by name).

        `on_reduce(stage, grads)` runs at REDUCE with the stage's finished gradients by name, `on_step()` at STEP after every send completed.
        `on_weights(kind, stage)` runs at GATHER and RELEASE (a schedule with them needs it).
        `forward_only`: the actions are F / SEND_F / RECV_F (+ STEP) and nothing is kept for a backward.
        """
        recv_f: dict[tuple[int, int], list[torch.Tensor]] = {}
        send_f: dict[tuple[int, int], list[torch.Tensor]] = {}
        saved: dict[tuple[int, int], list[torch.Tensor]] = {}
        recv_b: dict[tuple[int, int], list[torch.Tensor]] = {}
        send_b: dict[tuple[int, int], list[torch.Tensor]] = {}
        pending: list[tuple[Any, torch.Tensor]] = []
        weight_work: dict[tuple[int, int], list[torch.Tensor]] = {}  # I done, W pending: W's inputs
        grads: dict[str, torch.Tensor] = {}
        loss: torch.Tensor | None = None
        self.timeline = []
        # Each receive stream in schedule order; the first `recv_prefetch` of each are posted now,
        # and every RECV posts the next one of its stream before it waits.
        streams: dict[tuple[str, int], list[Action]] = {}
        for a in actions:
            if a.kind in (RECV_F, RECV_B):
                streams.setdefault((a.kind, a.stage), []).append(a)
        cursor = {key: 0 for key in streams}
        posted: dict[tuple[str, int, int], tuple[list[torch.Tensor], list[Any]]] = {}

        def post_next(key: tuple[str, int]) -> None:
            i, queue = cursor[key], streams[key]
            if i < len(queue):
                r = queue[i]
                posted[(r.kind, r.stage, r.microbatch)] = self._post_recv(r)
                cursor[key] = i + 1

        t0 = self.t0 = time.perf_counter()
        for key in streams:
            for _ in range(self.recv_prefetch):
                post_next(key)

        summed: set[str] = set()  # gradients safe to add into in place
        written: set[int] = set()  # stages whose gradient buffers hold this step's sum so far

        def into(s: int) -> list[Any]:
            """The trailing inputs (beta, *buffers) of stage s's gradient-accumulating programs."""
            p = self.programs[s]
            if not p.grads_into:
                return []
            if s not in self._grad_bufs:
                self._grad_bufs[s] = [torch.empty(m.shape, dtype=m.dtype, device=self.device) for m in p.grads_into_meta]
            beta = 1.0 if s in written else 0.0
            written.add(s)
            return [beta, *self._grad_bufs[s]]

        def add_grads(p: StageProgram, gs: list[torch.Tensor], others: list[torch.Tensor], seen: set[int]) -> None:
            # The first micro-batch's gradient is the program's output; later ones are added into
            # it in place whenever nothing else can see it: it shares storage with no other output
            # of this call and no input (parameters, saved activations, the carry W still reads):
            # `seen`, the inputs' storages. Otherwise out of place.
            # why: docs/decisions/sum-microbatch-gradients-in-place.md
            private: set[int] = set()
            if any(name not in grads for name in p.grads):
                private = _private_storages(gs, others) - seen
            for name, g in zip(p.grads, gs):
                if name not in grads:
                    grads[name] = g
                    if _storage(g) in private:
                        summed.add(name)
                elif name in summed:
                    grads[name].add_(g)
                else:
                    grads[name] = grads[name] + g
                    summed.add(name)

        for a in actions:
            s, m = a.stage, a.microbatch
            start = time.perf_counter()
            if a.kind == F:
                p = self.programs[s]
                ins = [*self._state[s], *microbatches[m], *(recv_f.pop((s, m)) if s > 0 else [])]
                with torch.no_grad():
                    outs = list(self._run_f[s](ins))
                k = len(p.send_f)
                if s < p.n_stages - 1:
                    send_f[(s, m)] = outs[:k]
                if not forward_only:
                    saved[(s, m)] = outs[k:k + p.n_saved]
                if p.has_loss:
                    lm = outs[k + p.n_saved].detach()
                    loss = lm.clone() if loss is None else loss + lm
                if p.buffer_updates:  # (F returns them last)
                    with torch.no_grad():
                        torch._foreach_copy_(self._updated[s], outs[len(outs) - len(p.buffer_updates):])
                del outs, ins
            elif a.kind in (B, I):
                p = self.programs[s]
                ins = [*self._state[s], *microbatches[m], *self._reloaded(saved.pop((s, m))),
                       *(recv_b.pop((s, m)) if s < p.n_stages - 1 else [])]
                split = a.kind == I and p.backward_input is not None
                # Storages of the inputs, taken before B frees them, for add_grads' aliasing check.
                seen = _storages(ins) if not split and any(n not in grads for n in p.grads) else set()
                if not split:
                    ins += into(s)  # the same list: B empties it, freeing each input at its last use
                with torch.no_grad():
                    outs = list(p.backward_input(*ins) if split else self._run_b[s](ins))
                k = len(p.send_b)
                if s > 0:
                    send_b[(s, m)] = outs[:k]
                if split:
                    # W reads the same inputs plus what I computed for it; they stay alive until W.
                    weight_work[(s, m)] = [*ins, *outs[k:]]
                else:  # B, or I of a stage without a split: the whole backward ran, W is a no-op
                    add_grads(p, outs[k:], outs[:k], seen)
                del ins, outs
            elif a.kind == W:
                p = self.programs[s]
                if p.backward_weight is not None and (s, m) in weight_work:
                    w_ins = weight_work.pop((s, m))
                    seen = _storages(w_ins) if any(n not in grads for n in p.grads) else set()
                    with torch.no_grad():
                        w_ins += into(s)
                        add_grads(p, list(self._run_w[s](w_ins)), [], seen)
            elif a.kind == SEND_F:
                pending += self._send(send_f.pop((s, m)), self.programs[s].send_f, a.peer, 0, s, m)
            elif a.kind == SEND_B:
                pending += self._send(send_b.pop((s, m)), self.programs[s].send_b, a.peer, 1, s - 1, m)
            elif a.kind in (RECV_F, RECV_B):
                key = (a.kind, s)
                if (a.kind, s, m) not in posted:  # the stream's order is the action order: only a bad list gets here
                    posted[(a.kind, s, m)] = self._post_recv(a)
                bufs, works = posted.pop((a.kind, s, m))
                post_next(key)  # before waiting, so the next message of the stream can move meanwhile
                for w in works:
                    w.wait()
                metas = self.programs[s].recv_f if a.kind == RECV_F else self.programs[s].recv_b
                (recv_f if a.kind == RECV_F else recv_b)[(s, m)] = [
                    b.to(torch.bool) if meta.dtype == torch.bool else b for b, meta in zip(bufs, metas)]
            elif a.kind == REDUCE:
                if on_reduce is not None:
                    # The stage's backward is complete: its summed gradients, to reduce while
                    # the rank's remaining actions run.
                    p = self.programs[s]
                    mine = {n: grads[n] for n in p.grads if n in grads}
                    if s in written:
                        mine.update(zip(p.grads_into, self._grad_bufs[s]))
                    on_reduce(s, mine)
            elif a.kind == OFFLOAD:
                self._offload(s, m, saved[(s, m)])
            elif a.kind == RELOAD:
                for t in saved[(s, m)]:
                    if isinstance(t, _Away):
                        self.activations.prefetch(t.key)
            elif a.kind in PARAMETER_KINDS:
                if on_weights is None:
                    raise RuntimeError(f"the schedule has {a} but the caller gave no on_weights to make the stage's "
                                       "weights whole")
                on_weights(a.kind, s)
            elif a.kind == STEP:
                for work, _ in pending:
                    work.wait()
                pending.clear()
                if on_step is not None:
                    on_step()
            self.timeline.append((a.kind, s, m, start - t0, time.perf_counter() - t0))
        for s in sorted(written):
            for name, buf in zip(self.programs[s].grads_into, self._grad_bufs[s]):
                # Another stage of this rank may return the same (shared) weight's gradient.
                grads[name] = grads[name] + buf if name in grads else buf
        leftovers = [name for name, d in (("saved", saved), ("recv_f", recv_f), ("recv_b", recv_b),
                                          ("send_f", send_f), ("send_b", send_b), ("weight_work", weight_work),
                                          ("posted receives", posted))
                     if d]
        if leftovers:
            raise RuntimeError(f"pipeline step ended with unconsumed {leftovers}: the schedule does not match "
                               "the stage programs")
        return loss, grads

    def _global(self, position: int) -> int:
        return self.peers[position] if self.peers is not None else position

    def _send(self, tensors: list[torch.Tensor], metas: list[TensorMeta], peer: int, direction: int, edge: int,
              mb: int) -> list[tuple[Any, torch.Tensor]]:
        works = []
        for i, (t, meta) in enumerate(zip(tensors, metas, strict=True)):
            t = t.detach()
            if t.dtype == torch.bool:
                t = t.to(torch.uint8)
            # In the traced value's memory order: the receiver's program assumes that layout.
            t = (t if meta.order is None else t.permute(meta.order)).contiguous()
            works.append((dist.isend(t, self._global(peer), group=self.group, tag=_tag(direction, edge, mb, i, self.M)), t))
        return works

    def _post_recv(self, a: Action) -> tuple[list[torch.Tensor], list[Any]]:
        """Post the irecvs of one RECV action's message; returns (buffers, works)."""
        s, m = a.stage, a.microbatch
        if a.kind == RECV_F:
            metas, direction, edge = self.programs[s].recv_f, 0, s - 1
        else:
            metas, direction, edge = self.programs[s].recv_b, 1, s
        bufs, works = [], []
        for i, meta in enumerate(metas):
            dtype = torch.uint8 if meta.dtype == torch.bool else meta.dtype
            buf = torch.empty(meta.memory_shape(), dtype=dtype, device=self.device)
            works.append(dist.irecv(buf, self._global(a.peer), group=self.group,
                                    tag=_tag(direction, edge, m, i, self.M)))
            # Received contiguously, a message traced transposed (q/k/v cut mid-attention) made the
            # stage's `view` of its transpose fail: the buffer is viewed back in the traced layout.
            bufs.append(buf if meta.order is None else buf.permute(meta.inverse_order()))
        return bufs, works
