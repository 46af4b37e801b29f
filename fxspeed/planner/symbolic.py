"""Symbolic plans: memory, FLOPs and time as exact polynomials of the input dims marked dynamic.

    plan = fxspeed.plan(model, ..., example_inputs={"input_ids": ids, "labels": ids},
                        dynamic={"input_ids": {0: "batch", 1: "seq"}, "labels": {0: "batch", 1: "seq"}})
    plan.expr("peak_memory")          # Max(step phase, optimizer phase), each a polynomial
    plan.max_size("batch", 80e9)      # the largest batch that fits

How: the step is traced again at a few sizes of the marked dims (a tensor-product grid, the
same symbol giving the same size in every tensor it marks) and each quantity is interpolated
exactly, in rational arithmetic, by a polynomial of degree <= 1 in batch-like dims and <= 2 in
the others (monomials such as batch*seq**2). A grid of (degree + 1) values per dim determines
such a polynomial uniquely. One more trace, at a point off the grid, checks the fit; its error
goes to plan.notes. Memory is fitted per phase (the peak is the larger of the two phases, a
maximum no polynomial can express) and per category within each phase.
why: docs/decisions/symbolic-dims-by-fitting.md
"""

from __future__ import annotations

import itertools
import math
from fractions import Fraction
from typing import Any, Sequence

import sympy
import torch
import torch.nn as nn

from fxspeed.config import Config
from fxspeed.errors import ConfigError, FxspeedError
from fxspeed.devices import DeviceSpec
from fxspeed.ir import CATEGORIES
from fxspeed.planner.plan import Plan

BATCH_NAMES = ("b", "bs", "bsz", "n_batch")


def is_batch_like(name: str) -> bool:
    """Batch dims scale everything linearly; other dims (sequence, image size) may enter squared."""
    n = name.lower()
    return n.startswith("batch") or n in BATCH_NAMES


def degree_of(name: str) -> int:
    return 1 if is_batch_like(name) else 2


def sample_values(example: int, count: int) -> list[int]:
    """`count` distinct sizes starting with `example`, preferring smaller ones (a bounded dim,
    such as a sequence under a model's maximum length, stays valid), then larger ones. Size 1
    only if the example has it: torch special-cases it (a batch of one needs no `clone` to be
    contiguous), so its graph differs from the others'."""
    candidates = [example, round(example / 2), round(example / 4), round(3 * example / 4), round(example / 8),
                  *(example + i for i in range(1, count + 2))]
    out: list[int] = []
    for c in candidates:
        if (c >= 2 or c == example) and c not in out:
            out.append(int(c))
        if len(out) == count:
            break
    return out


def quantities(plan: Plan) -> dict[str, sympy.Rational | float]:
    """The numbers of a concrete plan that the symbolic plan fits (memory and FLOPs are ints)."""
    q: dict[str, Any] = {}
    for phase, mem in plan.phase_memory.items():
        q[f"memory.{phase}"] = sum(int(v) for v in mem.values())
        for c in CATEGORIES:
            q[f"memory.{phase}.{c}"] = int(mem.get(c, 0))
    for k in ("forward", "backward", "total"):
        q["flops" if k == "total" else f"flops.{k}"] = int(plan.flops[k])
    for k in ("forward", "backward", "optimizer", "communication", "total"):
        q["time" if k == "total" else f"time.{k}"] = float(plan.time[k])
    return q


def _exact(v: Any) -> sympy.Rational:
    return sympy.Integer(v) if isinstance(v, int) else sympy.Rational(repr(float(v)))


def fit_polynomial(symbols: Sequence[sympy.Symbol], degrees: Sequence[int], points: Sequence[Sequence[int]],
                   values: Sequence[Any]) -> sympy.Expr:
    """The polynomial with per-symbol `degrees` through `values` at `points` (exact: rational
    linear algebra over the monomials prod(s_i ** e_i), e_i <= degrees[i])."""
    monomials = [sympy.Mul(*(s ** e for s, e in zip(symbols, exps)))
                 for exps in itertools.product(*(range(d + 1) for d in degrees))]
    if len(points) != len(monomials):
        raise ValueError(f"{len(monomials)} monomials need as many points, got {len(points)}")
    a = sympy.Matrix([[m.subs(dict(zip(symbols, p))) for m in monomials] for p in points])
    b = sympy.Matrix([_exact(v) for v in values])
    coeffs = a.LUsolve(b)
    return sympy.expand(sum(c * m for c, m in zip(coeffs, monomials)))


