"""Plotting helpers for plans and annotated graphs (matplotlib and networkx, imported lazily).

    from fxspeed.tools import viz
    g = viz.module_graph(engine.graph(), depth=2)     # nodes collapsed to module paths
    viz.draw_graph(g, color_by="role")               # or color_by="module"
    viz.plot_timeline(plan)                          # predicted live bytes over the step
    viz.plot_placements(plan)                        # which tensor-parallel rank holds what

Nothing here is needed to train; importing fxspeed does not import matplotlib.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import torch.fx as fx

from fxspeed.ir import META_KEY

ROLE_COLORS = {"forward": "#4C72B0", "backward": "#DD8452", "io": "#8C8C8C", "mixed": "#55A868"}


def module_key(module: str, depth: int) -> str:
    """A module path cut to its first `depth` components ('' -> '(root)').

    Numbered containers keep their index, so 'blocks.3.attn.qkv' at depth 2 is 'blocks.3'.
    """
    if not module:
        return "(root)"
    return ".".join(module.split(".")[:depth])


def module_graph(gm: fx.GraphModule, depth: int = 2, roles: tuple[str, ...] = ("forward", "backward")) -> Any:
    """Collapse an annotated graph to one node per (module prefix, role).

    Returns a networkx.DiGraph whose nodes are "<module>:<role>" with attributes module, role,
    ops (node count), flops and bytes (sum of output bytes); an edge u->v means some fx node
    of u feeds some fx node of v, weighted by the number of such fx edges.
    """
    import networkx as nx

    g = nx.DiGraph()
    key_of: dict[fx.Node, str] = {}
    agg: dict[str, dict[str, Any]] = defaultdict(lambda: {"ops": 0, "flops": 0, "bytes": 0, "order": None})
    for i, n in enumerate(gm.graph.nodes):
        inf = n.meta.get(META_KEY)
        if inf is None or inf.role not in roles:
            continue
        k = f"{module_key(inf.module, depth)}:{inf.role}"
        key_of[n] = k
        a = agg[k]
        a.update(module=module_key(inf.module, depth), role=inf.role)
        a["ops"] += 1
        a["flops"] += int(inf.flops)
        a["bytes"] += int(inf.output_bytes)
        a["order"] = i if a["order"] is None else a["order"]
    for k, a in agg.items():
        g.add_node(k, **a)
    for n, k in key_of.items():
        for u in n.users:
            ku = key_of.get(u)
            if ku is not None and ku != k:
                w = g.get_edge_data(k, ku, {"weight": 0})["weight"]
                g.add_edge(k, ku, weight=w + 1)
    return g


def node_graph(gm: fx.GraphModule, module_prefix: str | None = None) -> Any:
    """The fx graph itself as a networkx.DiGraph (optionally only nodes whose module starts
    with `module_prefix`), each node carrying module, role, category, flops, bytes, op."""
    import networkx as nx

    g = nx.DiGraph()
    for i, n in enumerate(gm.graph.nodes):
        inf = n.meta.get(META_KEY)
        if inf is None or (module_prefix is not None and not inf.module.startswith(module_prefix)):
            continue
        g.add_node(n.name, module=inf.module or "(root)", role=inf.role, category=inf.category, flops=int(inf.flops),
                   bytes=int(inf.output_bytes), op=str(getattr(n.target, "__name__", n.target)), order=i)
    for n in gm.graph.nodes:
        if n.name in g:
            for u in n.users:
                if u.name in g:
                    g.add_edge(n.name, u.name)
    return g


def _layered_pos(g: Any) -> dict[Any, tuple[float, float]]:
    """Left-to-right layout by topological generation (execution order), spread vertically."""
    import networkx as nx

    pos = {}
    try:
        gens = list(nx.topological_generations(g))
    except nx.NetworkXUnfeasible:  # a cycle: fall back to execution order
        gens = [[n] for n in sorted(g, key=lambda n: g.nodes[n].get("order", 0))]
    for x, layer in enumerate(gens):
        layer = sorted(layer, key=lambda n: g.nodes[n].get("order", 0))
        for j, n in enumerate(layer):
            pos[n] = (x, j - (len(layer) - 1) / 2)
    return pos


def _fwd_bwd_pos(g: Any) -> dict[Any, tuple[float, float]]:
    """Forward vertices left to right on the top row in execution order; each backward vertex
    below its module's forward vertex (so the backward reads right to left, mirroring it)."""
    fwd = sorted((n for n in g if g.nodes[n].get("role") == "forward"), key=lambda n: g.nodes[n].get("order", 0))
    x_of = {g.nodes[n].get("module"): float(i) for i, n in enumerate(fwd)}
    pos = {n: (float(i), 1.0) for i, n in enumerate(fwd)}
    extra = len(fwd)
    for n in sorted((n for n in g if n not in pos), key=lambda n: g.nodes[n].get("order", 0)):
        x = x_of.get(g.nodes[n].get("module"))
        if x is None:
            x, extra = float(extra), extra + 1
        pos[n] = (x, 0.0)
    return pos


