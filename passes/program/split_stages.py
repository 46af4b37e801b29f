"""split_stages: cut the joint forward+loss+backward graph into per-stage forward and backward programs.

    before (one joint graph, pipeline=2):   after (two StagePrograms):
      h = block0(x); y = block1(h)            stage 0  forward:  h = block0(x)            -> send h
      loss = ce(y, t)                                  backward: recv dh; dw0 = block0'(dh, saved)
      dh, dw1 = block1'(dloss)                stage 1  forward:  recv h; y = block1(h); loss = ce(y, t)
      dw0 = block0'(dh)                                backward: dh, dw1 = block1'(dloss, saved) -> send dh

Input: the annotated joint graph of ONE micro-batch, `gm(*params, *buffers, *batch) -> (loss, *grads)`
(captured with tied weights NOT deduplicated, so a weight shared by two stages has one input
and one gradient per name). Output: one `fxspeed.ir.program.StageProgram` per stage.

1. Forward placement. Forward nodes (annotate's role, plus `getitem`s of forward tuples) are
   taken in graph order. Candidate cut points are module boundaries: the first node of each
   repeated block (a module path with an integer component, e.g. `blocks.3`) and the first
   node after the last block that belongs to another module (`ln_f`); without repeated blocks,
   the first node of each top-level module. The user may name the modules stages start at
   (`split_points`). Among the candidates, the P-1 cuts minimizing the largest stage's
   predicted forward time (NodeInfo.time; FLOPs when no time was predicted) are chosen by a
   small dynamic program. Cutting by position in a topological order means every forward
   edge goes from a stage to the same or a later one.
2. Backward placement (mirror). A backward node must run on a stage no earlier than any
   forward value or parameter it reads, and no later than any backward node reading it (the
   gradient flows from the last stage to the first). The smallest such stage is computed in
   reverse topological order; a parameter's gradient is pinned to the parameter's stage.
   `getitem`s share their tuple's stage, so tuples never cross ranks.
3. Values that need no placement: the batch (every rank has it) and nodes computed from the
   batch and constants alone (no random op) are recomputed where they are used.
4. Messages: a forward value produced on stage a and read on stage c > a travels through
   every stage in between (F_a sends it, F_{a+1}..F_{c-1} relay it); likewise gradients
   backward. Stage s's backward reads its saved values: forward values (local or received)
   its backward nodes read.
5. Zero-bubble split (`split_stage_backward`): a stage's backward B becomes I (input
   gradients, what the upstream stage waits for) and W (weight gradients, deferrable).

Program passes (see fxspeed.compiler.pass_manager): `split_stages_pass` cuts the program's
joint graph into options.pipeline x options.pipeline_chunks stages at options.split_points;
`split_backward_pass` splits the backward of every stage the schedule runs I/W actions for.
"""

from __future__ import annotations

import dataclasses
import operator
from typing import Sequence

import networkx as nx
import torch
import torch.fx as fx

from fxspeed.compiler.pass_manager import DistributedProgram, PassContext, ProgramResult, program_pass
from fxspeed.errors import ConfigError, FxspeedError
from fxspeed.ir import FORWARD, META_KEY, StepSignature
from fxspeed.ir.program import StageProgram, TensorMeta
from fxspeed.ir.schedule import I, W


class PipelineSplitError(FxspeedError):
    """The graph cannot be split into the requested stages; says why and what works."""


def _is_random(n: fx.Node) -> bool:
    tags = getattr(n.target, "tags", ())
    return torch.Tag.nondeterministic_seeded in tags


def _meta(n: fx.Node) -> TensorMeta:
    v = n.meta.get("val")
    if not isinstance(v, torch.Tensor):
        raise PipelineSplitError(f"value {n.name!r} ({n.target}) crosses a stage boundary but is not a tensor "
                                 f"({type(v).__name__}); pipeline messages carry tensors only")
    shape = tuple(int(d) for d in v.shape)
    # Dims by stride, outermost first (stable: size-1 and broadcast dims keep their place).
    order = tuple(sorted(range(v.dim()), key=lambda d: -int(v.stride(d))))
    return TensorMeta(shape, v.dtype, None if order == tuple(range(v.dim())) else order)


def _unit(module: str) -> str | None:
    """'blocks.3.attn.qkv' -> 'blocks.3' (a repeated block); None for modules outside blocks."""
    parts = module.split(".") if module else []
    for i, p in enumerate(parts):
        if p.isdigit():
            return ".".join(parts[:i + 1])
    return None


