"""wait_parameter_gathers (ZeRO-1/2): let the post-step parameter all-gathers run behind the
next step's forward. Each parameter is read through a `wait_tensor` placed just before its
first use, so the program waits for a bucket's gather only when it first needs the bucket.

    before:  forward(w0, w1, x):  t0 = t(w0); h = addmm(b0, x, t0) ... y = mm(h, w1) ...
    after:   forward(w0, w1, x):  w0' = wait(w0); t0 = t(w0'); h = addmm(b0, x, t0) ...
                                  w1' = wait(w1); y = mm(h, w1') ...

Why this is enough: under ZeRO-1/2 every rank updates only its shard of each flat bucket and
the runtime (runtime.FlatParameters.after_step) then all-gathers each bucket in place with an
asynchronous functional collective, which registers the work against the bucket's storage.
`wait_tensor` on any view of that storage waits for the bucket's gather (the first such wait
in a step) or returns at once (every later one, and any step with nothing in flight), so one
wait per parameter is correct without the graph knowing which parameter comes first in its
bucket. Every use (forward and backward) is rewired to the waited value, so the order is a
data dependency of the graph rather than a convention.

The pass records `signature.waits_for_parameters = True`: the runtime defers the gathers only
for programs that wait for them, and waits itself before anything else reads the weights.
Requires the bucket layout from reduce_gradients. Options read: world_size, zero.
why: docs/decisions/defer-parameter-gathers.md
"""

from __future__ import annotations

import torch
import torch.fx as fx

from fxspeed.compiler.pass_manager import PassContext, PassResult, graph_pass
from fxspeed.compiler.rewrite import call
from fxspeed.errors import PassError

c10d = torch.ops._c10d_functional
# a whole parameter, and a tensor-parallel slice ("param_tp"), which the buckets hold like one
WAITED_KINDS = ("param", "param_tp")


@graph_pass("wait_parameter_gathers", requires=("gradient_buckets",), produces=("parameter_waits",),
            invalidates=("annotate",))
def wait_parameter_gathers(gm: fx.GraphModule, ctx: PassContext) -> PassResult:
    world = ctx.options.world_size
    if world == 1 or ctx.options.zero not in (1, 2):
        return PassResult(gm, modified=False)
    sig = ctx.signature
    g = gm.graph
    in_buckets = {name for b in sig.buckets for name in b.names}
    placeholders = [n for n in g.nodes if n.op == "placeholder"]
    order = {n: i for i, n in enumerate(g.nodes)}
    for spec, ph in zip(sig.inputs, placeholders):
        # (user inputs and buffers are named by position or buffer name, never bucketed)
        if not spec.kind.startswith("param") or spec.target not in in_buckets or not ph.users:
            continue
        if spec.kind not in WAITED_KINDS:
            # The runtime defers the gathers for this program: an input of a bucketed parameter
            # read without a wait would read old and new weights mixed whenever gloo is slow.
            raise PassError(f"wait_parameter_gathers: input {ph.name!r} ({spec.kind} of {spec.target!r}) is read from "
                            f"a gathered bucket but is not a kind this pass waits for ({WAITED_KINDS}); add its kind "
                            "here, or disable_passes=('wait_parameter_gathers',) to gather before each step")
        first = min(ph.users, key=order.__getitem__)
        with g.inserting_before(first):
            waited = call(g, c10d.wait_tensor.default, (ph,))
        ph.replace_all_uses_with(waited, delete_user_cb=lambda u: u is not waited)
    sig.waits_for_parameters = True
    return PassResult(gm, modified=True)