def draw_graph(g: Any, color_by: str = "role", ax: Any = None, labels: bool = True, layout: str = "auto",
               node_size: Any = "flops", title: str | None = None) -> Any:
    """Draw a graph from `module_graph` or `node_graph`, colored by "role" or "module".

    node_size="flops" scales nodes by their FLOPs; a number gives all nodes one size.
    Returns the matplotlib Axes.
    """
    import matplotlib.pyplot as plt
    import networkx as nx
    from matplotlib.lines import Line2D

    if color_by not in ("role", "module", "category"):
        raise ValueError(f"color_by={color_by!r}: use 'role', 'module' or 'category'")
    if ax is None:
        _, ax = plt.subplots(figsize=(14, 7))
    if layout == "auto":
        layout = "fwdbwd" if all(":" in str(n) for n in g) else "layered"
    if layout == "fwdbwd":
        pos = _fwd_bwd_pos(g)
    elif layout == "layered":
        pos = _layered_pos(g)
    elif layout == "spring":
        pos = nx.spring_layout(g, seed=0)
    else:
        raise ValueError(f"layout={layout!r}: use 'auto', 'fwdbwd' (module graphs), 'layered' or 'spring'")

    values = [g.nodes[n].get(color_by, "") for n in g]
    if color_by == "role":
        palette = ROLE_COLORS
    else:
        cmap = plt.get_cmap("tab20")
        palette = {v: cmap(i % 20) for i, v in enumerate(dict.fromkeys(values))}
    colors = [palette.get(v, "#cccccc") for v in values]
    if node_size == "flops":
        fl = [g.nodes[n].get("flops", 0) for n in g]
        top = max(fl) if fl and max(fl) > 0 else 1
        sizes = [80 + 900 * (f / top) ** 0.5 for f in fl]
    else:
        sizes = float(node_size)
    nx.draw_networkx_edges(g, pos, ax=ax, alpha=0.3, arrows=True, arrowsize=8, node_size=sizes)
    nx.draw_networkx_nodes(g, pos, ax=ax, node_color=colors, node_size=sizes, linewidths=0.5, edgecolors="k")
    if labels:
        lab = {n: (g.nodes[n].get("module", n) if ":" in str(n) else n) for n in g}
        for n, (px, py) in pos.items():
            ax.annotate(str(lab[n]), (px, py), xytext=(0, 14 if py >= 0.5 else -14), textcoords="offset points",
                        ha="center", va="center", fontsize=7, rotation=30 if layout == "fwdbwd" else 0)
    shown = list(dict.fromkeys(values))[:20]
    ax.legend(handles=[Line2D([], [], marker="o", ls="", color=palette.get(v, "#cccccc"), label=str(v)) for v in shown],
              title=color_by, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=7)
    ax.set_title(title or f"{g.number_of_nodes()} nodes, {g.number_of_edges()} edges, colored by {color_by}")
    ax.margins(0.05, 0.25)
    ax.axis("off")
    return ax


def plot_timeline(plan: Any, ax: Any = None, unit: float = 1e6, unit_name: str = "MB") -> Any:
    """Predicted bytes rank 0 holds after each node of the step, shaded by forward/backward: its
    shards, optimizer states and buffers under the plan's strategy, so the curve's peak is the
    plan's step-phase peak (`plan.phase_memory["step"]`). An extrapolated plan (a deep stack
    traced with a few blocks) or a pipeline's carries the traced graph's own bytes only
    (full-size weights, no strategy, the shorter trace): the plot says so."""
    import matplotlib.pyplot as plt

    tl = plan.timeline
    if not tl or not tl.get("bytes"):
        raise ValueError("this plan has no timeline (plans built before the memory analysis ran carry none)")
    ranked = bool(tl.get("rank_bytes"))
    ys = [b / unit for b in (tl["rank_bytes"] if ranked else tl["bytes"])]
    roles = tl.get("roles") or [""] * len(ys)
    if ax is None:
        _, ax = plt.subplots(figsize=(12, 4))
    ax.plot(range(len(ys)), ys, color="k", lw=1)
    start = 0
    for i in range(1, len(roles) + 1):  # shade runs of one role
        if i == len(roles) or roles[i] != roles[start]:
            if roles[start] in ("forward", "backward"):
                ax.axvspan(start, i, color=ROLE_COLORS[roles[start]], alpha=0.15, lw=0)
            start = i
    peak = max(range(len(ys)), key=ys.__getitem__)
    ax.annotate(f"peak {ys[peak]:,.1f} {unit_name}\n{tl['names'][peak]}", (peak, ys[peak]), xytext=(25, -35),
                textcoords="offset points", fontsize=8, arrowprops={"arrowstyle": "->"})
    handles = []
    if ranked and plan.peak_phase and plan.peak_phase[0] == "optimizer":
        opt = plan.peak_memory(0) / unit  # the optimizer step after the graph peaks higher
        handles.append(ax.axhline(opt, color="r", ls="--", lw=1, label=f"optimizer phase {opt:,.1f} {unit_name}"))
    from matplotlib.patches import Patch

    handles += [Patch(color=ROLE_COLORS[r], alpha=0.3, label=r) for r in ("forward", "backward")]
    ax.legend(handles=handles, loc="upper left")
    ax.set_xlabel("node (execution order)")
    if ranked:
        ax.set_ylabel(f"rank 0 {unit_name}")
        ax.set_title(f"{plan.model}: predicted memory of rank 0 over one training step")
    else:
        ax.set_ylabel(f"live {unit_name} in the traced graph")
        ax.set_title(f"{plan.model}: live bytes of the traced graph (full-size weights, before the strategy; "
                     "an extrapolated plan's shorter trace)", fontsize=9)
    return ax