def check_dynamic(args: tuple, kwargs: dict, dynamic: dict[str | int, dict[int, str]]) -> dict[str, int]:
    """symbol -> its size in the example batch; checks every mark."""
    sizes: dict[str, int] = {}
    for key, dims in dynamic.items():
        if isinstance(key, int) and not isinstance(key, bool):
            if not 0 <= key < len(args):
                raise ConfigError(f"dynamic: positional input {key} does not exist; the example has {len(args)} "
                                  "positional inputs")
            t = args[key]
        elif isinstance(key, str):
            if key not in kwargs:
                raise ConfigError(f"dynamic: keyword input {key!r} is not in example_inputs (keys: {sorted(kwargs)})")
            t = kwargs[key]
        else:
            raise ConfigError(f"dynamic: key {key!r} must be a keyword name (str) or a positional index (int)")
        if not isinstance(t, torch.Tensor):
            raise ConfigError(f"dynamic: input {key!r} is a {type(t).__name__}, not a tensor")
        for dim, name in dims.items():
            if not isinstance(dim, int) or not -t.dim() <= dim < t.dim():
                raise ConfigError(f"dynamic: input {key!r} has {t.dim()} dims; dim {dim!r} does not exist")
            if not isinstance(name, str) or not name.isidentifier():
                raise ConfigError(f"dynamic: symbol {name!r} for input {key!r} dim {dim} must be an identifier")
            size = int(t.shape[dim])
            if sizes.setdefault(name, size) != size:
                raise ConfigError(f"dynamic: symbol {name!r} marks dims of different sizes ({sizes[name]} and "
                                  f"{size} in input {key!r} dim {dim}); one symbol is one size")
    return sizes


def _with_same_shaped(args: tuple, kwargs: dict, dynamic: dict[str | int, dict[int, str]]
                      ) -> tuple[dict[str | int, dict[int, str]], list[str | int]]:
    """Give an unmarked tensor input the marks of a marked one of exactly the same shape (the
    usual case: labels shaped like input_ids), so a resized batch stays consistent."""
    keyed: list[tuple[str | int, Any]] = [*enumerate(args), *kwargs.items()]
    shape_of = {k: tuple(t.shape) for k, t in keyed if isinstance(t, torch.Tensor)}
    out, added = dict(dynamic), []
    for k, shape in shape_of.items():
        if k in dynamic:
            continue
        for mk, marks in dynamic.items():
            if shape_of.get(mk) == shape:
                out[k] = dict(marks)
                added.append(k)
                break
    return out, added


def resized_inputs(args: tuple, kwargs: dict, dynamic: dict[str | int, dict[int, str]],
                   sizes: dict[str, int]) -> tuple[tuple, dict]:
    """The example batch with every marked dim set to its symbol's size in `sizes` (new tensors
    of zeros, same dtype and device; zeros are valid token ids and labels)."""
    a, kw = list(args), dict(kwargs)
    for key, dims in dynamic.items():
        t = a[key] if isinstance(key, int) else kw[key]
        shape = list(t.shape)
        for dim, name in dims.items():
            shape[dim] = sizes[name]
        new = torch.zeros(shape, dtype=t.dtype, device=t.device)
        if isinstance(key, int):
            a[key] = new
        else:
            kw[key] = new
    return tuple(a), kw


def _inverse_vandermonde(symbols: Sequence[sympy.Symbol], degrees: Sequence[int],
                         points: Sequence[Sequence[int]]) -> tuple[list[sympy.Expr], list[list[Fraction]]]:
    monomials = [sympy.Mul(*(s ** e for s, e in zip(symbols, exps)))
                 for exps in itertools.product(*(range(d + 1) for d in degrees))]
    a = sympy.Matrix([[m.subs(dict(zip(symbols, p))) for m in monomials] for p in points])
    inv = a.inv()
    return monomials, [[Fraction(int(sympy.fraction(x)[0]), int(sympy.fraction(x)[1])) for x in row]
                       for row in inv.tolist()]


def peak_of_nodes(symbols: Sequence[sympy.Symbol], degrees: Sequence[int], points: Sequence[Sequence[int]],
                  series: Sequence[Sequence[float]], around: Sequence[int]) -> sympy.Expr:
    """The step phase's peak as Max over nodes of each node's live bytes, a polynomial per node.

    Every node's live bytes is a sum of tensor sizes, each a monomial of the dims, so it is an
    exact polynomial even where the peak moves from node to node as sizes change (which a
    single polynomial through the peaks would miss). Only nodes that hold the maximum
    somewhere on a wide range of sizes (1 to 4096x the example) are kept in the Max."""
    monomials, inv = _inverse_vandermonde(symbols, degrees, points)
    n_nodes = len(series[0])
    coeffs: dict[tuple[Fraction, ...], None] = {}
    for i in range(n_nodes):
        vals = [Fraction(int(round(s[i]))) for s in series]
        coeffs[tuple(sum(r * v for r, v in zip(row, vals)) for row in inv)] = None
    polys = list(coeffs)
    # Which node wins where: evaluate all on a log grid of sizes around the example.
    axes = [sorted({max(1, int(round(v * 2.0 ** k))) for k in range(-6, 13)}) for v in around]
    exps = list(itertools.product(*(range(d + 1) for d in degrees)))
    winners: set[int] = set()
    for pt in itertools.product(*axes):
        mono = [float(math.prod(x ** e for x, e in zip(pt, ex))) for ex in exps]
        best = max(range(len(polys)), key=lambda j: sum(float(c) * m for c, m in zip(polys[j], mono)))
        winners.add(best)
    terms = [sympy.expand(sum(sympy.Rational(c.numerator, c.denominator) * m for c, m in zip(polys[j], monomials)))
             for j in sorted(winners)]
    return sympy.Max(*terms) if len(terms) > 1 else terms[0]


