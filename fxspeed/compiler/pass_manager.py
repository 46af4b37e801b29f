"""Pass manager: runs passes in order, checks their contracts, verifies after each.

Two kinds of pass share one manager and one set of rules:

    GraphPass    (GraphModule, PassContext) -> PassResult      rewrites the step graph
    ProgramPass  (DistributedProgram, PassContext) -> ProgramResult
                 maps a distributed program (the joint graph of one micro-batch, then its
                 stage programs and schedule) to a new one: stage splitting, the I/W split,
                 schedule lowering, gradient accumulation into buffers

A pass is declared with `graph_pass` / `program_pass`: the analyses or facts it `requires`
(registered analyses run on demand when stale; anything else must have been produced by an
earlier pass), those it `produces`, and those it `invalidates`. After every pass the manager
verifies the result (`verify` for a graph: fx lint, inputs and outputs matching the step
signature, values typed; `verify_program` for a program: every stage program linted and laid
out as its StageProgram declares, messages agreeing between neighbours, the schedule valid),
and records seconds and node counts (PassRecord). Config's `disable_passes` turns any pass off
by name; a skipped pass is recorded as skipped. Errors name the pass and the passes run before it.
"""

from __future__ import annotations

import operator
import time
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, Iterator, Sequence

import torch
import torch.fx as fx

from fxspeed.compiler.options import PassOptions
from fxspeed.errors import ConfigError, PassError
from fxspeed.ir import StepSignature
from fxspeed.ir.program import StageProgram, TensorMeta
from fxspeed.ir.schedule import Schedule


@dataclass
class PassContext:
    """What passes may read besides the graph. No pass reads global configuration.

    `options` may be given as a mapping of PassOptions field names (converted here)."""

    signature: StepSignature
    options: PassOptions = field(default_factory=PassOptions)
    module_of: dict[str, str] = field(default_factory=dict)
    valid: set[str] = field(default_factory=set)  # analyses whose results in node.meta are current
    model_name: str = "the model"  # for messages

    def __post_init__(self) -> None:
        if not isinstance(self.options, PassOptions):
            self.options = PassOptions.coerce(self.options)


@dataclass
class PassResult:
    gm: fx.GraphModule
    modified: bool


@dataclass
class DistributedProgram:
    """What program passes map: the joint graph of one micro-batch with its signature and,
    once passes made them, the stage programs (StageProgram per stage) and the schedule."""

    joint: fx.GraphModule
    signature: StepSignature
    stages: list[StageProgram] = field(default_factory=list)
    schedule: Schedule | None = None

    def graphs(self) -> Iterator[tuple[str, fx.GraphModule]]:
        """(description, GraphModule) of every stage program, or of the joint graph before the split."""
        if not self.stages:
            yield "the joint graph", self.joint
        for p in self.stages:
            for kind in ("forward", "backward", "backward_input", "backward_weight"):
                gm = getattr(p, kind)
                if gm is not None:
                    yield f"stage {p.stage} {kind}", gm

    def node_count(self) -> int:
        return sum(len(gm.graph.nodes) for _, gm in self.graphs())


@dataclass
class ProgramResult:
    program: DistributedProgram
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
class Pass:
    """A declared pass; see GraphPass and ProgramPass for what it maps."""

    name: str
    fn: Callable[[Any, PassContext], Any]
    requires: tuple[str, ...] = ()
    produces: tuple[str, ...] = ()
    invalidates: tuple[str, ...] = ()
    is_analysis: bool = False
    what: ClassVar[str] = "graph"  # what it maps, for messages

    def __call__(self, ir: Any, ctx: PassContext) -> Any:
        return self.fn(ir, ctx)

    def size(self, ir: Any) -> int:
        raise NotImplementedError

    def unwrap(self, res: Any) -> tuple[Any, bool]:
        """(the new IR, modified) from what the pass function returned."""
        raise NotImplementedError

    def verify(self, ir: Any, ctx: PassContext) -> None:
        raise NotImplementedError