def _cost(n: fx.Node, use_time: bool) -> float:
    inf = n.meta.get(META_KEY)
    if inf is None:
        return 0.0
    return float(inf.time) if use_time else float(inf.flops + inf.bytes_read + inf.bytes_written)


def candidate_cuts(fwd: list[fx.Node], split_points: Sequence[str] | None = None) -> list[tuple[int, str]]:
    """(position in `fwd`, module the next stage starts at) of every allowed cut."""
    mods = [n.meta[META_KEY].module if META_KEY in n.meta else "" for n in fwd]
    if split_points:
        cuts = []
        for name in split_points:
            pos = next((i for i, m in enumerate(mods) if m == name or m.startswith(name + ".")), None)
            if pos is None or pos == 0:
                seen = sorted({_unit(m) or m.split(".")[0] for m in mods if m})
                what = ("is the first module the forward runs, where stage 0 starts anyway" if pos == 0 else
                        "is not a module the forward runs")
                raise ConfigError(f"pipeline split point {name!r} {what}; split points name the modules stages "
                                  f"1, 2, ... start at, e.g. one of {seen[:12]}")
            cuts.append((pos, name))
        return sorted(set(cuts))
    cuts: list[tuple[int, str]] = []
    seen_units: set[str] = set()
    last_block = None
    # Repeated blocks are units with modules inside (a transformer layer's attention and MLP). A
    # container of single layers (a U-Net's `tmlp = Sequential(Linear, SiLU, Linear)`) is not: it
    # gave the only cuts, all around it, and stage 0 held 4% of the model.
    units = {u for m in mods if (u := _unit(m)) is not None}
    if not any(m.startswith(u + ".") for m in mods for u in units):
        mods = [_unit(m) or m for m in mods]  # each such layer is a module of its own below
        units = set()
    for i, m in enumerate(mods):
        u = _unit(m) if units else None
        if u is not None and u not in seen_units:
            seen_units.add(u)
            cuts.append((i, u))
        if u is not None:
            # The last block's last node, not its first: a node of another module can sit inside
            # the last block (Hugging Face's rotary table given position_ids: `model.rotary_emb`
            # nodes placed at their first reader in layers.1), and a cut there split the block.
            last_block = i
    if last_block is not None:
        after = next((i for i in range(last_block + 1, len(mods)) if mods[i] and _unit(mods[i]) is None), None)
        if after is not None:  # the full path: 'transformer.ln_f', not the 'transformer' that also holds wte
            cuts.append((after, mods[after]))
    else:
        prev = None
        for i, m in enumerate(mods):
            top = (m if _unit(m) == m else m.split(".")[0]) if m else None
            if top and top != prev and prev is not None:
                cuts.append((i, top))
            if top:
                prev = top
    return sorted({(p, name) for p, name in cuts if 0 < p < len(fwd)})


def choose_cuts(costs: list[float], cuts: list[int], n_stages: int) -> list[int]:
    """P-1 of `cuts` (positions) minimizing the most expensive stage; exact DP over pieces."""
    bounds = [0, *cuts, len(costs)]
    pieces = [sum(costs[bounds[i]:bounds[i + 1]]) for i in range(len(bounds) - 1)]
    K = len(pieces)
    inf = float("inf")
    # best[k][j]: minimal max cost splitting pieces[:j] into k stages; arg for reconstruction.
    best = [[inf] * (K + 1) for _ in range(n_stages + 1)]
    arg = [[-1] * (K + 1) for _ in range(n_stages + 1)]
    best[0][0] = 0.0
    prefix = [0.0]
    for c in pieces:
        prefix.append(prefix[-1] + c)
    for k in range(1, n_stages + 1):
        for j in range(k, K + 1):
            for i in range(k - 1, j):
                v = max(best[k - 1][i], prefix[j] - prefix[i])
                if v < best[k][j] - 1e-18:
                    best[k][j], arg[k][j] = v, i
    ends, j = [], K
    for k in range(n_stages, 0, -1):
        i = arg[k][j]
        ends.append(i)
        j = i
    starts = sorted(ends)[1:]  # piece indices where stages 1..P-1 begin
    return [bounds[i] for i in starts]