def fit_symbolic(plan: Plan, model: nn.Module, args: tuple, kwargs: dict, dynamic: dict[str | int, dict[int, str]],
                 config: Config, devices: Sequence[DeviceSpec], loss_fn: Any = None) -> Plan:
    """Fill `plan.symbolic` (quantity -> sympy expression as a string) and `plan.dynamic`
    (symbol -> sizes traced, the example's first), and note the fit's checked error."""
    from fxspeed.planner import finish_plan, step_phase_series, trace_costs

    example = check_dynamic(args, kwargs, dynamic)
    dynamic, same = _with_same_shaped(args, kwargs, dynamic)
    names = list(example)
    symbols = [sympy.Symbol(n) for n in names]
    degrees = [degree_of(n) for n in names]
    values = {n: sample_values(example[n], d + 2) for n, d in zip(names, degrees)}
    grid = list(itertools.product(*(values[n][:d + 1] for n, d in zip(names, degrees))))
    check = tuple(values[n][d + 1] for n, d in zip(names, degrees))

    def sample(point: tuple[int, ...]) -> tuple[dict[str, Any], list[str], list[float] | None]:
        a, kw = resized_inputs(args, kwargs, dynamic, dict(zip(names, point)))
        try:
            costs, passes, notes = trace_costs(model, a, kw, config=config, devices=devices, loss_fn=loss_fn)
        except FxspeedError as e:
            # The sizes are the fit's, not the user's example: the error's own advice (check the
            # example's shapes, rewrite the line) would point the wrong way
            at = ", ".join(f"{n}={v}" for n, v in zip(names, point))
            raise ConfigError(f"plan(dynamic=...): the symbolic fit traces the model at sizes it chooses, and at {at} "
                          f"(example: {', '.join(f'{n}={example[n]}' for n in names)}) the model refused them. Mark "
                          "every input that shares a dynamic dim (a batch dim of the labels too), and do not mark a "
                          f"dim the model fixes (an image size, a maximum length). The trace said: {e}") from e
        p = finish_plan(costs, model_name=plan.model, config=config, devices=devices, passes=passes)
        dp = max(1, len(devices) // (config.pipeline * config.tensor))
        per_node = step_phase_series(costs, config, dp) if not notes else None  # not when extrapolated
        return quantities(p), costs.timeline["names"], per_node

    samples = [sample(p) for p in grid]
    fitted: dict[str, sympy.Expr] = {}
    for q in samples[0][0]:
        vals = [s[0][q] for s in samples]
        if all(v == 0 for v in vals):
            continue
        e = fit_polynomial(symbols, degrees, grid, vals)
        fitted[q] = e if not q.startswith("time") else e.evalf(12)
    same_graph = all(s[2] is not None and s[1] == samples[0][1] for s in samples)
    how = "the peak of the polynomials fitted through the peaks"
    if same_graph:
        fitted["memory.step"] = peak_of_nodes(symbols, degrees, grid, [s[2] for s in samples],
                                              [example[n] for n in names])
        how = "the step phase is Max over the graph's nodes of each node's exact live-bytes polynomial"
    phases = [fitted[k] for k in ("memory.step", "memory.optimizer") if k in fitted]
    fitted["peak_memory"] = sympy.Max(*phases) if len(phases) > 1 else phases[0]

    truth = sample(check)[0]
    truth["peak_memory"] = max(truth.get("memory.step", 0), truth.get("memory.optimizer", 0))
    subs = dict(zip(symbols, check))
    errors = {}
    for q in ("peak_memory", "memory.step", "memory.optimizer", "flops", "time"):
        if q in fitted:
            pred = float(fitted[q].subs(subs))
            errors[q] = abs(pred - truth[q]) / abs(truth[q]) if truth[q] else abs(pred)

    plan.symbolic = {q: str(e) for q, e in fitted.items()}
    plan.dynamic = {n: [example[n]] + [v for v in values[n][:d + 2] if v != example[n]]
                    for n, d in zip(names, degrees)}
    where = ", ".join(f"{n}={v}" for n, v in zip(names, check))
    grid_s = " x ".join(f"{n}∈{values[n][:d + 1]}" for n, d in zip(names, degrees))
    if same:
        plan.notes.append("symbolic fit: unmarked input(s) " + ", ".join(map(repr, same)) + " have the shape of a "
                          "marked input and were resized with it (mark them in dynamic= to say otherwise)")
    plan.notes.append(f"symbolic fit: exact polynomials (degree <= 1 in batch dims, <= 2 in others) through "
                      f"{len(grid)} traces on the grid {grid_s} ({how}; per-category memory is fitted through "
                      f"each phase's peak); checked at {where}: "
                      + ", ".join(f"{q} error {v:.2%}" for q, v in errors.items()))
    worst = max(errors.values(), default=0.0)
    plan.symbolic_error = errors.get("peak_memory", 0.0)
    if worst > 0.01:
        plan.notes.append(f"warning: the symbolic fit misses the check point by up to {worst:.1%}; the quantity is "
                          "not a polynomial of that degree over this range (e.g. the liveness peak moves)")
    return plan