@dataclass(frozen=True)
class GraphPass(Pass):
    fn: Callable[[fx.GraphModule, PassContext], PassResult]

    def size(self, gm: fx.GraphModule) -> int:
        return len(gm.graph.nodes)

    def unwrap(self, res: PassResult) -> tuple[fx.GraphModule, bool]:
        if not isinstance(res, PassResult):
            raise TypeError(f"a graph pass returns a PassResult, not {type(res).__name__}")
        if res.modified:
            res.gm.recompile()
        return res.gm, res.modified

    def verify(self, gm: fx.GraphModule, ctx: PassContext) -> None:
        verify(gm, ctx.signature)


@dataclass(frozen=True)
class ProgramPass(Pass):
    fn: Callable[[DistributedProgram, PassContext], ProgramResult]
    what: ClassVar[str] = "program"

    def size(self, program: DistributedProgram) -> int:
        return program.node_count()

    def unwrap(self, res: ProgramResult) -> tuple[DistributedProgram, bool]:
        if not isinstance(res, ProgramResult):
            raise TypeError(f"a program pass returns a ProgramResult, not {type(res).__name__}")
        return res.program, res.modified

    def verify(self, program: DistributedProgram, ctx: PassContext) -> None:
        verify_program(program)


def graph_pass(name: str, *, requires: Sequence[str] = (), produces: Sequence[str] = (),
               invalidates: Sequence[str] = (), is_analysis: bool = False) -> Callable[..., GraphPass]:
    """Decorator that turns `fn(gm, ctx) -> PassResult` into a declared GraphPass."""

    def wrap(fn: Callable[[fx.GraphModule, PassContext], PassResult]) -> GraphPass:
        return GraphPass(name, fn, tuple(requires), tuple(produces), tuple(invalidates), is_analysis)

    return wrap


def program_pass(name: str, *, requires: Sequence[str] = (), produces: Sequence[str] = (),
                 invalidates: Sequence[str] = ()) -> Callable[..., ProgramPass]:
    """Decorator that turns `fn(program, ctx) -> ProgramResult` into a declared ProgramPass."""

    def wrap(fn: Callable[[DistributedProgram, PassContext], ProgramResult]) -> ProgramPass:
        return ProgramPass(name, fn, tuple(requires), tuple(produces), tuple(invalidates))

    return wrap


class PassManager:
    """Runs passes of one kind (all GraphPass or all ProgramPass) over one IR."""

    def __init__(self, passes: Sequence[Pass], analyses: Sequence[Pass] = (),
                 disabled: Sequence[str] = (), known: Sequence[str] | None = None):
        """`known`: every pass name `disabled` may mention (default: these passes), for a
        pipeline split across several managers."""
        self.passes = list(passes)
        self.analyses = {a.name: a for a in analyses}
        kinds = {type(p) for p in [*self.passes, *self.analyses.values()]}
        if len(kinds) > 1:
            raise TypeError(f"one PassManager runs passes of one kind; got {sorted(k.__name__ for k in kinds)}")
        known = set(known) if known is not None else {p.name for p in self.passes}
        unknown = sorted(set(disabled) - known)
        if unknown:
            raise ConfigError(f"Config.disable_passes names unknown pass(es) {unknown}; the passes that can be "
                              f"disabled are {sorted(known)}")
        self.disabled = set(disabled)
        self.records: list[PassRecord] = []

    def run(self, ir: Any, ctx: PassContext) -> Any:
        """Run every pass over `ir` (a GraphModule or a DistributedProgram); returns the result."""
        done: list[str] = []
        for p in self.passes:
            if p.name in self.disabled:
                n0 = p.size(ir)
                self.records.append(PassRecord(p.name, 0.0, n0, n0, False, skipped=True))
                continue
            for req in p.requires:
                if req not in ctx.valid:
                    ir = self._run_one(self.analyses[req], ir, ctx, done) if req in self.analyses else self._missing(p, req, done)
            ir = self._run_one(p, ir, ctx, done)
        return ir

    def ensure(self, name: str, ir: Any, ctx: PassContext) -> Any:
        """Run analysis `name` unless its results are current."""
        if name not in ctx.valid:
            if name not in self.analyses:
                raise PassError(f"no analysis named {name!r} is registered; analyses are {sorted(self.analyses)}")
            ir = self._run_one(self.analyses[name], ir, ctx, [r.name for r in self.records if not r.skipped])
        return ir

    def _missing(self, p: Pass, req: str, done: list[str]) -> Any:
        disabled = [q.name for q in self.passes if q.name in self.disabled and req in q.produces]
        why = f"; it is produced by disabled pass(es) {disabled}" if disabled else ""
        raise PassError(f"pass {p.name!r} requires {req!r}, which no registered analysis provides and no earlier "
                        f"pass produced or left valid (ran: {done or 'none'}){why}")

    def _run_one(self, p: Pass, ir: Any, ctx: PassContext, done: list[str]) -> Any:
        n0 = p.size(ir)
        t0 = time.perf_counter()
        try:
            ir, modified = p.unwrap(p(ir, ctx))
        except PassError:
            raise
        except ConfigError as e:
            # The user's settings (Config.split_points, pipeline, schedule, microbatches) do not fit
            # the model: a ConfigError naming the key and the fix, as the same checks raise before
            # compile, not a PassError that reads as an internal failure (and escapes `except
            # ConfigError`). The pass is named after the user's message.
            raise ConfigError(f"{e} (found by pass {p.name!r})") from e
        except Exception as e:
            raise PassError(f"pass {p.name!r} failed after {done or 'no other passes'}: {type(e).__name__}: {e}") from e
        try:
            p.verify(ir, ctx)
        except Exception as e:
            raise PassError(f"pass {p.name!r} (after {done or 'no other passes'}) left an invalid {p.what}: {e}") from e
        for a in p.invalidates if modified else ():
            ctx.valid.discard(a)
        ctx.valid.update(p.produces)
        if p.is_analysis:
            ctx.valid.add(p.name)
        self.records.append(PassRecord(p.name, time.perf_counter() - t0, n0, p.size(ir), modified))
        done.append(p.name)
        return ir


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
    _check_typed(gm, "")