def split_stages(gm: fx.GraphModule, sig: StepSignature, n_stages: int, *,
                 split_points: Sequence[str] | None = None, model_name: str = "the model",
                 split_backward: bool = True, _twins_read: bool = False) -> list[StageProgram]:
    """The stage programs of `gm`, one per stage. With `split_backward` each stage whose
    backward has weight-gradient work is also split into I and W (`split_stage_backward`);
    the program pass leaves that to its own pass, run only for schedules with I/W actions."""
    P = n_stages
    nodes = list(gm.graph.nodes)
    phs = [n for n in nodes if n.op == "placeholder"]
    output = nodes[-1]
    outs = list(output.args[0])
    batch_ph = [ph for ph, s in zip(phs, sig.inputs) if s.kind == "input"]
    # The fp16 loss scale is bound like a weight: a tensor the engine owns, read by the last
    # stage's backward seed.
    # A tensor-parallel program's sliced weights ("param_tp") are weights like the others.
    state_ph = {ph: s for ph, s in zip(phs, sig.inputs) if s.kind in ("param", "param_tp", "buffer", "loss_scale")}
    other = [s for s in sig.inputs if s.kind not in ("param", "param_tp", "buffer", "input", "loss_scale")]
    if other:
        raise PipelineSplitError(f"graph inputs {other} are not supported by pipeline parallelism yet")
    # Buffers the step writes (BatchNorm's running statistics): each stage's F returns the new
    # values of the buffers it holds, and the runtime writes them after every micro-batch's F,
    # so micro-batch m+1 reads what m wrote, as eager's forwards over the slices would.
    updates = [(o, s.target) for o, s in zip(outs, sig.outputs) if s.kind == "buffer_update"]
    updated = {name for _, name in updates}
    loss_node = next(o for o, s in zip(outs, sig.outputs) if s.kind == "loss")
    grad_out = [(o, s.target) for o, s in zip(outs, sig.outputs) if s.kind == "grad" and isinstance(o, fx.Node)]

    # --- classify -----------------------------------------------------------------------------
    batch_set = set(batch_ph)
    free: set[fx.Node] = set()
    forward: set[fx.Node] = set()
    for n in nodes:
        if n.op == "get_attr" or (n.op == "call_function" and not _is_random(n)
                                  and all(a in batch_set or a in free for a in n.all_input_nodes)):
            free.add(n)
            continue
        if n.op != "call_function":
            continue
        inf = n.meta.get(META_KEY)
        if inf is not None and inf.role == FORWARD:
            forward.add(n)
        elif n.target is operator.getitem and n.args[0] in forward:
            forward.add(n)
    fwd_seq = [n for n in nodes if n in forward]
    bwd_seq = [n for n in nodes if n.op == "call_function" and n not in forward and n not in free]
    twins = _recomputed_twins(fwd_seq, bwd_seq)

    # --- forward placement ----------------------------------------------------------------------
    # Nodes computed from weights alone (insert_casts' one cast per parameter, hoisted to the
    # top of the graph; transposes/views of weights) are not part of the activation flow: they
    # neither mark where a module starts nor take a stage by position. Each runs on the stage
    # that uses it, so a weight and its low-precision copy live on one rank and never travel.
    from_batch = set(batch_ph)
    for n in nodes:
        if any(a in from_batch for a in n.all_input_nodes):
            from_batch.add(n)
    weight_only: list[fx.Node] = []
    wo_set: set[fx.Node] = set()
    for n in fwd_seq:
        ins = n.all_input_nodes
        if n not in from_batch and all(a in state_ph or a in wo_set or a in free for a in ins) \
                and any(a in state_ph or a in wo_set for a in ins):
            weight_only.append(n)
            wo_set.add(n)
    flow = [n for n in fwd_seq if n not in wo_set]
    cands = candidate_cuts(flow, split_points)
    if len(cands) + 1 < P:
        where = ", ".join(name for _, name in cands) or "nowhere"
        raise ConfigError(f"Config.pipeline={P}: {model_name} can be split into at most {len(cands) + 1} stages "
                          f"(stages can start at: {where}); use pipeline <= {len(cands) + 1}"
                          + ("" if split_points else " or a model with more blocks"))
    if split_points and len(cands) != P - 1:
        raise ConfigError(f"{len(cands)} pipeline split points {list(split_points)} give {len(cands) + 1} stages, "
                          f"but Config.pipeline={P}; give exactly {P - 1}")
    use_time = any(_cost(n, True) > 0 for n in flow)
    costs = [_cost(n, use_time) for n in flow]
    cuts = [p for p, _ in cands] if split_points else choose_cuts(costs, [p for p, _ in cands], P)
    cut_names = dict(cands)
    stage: dict[fx.Node, int] = {}
    s = 0
    for i, n in enumerate(flow):
        while s < len(cuts) and i >= cuts[s]:
            s += 1
        stage[n] = s
    for n in reversed(weight_only):  # users first: a chain of casts/views follows its final reader
        used_on = [stage[u] for u in n.users if u in stage]
        if not used_on:  # read by backward only: go where the weight's forward readers are
            roots = [a for a in n.all_input_nodes if a in state_ph]
            used_on = [stage[u] for r in roots for u in r.users if u in stage]
        stage[n] = min(used_on, default=0)
    if stage.get(loss_node, P - 1) != P - 1:
        raise PipelineSplitError("the loss is not computed on the last stage; please report this")

    # Parameters: a weight lives on the stage whose forward reads it. A tied weight (one
    # Parameter under several names, GPT's wte/head) may be read on several stages; each of
    # them holds a copy and the engine sums its gradients over those ranks.
    group_of = {ph: sig.tied.get(spec.target, spec.target) for ph, spec in state_ph.items()}
    tied_groups = {g for g in group_of.values() if g in sig.tied.values()}
    readers: dict[fx.Node, set[int]] = {ph: {stage[u] for u in ph.users if u in forward} for ph in state_ph}
    pstage: dict[fx.Node, int] = {}  # the stage of an untied parameter
    # State nothing writes (a buffer the step does not update; a frozen weight) may be read
    # on several stages, as a causal mask or rotary table on the root module read by every
    # block: each of them holds a copy, and there is no gradient to sum.
    has_grad = {name for _, name in grad_out}
    read_only = {ph for ph, spec in state_ph.items() if (spec.kind == "buffer" and spec.target not in updated)
                 or (spec.kind in ("param", "param_tp") and spec.target not in has_grad)}
    for ph, spec in state_ph.items():
        if group_of[ph] in tied_groups or (ph in read_only and len(readers[ph]) > 1):
            continue
        if len(readers[ph]) > 1:
            # Name where each stage reads it: the usual case is a weight read again outside its
            # module (`F.linear(h, self.wte.weight)` for an output head), whose two readers sit at
            # the first and the last stage, where no split point can bring them together.
            by_stage: dict[int, set[str]] = {}
            for u in ph.users:
                if u in forward:
                    inf = u.meta.get(META_KEY)
                    by_stage.setdefault(stage[u], set()).add(
                        repr(inf.module) if inf is not None and inf.module else "the root module's forward")
            where = "; ".join(f"stage {st}: {', '.join(sorted(ms))}" for st, ms in sorted(by_stage.items()))
            owner, _, attr = spec.target.rpartition(".")
            tie = f"self.{owner + '.' if owner else ''}{attr}"
            raise PipelineSplitError(
                f"{spec.kind} {spec.target!r} is read by stages {sorted(readers[ph])} ({where}); a weight used by "
                "several stages must be tied: one Parameter under two module names, as GPT's wte/head, which "
                "each stage then holds a copy of, their gradients summed. Read it on the later stage through "
                f"a module of its own sharing it (in __init__: `self.out = nn.Linear(in, out, bias=False); "
                f"self.out.weight = {tie}`; in forward: `self.out(h)` for `F.linear(h, {tie})`), or give "
                "Config.split_points that keep its readers on one stage")
        if readers[ph]:
            pstage[ph] = next(iter(readers[ph]))
    name_to_ph = {s.target: ph for ph, s in state_ph.items()}
    grad_pin: dict[fx.Node, int] = {}
    tied_grads: list[tuple[fx.Node, str]] = []
    for o, name in grad_out:
        ph = name_to_ph.get(name)
        group = sig.tied.get(name, name)
        if group in tied_groups:
            tied_grads.append((o, name))
        elif ph is None or ph not in pstage:
            raise PipelineSplitError(f"parameter {name!r} has a gradient but no forward use; not supported")
        else:
            grad_pin[o] = max(grad_pin.get(o, 0), pstage[ph])

    # --- backward placement (reverse topological) -----------------------------------------------
    bwd_set = set(bwd_seq)

    def place_backward() -> None:
        for n in reversed(bwd_seq):
            lo = grad_pin.get(n, 0)
            for a in n.all_input_nodes:
                if a in forward:
                    lo = max(lo, stage[a])
                elif a in pstage:
                    lo = max(lo, pstage[a])
            for u in n.users:
                if u in bwd_set:
                    lo = max(lo, stage[u])
            stage[n] = lo
        for n in bwd_seq:  # getitems live with their tuple (the tuple's stage is >= each of theirs)
            if n.target is operator.getitem and n.args[0] in bwd_set:
                stage[n] = stage[n.args[0]]

    def anchor(n: fx.Node) -> int | None:
        """Stage bound from forward values / parameters the node reads (None: reads none)."""
        st = [stage[a] for a in n.all_input_nodes if a in forward] + \
             [pstage[a] for a in n.all_input_nodes if a in pstage]
        return max(st) if st else None

    place_backward()
    # A forward value backward recomputes (recompute_pointwise: cheap on one device) whose
    # readers landed on a later stage than the forward value would read the earlier stage's
    # inputs and weights there (a root-module `x * self.gate` before a cut: the gate lives on
    # stage 0). The forward value crosses the boundary anyway; read it instead of recomputing.
    later = [n for n in bwd_seq if n in twins and stage[n] > stage[twins[n]]]
    if later and not _twins_read:
        return split_stages(_read_twins(gm, {n: twins[n] for n in later}, set(twins)), sig, n_stages,
                            split_points=split_points, model_name=model_name,
                            split_backward=split_backward, _twins_read=True)
    if tied_grads:
        # A tied weight's per-name gradient is computed on the stage of the forward use it
        # differentiates: the nearest backward ancestors that read forward values say which.
        for o, name in tied_grads:
            frontier, seen, found = [o], set(), []
            while frontier:
                n = frontier.pop()
                if n in seen or n not in bwd_set:
                    continue
                seen.add(n)
                a = anchor(n)
                if a is not None:
                    found.append(a)
                else:
                    frontier.extend(x for x in n.all_input_nodes if x in bwd_set)
            # ... and it must be a stage that holds the weight (reads it in forward).
            group = sig.tied.get(name, name)
            holders = sorted({t for ph in state_ph if group_of[ph] == group for t in readers[ph]})
            bound = min(found) if found else 0
            grad_pin[o] = max((t for t in holders if t <= bound), default=holders[0] if holders else 0)
        place_backward()
    # Lift nodes that read only gradients (residual sums, views) to the stage their inputs come
    # from: a sum of two incoming gradients then crosses the boundary once, not twice.
    for n in bwd_seq:
        if n in grad_pin or n.target is operator.getitem or anchor(n) is not None:
            continue
        ins = [stage[a] for a in n.all_input_nodes if a in bwd_set]
        if sum(1 for t in ins if t > stage[n]) >= 2:
            stage[n] = max(stage[n], min(ins))
    for n in bwd_seq:
        if n.target is operator.getitem and n.args[0] in bwd_set:
            stage[n] = stage[n.args[0]]
    grad_stage = {o: stage.get(o, grad_pin.get(o, 0)) for o, _ in grad_out}
    for o, name in grad_out:
        if o in grad_pin and grad_stage[o] != grad_pin[o]:
            raise PipelineSplitError(f"the gradient of {name!r} is computed on stage {grad_stage[o]} but the "
                                     f"parameter lives on stage {grad_pin[o]}; not supported")
    for n in bwd_seq:
        for a in n.all_input_nodes:
            if a in pstage and pstage[a] != stage[n]:
                raise PipelineSplitError(f"backward node {n.name} on stage {stage[n]} reads parameter "
                                         f"{state_ph[a].target!r} of stage {pstage[a]}; not supported")

    update_stage: dict[str, int] = {}
    for o, name in updates:
        ph = name_to_ph.get(name)
        on = stage.get(o) if isinstance(o, fx.Node) else None
        if ph is None or on is None or pstage.get(ph, on) != on:
            raise PipelineSplitError(f"{model_name} updates buffer {name!r} on another stage than the one reading it "
                                     "(or outside the forward); not supported under a pipeline: choose other split "
                                     "points")
        late = [n.name for n in ph.users if n in bwd_set]
        if late:  # F of the next micro-batch would have written it before this one's backward read it
            raise PipelineSplitError(f"{model_name}'s backward reads buffer {name!r}, which its forward updates "
                                     f"({late[0]}); under a pipeline the next micro-batch's forward writes it first. "
                                     "Not supported: compute with a copy taken before the update")
        update_stage[name] = on

    # Sanity (networkx): forward edges never go to an earlier stage, gradient edges never to a
    # later one, and the stage-level graph of F_s / B_s programs is acyclic.
    g = nx.DiGraph()
    for n in fwd_seq + bwd_seq:
        for a in n.all_input_nodes:
            if a not in stage:
                continue
            ok = stage[a] <= stage[n] if a in forward else stage[a] >= stage[n]
            if not ok:
                raise PipelineSplitError(f"edge {a.name}->{n.name} goes from stage {stage[a]} to "
                                         f"{stage[n]} against the pipeline; please report this")
            u = ("F" if a in forward else "B", stage[a])
            v = ("F" if n in forward else "B", stage[n])
            if u != v:
                g.add_edge(u, v)
    if not nx.is_directed_acyclic_graph(g):
        raise PipelineSplitError(f"the stage programs depend on each other in a cycle: {nx.find_cycle(g)}")

    # --- consumers and messages -----------------------------------------------------------------
    consumers: dict[fx.Node, set[int]] = {}
    for n in fwd_seq + bwd_seq:
        for a in n.all_input_nodes:
            if a in stage:
                consumers.setdefault(a, set()).add(stage[n])
    consumers.setdefault(loss_node, set()).add(P - 1)
    for o, _ in grad_out:
        consumers.setdefault(o, set()).add(grad_stage[o])

    fmsg: list[list[fx.Node]] = [[] for _ in range(P + 1)]  # fmsg[s]: into stage s from s-1
    bmsg: list[list[fx.Node]] = [[] for _ in range(P + 1)]  # bmsg[s]: into stage s from s+1
    saved: list[list[fx.Node]] = [[] for _ in range(P)]
    for n in fwd_seq:
        cs = consumers.get(n, set())
        if not cs:
            continue
        for t in range(stage[n] + 1, max(cs) + 1):
            fmsg[t].append(n)
        for t in {stage[u] for u in n.users if u in bwd_set}:
            saved[t].append(n)
    for n in bwd_seq:
        cs = consumers.get(n, set())
        if not cs:
            continue
        for t in range(min(cs), stage[n]):
            bmsg[t].append(n)
    for t in range(P):
        saved[t].sort(key=nodes.index)

    # --- build the programs ---------------------------------------------------------------------
    programs = []
    for s in range(P):
        state = [ph for ph in phs if ph in state_ph
                 and any(u in stage and stage[u] == s for u in ph.users)]
        fwd_local = [n for n in fwd_seq if stage[n] == s]
        bwd_local = [n for n in bwd_seq if stage[n] == s]
        f_updates = [(o, name) for o, name in updates if update_stage[name] == s]
        f_outs = fmsg[s + 1] + saved[s] + ([loss_node] if s == P - 1 else []) + [o for o, _ in f_updates]
        fgm = _build(gm, state, batch_ph, fmsg[s], fwd_local, f_outs, free)
        b_grads = [(o, name) for o, name in grad_out if grad_stage[o] == s]
        b_outs = (bmsg[s - 1] if s > 0 else []) + [o for o, _ in b_grads]
        bgm = _build(gm, state, batch_ph, saved[s] + bmsg[s], bwd_local, b_outs, free)
        # The I/W partition is computed here for the predicted times only (the planner's
        # simulator reads them for every schedule); split_stage_backward builds the programs.
        i_nodes, w_nodes, _ = _split_backward(bwd_local, bmsg[s - 1] if s > 0 else [], [o for o, _ in b_grads])
        secs = lambda ns: sum(_cost(n, True) for n in ns)  # noqa: E731
        with_grad = {sig.tied.get(n, n) for _, n in b_grads}
        frozen = [state_ph[ph].target for ph in state if state_ph[ph].kind in ("param", "param_tp")
                  and sig.tied.get(state_ph[ph].target, state_ph[ph].target) not in with_grad]
        predicted = {"forward": secs(fwd_local), "backward_input": secs(i_nodes) if w_nodes else secs(bwd_local),
                     "backward_weight": secs(w_nodes),
                     "params": float(sum(ph.meta["val"].numel() for ph in state if state_ph[ph].kind in ("param", "param_tp"))),
                     "param_bytes": float(sum(_nbytes(ph) for ph in state if state_ph[ph].kind in ("param", "param_tp"))),
                     "saved_bytes": float(sum(_nbytes(n) for n in saved[s] + bmsg[s])),
                     "send_bytes": float(sum(_nbytes(n) for n in fmsg[s + 1]))}
        program = StageProgram(
            stage=s, n_stages=P, forward=fgm, backward=bgm, state=[state_ph[ph] for ph in state],
            n_batch=len(batch_ph), recv_f=[_meta(n) for n in fmsg[s]] if s > 0 else [],
            send_f=[_meta(n) for n in fmsg[s + 1]] if s < P - 1 else [], n_saved=len(saved[s]),
            has_loss=s == P - 1, recv_b=[_meta(n) for n in bmsg[s]] if s < P - 1 else [],
            send_b=[_meta(n) for n in bmsg[s - 1]] if s > 0 else [], grads=[name for _, name in b_grads],
            tied={state_ph[ph].target: sig.tied[state_ph[ph].target] for ph in state
                  if state_ph[ph].target in sig.tied} | {n: sig.tied[n] for _, n in b_grads if n in sig.tied},
            nodes={"forward_nodes": len(fwd_local), "backward_nodes": len(bwd_local)},
            predicted=predicted, modules=_modules([n for _, n in b_grads] + frozen),
            starts_at=cut_names[cuts[s - 1]] if s > 0 else "", buffer_updates=[name for _, name in f_updates])
        programs.append(split_stage_backward(program) if split_backward else program)
    return programs


