"""accumulate_gradients: a pipeline stage's weight-gradient matmuls write straight into
persistent per-parameter gradient buffers, accumulating over the step's micro-batches inside
the GEMM (Megatron's "gradient accumulation fusion", done as a graph rewrite).

    before:  B(*ins)                                  -> (*send_b, g_w, g_b)
                 g_w = t(t(mm(t(dy), x)))             # a fresh [out, in] tensor per micro-batch
             runtime: grad_w = g_w (first micro-batch) / grad_w += g_w (the others)
    after:   B(*ins, beta, buf_w)                     -> (*send_b, g_b)
                 addmm.out(buf_w, t(dy), x, beta=beta, out=buf_w)   # buf_w = beta * buf_w + t(dy) @ x
             runtime: beta = 0 on the stage's first backward of the step (BLAS then ignores
             buf_w's old contents, NaNs included), 1 on the others; buf_w is the gradient

The buffers live across steps (the engine hands them to the optimizer as `.grad`), so a
steady-state step allocates no weight gradients at all.
why: docs/decisions/accumulate-gradients-inside-the-gemm.md

Embedding tables the same way, with rows instead of a GEMM:

    before:  g_e = embedding_dense_backward(dy, ids, V, -1, False)   # a fresh zeroed [V, C] per micro-batch
    after:   accumulate_rows_(buf_e, beta, ids, dy)                  # (zero it if beta is 0) index_add_ the rows

which touches only the rows of the batch's tokens instead of a [V, C] fill and a [V, C] add
per micro-batch.

Which outputs: a gradient output computed by an `mm` through a chain of transposes only, where
no other node reads the mm or the chain, so that writing it into the buffer changes nothing
else. The buffer has the gradient's shape; the mm writes to it through the chain's net view
(an even number of `t`s: the buffer itself; odd: its transpose, which BLAS writes as a
column-major matrix). And an `embedding_dense_backward` output without padding_idx or
scale_grad_by_freq (those change which rows count). Other gradients (biases, norms) stay
outputs. A program
without any such output is returned unchanged. With `fuse=` the caller names the gradients to
consider (a stage whose backward is also split into I and W needs the same set in B and W).

`accumulate_gradients_pass` is the program pass: it rewrites the stages of the pipeline
positions in options.positions (the ones this rank runs).
"""

from __future__ import annotations

import copy
import dataclasses

import torch
import torch.fx as fx

from fxspeed.compiler.pass_manager import DistributedProgram, PassContext, ProgramResult, program_pass
from fxspeed.ir.program import StageProgram, TensorMeta
from fxspeed.runtime.kernels import accumulate_rows_

_MM = torch.ops.aten.mm.default
_T = torch.ops.aten.t.default
_ADDMM_OUT = torch.ops.aten.addmm.out
_EMBEDDING_BACKWARD = torch.ops.aten.embedding_dense_backward.default


@program_pass("accumulate_gradients", requires=("stages", "schedule"))
def accumulate_gradients_pass(program: DistributedProgram, ctx: PassContext) -> ProgramResult:
    """Rewrite the stages this rank runs (placed on one of options.positions) to accumulate
    their fusible gradients into buffers. Runs after split_backward (B and W change together)."""
    positions = set(ctx.options.positions)
    stages = list(program.stages)
    for s, pos in enumerate(program.schedule.placement):
        if pos in positions:
            stages[s] = accumulate_stage_gradients(stages[s])
    if all(a is b for a, b in zip(stages, program.stages)):
        return ProgramResult(program, modified=False)
    return ProgramResult(dataclasses.replace(program, stages=stages), modified=True)


def accumulate_stage_gradients(p: StageProgram) -> StageProgram:
    """The stage with its backward (and weight-backward) programs rewritten; `p.grads` then
    names the gradients still returned, `p.grads_into` those written into buffers."""
    fuse = fusible_gradients(p.backward, len(p.send_b), p.grads)
    if p.backward_weight is not None:  # B and W must write the same gradients
        fuse = [n for n in fusible_gradients(p.backward_weight, 0, p.grads) if n in fuse]
    if not fuse:
        return p
    backward, into, metas = accumulate_gradients(p.backward, len(p.send_b), p.grads, fuse)
    weight = p.backward_weight
    if weight is not None:
        weight, _, _ = accumulate_gradients(weight, 0, p.grads, fuse)
    return dataclasses.replace(p, backward=backward, backward_weight=weight,
                               grads=[n for n in p.grads if n not in into], grads_into=into, grads_into_meta=metas)