def verify_program(program: DistributedProgram) -> None:
    """Program invariants every program pass must keep.

    Before the split, the joint graph lints. After it, for every stage s (inputs in order; see
    StageProgram):

        forward          state, batch, recv_f                         -> send_f, saved, (loss)
        backward         state, batch, saved, recv_b, (beta, buffers) -> send_b, grads
        backward_input   state, batch, saved, recv_b                  -> send_b, carry
        backward_weight  state, batch, saved, recv_b, carry, (beta, buffers) -> grads

    where (beta, buffers) are there when the stage accumulates gradients into buffers
    (`grads_into`). Every program lints and has typed values; message tensors match their
    declared shapes and dtypes; what stage s sends is what stage s + 1 receives and back; the
    schedule (when made) validates and covers the stages."""
    if not program.stages:
        program.joint.graph.lint()
    n = len(program.stages)
    for s, p in enumerate(program.stages):
        if p.stage != s or p.n_stages != n:
            raise AssertionError(f"stage program {s} says it is stage {p.stage} of {p.n_stages}; the program has {n}")
        if (p.backward_input is None) != (p.backward_weight is None):
            raise AssertionError(f"stage {s} has {'no ' if p.backward_input is None else ''}backward_input but "
                                 f"{'no ' if p.backward_weight is None else ''}backward_weight; both or neither")
        if len(p.grads_into) != len(p.grads_into_meta):
            raise AssertionError(f"stage {s}: {len(p.grads_into)} gradients accumulated into buffers but "
                                 f"{len(p.grads_into_meta)} buffer metas")
        if p.has_loss != (s == n - 1):
            raise AssertionError(f"stage {s} has_loss={p.has_loss}; only the last stage returns the loss")
        lead = len(p.state) + p.n_batch
        into = 1 + len(p.grads_into) if p.grads_into else 0
        _check_stage_graph(p.forward, f"stage {s} forward", lead, p.recv_f, 0, p.send_f,
                           len(p.send_f) + p.n_saved + int(p.has_loss) + len(p.buffer_updates))
        _check_stage_graph(p.backward, f"stage {s} backward", lead + p.n_saved, p.recv_b, into, p.send_b,
                           len(p.send_b) + len(p.grads))
        if p.backward_input is not None:
            _check_stage_graph(p.backward_input, f"stage {s} backward_input", lead + p.n_saved, p.recv_b, 0,
                               p.send_b, len(p.send_b) + p.n_carry)
            _check_stage_graph(p.backward_weight, f"stage {s} backward_weight", lead + p.n_saved, p.recv_b,
                               p.n_carry + into, [], len(p.grads))
    for s in range(n - 1):
        a, b = program.stages[s], program.stages[s + 1]
        if list(a.send_f) != list(b.recv_f):
            raise AssertionError(f"stage {s} sends {_shapes(a.send_f)} forward but stage {s + 1} receives "
                                 f"{_shapes(b.recv_f)}")
        if list(b.send_b) != list(a.recv_b):
            raise AssertionError(f"stage {s + 1} sends {_shapes(b.send_b)} backward but stage {s} receives "
                                 f"{_shapes(a.recv_b)}")
    if program.stages and (program.stages[0].recv_f or program.stages[-1].send_f or program.stages[0].send_b
                           or program.stages[-1].recv_b):
        raise AssertionError("the first stage receives nothing forward and sends nothing backward, the last the "
                             "reverse; found messages past the ends of the pipeline")
    if program.schedule is not None:
        from fxspeed.ir.schedule import validate

        validate(program.schedule)
        if program.stages and program.schedule.n_stages != n:
            raise AssertionError(f"the schedule {program.schedule.name!r} runs {program.schedule.n_stages} stages but "
                                 f"the program has {n}")