def split_stage_backward(p: StageProgram) -> StageProgram:
    """Zero-bubble split of stage `p`'s backward program B into I (what the upstream stage
    waits for: the input gradients it sends) and W (the rest: weight-gradient matmuls and
    reductions), read off B itself. I returns (*send_b, *carry), W takes B's inputs plus the
    carry and returns the gradients (see `_split_backward`). Values B recomputes from the batch
    are recomputed in each of I and W, as split_stages does across stages.

    A stage without weight-gradient work, or already split, is returned unchanged. The split
    must come before accumulate_gradients, which rewrites B and W together."""
    if p.backward_input is not None:
        return p
    if p.grads_into:
        raise PipelineSplitError(f"stage {p.stage}: split the backward before accumulating its gradients into "
                                 "buffers (split_backward runs before accumulate_gradients)")
    gm = p.backward
    nodes = list(gm.graph.nodes)
    phs = [n for n in nodes if n.op == "placeholder"]
    batch = set(phs[len(p.state):len(p.state) + p.n_batch])
    free: set[fx.Node] = set()
    for n in nodes:  # the classification split_stages makes on the joint graph
        if n.op == "get_attr" or (n.op == "call_function" and not _is_random(n)
                                  and all(a in batch or a in free for a in n.all_input_nodes)):
            free.add(n)
    body = [n for n in nodes if n.op == "call_function" and n not in free]
    out = next(n for n in reversed(nodes) if n.op == "output")
    outs = list(out.args[0])
    k = len(p.send_b)
    i_nodes, w_nodes, carry = _split_backward(body, outs[:k], outs[k:])
    if not w_nodes:
        return p
    igm = _build(gm, phs, [], [], i_nodes, outs[:k] + carry, free)
    wgm = _build(gm, phs, [], carry, w_nodes, outs[k:], free)
    return dataclasses.replace(p, backward_input=igm, backward_weight=wgm, n_carry=len(carry))


