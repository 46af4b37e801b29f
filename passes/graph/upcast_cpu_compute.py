"""upcast_cpu_compute: on a CPU without native bf16/fp16 arithmetic, the low-precision matmuls,
convolutions and attention that insert_casts made compute in fp32 from the same rounded values,
and their results are rounded back to the low dtype.

    before:  y16 = addmm(b16, x16, t(w16))              # bf16 GEMM
    after:   y16 = to(addmm(to(b16, f32), to(x16, f32), t(to(w16, f32))), bf16)
             (each upcast is made right before its reader: an fp32 copy lives for one op, and a
             value backward reads stays saved in the low dtype)

Why: on an x86 CPU without AVX-512, PyTorch computes bf16 matmuls with its own reference GEMM
(oneDNN's bf16 paths need avx512_core); fp16 needs AVX512-FP16 or AMX-FP16. Measured on a 2-core
AVX2 EPYC, one thread (milliseconds, native / upcast): a GEMM of 16 x 1152 x 4608 forward
16 / 9, input gradient 156 / 5, weight gradient 15 / 5; 512 x 768 x 3072 237 / 27, 3130 / 27,
122 / 27; fp16 the same or worse; causal attention forward + backward [2, 12, 512, 64] 478 / 91
(fp32); a 3x3 convolution [8, 64, 32, 32] 538 / 8. Both ways multiply bf16-representable values
exactly and accumulate in fp32, then round once to the low dtype: the results differ only by
the order of the sums (a last-bit difference in some elements), as between two GEMM libraries.
The planner reads the rewritten program, so the fp32 copies are in the plan's memory and the
fp32 FLOP rate in its time.

Ops: the ones insert_casts runs in low precision (insert_casts.LOW_OPS: mm, addmm, bmm,
baddbmm, convolution and its backward, the attention kernels and their backward). Every
floating input of such a node in bf16/fp16 is upcast; every bf16/fp16 output (or tuple
element) is rounded back, so the rest of the graph sees the dtypes it was traced with.
compile_step and compile_inference run it where `wanted` says so (PassOptions.upcast_cpu_compute
"auto", the default; the planner's programs for a CUDA target say "off"); disabled by name
("upcast_cpu_compute").
why: docs/decisions/upcast-low-precision-on-cpu.md
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from fxspeed.compiler.options import PassOptions
from fxspeed.compiler.pass_manager import PassContext, PassResult, graph_pass
from fxspeed.compiler.rewrite import call, fake_value
from fxspeed.devices import cpu_computes_natively
from fxspeed.passes.graph.insert_casts import LOW_DTYPES, LOW_OPS

aten = torch.ops.aten
LOW = tuple(LOW_DTYPES.values())


def _low_inputs(n: fx.Node) -> list[fx.Node]:
    return [a for a in n.all_input_nodes
            if isinstance(v := a.meta.get("val"), torch.Tensor) and v.dtype in LOW]


def _slow_here(n: fx.Node) -> bool:
    """A LOW_OPS node on the CPU with a low-precision input this CPU has no native arithmetic for."""
    if n.op != "call_function" or n.target not in LOW_OPS:
        return False
    vals = [a.meta["val"] for a in _low_inputs(n)]
    return bool(vals) and all(v.device.type == "cpu" for v in vals) and \
        not all(cpu_computes_natively(v.dtype) for v in vals)


def wanted(gm: fx.GraphModule, options: PassOptions) -> bool:
    """Whether the program (before insert_casts) will have a low-precision matmul, convolution or
    attention on a CPU that computes it slowly: its inputs are on the CPU and options.precision is
    such a dtype, or it has such ops already (a model built in bf16); options.upcast_cpu_compute
    "off" (a plan for a CUDA target, traced on the host's CPU) never."""
    if options.upcast_cpu_compute == "off":
        return False
    on_cpu = all(v.device.type == "cpu" for n in gm.graph.nodes
                 if n.op == "placeholder" and isinstance(v := n.meta.get("val"), torch.Tensor))
    low = LOW_DTYPES.get(options.precision)
    return on_cpu and (low is not None and not cpu_computes_natively(low) or any(_slow_here(n) for n in gm.graph.nodes))


@graph_pass("upcast_cpu_compute", invalidates=("annotate",))
def upcast_cpu_compute(gm: fx.GraphModule, ctx: PassContext) -> PassResult:
    g = gm.graph
    changed = False
    for n in list(g.nodes):
        if not _slow_here(n):
            continue
        old = n.meta["val"]
        ups = {}
        with g.inserting_before(n):
            for a in dict.fromkeys(_low_inputs(n)):
                ups[a] = call(g, aten._to_copy.default, (a,), {"dtype": torch.float32})
                n.replace_input_with(a, ups[a])
        new = fake_value(n.target, n.args, n.kwargs)
        if not _same_layouts(old, new):  # readers were traced on the old strides: leave this one
            for a, up in ups.items():
                n.replace_input_with(up, a)
                g.erase_node(up)
            continue
        n.meta["val"] = new
        _round_back(g, n, old)
        changed = True
    return PassResult(gm, modified=changed)


def _same_layouts(old: object, new: object) -> bool:
    """Every tensor output keeps its shape and strides (the dtype may change)."""
    if isinstance(old, torch.Tensor) or isinstance(new, torch.Tensor):
        return isinstance(old, torch.Tensor) and isinstance(new, torch.Tensor) and \
            old.shape == new.shape and old.stride() == new.stride()
    if isinstance(old, (tuple, list)) and isinstance(new, (tuple, list)) and len(old) == len(new):
        return all(_same_layouts(o, w) for o, w in zip(old, new))
    return type(old) is type(new)


def _round_back(g: fx.Graph, n: fx.Node, old: object) -> None:
    """Give `n`'s readers its outputs in the dtypes they were traced with (`old`: its old value)."""
    if isinstance(old, torch.Tensor):
        outs = [(n, old)]
    else:  # tuple outputs are read through getitem nodes
        outs = []
        for u in n.users:
            if u.target is operator.getitem:
                u.meta["val"] = n.meta["val"][u.args[1]]
                outs.append((u, old[u.args[1]]))
    for o, was in outs:
        if not isinstance(was, torch.Tensor) or was.dtype == o.meta["val"].dtype:
            continue
        readers = list(o.users)
        with g.inserting_after(o):
            back = call(g, aten._to_copy.default, (o,), {"dtype": was.dtype})
        for r in readers:
            r.replace_input_with(o, back)