def _check_stage_graph(gm: fx.GraphModule, where: str, lead: int, recv: Sequence[TensorMeta], after: int,
                       send: Sequence[TensorMeta], n_out: int) -> None:
    """`gm` lints, takes `lead` inputs, then one per `recv` message (matching it), then `after`
    more, and returns `n_out` values of which the first are the `send` messages."""
    try:
        gm.graph.lint()
    except Exception as e:
        raise AssertionError(f"{where}: {e}") from e
    phs = [n for n in gm.graph.nodes if n.op == "placeholder"]
    want = lead + len(recv) + after
    if len(phs) != want:
        raise AssertionError(f"{where} takes {len(phs)} inputs but its layout says {want} "
                             f"({lead} state/batch/saved, {len(recv)} received, {after} more)")
    out = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    outs = list(out.args[0]) if isinstance(out.args[0], (tuple, list)) else [out.args[0]]
    if len(outs) != n_out:
        raise AssertionError(f"{where} returns {len(outs)} values but its layout says {n_out}")
    for kind, nodes, metas in (("received", phs[lead:lead + len(recv)], recv), ("sent", outs[:len(send)], send)):
        for i, (node, meta) in enumerate(zip(nodes, metas)):
            v = node.meta.get("val") if isinstance(node, fx.Node) else None
            if isinstance(v, torch.Tensor) and (tuple(v.shape) != tuple(meta.shape) or v.dtype != meta.dtype):
                raise AssertionError(f"{where}: {kind} message {i} is {tuple(v.shape)} {v.dtype} but declared "
                                     f"{tuple(meta.shape)} {meta.dtype}")
    _check_typed(gm, f"{where}: ")


def _shapes(metas: Sequence[TensorMeta]) -> list[tuple[int, ...]]:
    return [tuple(m.shape) for m in metas]


def _check_typed(gm: fx.GraphModule, where: str) -> None:
    for n in gm.graph.nodes:
        if n.op == "call_function" and "val" not in n.meta and not _is_none_item(n):
            raise AssertionError(f"{where}node {n.name!r} ({n.target}) has no meta['val']; passes must set it on "
                                 "new nodes")


def _is_none_item(n: fx.Node) -> bool:
    """`getitem(t, i)` where element i of t is None (e.g. an input gradient that
    native_layer_norm_backward does not compute): AOT export leaves such nodes untyped, and
    there is no value to type."""
    if n.target is not operator.getitem or not isinstance(n.args[0], fx.Node):
        return False
    src = n.args[0].meta.get("val")
    i = n.args[1]
    return isinstance(src, (list, tuple)) and isinstance(i, int) and -len(src) <= i < len(src) and src[i] is None