def _modules(names: list[str]) -> list[str]:
    """The blocks (or modules) holding the given parameter names, in order: ['wte', 'wpe',
    'blocks.0']. A stage's modules are read off the weights it computes gradients for (then its
    frozen ones), not off the nodes' module tags: a tied weight's lookup is tagged with the
    weight's other owner ('head' for the embedding), and values recomputed from the batch with
    the block that first computed them."""
    out: list[str] = []
    for name in names:
        module = name.rpartition(".")[0] or name
        u = _unit(module) or module
        if u not in out:
            out.append(u)
    return out


def _nbytes(n: fx.Node) -> int:
    v = n.meta.get("val")
    return v.numel() * v.element_size() if isinstance(v, torch.Tensor) else 0


def _split_backward(body: list[fx.Node], input_grads: list[fx.Node], param_grads: list[fx.Node]
                    ) -> tuple[list[fx.Node], list[fx.Node], list[fx.Node]]:
    """Zero-bubble split of one stage's backward: (I nodes, W nodes, carry).

    I = the nodes the input gradient (what the stage sends upstream) depends on; W = the rest,
    i.e. the weight-gradient matmuls and reductions, which nothing upstream waits for. `carry`
    are I's values W reads (and weight gradients that happen to be computed on I's path).

        B: dx = g @ w ; dw = g.T @ x ; db = g.sum(0)     ->   I: dx = g @ w      W: dw = g.T @ x ; db = ...
    """
    local = set(body)
    need: set[fx.Node] = set()
    stack = [n for n in input_grads if n in local]
    while stack:
        n = stack.pop()
        if n in need:
            continue
        need.add(n)
        stack.extend(a for a in n.all_input_nodes if a in local)
    for n in body:  # a tuple's getitems go with it, so no tuple crosses from I to W
        if n.target is operator.getitem and n.args[0] in need:
            need.add(n)
    i_nodes = [n for n in body if n in need]
    w_nodes = [n for n in body if n not in need]
    w_set = set(w_nodes)
    carry = [n for n in i_nodes if any(u in w_set for u in n.users) or n in param_grads]
    return i_nodes, w_nodes, carry