def plot_memory_breakdown(plan: Any, rank: int = 0, ax: Any = None, unit: float = 1e9, unit_name: str = "GB") -> Any:
    """Horizontal bar of the predicted peak's breakdown by category, with the device's memory."""
    import matplotlib.pyplot as plt

    mem = plan.memory(rank)
    cats = [c for c in mem if c != "total" and mem[c]]
    if ax is None:
        _, ax = plt.subplots(figsize=(10, 1.8))
    cmap = plt.get_cmap("tab10")
    left = 0.0
    for i, c in enumerate(cats):
        w = mem[c] / unit
        ax.barh(0, w, left=left, color=cmap(i), label=f"{c} {w:,.2f}")
        left += w
    cap = plan.devices[rank]["memory"] / unit
    ax.axvline(cap, color="r", ls="--", label=f"device {cap:,.0f}")
    ax.set_yticks([])
    ax.set_xlabel(unit_name)
    ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=7)
    ax.set_title(f"{plan.model}: rank {rank} predicted peak {mem['total'] / unit:,.2f} {unit_name}")
    return ax


_PLACEMENT_COLORS = {"R": "#C8C8C8", "S(0)": "#4C72B0", "S(1)": "#DD8452"}


def plot_placements(plan: Any, ax: Any = None, collapse_blocks: bool = True, max_rows: int = 40) -> Any:
    """Which tensor-parallel rank holds what: one row per parameter, one column per tp rank.
    A grey cell is a whole copy (R); a coloured cell is the rank's slice, labelled with the dim
    it is cut on and which piece it is ("dim 0, 2/4"; a fused QKV cut in blocks: "dim 0, 2/4 of
    each of 3"). Repeated blocks are shown once ("blocks.#.mlp.fc.weight") when `collapse_blocks`."""
    import re

    import matplotlib.pyplot as plt

    from fxspeed.planner.placement import collapse_blocks as collapse

    T = int(plan.strategy.get("tp", 1))
    if not plan.tp_placements or T < 2:
        raise ValueError("plot_placements: the plan has no tensor-parallel placements; plan or compile with "
                         "Config(tensor=T), T > 1")
    rows = collapse(plan.tp_placements) if collapse_blocks else dict(plan.tp_placements)
    names = list(rows)[:max_rows]
    if ax is None:
        _, ax = plt.subplots(figsize=(2.2 + 1.6 * T, 0.32 * len(names) + 1.0))
    for i, name in enumerate(names):
        p = rows[name]
        m = re.match(r"S\((\d+)(?:,blocks=(\d+))?(?:,rep=(\d+))?\)", p)
        for r in range(T):
            if m is None:
                color, text = _PLACEMENT_COLORS["R"], "whole"
            else:
                dim, blocks, rep = int(m.group(1)), int(m.group(2) or 1), int(m.group(3) or 1)
                color = _PLACEMENT_COLORS.get(f"S({dim})", "#55A868")
                # rep > 1: T/rep pieces, each held by rep consecutive ranks (GQA's shared key/value heads)
                text = f"dim {dim}, {r // rep + 1}/{T // rep}" + (f" of each of {blocks}" if blocks > 1 else "")
            ax.add_patch(plt.Rectangle((r, i), 0.96, 0.9, color=color))
            ax.text(r + 0.48, i + 0.45, text, ha="center", va="center", fontsize=6)
    ax.set_xlim(0, T)
    ax.set_ylim(len(names), 0)
    ax.set_xticks([r + 0.48 for r in range(T)])
    ax.set_xticklabels([f"tp rank {r}" for r in range(T)], fontsize=8)
    ax.set_yticks([i + 0.45 for i in range(len(names))])
    ax.set_yticklabels(names, fontsize=7)
    more = f" (first {max_rows} of {len(rows)})" if len(rows) > max_rows else ""
    ax.set_title(f"{plan.model}: what each tensor-parallel rank holds{more}", fontsize=9)
    return ax