def fusible_gradients(gm: fx.GraphModule, first: int, names: list[str]) -> list[str]:
    """Names of the gradient outputs (outputs `first:`, one per name) an mm computes through
    transposes that nothing else reads, or an embedding backward without padding index."""
    return [name for name, _ in _matches(gm.graph, first, names)]


def accumulate_gradients(gm: fx.GraphModule, first: int, names: list[str], fuse: list[str] | None = None
                         ) -> tuple[fx.GraphModule, list[str], list[TensorMeta]]:
    """Rewrite the gradient outputs `first:` of `gm` (named `names`) that `fusible_gradients`
    finds, restricted to `fuse` when given, into accumulation into buffers (addmm into the
    buffer for a matmul, a row scatter-add for an embedding table).

    Returns (program, fused names, their buffers' metas). The program takes, after its old
    inputs, `beta` (a float) and one buffer per fused name, and no longer returns those
    gradients; its other outputs keep their order."""
    graph = copy.deepcopy(gm.graph)
    found = [(name, chain) for name, chain in _matches(graph, first, names) if fuse is None or name in fuse]
    if not found:
        return gm, [], []
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    with graph.inserting_after(placeholders[-1]):
        beta = graph.placeholder("grad_beta")
    beta.meta["val"] = 1.0
    bufs, metas, last = [], [], beta
    for k, (name, chain) in enumerate(found):
        with graph.inserting_after(last):
            buf = graph.placeholder(f"grad_into_{k}")
        val = chain[0].meta["val"]  # the output: the gradient as the program returned it
        buf.meta["val"] = torch.empty(tuple(val.shape), dtype=val.dtype, device="meta")
        bufs.append(buf)
        metas.append(TensorMeta(tuple(int(d) for d in val.shape), val.dtype))
        last = buf
    out = next(n for n in reversed(graph.nodes) if n.op == "output")
    results = list(out.args[0])
    drop = {id(chain[0]) for _, chain in found}
    out.args = (tuple(r for i, r in enumerate(results) if i < first or id(r) not in drop),)
    for buf, (_, chain) in zip(bufs, found):
        mm = chain[-1]
        with graph.inserting_before(mm):
            if mm.target is _EMBEDDING_BACKWARD:
                acc = graph.call_function(accumulate_rows_, (buf, beta, mm.args[1], mm.args[0]))
            else:
                target = buf
                if (len(chain) - 1) % 2:
                    target = graph.call_function(_T, (buf,))
                    target.meta["val"] = buf.meta["val"].t()
                acc = graph.call_function(_ADDMM_OUT, (target, *mm.args), {"beta": beta, "out": target})
        acc.meta = dict(mm.meta)
        for n in chain:  # the output first: each node's only user is the one before it
            graph.erase_node(n)
    graph.lint()
    return fx.GraphModule(gm, graph), [name for name, _ in found], metas


def _matches(graph: fx.Graph, first: int, names: list[str]) -> list[tuple[str, list[fx.Node]]]:
    """(name, [output value, ..., mm or embedding backward]) for each fusible gradient output."""
    out = next(n for n in reversed(graph.nodes) if n.op == "output")
    results = list(out.args[0])
    grads = results[first:]
    if len(grads) != len(names):
        raise ValueError(f"{len(grads)} gradient outputs after output {first}, {len(names)} names")
    found = []
    for name, v in zip(names, grads):
        if not isinstance(v, fx.Node) or results.count(v) != 1 or set(v.users) != {out}:
            continue
        chain, n = [v], v
        while n.op == "call_function" and n.target is _T and len(n.args[0].users) == 1:
            n = n.args[0]
            chain.append(n)
        val = v.meta.get("val")
        if n.op != "call_function" or not isinstance(val, torch.Tensor) or not val.dtype.is_floating_point:
            continue
        if n.target is _EMBEDDING_BACKWARD:
            if len(chain) != 1 or len(n.args) != 5:  # rows are scattered into the table as it is, untransposed
                continue
            dy, _, _, padding_idx, by_freq = n.args
            if padding_idx != -1 or by_freq or not isinstance(dy, fx.Node) or dy.meta["val"].dtype != val.dtype:
                continue
        elif n.target is not _MM or val.dtype != n.meta["val"].dtype:
            continue
        found.append((name, chain))
    return found
