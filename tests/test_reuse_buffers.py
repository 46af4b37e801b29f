"""reuse_buffers: flat buffers written into shared workspaces must never overwrite a value that
is still read. Random programs allocate 1-D buffers (cat, zero padding) whose last readers sit
at random later points, some through views; the rewritten program must give the same numbers
bit for bit, and buffers whose lifetimes do not overlap must share memory."""

from __future__ import annotations

import torch
import torch.fx as fx
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.fx.experimental.proxy_tensor import make_fx

from fxspeed.ir import IOSpec, StepSignature
from fxspeed.compiler.pass_manager import PassContext, PassManager
from fxspeed.passes import reuse_buffers

aten = torch.ops.aten
OPTIONS = {"world_size": 2, "reuse_min_bytes": 0}


def program(buffers: list[tuple[str, int, int, bool]]):  # noqa: ANN201
    """buffers[i] = (kind, size, delay, through_view): buffer i is made at step i and read (then
    dropped) at step i + delay; each step also reads every buffer still alive."""

    def f(*xs: torch.Tensor) -> tuple[torch.Tensor]:
        alive: dict[int, torch.Tensor] = {}
        acc = xs[0].new_zeros(())
        for i, (kind, size, delay, view) in enumerate(buffers):
            x = xs[i][:size]
            b = torch.cat([x, x * 2]) if kind == "cat" else torch.nn.functional.pad(x, (i % 3, 2))
            alive[i] = b[1:].view(-1, 1).t() if view else b
            for j, t in list(alive.items()):
                acc = acc + t.sum() * (j + 1)  # a read of every live buffer at every step
                if j + buffers[j][2] <= i:
                    del alive[j]  # its last read was just now
        for j, t in alive.items():
            acc = acc + t.pow(2).sum()
        return (acc,)

    return f


def run_pass(gm: fx.GraphModule) -> fx.GraphModule:
    n_in = sum(n.op == "placeholder" for n in gm.graph.nodes)
    n_out = len(next(n for n in gm.graph.nodes if n.op == "output").args[0])
    sig = StepSignature([IOSpec("input", str(i)) for i in range(n_in)], [IOSpec("output", str(i)) for i in range(n_out)])
    return PassManager([reuse_buffers]).run(gm, PassContext(signature=sig, options=dict(OPTIONS)))


buffer_specs = st.lists(st.tuples(st.sampled_from(["cat", "pad"]), st.integers(1, 6), st.integers(0, 3), st.booleans()),
                        min_size=1, max_size=8)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(buffers=buffer_specs)
def test_buffers_sharing_a_workspace_never_overwrite_a_value_that_is_still_read(buffers) -> None:
    xs = [torch.randn(6) for _ in buffers]
    f = program(buffers)
    gm = make_fx(f)(*xs)
    (want,) = gm(*xs)
    n_alloc = sum(n.target in (aten.cat.default, aten.constant_pad_nd.default) for n in gm.graph.nodes)
    out = run_pass(gm)
    assert torch.equal(out(*xs)[0], want)
    assert torch.equal(out(*xs)[0], f(*xs)[0])
    # Every allocation went into a workspace only if some other one reused its memory.
    workspaces = [n for n in out.graph.nodes if n.target is aten.empty.memory_format]
    left = sum(n.target in (aten.cat.default, aten.constant_pad_nd.default) for n in out.graph.nodes)
    assert len(workspaces) + left <= n_alloc


def test_buffers_whose_lifetimes_do_not_overlap_share_one_workspace() -> None:
    buffers = [("cat", 6, 0, False), ("pad", 6, 0, True), ("cat", 4, 0, False), ("pad", 3, 0, False)]
    xs = [torch.randn(6) for _ in buffers]
    out = run_pass(make_fx(program(buffers))(*xs))
    workspaces = [n for n in out.graph.nodes if n.target is aten.empty.memory_format]
    assert len(workspaces) == 1
    assert [n.target for n in out.graph.nodes].count(aten.cat.out) == 2
    assert torch.equal(out(*xs)[0], program(buffers)(*xs)[0])


def test_a_buffer_the_program_returns_keeps_its_own_memory() -> None:
    def f(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        a = torch.cat([x, x])
        s = a.sum()
        b = torch.cat([x * 3, x])
        return b, s

    out = run_pass(make_fx(f)(torch.randn(4)))
    assert not [n for n in out.graph.nodes if n.target is aten.empty.memory_format]


def test_a_buffer_only_read_by_an_in_place_op_is_dead_there_for_the_next_buffer() -> None:
    """ZeRO-2's gloo reduce-scatter adds the rank's own chunk of the flat bucket into the received
    sum in place (`recv.add_(bucket[:n])`) and steps the sum after the next bucket is flattened:
    the add_'s result is `recv`, not the bucket, so the next bucket reuses the workspace."""

    def f(x: torch.Tensor, acc: torch.Tensor) -> tuple[torch.Tensor]:
        a = torch.cat([x, x])
        r = acc.add_(a[:4])       # reads a; r is acc
        b = torch.cat([x * 2, x])
        return (r * b.sum(),)     # r is read after b is made

    x, acc = torch.randn(4), torch.randn(4)
    want = f(x, acc.clone())[0]
    out = run_pass(make_fx(f)(x, acc.clone()))
    assert [n.target for n in out.graph.nodes].count(aten.cat.out) == 2
    assert len([n for n in out.graph.nodes if n.target is aten.empty.memory_format]) == 1
    assert torch.equal(out(x, acc.clone())[0], want)


def test_an_argument_reaching_an_aliasing_op_outside_its_schema_arguments_is_taken_as_aliased() -> None:
    """Liveness reads which arguments an op's result aliases off the schema; a node reaching the op
    some other way (nested deeper than a list argument) is assumed aliased, never dead early."""
    from fxspeed.passes.memory.reuse_buffers import _aliases

    g = fx.Graph()
    x, w = g.placeholder("x"), g.placeholder("w")
    plain = g.call_function(torch.ops.aten.add_.Tensor, (w, x))  # x only read: the result is w's memory
    nested = g.call_function(torch.ops.aten.cat.out, ([[x]],), {"out": w})  # x where the schema does not look
    assert not _aliases(plain, x) and _aliases(plain, w)
    assert _aliases(nested, x)
