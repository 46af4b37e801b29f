"""dedupe_tied_parameters: feed a tied (shared) Parameter to the graph once, with one gradient.

AOT export lifts a Parameter reachable under two names (GPT's `head.weight` is `wte.weight`)
as two graph inputs and returns one gradient per name. `StepSignature.tied` maps each alias
name to its canonical name. This pass merges every alias into its canonical input:

    before:  inputs  (w_wte: param wte.weight, ..., w_head: param head.weight, ...)
             e = embedding(w_wte, idx);  logits = mm(h, t(w_head))
             outputs (loss, g_wte: grad wte.weight, ..., g_head: grad head.weight)
    after:   inputs  (w_wte: param wte.weight, ...)
             e = embedding(w_wte, idx);  logits = mm(h, t(w_wte))
             g = add(g_wte, g_head)
             outputs (loss, g: grad wte.weight, ...)

The signature's `inputs`/`outputs` lists are updated in place (the runtime binds inputs and
reads gradients through them); `tied` is kept, since it describes the model, not the graph.
The sum is exactly what eager autograd accumulates into the shared `.grad`, so training
results do not change. Sharding (ZeRO) needs this: one tensor must have one owner and one
gradient, or the shared weight would be sharded, reduced and updated twice.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx

from fxspeed.ir import IOSpec, StepSignature
from fxspeed.compiler.pass_manager import PassContext, PassResult, graph_pass

aten = torch.ops.aten


def _fake_add(a: Any, b: Any) -> Any:
    """meta['val'] of add(a, b) from the operands' fake values (same fake mode as the graph)."""
    from torch._subclasses.fake_tensor import FakeTensor

    if isinstance(a, FakeTensor) and isinstance(b, FakeTensor) and a.fake_mode is b.fake_mode:
        with a.fake_mode:
            return aten.add.Tensor(a, b)
    return a  # same shape and dtype: the sum of two gradients of one tensor


@graph_pass("dedupe_tied_parameters", invalidates=("annotate",))
def dedupe_tied_parameters(gm: fx.GraphModule, ctx: PassContext) -> PassResult:
    sig: StepSignature = ctx.signature
    if not sig.tied:
        return PassResult(gm, modified=False)
    graph = gm.graph
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    param_ph = {s.target: ph for s, ph in zip(sig.inputs, placeholders) if s.kind == "param"}
    output = next(n for n in reversed(graph.nodes) if n.op == "output")
    outs = list(output.args[0])
    out_specs = list(sig.outputs)
    grad_pos = {s.target: i for i, s in enumerate(out_specs) if s.kind == "grad"}

    drop_inputs: set[int] = set()
    drop_outputs: set[int] = set()
    renamed_inputs = False
    for alias, canonical in sig.tied.items():
        a_ph, c_ph = param_ph.get(alias), param_ph.get(canonical)
        if a_ph is None:
            continue  # the trace already feeds this weight once
        if c_ph is None:
            # Only the alias is an input: rename it so one name remains, the canonical one.
            i = placeholders.index(a_ph)
            sig.inputs[i] = IOSpec("param", canonical)
            renamed_inputs = True
            if alias in grad_pos:
                out_specs[grad_pos[alias]] = IOSpec("grad", canonical)
            continue
        a_ph.replace_all_uses_with(c_ph)
        drop_inputs.add(placeholders.index(a_ph))
        ia, ic = grad_pos.get(alias), grad_pos.get(canonical)
        if ia is None:
            continue
        if ic is None:
            out_specs[ia] = IOSpec("grad", canonical)  # the alias's gradient is the weight's gradient
            continue
        ga, gc = outs[ia], outs[ic]
        if ga is None:
            pass
        elif gc is None:
            outs[ic] = ga
        else:
            with graph.inserting_before(output):
                total = graph.call_function(aten.add.Tensor, (gc, ga))
            total.meta["val"] = _fake_add(gc.meta.get("val"), ga.meta.get("val"))
            outs[ic] = total
        drop_outputs.add(ia)

    renamed = any(s != o for s, o in zip(out_specs, sig.outputs))
    if not (drop_inputs or drop_outputs or renamed or renamed_inputs):
        return PassResult(gm, modified=False)
    output.args = (tuple(o for i, o in enumerate(outs) if i not in drop_outputs),)
    sig.outputs[:] = [s for i, s in enumerate(out_specs) if i not in drop_outputs]
    for i in sorted(drop_inputs, reverse=True):
        graph.erase_node(placeholders[i])
        del sig.inputs[i]
    return PassResult(gm, modified=True)
