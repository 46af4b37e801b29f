"""offload_parameters (ZeRO-Infinity's parameter tier, Config.offload="parameters"/"all"): the
ZeRO-3 program no longer takes this rank's working shards as inputs; it reads each one from the
rank's parameter files just before the collective that gathers it, and starts reading the next
one there, so the disk works while the previous bucket computes.

    before:  forward(..., param_shard_0, param_shard_1):
               a0 = exchange_gather(param_shard_0, N, g) ... a1 = exchange_gather(param_shard_1, N, g)
               ... (backward) a1' = exchange_gather(param_shard_1, N, g) ...
    after:   forward(...):
               s0 = fxspeed.fetch_shard(store, 0, then=1); a0 = exchange_gather(s0, N, g) ...
               s1 = fxspeed.fetch_shard(store, 1, then=1); a1 = exchange_gather(s1, N, g) ...
               s1' = fxspeed.fetch_shard(store, 1, then=0); a1' = ...

A shard read twice in a step (forward and backward, or two clusters of readers) is fetched twice:
between its reads it is on disk, not in memory. `then` is the bucket of the next fetch in graph
order; the engine prefetches the first before the program runs (`signature.first_fetch`).
Requires shard_parameters. Options read: parameter_store (empty: the pass does nothing).
why: docs/decisions/parameter-offload.md
"""

from __future__ import annotations

import torch.fx as fx

from fxspeed.compiler.pass_manager import PassContext, PassResult, graph_pass
from fxspeed.compiler.rewrite import call
from fxspeed.runtime.offloaded_parameters import fetch_shard_op


@graph_pass("offload_parameters", invalidates=("annotate",))
def offload_parameters(gm: fx.GraphModule, ctx: PassContext) -> PassResult:
    store = ctx.options.parameter_store
    sig = ctx.signature
    g = gm.graph
    placeholders = [n for n in g.nodes if n.op == "placeholder"]
    shards = {int(spec.target): ph for spec, ph in zip(sig.inputs, placeholders) if spec.kind == "param_shard"}
    if not store or not shards:
        return PassResult(gm, modified=False)
    order = {n: i for i, n in enumerate(g.nodes)}
    # Every read of a shard (its cast, gather or alias), in the order the program runs them.
    reads = sorted(((u, k) for k, ph in shards.items() for u in ph.users), key=lambda uk: order[uk[0]])
    for i, (user, k) in enumerate(reads):
        then = reads[i + 1][1] if i + 1 < len(reads) else -1
        val = shards[k].meta["val"]
        with g.inserting_before(user):
            fetched = call(g, fetch_shard_op, (store, k, then, val.numel(), val.dtype))
        user.replace_input_with(shards[k], fetched)
    sig.first_fetch = reads[0][1] if reads else -1
    for ph in shards.values():
        g.erase_node(ph)
    sig.inputs = [s for s in sig.inputs if s.kind != "param_shard"]
    return PassResult(gm, modified=True)
