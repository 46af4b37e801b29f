"""step_buckets_in_backward: where gradients are reduced in buckets (data-parallel replicas, or
the flat layout of master weights with an offloaded optimizer), the optimizer steps each reduced
bucket inside backward, right after the next bucket's collective is issued, instead of after
the program. The bucket's reduced gradient dies at its call; its step runs while the next
bucket's reduction is in flight; an offloaded optimizer's disk reads and writes spread over
backward instead of sitting after it.

    before:  b0 = all_reduce_(flat0) ... w0 = wait(b0)
             b1 = all_reduce_(flat1)                         # issued
             ... w1 = wait(b1)                               return (loss, w0, w1)
    after:   b0 = all_reduce_(flat0) ... w0 = wait(b0)
             b1 = all_reduce_(flat1)
             fxspeed.step_buckets(store, [0], [w_b0...], [w0])   # runs while b1 is in flight
             ... w1 = wait(b1)
             fxspeed.step_buckets(store, [1], [w_b1...], [w1])   return (loss,)

The update is in place (the buckets' Parameters, or this rank's shard of them, are what the
program reads), so a bucket's call also goes after the last reader of every program input that
holds its weights (its parameters, or its ZeRO-3 shard; views and collectives included: reuse_
buffers' `last_use`). A bucket whose weights reach an output is left to the step after the
program. The engine sets PassOptions.optimizer_store only where one step at the end would be
the same computation (fxspeed/compiler/options.py: steps_in_backward).
Options read: optimizer_store (empty: nothing to do).
why: docs/decisions/step-in-backward.md
"""

from __future__ import annotations

import torch
import torch.fx as fx

from fxspeed.compiler.pass_manager import PassContext, PassResult, graph_pass
from fxspeed.compiler.rewrite import output_node
from fxspeed.passes.memory.reuse_buffers import is_collective, last_use
from fxspeed.runtime.step_in_backward import step_buckets_op

_WAIT = torch.ops._c10d_functional.wait_tensor.default
aten = torch.ops.aten


@graph_pass("step_buckets_in_backward", requires=("gradient_buckets",), invalidates=("annotate",))
def step_buckets_in_backward(gm: fx.GraphModule, ctx: PassContext) -> PassResult:
    store = ctx.options.optimizer_store
    sig = ctx.signature
    g = gm.graph
    out = output_node(gm)
    values = list(out.args[0])
    if not store or not sig.buckets or len(values) != len(sig.outputs):
        return PassResult(gm, modified=False)
    placeholders = [n for n in g.nodes if n.op == "placeholder"]
    holders: dict[int, list[fx.Node]] = {}  # bucket -> the inputs holding its weights
    bucket_of = {name: b.index for b in sig.buckets for name in b.names}
    for spec, ph in zip(sig.inputs, placeholders):
        if spec.kind in ("param", "param_tp"):
            k = bucket_of.get(sig.tied.get(spec.target, spec.target))
        elif spec.kind == "param_shard":
            k = int(spec.target)
        else:
            continue
        if k is not None:
            holders.setdefault(k, []).append(ph)
    before = list(g.nodes)
    order = {n: i for i, n in enumerate(before)}
    steppable: list[tuple[int, fx.Node, list[fx.Node]]] = []  # (bucket, value, last readers of its weights)
    for i, spec in enumerate(sig.outputs):
        if spec.kind != "grad_bucket" or not isinstance(values[i], fx.Node):
            continue
        k = int(spec.target)
        ends = [last_use(ph, order) for ph in holders.get(k, [])]
        if any(e is None for e in ends):  # a weight of the bucket is (a view of) an output
            continue
        steppable.append((k, values[i], [before[e] for e in ends]))
    if not steppable:
        return PassResult(gm, modified=False)
    for _, value, _ in steppable:
        # reduce_gradients casts a bucket reduced in Config.reduce_dtype back just before the
        # output: moved right after what it casts, so its step need not wait for the end.
        if value.target is aten._to_copy.default and len(value.args) == 1 and isinstance(value.args[0], fx.Node):
            value.args[0].append(value)
    nodes = list(g.nodes)
    at = {n: i for i, n in enumerate(nodes)}
    # (position, bucket, value) in graph order; at one position, in bucket order
    calls = sorted((_after_next_issue(nodes, max(at[n] for n in [value, *ends])), k, value)
                   for k, value, ends in steppable)
    last: dict[int, fx.Node] = {}  # position -> the call put there last
    for pos, k, value in calls:
        with g.inserting_after(last.get(pos, nodes[pos])):
            call = g.call_function(step_buckets_op, (store, [k], holders.get(k, []), [value]))
        call.meta["val"] = None
        last[pos] = call
    gone = {str(k) for _, k, _ in calls}
    keep = [i for i, s in enumerate(sig.outputs) if not (s.kind == "grad_bucket" and s.target in gone)]
    out.args = (tuple(values[i] for i in keep),)
    sig.outputs = [sig.outputs[i] for i in keep]
    sig.stepped_in_backward = [name for _, k, _ in calls for name in sig.buckets[k].names]
    return PassResult(gm, modified=True)


def _after_next_issue(nodes: list[fx.Node], pos: int) -> int:
    """`pos`, or the next collective's issue if one comes before any wait: the step then runs
    while that collective (the next bucket's reduction) is in flight instead of delaying it."""
    for j in range(pos + 1, len(nodes)):
        n = nodes[j]
        if n.op != "call_function" or n.target is _WAIT:
            return pos
        if is_collective(n):
            return j
    return pos
