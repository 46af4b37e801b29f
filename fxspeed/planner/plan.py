"""Plan: the planner's answer, a plain serializable object to inspect, diff and override.

    plan.summary()        readable table (strategy, per-rank memory by category, time, passes)
    plan.memory(rank)     bytes by category at that rank's predicted peak
    plan.to_dict() / Plan.from_dict(d)   round-trips through JSON
    plan.max_size("batch", 80e9)         largest value of a dynamic dim that fits (if fitted)
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import sympy

from fxspeed.errors import ConfigError
from fxspeed.ir import CATEGORIES
from fxspeed.units import size


_FIT_TOLERANCE = 0.01  # symbolic fit error above which max_size refuses (planner/symbolic.py warns)


@dataclass
class Plan:
    """What `fxspeed.plan` / `engine.plan` predict for one training step on every rank: memory by
    category at each rank's peak, time by phase, communication, the passes run and the layout.
    Plain and serializable (`to_json` / `from_json`); `summary()` is the readable form."""

    model: str
    n_params: int
    n_trainable: int
    config: dict[str, Any]
    devices: list[dict[str, Any]]
    strategy: dict[str, Any]
    rank_memory: list[dict[str, int]]  # per rank: category -> bytes at the peak
    peak_phase: list[str]  # per rank: "step" (forward/backward) or "optimizer"
    time: dict[str, float]  # predicted seconds: forward, backward, optimizer, communication, total
    flops: dict[str, int]
    passes: list[dict[str, Any]] = field(default_factory=list)
    timeline: dict[str, list[Any]] = field(default_factory=dict)  # rank 0 live bytes per node
    symbolic: dict[str, str] = field(default_factory=dict)  # quantity -> sympy expression (str)
    dynamic: dict[str, list[int]] = field(default_factory=dict)  # symbol -> values traced
    symbolic_error: float = 0.0  # the fit's relative error at its check point (peak memory)
    notes: list[str] = field(default_factory=list)
    zero_formula: list[int] = field(default_factory=list)  # ZeRO paper model-state bytes per rank
    # rank 0's model states as this layout holds them: parameters, gradients (as backward leaves
    # them), optimizer states (with the fp32 master under master weights), i.e. what the paper's
    # Table 1 counts; comparable with zero_formula
    model_states: dict[str, int] = field(default_factory=dict)
    # rank 0 bytes by category in each phase: "step" (graph peak, states resident), "optimizer"
    phase_memory: dict[str, dict[str, int]] = field(default_factory=dict)
    dtypes: dict[str, str] = field(default_factory=dict)  # tensor category -> dtype(s) it is held in
    communication: dict[str, int] = field(default_factory=dict)  # bytes sent per rank per step, by collective
    # pipeline parallelism: per stage modules, params, predicted time/memory; per position its
    # peak memory; the simulated bubble (planner/pipeline.py)
    pipeline: dict[str, Any] = field(default_factory=dict)
    mesh: str = ""  # the rank layout over the dp x pp x tp mesh, one line per rank (layout_text)
    # tensor parallel: every parameter's placement over the tp ranks ("R", "S(0)", "S(1,blocks=3)")
    # and the tp collectives' bytes per step (fxspeed/planner/placement.py)
    tp_placements: dict[str, str] = field(default_factory=dict)
    tp_communication: dict[str, int] = field(default_factory=dict)
    # bytes per rank kept off the device, by where ("disk": Config.offload's states in files)
    offloaded: dict[str, int] = field(default_factory=dict)
    # of those, the optimizer states' (masters included): all of them, or what memory_budget_gb needs
    offloaded_optimizer: int = 0
    # the notes (also in `notes`) saying Config.memory_budget_gb cannot be met: one per pipeline
    # position that misses it; the engine warns with them
    over_budget: list[str] = field(default_factory=list)

    # --- queries ---------------------------------------------------------------------------
    def memory(self, rank: int = 0) -> dict[str, int]:
        """Predicted bytes by category at `rank`'s peak, plus "total"."""
        if not 0 <= rank < len(self.rank_memory):
            raise ValueError(f"rank={rank} is out of range; this plan has ranks 0..{len(self.rank_memory) - 1}")
        d = {c: int(self.rank_memory[rank].get(c, 0)) for c in CATEGORIES}
        d["total"] = sum(d.values())
        return d

    def peak_memory(self, rank: int = 0) -> int:
        """Predicted bytes `rank` holds at its peak (`memory(rank)["total"]`)."""
        return self.memory(rank)["total"]

    def fits(self) -> bool:
        """Whether every rank's predicted peak fits its device's memory."""
        return all(self.peak_memory(r) <= d["memory"] for r, d in enumerate(self.devices))

    def expr(self, quantity: str = "peak_memory") -> sympy.Expr:
        """A fitted quantity as a sympy expression over the dynamic dims' symbols."""
        if quantity not in self.symbolic:
            raise KeyError(f"no symbolic {quantity!r}; mark dims dynamic with plan(..., dynamic=...) "
                           f"(available: {sorted(self.symbolic)})")
        return sympy.sympify(self.symbolic[quantity])

    def max_size(self, symbol: str, memory_bytes: float, **fixed: int) -> int:
        """Largest integer value of `symbol` whose predicted peak fits in `memory_bytes`, other
        dynamic dims held at `fixed` (default: the traced example's values). 0 if none fits.
        Refused where the fit missed its own check point (a program that changes between the traced
        sizes, e.g. the chunked cross-entropy switching on at 64 MiB of logits: the fitted memory
        fell as the batch grew, and the answer was ~4000x too large). Beyond the traced sizes it
        extrapolates: a program change up there is not seen."""
        unknown = sorted({symbol, *fixed} - set(self.dynamic))
        if unknown:
            raise ConfigError(f"max_size: {unknown} {'is' if len(unknown) == 1 else 'are'} not a dynamic dim of "
                              f"this plan (its symbols: {sorted(self.dynamic)}); mark it in plan(..., dynamic=...)")
        if self.symbolic_error > _FIT_TOLERANCE:
            raise ConfigError(f"max_size: the symbolic fit missed its check point by {self.symbolic_error:.0%} (see "
                              "plan.notes): the program changes between the traced sizes, so the fitted formula is "
                              "not the memory. Plan concrete sizes instead (fxspeed.plan with example_inputs of "
                              "that size), or trace from an example on one side of the change")
        e = self.expr("peak_memory")
        subs = {sympy.Symbol(k): v for k, v in fixed.items()}
        for name, vals in self.dynamic.items():
            if name != symbol and sympy.Symbol(name) not in subs:
                subs[sympy.Symbol(name)] = vals[0]
        f = sympy.lambdify(sympy.Symbol(symbol), e.subs(subs))
        if f(1) > memory_bytes:
            return 0
        lo, hi = 1, 2
        while f(hi) <= memory_bytes and hi < 2**40:
            lo, hi = hi, hi * 2
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if f(mid) <= memory_bytes else (lo, mid)
        return lo

    # --- presentation ----------------------------------------------------------------------
    def summary(self) -> str:
        """The plan as text: memory by category, time, FLOPs, the rank layout and the passes run
        (and, where they apply, pipeline stages, tensor-parallel placements, offload), with the
        planner's notes."""
        gb = lambda b: size(b, 11)  # noqa: E731 - the unit that shows the figure: a small model's read "0.000 GB"
        s = self.strategy
        lines = [
            f"fxspeed plan · {self.model} · {self.n_params / 1e6:,.1f}M params ({self.n_trainable / 1e6:,.1f}M trainable)",
            f"devices: {len(self.devices)} × {self.devices[0]['name']} ({self.devices[0]['memory'] / 1e9:.0f} GB)   "
            f"strategy: dp={s['dp']} zero={s['zero']} pp={s['pp']} tp={s['tp']} precision={s['precision']} "
            f"optimizer={s['optimizer']}",
            "",
            f"{'memory per rank (rank 0)':<28}{'predicted':>12}",
        ]
        mem = self.memory(0)
        for c in CATEGORIES:
            if mem[c]:
                lines.append(f"  {c:<26}{gb(mem[c])}")
        fit = "fits" if mem["total"] <= self.devices[0]["memory"] else "DOES NOT FIT"
        budget = self.config.get("memory_budget_gb") if self.config.get("offload") in ("optimizer", "all") else None
        if budget is not None and fit == "fits":  # the stated budget, not the device, is the limit then
            fit = f"{'within' if mem['total'] <= budget * 1e9 else 'OVER'} memory_budget_gb={budget:g}"
        lines.append(f"  {'total (peak, ' + self.peak_phase[0] + ')':<26}{gb(mem['total'])}   {fit}")
        if self.model_states:
            parts = " + ".join(f"{c} {gb(b).strip()}" for c, b in self.model_states.items())
            lines.append(f"  {'model states':<26}{gb(sum(self.model_states.values()))}   ({parts})")
        if self.zero_formula:
            # the paper's layout, a reference beside what this plan holds (ZeRO-0 keeps fp32 weights)
            k = ("the paper's mixed-precision layout: 2-byte params/grads, K=12" if self.strategy["precision"] != "fp32"
                 else "fp32 Adam: 4+4+8 bytes")
            lines.append(f"  {'ZeRO paper model states':<26}{gb(self.zero_formula[0])}   ({k})")
        offload = self.config.get("offload", "optimizer")
        what = {"parameters": "working parameter shards, read ahead of each gather",
                "all": "optimizer states and working parameter shards"}.get(offload, "optimizer states")
        for where, b in self.offloaded.items():
            held = "saved activations" if where.startswith("activations") else what
            lines.append(f"  {'off the device: ' + where:<26}{gb(b)}   ({held}; read and written every step)")
        if self.dtypes:
            lines.append("  dtypes: " + "; ".join(f"{c} {d}" for c, d in self.dtypes.items()))
        if self.communication:
            lines.append("  communication per step: " + ", ".join(f"{k} {size(v)}" for k, v in self.communication.items()))
        t = self.time
        bubble = f" + bubble {t['bubble'] * 1e3:,.2f}" if "bubble" in t else ""
        disk = f" + disk {t['disk'] * 1e3:,.2f}" if t.get("disk") else ""
        lines += ["", f"time per step (predicted): {t['total'] * 1e3:,.2f} ms = forward {t['forward'] * 1e3:,.2f} + "
                  f"backward {t['backward'] * 1e3:,.2f}{bubble} + optimizer {t['optimizer'] * 1e3:,.2f} + comm {t['communication'] * 1e3:,.2f}{disk}",
                  f"FLOPs per step: {_flop(self.flops['total'])} (forward {_flop(self.flops['forward'])})"]
        if self.pipeline:
            pp = self.pipeline
            ranks = pp.get("ranks", [])
            lines += ["", f"pipeline: {pp['stages_n']} stages, schedule {pp['schedule']}, {pp['microbatches']} "
                      f"micro-batches, {pp['replicas']} replica(s); simulated bubble {pp['bubble']:.3f}, "
                      f"step {pp['step_s'] * 1e3:,.2f} ms (costs of one micro-batch)",
                      f"  {'stage':<6}{'position':>9}{'params':>16}{'fwd ms':>9}{'bwd ms':>9}{'weights+grads+opt':>19}"
                      f"{'act peak':>11}  modules"]
            for st in pp["stages"]:
                m = st["memory_bytes"]
                w = m["parameters"] + m["gradients"] + m["optimizer_states"]
                mods = st["modules"]
                shown = ", ".join(mods if len(mods) <= 4 else [mods[0], mods[1], "...", mods[-1]])
                lines.append(f"  {st['stage']:<6}{st.get('position', st['rank']):>9}{st['params']:>16,}{st['forward_s'] * 1e3:9.2f}"
                             f"{st['backward_s'] * 1e3:9.2f}{gb(w):>19}{size(m['activations'], 11)}  {shown}")
            for rk in ranks:
                phase = rk.get("peak_phase", "step")
                mem = rk["phase_memory"][phase]
                where = rk["peak_at"] if phase == "step" else "optimizer step"
                lines.append(f"  position {rk['position']} (stages {', '.join(map(str, rk['stages']))}): peak "
                             f"{gb(sum(mem.values())).strip()} at {where} (" + ", ".join(
                                 f"{c} {size(v)}" for c, v in mem.items() if v) + ")")
        if self.mesh:
            layout = self.mesh.splitlines()
            if len(layout) > 18:  # the header and the first and last ranks
                layout = [*layout[:9], f"  ... {len(layout) - 17} more rank(s) ...", *layout[-8:]]
            lines += ["", *layout]
        if self.symbolic:
            lines += ["", "symbolic (fitted over dynamic dims " + ", ".join(f"{k}∈{v}" for k, v in self.dynamic.items()) + "):"]
            for k, v in self.symbolic.items():
                lines.append(f"  {k} = {v}")
        if self.tp_placements:
            lines += ["", "tensor parallel placements (R replicated, S(d) sharded on dim d; chosen by the planner):"]
            w = max(48, *(len(n) + 2 for n in self.tp_placements))  # T5's names run past 48
            lines += [f"  {n:<{w}}{p}" for n, p in self.tp_placements.items()]
            lines.append("  tp collectives per step (rank 0): " + ", ".join(f"{k} {v / 1e6:.3f} MB"
                                                                  for k, v in self.tp_communication.items()))
        if self.passes:
            w = max(22, *(len(p["name"]) + 1 for p in self.passes))  # step_buckets_in_backward is 24
            lines += ["", f"{'pass':<{w + 2}}{'ms':>9}{'nodes':>16}"]
            for p in self.passes:
                state = "disabled" if p["skipped"] else f"{p['nodes_before']}→{p['nodes_after']}"
                lines.append(f"  {p['name']:<{w}}{p['seconds'] * 1e3:9.1f}{state:>16}")
        for n in self.notes:
            lines.append(f"note: {n}")
        return "\n".join(lines)

    def __repr__(self) -> str:
        return f"Plan({self.model}, {self.n_params / 1e6:.1f}M params, peak rank0 {self.peak_memory(0) / 1e9:.3f} GB)"

    # --- serialization ---------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """The fields as plain JSON values (`Plan.from_dict` reads it back)."""
        return json.loads(json.dumps(self.__dict__))

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Plan":
        """A Plan from `to_dict()`'s fields (an unknown field is an error naming it)."""
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise ValueError(f"Plan.from_dict: unknown key(s) {unknown}; valid keys are {sorted(names)}")
        return cls(**d)

    def to_json(self, path: str | Path | None = None) -> str:
        """The plan as JSON text, also written to `path` when one is given."""
        text = json.dumps(self.to_dict(), indent=1)
        if path is not None:
            Path(path).write_text(text)
        return text

    @classmethod
    def from_json(cls, text_or_path: str | Path) -> "Plan":
        """A Plan from JSON text or from a file holding it (what `to_json` wrote)."""
        p = Path(text_or_path)
        text = p.read_text() if len(str(text_or_path)) < 4096 and p.exists() else str(text_or_path)
        return cls.from_dict(json.loads(text))


def layout_text(dp: int, pp: int = 1, tp: int = 1) -> str:
    """The rank layout of a dp x pp x tp mesh, one line per rank, as fxspeed.mesh.Mesh.describe
    writes it (global rank g = (dp_index * pp + pp_index) * tp + tp_index)."""
    world = dp * pp * tp
    lines = [f"mesh dp={dp} x pp={pp} x tp={tp} over {world} rank(s); "
             "rank = (dp_index * pp + pp_index) * tp + tp_index"]
    for g in range(world):
        rest, t = divmod(g, tp)
        d, p = divmod(rest, pp)
        lines.append(f"  rank {g}: dp {d}, pp {p}, tp {t}")
    return "\n".join(lines)


def _flop(n: float) -> str:
    """TFLOP, or GFLOP where TFLOP would read 0.000 (a small model's step)."""
    return f"{n / 1e12:,.3f} TFLOP" if n >= 1e11 else f"{n / 1e9:,.3f} GFLOP"
