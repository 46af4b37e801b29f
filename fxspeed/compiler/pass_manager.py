"""Pass manager: runs graph passes in order, checks their contracts, verifies after each.

A pass is a function `(GraphModule, PassContext) -> PassResult` wrapped by `graph_pass`, which
declares the analyses it `requires` (run on demand when stale), `produces`, and `invalidates`.
After every pass the manager lints the graph and checks that its inputs and outputs still
match the step signature; it records seconds and node counts per pass in the plan. Config's
`disable_passes` turns a pass off by name.
"""

from __future__ import annotations

import operator
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch.fx as fx

from fxspeed.errors import ConfigError, PassError
from fxspeed.ir import StepSignature


@dataclass
class PassContext:
    """What passes may read besides the graph. No pass reads global configuration."""

    signature: StepSignature
    options: dict[str, Any] = field(default_factory=dict)
    module_of: dict[str, str] = field(default_factory=dict)
    valid: set[str] = field(default_factory=set)  # analyses whose results in node.meta are current


@dataclass
class PassResult:
    gm: fx.GraphModule
    modified: bool


@dataclass
class PassRecord:
    name: str
    seconds: float
    nodes_before: int
    nodes_after: int
    modified: bool
    skipped: bool = False

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


@dataclass(frozen=True)
class GraphPass:
    name: str
    fn: Callable[[fx.GraphModule, PassContext], PassResult]
    requires: tuple[str, ...] = ()
    produces: tuple[str, ...] = ()
    invalidates: tuple[str, ...] = ()
    is_analysis: bool = False

    def __call__(self, gm: fx.GraphModule, ctx: PassContext) -> PassResult:
        return self.fn(gm, ctx)


def graph_pass(name: str, *, requires: Sequence[str] = (), produces: Sequence[str] = (),
               invalidates: Sequence[str] = (), is_analysis: bool = False) -> Callable[..., GraphPass]:
    """Decorator that turns `fn(gm, ctx) -> PassResult` into a declared GraphPass."""

    def wrap(fn: Callable[[fx.GraphModule, PassContext], PassResult]) -> GraphPass:
        return GraphPass(name, fn, tuple(requires), tuple(produces), tuple(invalidates), is_analysis)

    return wrap


class PassManager:
    def __init__(self, passes: Sequence[GraphPass], analyses: Sequence[GraphPass] = (),
                 disabled: Sequence[str] = (), known: Sequence[str] | None = None):
        """`known`: every pass name `disabled` may mention (default: these passes), for a
        pipeline split across several managers."""
        self.passes = list(passes)
        self.analyses = {a.name: a for a in analyses}
        known = set(known) if known is not None else {p.name for p in self.passes}
        unknown = sorted(set(disabled) - known)
        if unknown:
            raise ConfigError(f"Config.disable_passes names unknown pass(es) {unknown}; the passes that can be "
                              f"disabled are {sorted(known)}")
        self.disabled = set(disabled)
        self.records: list[PassRecord] = []

    def run(self, gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
        done: list[str] = []
        for p in self.passes:
            n0 = len(gm.graph.nodes)
            if p.name in self.disabled:
                self.records.append(PassRecord(p.name, 0.0, n0, n0, False, skipped=True))
                continue
            for req in p.requires:
                if req not in ctx.valid:
                    gm = self._run_one(self.analyses[req], gm, ctx, done) if req in self.analyses else self._missing(p, req, done)
            gm = self._run_one(p, gm, ctx, done)
        return gm

    def ensure(self, name: str, gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
        """Run analysis `name` unless its results are current."""
        if name not in ctx.valid:
            if name not in self.analyses:
                raise PassError(f"no analysis named {name!r} is registered; analyses are {sorted(self.analyses)}")
            gm = self._run_one(self.analyses[name], gm, ctx, [r.name for r in self.records if not r.skipped])
        return gm

    def _missing(self, p: GraphPass, req: str, done: list[str]) -> fx.GraphModule:
        disabled = [q.name for q in self.passes if q.name in self.disabled and req in q.produces]
        why = f"; it is produced by disabled pass(es) {disabled}" if disabled else ""
        raise PassError(f"pass {p.name!r} requires {req!r}, which no registered analysis provides and no earlier "
                        f"pass produced or left valid (ran: {done or 'none'}){why}")

    def _run_one(self, p: GraphPass, gm: fx.GraphModule, ctx: PassContext, done: list[str]) -> fx.GraphModule:
        n0 = len(gm.graph.nodes)
        t0 = time.perf_counter()
        try:
            res = p(gm, ctx)
        except PassError:
            raise
        except Exception as e:
            raise PassError(f"pass {p.name!r} failed after {done or 'no other passes'}: {type(e).__name__}: {e}") from e
        gm = res.gm
        if res.modified:
            gm.recompile()
        try:
            verify(gm, ctx.signature)
        except Exception as e:
            raise PassError(f"pass {p.name!r} (after {done or 'no other passes'}) left an invalid graph: {e}") from e
        for a in p.invalidates if res.modified else ():
            ctx.valid.discard(a)
        ctx.valid.update(p.produces)
        if p.is_analysis:
            ctx.valid.add(p.name)
        self.records.append(PassRecord(p.name, time.perf_counter() - t0, n0, len(gm.graph.nodes), res.modified))
        done.append(p.name)
        return gm


def verify(gm: fx.GraphModule, signature: StepSignature) -> None:
    """Graph invariants every pass must keep: fx lint, I/O matches the signature, values typed."""
    gm.graph.lint()
    phs = [n for n in gm.graph.nodes if n.op == "placeholder"]
    if len(phs) != len(signature.inputs):
        raise AssertionError(f"{len(phs)} graph inputs but the signature describes {len(signature.inputs)}")
    out = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    outs = out.args[0]
    if len(outs) != len(signature.outputs):
        raise AssertionError(f"{len(outs)} graph outputs but the signature describes {len(signature.outputs)}")
    for n in gm.graph.nodes:
        if n.op == "call_function" and "val" not in n.meta and not _is_none_item(n):
            raise AssertionError(f"node {n.name!r} ({n.target}) has no meta['val']; passes must set it on new nodes")


def _is_none_item(n: fx.Node) -> bool:
    """`getitem(t, i)` where element i of t is None (e.g. an input gradient that
    native_layer_norm_backward does not compute): AOT export leaves such nodes untyped, and
    there is no value to type."""
    if n.target is not operator.getitem or not isinstance(n.args[0], fx.Node):
        return False
    src = n.args[0].meta.get("val")
    i = n.args[1]
    return isinstance(src, (list, tuple)) and isinstance(i, int) and -len(src) <= i < len(src) and src[i] is None