def _recomputed_twins(fwd_seq: list[fx.Node], bwd_seq: list[fx.Node]) -> dict[fx.Node, fx.Node]:
    """backward node -> the forward node computing the same value: the same op (not a random
    one) on the same inputs, where an input recomputed itself counts as its forward twin."""
    canon: dict[fx.Node, fx.Node] = {}

    def key(n: fx.Node) -> tuple | None:
        if _is_random(n):
            return None
        args = fx.node.map_arg((n.args, n.kwargs), lambda a: canon.get(a, a))
        try:
            k = (n.target, repr(args))  # (reprs name nodes; lists and dtypes compare by value)
            hash(k)
        except Exception:  # noqa: BLE001 - an argument without a stable repr: no twin
            return None
        return k

    forward = {k: n for n in fwd_seq if (k := key(n)) is not None}
    for n in bwd_seq:
        k = key(n)
        if k is not None and k in forward:
            canon[n] = forward[k]
    return canon


def _read_twins(gm: fx.GraphModule, twins: dict[fx.Node, fx.Node], recomputed: set[fx.Node]) -> fx.GraphModule:
    """A copy of `gm` whose readers of each backward node in `twins` read its forward twin;
    recomputations (`recomputed`) left without readers are dropped."""
    g = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    g.output(g.graph_copy(gm.graph, env))
    for n, twin in twins.items():
        env[n].replace_all_uses_with(env[twin])
    for n in reversed(list(gm.graph.nodes)):
        if n in recomputed and not env[n].users:
            g.erase_node(env[n])
    new = fx.GraphModule(gm, g)
    new.meta.update(gm.meta)
    return new


def _build(root: fx.GraphModule, state: list[fx.Node], batch: list[fx.Node], received: list[fx.Node],
           body: list[fx.Node], results: list[fx.Node], free: set[fx.Node]) -> fx.GraphModule:
    g = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for n in [*state, *batch, *received]:
        if n in env:
            continue
        ph = g.placeholder(n.name)
        ph.meta = dict(n.meta)
        env[n] = ph
    def get(a: fx.Node) -> fx.Node:
        if a in env:
            return env[a]
        if a in free:
            for inp in a.all_input_nodes:
                get(inp)
            env[a] = g.node_copy(a, lambda x: env[x])
            return env[a]
        raise PipelineSplitError(f"value {a.name!r} is needed on a stage that neither computes nor receives it; "
                                 "please report this")

    for n in body:
        env[n] = g.node_copy(n, get)
    g.output(tuple(get(r) for r in results))
    gm = fx.GraphModule(root, g)
    gm.graph.lint()
    return gm


@program_pass("split_stages", produces=("stages",))
def split_stages_pass(program: DistributedProgram, ctx: PassContext) -> ProgramResult:
    """Cut the joint graph into stage programs (forward and backward per stage)."""
    if program.stages:
        raise PipelineSplitError(f"the program is already split into {len(program.stages)} stages")
    o = ctx.options
    stages = split_stages(program.joint, program.signature, o.n_stages, split_points=o.split_points or None,
                          model_name=ctx.model_name, split_backward=False)
    return ProgramResult(dataclasses.replace(program, stages=stages), modified=True)


@program_pass("split_backward", requires=("stages", "schedule"), produces=("split_backward",))
def split_backward_pass(program: DistributedProgram, ctx: PassContext) -> ProgramResult:
    """Split B into I and W for the stages whose schedule has I or W actions (zero bubble).
    Disabled, such a stage runs B whole at I and nothing at W."""
    wanted = {a.stage for acts in program.schedule.actions for a in acts if a.kind in (I, W)}
    stages = [split_stage_backward(p) if s in wanted else p for s, p in enumerate(program.stages)]
    if all(a is b for a, b in zip(stages, program.stages)):
        return ProgramResult(program, modified=False)
    return ProgramResult(dataclasses.replace(program, stages=stages), modified=True)
